"""Real defaults: prompt length follows the tokenizer and the data (a prompt that would be cut is refused
before the model loads, unless rollout.truncate_prompts), the built-in tasks keep their toy settings and a
real model's run starts from the paper's (configs/qwen2.5-math.yaml)."""

import json
import os

import pytest

from pacs.cli import main
from pacs.config import Config, load_config, validate
from pacs.model.model_zoo import build_byte_tokenizer, build_small_model
from pacs.run.prompt_lengths import fit_prompt_length
from pacs.tasks import MathTask, make_task

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_rows(path, problems):
    with open(path, "w") as fh:
        for i, problem in enumerate(problems):
            fh.write(json.dumps({"problem": problem, "answer": str(i)}) + "\n")
    return str(path)


def test_built_in_tasks_keep_their_toy_settings_and_data_runs_start_from_the_papers():
    for builtin in (load_config(None), load_config(None, ["task.name=wordmath"]),
                    load_config(os.path.join(REPO, "configs", "default.yaml"))):
        r = builtin.rollout
        assert (builtin.optim.lr, r.max_prompt_len, r.max_new_tokens, r.gpu_memory_utilization) == (2e-4, 32, 6, 0.3)
    real = load_config(None, ["task.name=math", "task.data_path=x.jsonl"])
    r = real.rollout
    assert (real.optim.lr, r.group_size, r.max_prompt_len, r.max_new_tokens, r.gpu_memory_utilization) == (
        1e-6, 8, None, 4096, 0.5)
    assert r.truncate_prompts is False and real.rollout == Config().rollout and real.optim == Config().optim
    # what is set wins over either layer, wherever it is set
    assert load_config(None, ["optim.lr=3e-4", "task.name=math", "task.data_path=x"]).optim.lr == 3e-4
    assert load_config(None, ["rollout.max_prompt_len=20"]).rollout.max_prompt_len == 20
    validate(real)


def test_the_real_model_config_loads_and_validates():
    cfg = load_config(os.path.join(REPO, "configs", "qwen2.5-math.yaml"))
    validate(cfg)
    assert cfg.task.name == "math" and cfg.task.use_chat_template and cfg.model.dtype == "bfloat16"
    assert (cfg.optim.lr, cfg.rollout.group_size, cfg.rollout.max_new_tokens) == (1e-6, 8, 4096)
    assert cfg.rollout.max_prompt_len is None and cfg.rollout.gpu_memory_utilization == 0.5


def test_eval_data_flag_gives_a_data_run_its_defaults(tmp_path):
    from pacs.cli import build_config, build_parser

    args = build_parser().parse_args(["eval", "--data", "rows.jsonl", "--model", "m"])
    cfg = build_config(args)
    assert (cfg.task.name, cfg.task.data_path, cfg.task.eval_path) == ("math", "rows.jsonl", "rows.jsonl")
    assert cfg.rollout.max_prompt_len is None and cfg.optim.lr == 1e-6
    # every row of the file (the default 200, or a run's config.yaml saying 200, cut MATH500 to 200 problems)
    assert cfg.eval.num_problems >= 10 ** 6
    saved = tmp_path / "config.yaml"
    saved.write_text("eval:\n  num_problems: 200\n")
    assert build_config(build_parser().parse_args(["eval", "--config", str(saved), "--data", "rows.jsonl"])
                        ).eval.num_problems >= 10 ** 6
    asked = build_parser().parse_args(["eval", "--data", "rows.jsonl", "eval.num_problems=50"])
    assert build_config(asked).eval.num_problems == 50


def test_unset_limit_becomes_the_longest_prompt_with_the_chat_template(tmp_path):
    data = write_rows(tmp_path / "rows.jsonl", ["a" * 10, "b" * 40, "c" * 25, "d" * 5])
    tokenizer = build_byte_tokenizer()
    for chat, overhead in ((False, 0), (True, len("<|im_start|>user\n") - len("<|im_start|>") + 1
                                              + 1 + 1 + len("<|im_start|>assistant\n") - len("<|im_start|>") + 1)):
        cfg = load_config(None, ["task.name=math", f"task.data_path={data}", "task.eval_size=1",
                                 f"task.use_chat_template={str(chat).lower()}"])
        lines = []
        fit_prompt_length(cfg, make_task(cfg), tokenizer, log=lines.append)
        # one token per byte; the chat template adds its markers (special tokens: one each) and newlines
        assert cfg.rollout.max_prompt_len == 40 + overhead, chat
        assert lines == [f"[data] rollout.max_prompt_len: {40 + overhead} tokens, the longest prompt "
                         "(task.data_path row 1)"]


@pytest.mark.parametrize("model", ["qwen2.5-0.5b-instruct", "llama-3.2-1b-instruct"])
def test_measured_lengths_are_those_of_the_prompts_the_run_encodes(tmp_path, model):
    """The batched count equals encode_prompt's, with and without the chat template, whatever tokenizer class
    transformers picks for the model (Qwen2Tokenizer for a qwen2 config, the generic one for llama)."""
    from transformers import AutoTokenizer

    from pacs.eval.evaluate import encode_prompt
    from pacs.run.prompt_lengths import prompt_lengths
    from pacs.tasks import Problem

    tokenizer = AutoTokenizer.from_pretrained(build_small_model(model, str(tmp_path / "m")))
    problems = [Problem(f"What is {i} + {i}?" + " Think. Then answer in \\boxed{}." * i, str(2 * i)) for i in range(7)]
    for chat in (False, True):
        cfg = load_config(None, ["task.name=math", "task.data_path=x", f"task.use_chat_template={str(chat).lower()}",
                                 "task.prompt_template=Q: {prompt}"])
        want = [len(encode_prompt(tokenizer, p, template="Q: {prompt}", use_chat_template=chat)) for p in problems]
        assert prompt_lengths(cfg, problems, tokenizer, chunk=3) == want
        assert len(set(want)) == 7


def test_a_limit_some_prompt_exceeds_is_refused_unless_truncation_is_asked_for(tmp_path):
    data = write_rows(tmp_path / "rows.jsonl", ["short", "x" * 30, "y" * 12])
    held = write_rows(tmp_path / "held.jsonl", ["z" * 45])
    tokenizer = build_byte_tokenizer()
    cfg = load_config(None, ["task.name=math", f"task.data_path={data}", f"task.eval_path={held}",
                             "rollout.max_prompt_len=20"])
    task = MathTask(data, eval_path=held)
    with pytest.raises(ValueError, match=r"^rollout.max_prompt_len=20 is shorter than the longest prompt "
                                         r"\(task.eval_path row 0: 45 tokens\); raise it to at least 45"):
        fit_prompt_length(cfg, task, tokenizer)
    cfg.rollout.truncate_prompts = True
    lines = []
    fit_prompt_length(cfg, task, tokenizer, log=lines.append)
    assert cfg.rollout.max_prompt_len == 20 and "cut to their last max_prompt_len tokens" in lines[0]
    cfg.rollout.max_prompt_len, cfg.rollout.truncate_prompts = 45, False
    fit_prompt_length(cfg, task, tokenizer)  # exactly the longest: fits


def test_pacs_train_refuses_a_long_prompt_before_the_model_loads(tmp_path, capsys, monkeypatch):
    import pacs.train.start

    model_dir = build_small_model("qwen3-0.6b", str(tmp_path / "model"))
    data = write_rows(tmp_path / "rows.jsonl", ["What is 1 + 1?"] * 3 + ["W" * 300] + ["What is 2 + 2?"] * 4)
    monkeypatch.setattr(pacs.train.start, "load_policy", lambda *a, **k: pytest.fail("the model was loaded"))
    out = tmp_path / "run"
    capsys.readouterr()
    code = main(["train", "--model", model_dir, "--output-dir", str(out), "task.name=math",
                 f"task.data_path={data}", "task.eval_size=2", "rollout.max_prompt_len=100", "rollout.engine=hf"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and err == [
        "pacs train: error: rollout.max_prompt_len=100 is shorter than the longest prompt (task.data_path row 3: "
        "300 tokens); raise it to at least 300, leave it unset to follow the data, or set "
        "rollout.truncate_prompts=true to cut prompts to their last max_prompt_len tokens"]
    assert not (out / "metrics.jsonl").exists()


def test_a_measured_prompt_length_is_checked_against_the_model_positions(tmp_path, capsys):
    from pacs.tasks.embedded import build_model

    model_dir = tmp_path / "tiny"  # the built-in model family: 64 positions
    build_model(Config().task, 300, seed=0).save_pretrained(model_dir)
    build_byte_tokenizer().save_pretrained(model_dir)
    data = write_rows(tmp_path / "rows.jsonl", ["x" * 69 + c for c in "abcd"])  # (a repeated row is dropped)
    code = main(["train", "--model", str(model_dir), "--output-dir", str(tmp_path / "run"), "task.name=math",
                 f"task.data_path={data}", "task.eval_size=2", "rollout.max_new_tokens=4", "rollout.engine=hf"])
    assert code == 2
    assert ("rollout.max_prompt_len + rollout.max_new_tokens = 74 exceeds the model's max_position_embeddings (64)"
            in capsys.readouterr().err)
