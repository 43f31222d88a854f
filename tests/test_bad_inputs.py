"""Bad input that used to end badly (issue 46, item 7): each now ends in one line naming the setting, with
exit code 2 before any work and nothing written to the run directory, or behaves as documented. One test
each; the everyday mistakes before them: tests/test_run_errors.py, tests/test_cli_mistakes.py."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest
from test_run_errors import TINY_RUN, one_error_line, run_cli, tiny_model  # noqa: F401  (a fixture)

from pacs.tasks.math_data import MathTask, load_problems
from pacs.train.metrics import read_metrics


def test_a_learning_rate_above_one_is_refused_before_any_work(tmp_path, capsys, tiny_model):
    """optim.lr=1e300 passed validation, then AdamW's update overflowed in a traceback."""
    out = tmp_path / "run"
    code, _, err = run_cli(capsys, "train", "--model", tiny_model, "--output-dir", str(out), "--max-steps", "1",
                           *TINY_RUN, "optim.lr=1e300")
    assert code == 2
    assert one_error_line(err) == ("pacs train: error: optim.lr must be in (0, 1] (AdamW moves each weight by "
                                   "about lr per step), got 1e+300")
    assert not out.exists()


def test_a_json_file_holding_an_array_of_rows_loads(tmp_path):
    """A .json file holding one JSON array (pandas' to_json(orient="records"), json.dump of a list) failed with
    "'<' not supported between instances of 'dict'"; a row that is no JSON object is named in one line."""
    rows = [{"problem": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(4)]
    for name, text in (("one_line.json", json.dumps(rows)), ("indented.json", json.dumps(rows, indent=2)),
                       ("lines.json", "\n".join(json.dumps(row) for row in rows))):
        path = tmp_path / name
        path.write_text(text)
        assert [(p.prompt, p.answer) for p in load_problems(str(path))] == [(r["problem"], r["answer"]) for r in rows]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([rows[0], ["What is 1 + 1?", "2"]]))
    with pytest.raises(ValueError) as raised:
        load_problems(str(bad))
    assert str(raised.value) == (f"{bad} row 1: a row must be a JSON object such as {{\"problem\": ..., \"answer\": "
                                 "...}, got list [\"What is 1 + 1?\", \"2\"]")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:3: a row must be a JSON object"):
        load_problems(str(bad))


def _long_prompt_data(tmp_path) -> str:
    rows = [{"problem": "1+1" + (" +0" * 200 if i == 1 else ""), "answer": "2"} for i in range(6)]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_a_refused_run_writes_nothing_so_the_mended_command_runs(tmp_path, capsys, tiny_model):
    """A run refused for a prompt too long had already written config.yaml and .lock: the same command, mended,
    was refused as "already holds a run", and so was --resume (with the changed setting)."""
    data = _long_prompt_data(tmp_path)
    out = tmp_path / "run"
    argv = ["train", "--model", tiny_model, "--output-dir", str(out), "--max-steps", "1", *TINY_RUN, "task.name=math",
            f"task.data_path={data}", "task.eval_size=2"]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and "exceeds the model's max_position_embeddings (64)" in one_error_line(err)
    assert not out.exists()  # created for the run, removed with its lock
    out.mkdir()  # a directory the user made: kept, empty
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and os.listdir(out) == []
    code, _, err = run_cli(capsys, *argv, "rollout.max_prompt_len=40", "rollout.truncate_prompts=true")
    assert code == 0, err
    assert [row["step"] for row in read_metrics(str(out / "metrics.jsonl"))] == [0, 1]


def test_overwrite_does_not_move_a_run_a_live_process_works_in(tmp_path, capsys, tiny_model):
    """--overwrite moved the run aside while a live `pacs eval` of it held OUTPUT_DIR/eval/.lock (its journal
    and outputs then landed in the new run): refused in one line naming the holder, nothing moved."""
    out = tmp_path / "run"
    (out / "eval").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    lock = out / "eval" / ".lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time\nfd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\nos.write(fd, f'{os.getpid()} __main__.py eval'.encode())\n"
         "print('locked', flush=True)\ntime.sleep(120)", str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        code, _, err = run_cli(capsys, "train", "--model", tiny_model, "--output-dir", str(out), "--overwrite",
                               "--max-steps", "1", *TINY_RUN)
    finally:
        holder.kill()
        holder.wait()
    assert code == 2
    assert one_error_line(err) == (
        f"pacs train: error: --output-dir '{out}' is in use by process {holder.pid} (__main__.py eval), which holds "
        f"{lock}; wait for it to end or choose another --output-dir")
    assert sorted(os.listdir(out)) == [".lock", "eval", "metrics.jsonl"]
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # nothing moved aside


@pytest.mark.parametrize("overrides, message", [
    # trained q_proj and ignored the name the model lacks
    (["model.lora.rank=4", "model.lora.target_modules=q_proj,bogus_proj"],
     "model.lora.target_modules='q_proj,bogus_proj': 'bogus_proj' names no layer of the model (its linear layers: "
     "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj; or all-linear)"),
    # accepted on a 64-wide model (one step took 611 s)
    (["model.lora.rank=100000"],
     "model.lora.rank=100000 is wider than a layer it adapts: model.layers.0.self_attn.q_proj maps 64 -> 64 "
     "features, so a rank above 64 adds parameters, not capacity; choose model.lora.rank <= 64"),
])
def test_lora_targets_the_model_lacks_or_a_rank_wider_than_its_layers_are_refused(tmp_path, capsys, tiny_model,
                                                                                 overrides, message):
    out = tmp_path / "run"
    code, _, err = run_cli(capsys, "train", "--model", tiny_model, "--output-dir", str(out), "--max-steps", "0",
                           *TINY_RUN, *overrides)
    assert code == 2 and one_error_line(err) == f"pacs train: error: {message}"
    assert not out.exists()


def test_a_full_disk_during_the_final_export_ends_in_one_line_and_leaves_no_tmp(tmp_path, capsys, tiny_model,
                                                                                  monkeypatch):
    """A full disk while final_model was written: a 27-line traceback and final_model.tmp/ left behind."""
    import pacs.run.export as export

    def full_disk(path):
        with open(os.path.join(path, "model.safetensors"), "ab") as fh:
            fh.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", os.path.join(path, "model.safetensors"))

    monkeypatch.setattr(export, "fsync_tree", full_disk)
    out = tmp_path / "run"
    code, _, err = run_cli(capsys, "train", "--model", tiny_model, "--output-dir", str(out), "--max-steps", "1",
                           *TINY_RUN)
    assert code == 2
    line = one_error_line(err)
    assert line.startswith(f"pacs train: error: no space left on the device writing the final model {out}/final_model: "
                           "it needs about ")
    assert line.endswith(f"; the unfinished {out}/final_model.tmp was removed; the last checkpoint is "
                         f"{out}/checkpoints/step_000001 (step 1); resume with: pacs train --config {out}/config.yaml "
                         "--resume")
    assert not (out / "final_model.tmp").exists() and not (out / "final_model").exists()
    monkeypatch.undo()  # space freed: the printed command finishes the run
    code, _, err = run_cli(capsys, "train", "--config", str(out / "config.yaml"), "--resume")
    assert code == 0, err
    assert (out / "final_model" / "model.safetensors").is_file()


def test_repeated_rows_are_dropped_and_said_so_no_held_out_problem_is_a_training_one(tmp_path, capsys):
    """A file of 10 rows repeated 12 times trained without a word, and its held-out split was made of training
    problems."""
    rows = [{"problem": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(10)]
    data = tmp_path / "repeated.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows * 12))
    task = MathTask(str(data), eval_size=200)
    said = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert said == [f"[data] task.data_path {str(data)!r}: 110 of 120 rows repeat an earlier row's question (rows 10, "
                    "11, 12, 13, 14, ...): dropped, 10 problems left"]
    train = {task.train_problem(i).prompt for i in range(10)}
    held_out = {p.prompt for p in task.eval_problems()}
    assert len(train) == 5 and len(held_out) == 5 and not train & held_out
    # a separate held-out file: the training rows it holds are dropped from training
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps(row) + "\n" for row in rows[:3]))
    task = MathTask(str(data), eval_path=str(held))
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"[data] task.data_path {str(data)!r}: 3 of 10 rows repeat a task.eval_path row's question (rows 0, 1, 2): "
        "dropped, 7 problems left")
    assert not {task.train_problem(i).prompt for i in range(7)} & {p.prompt for p in task.eval_problems()}


def test_an_empty_prompt_is_refused(tmp_path, capsys, tiny_model):
    data = tmp_path / "empty.jsonl"
    data.write_text("".join(json.dumps({"problem": q, "answer": "2"}) + "\n" for q in ("1+1", "1+1 ", " \n", "2+0")))
    out = tmp_path / "run"
    code, _, err = run_cli(capsys, "train", "--model", tiny_model, "--output-dir", str(out), *TINY_RUN,
                           "task.name=math", f"task.data_path={data}")
    assert code == 2
    assert one_error_line(err) == (f"pacs train: error: {data} row 2: the question is empty; each row needs a problem "
                                   "to solve")
    assert not out.exists()


def test_key_value_overrides_after_an_option_are_taken(tmp_path, capsys, monkeypatch):
    """KEY=VALUE after an option (a second run of them) was refused with argparse's "unrecognized arguments"."""
    import pacs.cli as cli

    built = {}

    def build_and_stop(args):
        built["cfg"] = cli.build_config.__wrapped__(args)
        raise ValueError("stopped before any work")

    build_and_stop.__wrapped__ = cli.build_config
    monkeypatch.setattr(cli, "build_config", build_and_stop)
    code = cli.main(["train", "optim.lr=1e-3", "--output-dir", str(tmp_path / "o"), "rollout.group_size=4", "--seed",
                     "3", "optim.lr=2e-3"])
    assert code == 2 and one_error_line(capsys.readouterr().err) == "pacs train: error: stopped before any work"
    cfg = built["cfg"]
    assert (cfg.optim.lr, cfg.rollout.group_size, cfg.seed) == (2e-3, 4, 3)  # the later value wins, as before
    with pytest.raises(SystemExit):  # an unknown option is still argparse's error
        cli.main(["train", "--output-dir", str(tmp_path / "o"), "--bogus", "optim.lr=1e-3"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def _nan_for_sevens(completions, **kwargs):
    return [float("nan") if "7" in text else (1.0 if "1" in text else 0.0) for text in completions]


def _string_labels(completions, **kwargs):
    return ["1" if "1" in text else "0" for text in completions]


@pytest.mark.parametrize("reward, error, message", [
    # taken as "no verdict" (docs/trl.md: refused)
    (_nan_for_sevens, ValueError, r"reward function '_nan_for_sevens' returned NaN for completion \d+: expected 1.0 "
                                  r"\(correct\), 0.0 \(wrong\) or None \(no verdict; a NaN is not taken for one\)"),
    # failed 13 frames deep in torch.tensor without naming the function
    (_string_labels, TypeError, r"reward function '_string_labels' returned str '[01]' for completion 0: expected a "
                                r"number \(1.0 correct, 0.0 wrong\) or None \(no verdict\)"),
])
def test_a_trl_reward_function_returning_nan_or_strings_is_named(tmp_path, reward, error, message):
    pytest.importorskip("trl")
    import trl_helpers
    from accelerate.state import GradientState

    trainer = trl_helpers.trainer(tmp_path, reward=reward, max_steps=1, seed=3)
    try:
        with pytest.raises(error, match=message):
            trainer.train()
    finally:  # a training loop stopped mid-step leaves accelerate's process-wide sync_gradients False: the
        GradientState._reset_state()  # next trainer in this process would take every step for accumulation


def test_trl_colocated_vllm_with_a_model_built_in_code_is_refused_at_construction(tmp_path):
    """PACSTrainer(use_vllm=True) with a model built in code failed 16 frames deep inside vLLM ("Repo id must use
    alphanumeric chars"); docs/trl.md says this mode needs a saved model."""
    pytest.importorskip("trl")
    import trl_helpers

    model = trl_helpers.tiny_model(len(trl_helpers.tokenizer()))
    with pytest.raises(ValueError) as raised:
        trl_helpers.trainer(tmp_path / "out", model=model, use_vllm=True, vllm_mode="colocate")
    assert str(raised.value) == (
        "use_vllm=True (vllm_mode='colocate') starts vLLM from the model's saved directory or hub id, and this model "
        "has none (its name_or_path is '', as for a model built in code); save it first (model.save_pretrained(DIR), "
        "tokenizer too) and pass DIR or the model loaded from it")
    assert not (tmp_path / "out").exists()
    from pacs.integrations.trl import PACSConfig, check_vllm_model

    args = PACSConfig(output_dir=str(tmp_path / "out"), use_vllm=True, vllm_mode="colocate", use_cpu=True,
                      report_to="none")
    model.save_pretrained(tmp_path / "saved")  # a saved model, a hub id, a directory name: accepted
    for saved in (model.from_pretrained(tmp_path / "saved"), str(tmp_path / "saved"), "Qwen/Qwen2.5-0.5B"):
        check_vllm_model(saved, args)


def test_update_nonzero_frac_counts_every_weight():
    """Sampled from 64 elements a tensor, update_nonzero_frac logged 1e-4 where 0.5% of the weights moved."""
    import torch

    from pacs.train.weight_updates import UpdateMonitor

    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(400, 250)), torch.nn.Parameter(torch.randn(1000))]
    monitor = UpdateMonitor(weights)
    for w in weights:
        w.grad = torch.randn_like(w)
    moved = torch.randperm(100_000)[:500]  # 0.5% of the big tensor
    monitor.before()
    with torch.no_grad():
        weights[0].view(-1)[moved] += 1.0
    assert monitor.after() == 500 / 101_000


def test_the_papers_settings_use_the_papers_constant_learning_rate():
    """configs/qwen2.5-math.yaml ("the paper's settings") took a real model's default cosine schedule."""
    from pacs.config import load_config, validate

    cfg = load_config(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                                   "qwen2.5-math.yaml"))
    validate(cfg)
    assert (cfg.optim.lr, cfg.optim.lr_schedule, cfg.optim.lr_warmup_steps) == (1e-6, "constant", 0)


def test_the_docs_say_what_the_math_reward_scores():
    """docs/real-models.md said only the last \\boxed{} counts, while math-verify scores an unboxed reply by its last
    expression (the public PACS code's settings, docs/evaluation.md): the docs now say so."""
    from pacs.tasks.rewards import math_reward

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(repo, "docs", "real-models.md")) as fh:
        answer_row = next(line for line in fh if line.startswith("| `answer` |"))
    assert "last `\\boxed{}` (a reply without one: its last expression" in answer_row
    assert math_reward("so the answer is 5", "5") == 1.0  # no box: the last expression
    assert math_reward("\\boxed{4}, or 5", "5") == 0.0  # a box: it alone counts


def test_the_add_pacs_forward_block_of_docs_pytorch_md_runs_as_pasted():
    """It used model, optimizer, torch and a batch it never made (NameError as pasted)."""
    import math

    from test_readme_integrations import readme_block

    namespace = {"__name__": "__docs__"}
    exec(readme_block("plain"), namespace)
    assert math.isfinite(float(namespace["out"].loss))


def _help(capsys, *argv: str) -> str:
    from pacs.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_help_texts_read_as_text_and_belong_to_their_command(capsys):
    """pacs --help showed reST markup (``pacs train``); pacs eval --help had no description and listed training's
    keys; pacs bench --help showed python benchmarks/run.py's examples."""
    text = _help(capsys, "--help")
    assert "``" not in text and "pacs train | eval | plan | bench: one entry point" in text
    text = _help(capsys, "eval", "--help")
    assert "Held-out accuracy and pass@k of a model (--model: a run's final_model" in text
    assert "eval.n_samples = " in text and "rollout.max_new_tokens = " in text and "task.data_path = " in text
    for training_key in ("optim.lr = ", "rollout.group_size = ", "max_steps = ", "train.packing = ",
                         "model.lora.rank = ", "checkpoint_every = "):
        assert training_key not in text
    assert "optim.lr = " in _help(capsys, "train", "--help")
    text = _help(capsys, "bench", "--help")
    assert "pacs bench --set cpu" in text and "``" not in text
    assert "python benchmarks/run.py --set" not in text


def test_a_run_refused_as_its_model_loads_leaves_no_config(tmp_path, capsys, tiny_model, monkeypatch):
    """Refused after config.yaml was written (here: too little disk for its checkpoints), the same command,
    mended, was refused as "already holds a run"."""
    import pacs.run.disk_space as disk_space

    out = tmp_path / "run"
    out.mkdir()
    monkeypatch.setattr(disk_space, "free_bytes", lambda path: 1024)
    argv = ["train", "--model", tiny_model, "--output-dir", str(out), "--max-steps", "1", *TINY_RUN]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and "has 1.0 KiB free, but the checkpoints this run keeps" in one_error_line(err)
    assert os.listdir(out) == []
    monkeypatch.undo()
    code, _, err = run_cli(capsys, *argv)
    assert code == 0, err
