"""The evaluation protocol: presets, per-problem records (pass@k checked against exact enumeration
over subsets), mean@n, response length, the files `pacs eval` writes, and the dataset registry's
loaders on small shipped files in each Hub dataset's schema (no network)."""

import itertools
import json
import os
import random
import sys

import pytest

from pacs.cli import build_config, main
from pacs.config import validate
from pacs.eval.evaluate import encode_prompt, run_eval
from pacs.eval.outputs import pass_at_k_points, write_eval_outputs
from pacs.eval.presets import PAPER_INSTRUCTION, PRESETS, preset_overrides
from pacs.tasks import MathTask, load_problems
from pacs.tasks.base import Problem
from pacs.tasks.datasets import DATASETS, load_dataset_file, load_hf, spec
from pacs.tasks.word_problems import build_word_tokenizer

DATA = os.path.join(os.path.dirname(__file__), "data")


def enumerated_pass_at_k(outcomes: list[float], k: int) -> float:
    """Fraction of the k-subsets of the samples that hold a correct one (exact enumeration)."""
    subsets = list(itertools.combinations(range(len(outcomes)), k))
    return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


class ScriptedEngine:
    """Replies to problem i with the texts ``replies[i]`` (one per sample), then EOS."""

    def __init__(self, tokenizer, replies):
        self.tok, self.replies, self.calls = tokenizer, replies, []

    def generate(self, prompts, n, *, temperature, top_p, max_new_tokens, stop_token_ids, seed=None):
        self.calls.append(dict(prompts=prompts, n=n, temperature=temperature, top_p=top_p))
        return [[self.tok(text, add_special_tokens=False)["input_ids"] + stop_token_ids for text in texts]
                for texts in self.replies[:len(prompts)]]


def _random_eval(seed: int, n: int = 6, problems: int = 5):
    rng = random.Random(seed)
    tok = build_word_tokenizer()
    probs = [Problem(prompt=f"ann has {rng.randint(2, 9)} pens . how many pens now ?", answer=str(rng.randint(10, 99)))
             for _ in range(problems)]
    replies = [[("\\boxed{" + p.answer + "}") if rng.random() < 0.4 else ("\\boxed{" + str(rng.randint(0, 9)) + "}")
                for _ in range(n)] for p in probs]
    task = MathTask.__new__(MathTask)  # only its reward is used
    from pacs.tasks.rewards import math_reward

    task.reward_fn = math_reward
    return tok, probs, replies, task


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_run_eval_records_and_pass_at_k_against_enumeration(seed):
    tok, probs, replies, task = _random_eval(seed)
    engine = ScriptedEngine(tok, replies)
    report = run_eval(engine, task, tok, probs, n_samples=6, temperature=0.6, top_p=0.95, ks=(1, 2, 3, 6),
                      max_new_tokens=8, stop_token_ids=[tok.eos_token_id], max_prompt_len=12)
    assert engine.calls[0]["top_p"] == 0.95 and engine.calls[0]["n"] == 6
    assert all(len(p) <= 12 for p in engine.calls[0]["prompts"])  # cut to max_prompt_len
    truth = [[float(text == "\\boxed{" + p.answer + "}") for text in texts] for p, texts in zip(probs, replies)]
    for record, outcomes, texts in zip(report.records, truth, replies):
        assert record["rewards"] == outcomes and record["correct"] == sum(outcomes)
        assert record["responses"] == texts
        assert record["lengths"] == [len(tok(t, add_special_tokens=False)["input_ids"]) + 1 for t in texts]
        for k in (1, 2, 3, 6):
            assert record[f"pass@{k}"] == pytest.approx(enumerated_pass_at_k(outcomes, k), abs=1e-12)
    m = report.metrics
    for k in (1, 2, 3, 6):
        assert m[f"pass@{k}"] == pytest.approx(sum(enumerated_pass_at_k(o, k) for o in truth) / len(truth))
    assert m["mean@6"] == m["accuracy"] == pytest.approx(sum(map(sum, truth)) / (6 * len(truth)))
    assert m["pass@1"] == pytest.approx(m["mean@6"])
    assert m["response_length"] == pytest.approx(
        sum(sum(r["lengths"]) for r in report.records) / (6 * len(probs)))
    with pytest.raises(ValueError, match=r"ks entries must be in \[1, n_samples=6\]"):
        run_eval(engine, task, tok, probs, n_samples=6, temperature=0.6, ks=(7,), max_new_tokens=8,
                 stop_token_ids=[2])


def test_eval_outputs_written(tmp_path):
    tok, probs, replies, task = _random_eval(3)
    report = run_eval(ScriptedEngine(tok, replies), task, tok, probs, n_samples=6, temperature=1.0, ks=(1, 2, 4),
                      max_new_tokens=8, stop_token_ids=[tok.eos_token_id])
    paths = write_eval_outputs(report, str(tmp_path / "ev"), info={"model": "m", "label": "m"})
    lines = [json.loads(line) for line in open(paths["problems"])]
    assert [r["correct"] for r in lines] == [r["correct"] for r in report.records]
    saved = json.load(open(paths["metrics"]))
    assert saved["model"] == "m" and saved["pass@4"] == pytest.approx(report.metrics["pass@4"])
    assert pass_at_k_points(saved) == [1, 2, 4]
    assert os.path.getsize(paths["plot"]) > 1000


def test_presets_follow_the_public_protocol():
    class Args:
        config, model, output_dir, seed, rollout = None, None, None, None, None
        preset, overrides = "paper", []

    cfg = build_config(Args)
    assert (cfg.eval.n_samples, cfg.eval.temperature, cfg.eval.top_p) == (32, 0.6, 0.95)
    assert cfg.eval.ks == (1, 2, 4, 8, 16, 32) and cfg.rollout.max_new_tokens == 4096
    assert cfg.task.use_chat_template and cfg.task.name == "math"
    text = cfg.task.prompt_template.format(prompt="What is 1+1?")
    assert text == "What is 1+1? " + PAPER_INSTRUCTION and "\\boxed{}" in text
    Args.preset, Args.overrides = "paper256", ["eval.temperature=1.0"]  # command-line overrides win
    cfg = build_config(Args)
    assert cfg.eval.n_samples == 256 and cfg.eval.ks[-1] == 256 and cfg.eval.temperature == 1.0
    cfg.task.data_path = "x.jsonl"
    validate(cfg)
    for name in PRESETS:
        assert preset_overrides(name)
    with pytest.raises(ValueError, match="--preset must be one of"):
        preset_overrides("nope")


def test_eval_cli_rejects_unknown_preset(capsys):
    assert main(["eval", "--preset", "nope"]) == 2
    assert "--preset must be one of" in capsys.readouterr().err


# ------------------------------------------------------------------------- dataset registry
SAMPLES = {"math500": "math500_sample.jsonl", "amc23": "amc23_sample.jsonl", "aime2024": "aime2024_sample.parquet",
           "aime2025": "aime2025_sample.jsonl", "deepscaler": "deepscaler_sample.jsonl"}


def test_registry_names_the_paper_datasets():
    assert set(DATASETS) == set(SAMPLES)
    assert spec("math500").hf_id == "HuggingFaceH4/MATH-500" and spec("aime2024").hf_id == "Maxwell-Jia/AIME_2024"
    assert spec("aime2025").hf_id == "yentinglin/aime_2025" and spec("amc23").hf_id == "zwhe99/amc23"
    assert spec("deepscaler").hf_id == "agentica-org/DeepScaleR-Preview-Dataset"
    with pytest.raises(ValueError, match="dataset name must be one of"):
        spec("gsm9k")


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_loaders_read_each_schema_offline(name):
    pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    path = os.path.join(DATA, SAMPLES[name])
    problems = load_dataset_file(path, name)
    assert len(problems) >= 2 and all(p.prompt and p.answer for p in problems)
    # the generic math loader reads the same files (AIME 2024's capitalized columns included)
    generic = load_problems(path)
    assert [(p.prompt, p.answer) for p in generic] == [(p.prompt, p.answer) for p in problems]
    # the reference answers are what math-verify accepts in a boxed reply
    task = MathTask(path, eval_path=path)
    for p in task.eval_problems():
        assert task.reward(f"so the answer is \\boxed{{{p.answer}}}", p) == 1.0, p
        assert task.reward("so the answer is \\boxed{123456789}", p) == 0.0, p


def test_loader_errors_name_the_columns(tmp_path):
    bad = tmp_path / "x.jsonl"
    bad.write_text(json.dumps({"problem": "1+1?", "solution": "2"}) + "\n")
    with pytest.raises(ValueError, match="needs columns 'Problem' and 'Answer'"):
        load_dataset_file(str(bad), "aime2024")


def test_hf_prefix_without_datasets_package_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now raises ImportError
    with pytest.raises(ValueError, match="needs the 'datasets' package"):
        load_problems("hf:math500")
    with pytest.raises(ValueError, match="needs the 'datasets' package"):
        load_hf("aime2025")


def test_paper_prompt_with_chat_template_encodes():
    """The paper preset's template goes through a tokenizer's chat template (Qwen-style here)."""
    tok = build_word_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    template = "{prompt} " + PAPER_INSTRUCTION.replace("{", "{{").replace("}", "}}")
    ids = encode_prompt(tok, Problem("ann has 3 pens .", "3"), template=template, use_chat_template=True)
    assert tok.convert_ids_to_tokens(ids)[:4] == ["ann", "has", "3", "pens"]
