"""The generated word-problem task: problems and answers, tokenizer, warm-up cache, and the math
path end to end (train a few steps, then `pacs eval --preset math` on the shipped file)."""

import json
import os
import re
import subprocess
import sys

import pytest
from trainer_helpers import repo_root

from pacs.config import Config, TaskConfig, load_config
from pacs.tasks import WordProblemTask, make_task
from pacs.tasks.embedded import warmup_key
from pacs.tasks.word_problems import FEWER, MORE, boxed, build_word_tokenizer, write_jsonl
from pacs.train.metrics import read_metrics

DATA = os.path.join(os.path.dirname(__file__), "data")


def solve(prompt: str) -> int:
    """Recompute a problem's answer from its words."""
    sentences = [s.strip() for s in prompt.split(" . ")]
    count = int(re.match(r"\w+ has (\d+) ", sentences[0]).group(1))
    more = [m.split()[0] for m in MORE]
    fewer = [f.split()[0] for f in FEWER]
    for s in sentences[1:-1]:
        words = s.removeprefix("then ").split()
        n = int(next(w for w in words if w.isdigit()))
        assert words[1] in more + fewer, s
        count += n if words[1] in more else -n
        assert count >= 0
    assert sentences[-1].startswith("how many")
    return count


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_problems_are_right_deterministic_and_held_out_disjoint(steps):
    task = WordProblemTask(steps, seed=5, eval_size=40)
    train = task.train_batch(0, 300)
    assert train == WordProblemTask(steps, seed=5, eval_size=40).train_batch(0, 300)
    assert task.train_batch(50, 3) == train[50:53]
    assert not {p.prompt for p in train} & {p.prompt for p in task.eval_problems()}
    assert len({p.prompt for p in task.eval_problems()}) == 40
    for p in train + task.eval_problems():
        assert int(p.answer) == solve(p.prompt)
        assert p.prompt.count(" . ") == steps + 1
    assert WordProblemTask(steps, seed=6).train_batch(0, 20) != train[:20]
    p = train[0]
    assert task.target_text(p) == boxed(p.answer)
    assert task.reward(boxed(p.answer), p) == 1.0
    assert task.reward(boxed(str(int(p.answer) + 1)), p) == 0.0
    assert task.reward(p.answer, p) == 1.0  # math-verify also reads a bare number


def test_tokenizer_reads_every_problem_and_decodes_boxed_answers(tmp_path):
    from transformers import AutoTokenizer

    build_word_tokenizer().save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    task = WordProblemTask(3, seed=0, eval_size=20)
    for p in task.train_batch(0, 200) + task.eval_problems():
        ids = tok(p.prompt)["input_ids"]
        assert ids[0] == tok.bos_token_id and tok.unk_token_id not in ids
        assert len(ids) <= 32
    reply = tok(boxed("107"), add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(reply) == ["\\", "boxed", "{", "1", "0", "7", "}"]
    assert tok.decode(reply + [tok.eos_token_id], skip_special_tokens=True) == "\\boxed{107}"
    assert tok("Zebra 12")["input_ids"][1] == tok.unk_token_id  # unknown words do not crash


def test_shipped_file_is_the_seed0_held_out_set(tmp_path):
    path = tmp_path / "w.jsonl"
    write_jsonl(str(path), 50)
    assert path.read_text() == open(os.path.join(DATA, "wordmath_eval.jsonl")).read()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(int(r["answer"]) == solve(r["problem"]) for r in rows)


def test_config_and_warmup_key():
    cfg = load_config(os.path.join(repo_root(), "configs", "wordmath.yaml"))
    assert isinstance(make_task(cfg), WordProblemTask)
    assert warmup_key(TaskConfig(name="wordmath"), 0) != warmup_key(TaskConfig(), 0)
    assert warmup_key(TaskConfig(name="wordmath"), 0) != warmup_key(TaskConfig(name="wordmath", word_steps=3), 0)
    # the addition task's key did not change with the word task's fields
    assert warmup_key(TaskConfig(word_steps=5), 0) == warmup_key(TaskConfig(), 0)
    bad = Config()
    bad.task.name, bad.task.word_steps = "wordmath", 0
    from pacs.config import validate

    with pytest.raises(ValueError, match="task.word_steps"):
        validate(bad)


@pytest.mark.slow
def test_train_then_eval_with_the_math_preset(tmp_path):
    """The math path end to end: warm-up, PACS steps rewarded by math-verify, HF export, then
    `pacs eval --preset math` on the shipped file."""
    cache = tmp_path / "cache"
    run = tmp_path / "run"
    overrides = ["task.name=wordmath", f"advanced.task.cache_dir={cache}", "advanced.task.warmup_steps=50",
                 "advanced.task.warmup_batch_size=16",
                 "rollout.max_new_tokens=7", "rollout.prompts_per_step=4", "rollout.group_size=4",
                 "optim.mini_batches_per_step=2", "optim.micro_batch_groups=1", "eval.num_problems=8",
                 "eval.every=0", "checkpoint_every=0", "advanced.plot=false"]
    env = dict(os.environ, PYTHONPATH=repo_root())
    out = subprocess.run([sys.executable, "-m", "pacs", "train", "--output-dir", str(run), "--max-steps", "2",
                          "--rollout", "hf", *overrides], cwd=repo_root(), capture_output=True, text=True,
                         timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(str(run / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["reward_timeouts"] == 0 and r["reward_errors"] == 0 for r in rows[1:])
    model = str(run / "final_model")
    out = subprocess.run([sys.executable, "-m", "pacs", "eval", "--preset", "math", "--model", model,
                          "--data", os.path.join(DATA, "wordmath_eval.jsonl"), "--n-samples", "4", "--num-problems",
                          "10", "--rollout", "hf", "--eval-dir", str(tmp_path / "ev"), "rollout.max_new_tokens=7"],
                         cwd=repo_root(), capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["num_problems"] == 10 and report["n_samples"] == 4
    assert 0.0 <= report["pass@1"] <= report["pass@2"] <= report["pass@4"] <= 1.0
    assert 1 <= report["response_length"] <= 7
    records = [json.loads(line) for line in open(report["problems_path"])]
    shipped = [json.loads(line) for line in open(os.path.join(DATA, "wordmath_eval.jsonl"))][:10]
    assert [r["answer"] for r in records] == [s["answer"] for s in shipped]
    assert all(len(r["responses"]) == 4 for r in records)
    assert sum(r["correct"] for r in records) == round(report["mean@4"] * 40)
    metrics = json.load(open(report["metrics_path"]))
    assert metrics["temperature"] == 0.6 and metrics["top_p"] == 0.95 and metrics["preset"] == "math"
    assert os.path.getsize(report["plot_path"]) > 1000
