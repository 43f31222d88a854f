"""Everyday mistakes end in one line and exit code 2, never in a traceback or a lost run: unusable
or occupied output directories, a model without weights, a data set too small for its held-out
split, nonsense settings; Ctrl-C twice says how to resume; --overwrite moves the old run aside. (One
Ctrl-C or a scheduler's SIGTERM finishes the step: tests/test_trainer_e2e.py.)"""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch

import pacs.train.update as update
from pacs.cli import main
from pacs.config import Config
from pacs.run import stop_signals
from pacs.run.checkpoint import latest_checkpoint
from pacs.tasks.embedded import build_model, build_tokenizer
from pacs.train.metrics import read_metrics

TINY_RUN = ["advanced.task.digits=1", "rollout.engine=hf", "rollout.prompts_per_step=2", "rollout.group_size=2",
            "rollout.max_new_tokens=3", "optim.mini_batches_per_step=1", "optim.micro_batch_groups=1",
            "eval.num_problems=4", "eval.every=0", "checkpoint_every=1", "advanced.plot=false",
            "advanced.torch_threads=1"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A randomly initialised copy of the embedded model's architecture (no warm-up: fast)."""
    path = tmp_path_factory.mktemp("tiny_model")
    build_model(Config().task, len(build_tokenizer()), seed=3).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error_line(err: str) -> str:
    """The one line on stderr apart from the progress bar's."""
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("rollout steps")]
    assert len(lines) == 1, err
    return lines[0]


def test_unusable_output_dirs(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    code, _, err = run_cli(capsys, "train", "--output-dir", str(a_file))
    assert code == 2 and one_error_line(err).startswith("pacs train: error: --output-dir")
    assert "is a file, not a directory" in err
    code, _, err = run_cli(capsys, "train", "--output-dir", str(a_file / "below"))
    assert code == 2 and "cannot be written (a parent is a file)" in one_error_line(err)
    code, _, err = run_cli(capsys, "train", "--output-dir", "/proc/pacs-run")
    assert code == 2 and "--output-dir '/proc/pacs-run' cannot be written" in one_error_line(err)
    if os.geteuid() != 0:  # root writes anywhere: the permission case needs an ordinary user
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        code, _, err = run_cli(capsys, "train", "--output-dir", str(locked / "run"))
        assert code == 2 and "no permission" in one_error_line(err)


def test_a_used_output_dir_needs_resume_or_overwrite(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    code, _, err = run_cli(capsys, "train", "--output-dir", str(out))
    assert code == 2
    assert one_error_line(err) == (
        f"pacs train: error: --output-dir '{out}' already holds a run (metrics.jsonl); pass --resume to continue "
        "it, --overwrite to move it aside and start afresh, or choose another --output-dir")
    code, _, err = run_cli(capsys, "train", "--output-dir", str(out), "--resume", "--overwrite")
    assert code == 2 and "--resume and --overwrite exclude each other" in one_error_line(err)
    assert (out / "metrics.jsonl").read_text() == '{"step": 0}\n'  # untouched


def test_resume_refuses_a_run_whose_checkpoints_all_fail(tmp_path, capsys, tiny_model):
    out = tmp_path / "run"
    (out / "checkpoints" / "step_000004").mkdir(parents=True)
    (out / "checkpoints" / "step_000004" / "model.pt").write_bytes(b"half")
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    code, out_text, err = run_cli(capsys, "train", "--model", tiny_model, "--output-dir", str(out), "--resume",
                                  *TINY_RUN)
    assert code == 2
    assert "[resume] skipping" in out_text and "step_000004: no manifest.json" in out_text
    assert "holds a run (metrics.jsonl, checkpoints) but no checkpoint that verifies" in one_error_line(err)
    assert (out / "metrics.jsonl").read_text() == '{"step": 0}\n'


def test_resume_of_a_run_killed_before_its_first_checkpoint_starts_it_again(tmp_path, capsys, tiny_model):
    """A run killed (kill -9, out of memory) before its first checkpoint left its config and metrics: --resume,
    the command a scheduler's requeue repeats, moves that run aside and starts again (it refused, every time)."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    (out / "checkpoints" / "step_000001.tmp").mkdir(parents=True)  # killed while writing the first one
    code, out_text, err = run_cli(capsys, "train", "--model", tiny_model, "--output-dir", str(out), "--resume",
                                  "--max-steps", "1", *TINY_RUN)
    assert code == 0, err
    assert (f"[resume] no checkpoint under {out}/checkpoints: starting from scratch (the run there wrote none: "
            "metrics.jsonl, checkpoints moved aside)") in out_text
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert len(aside) == 1 and (aside[0] / "metrics.jsonl").read_text() == '{"step": 0}\n'  # kept, not deleted
    assert f"[train] --resume: moved the previous run in {out} to {aside[0]}" in out_text
    assert [row["step"] for row in read_metrics(str(out / "metrics.jsonl"))] == [0, 1]


def test_model_directory_without_weights(tmp_path, capsys, tiny_model):
    no_weights = tmp_path / "config_only"
    no_weights.mkdir()
    shutil.copy(os.path.join(tiny_model, "config.json"), no_weights)
    for command in ("train", "eval"):
        code, _, err = run_cli(capsys, command, "--model", str(no_weights), "--output-dir", str(tmp_path / "o"),
                               *TINY_RUN)
        assert code == 2
        assert one_error_line(err) == (
            f"pacs {command}: error: --model: '{no_weights}' has a config.json but no weights (expected "
            "model.safetensors, model-*.safetensors with its index, or pytorch_model.bin)")


def test_data_set_too_small_for_the_held_out_split(tmp_path, capsys, tiny_model):
    data = tmp_path / "one_row.jsonl"
    data.write_text(json.dumps({"problem": "1+1", "answer": "2"}) + "\n")
    for command in ("train", "eval"):
        code, _, err = run_cli(capsys, command, "--model", tiny_model, "--output-dir", str(tmp_path / command),
                               *TINY_RUN, "task.name=math", f"task.data_path={data}")
        assert code == 2
        assert f"task.data_path '{data}' is too small for a held-out split: 0 held-out problems" in one_error_line(err)


@pytest.mark.parametrize("override, message", [
    ("optim.beta=-1", "optim.beta must be > 0, got -1.0"),
    ("optim.beta=0", "optim.beta must be > 0, got 0.0"),
    ("advanced.optim.weight_decay=-0.1", "optim.weight_decay must be >= 0"),
    ("advanced.optim.betas=[0.9,1.5]", "optim.betas must be two numbers in [0, 1)"),
    ("advanced.optim.clip_eps=2", "optim.clip_eps must be in (0, 1)"),
    ("advanced.optim.score=logit", "optim.score must be one of"),
    ("advanced.optim.lr_warmup_steps=-3", "optim.lr_warmup_steps must be >= 0"),
    ("advanced.rollout.kv_cache_gib=0", "rollout.kv_cache_gib must be > 0"),
    ("rollout.gpu_memory_utilization=1.5", "rollout.gpu_memory_utilization must be in (0, 1]"),
    ("max_minutes=0", "max_minutes must be > 0"),
    ("advanced.checkpoint_minutes=-5", "checkpoint_minutes must be > 0"),
    ("advanced.checkpoint_minutes=.nan", "checkpoint_minutes must be > 0"),
    ("max_minutes=.nan", "max_minutes must be > 0"),
    ("advanced.torch_threads=0", "torch_threads must be > 0"),
    ("seed=-1", "seed (--seed) must be >= 0"),
    ("eval.temperature=-1", "eval.temperature must be >= 0"),
    ("advanced.task.num_heads=0", "task.num_heads must be > 0"),
    ("advanced.task.warmup_target_accuracy=2", "task.warmup_target_accuracy must be in [0, 1]"),
])
def test_nonsense_settings_exit_2_before_any_work(tmp_path, capsys, override, message):
    code, _, err = run_cli(capsys, "train", "--output-dir", str(tmp_path / "o"), override)
    assert code == 2 and message in one_error_line(err)
    assert not (tmp_path / "o").exists()  # refused before the output directory was even created


def test_train_help_shows_defaults_and_every_key(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "configs/default.yaml" in text and "(default: 600)" in text and "(default: runs/embedded)" in text
    for line in ("optim.beta = 1.0", "rollout.group_size = 8", "eval.ks = [1]", "task.data_path = None"):
        assert line in text


@pytest.mark.slow
def test_ctrl_c_resume_and_overwrite(tmp_path, capsys, tiny_model, monkeypatch):
    out = tmp_path / "run"
    argv = ["train", "--model", tiny_model, "--output-dir", str(out), "--max-steps", "3", *TINY_RUN]
    real_update, calls = update.update_policy, {"n": 0}

    def interrupted_at_step_3(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # Ctrl-C twice: the first would finish the step, the second stops at once
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)  # KeyboardInterrupt from here
        return real_update(*args, **kwargs)

    monkeypatch.setattr(update, "update_policy", interrupted_at_step_3)
    monkeypatch.setattr(stop_signals, "REPEAT_SECONDS", 0.0)  # the second Ctrl-C is a second request, not a repeat
    code, _, err = run_cli(capsys, *argv)
    config = out / "config.yaml"
    assert code == 130
    assert one_error_line(err) == (
        f"pacs train: interrupted at step 3; the last checkpoint is {out}/checkpoints/step_000002 (step 2); "
        f"resume with: pacs train --config {config} --resume")
    monkeypatch.setattr(update, "update_policy", real_update)

    code, _, err = run_cli(capsys, *argv)  # the same command again: refused, nothing lost
    assert code == 2 and "already holds a run" in err
    assert [r["step"] for r in read_metrics(str(out / "metrics.jsonl"))] == [0, 1, 2]

    code, text, err = run_cli(capsys, "train", "--config", str(config), "--resume")  # the printed command
    assert code == 0, err
    assert f"[resume] continuing from {out}/checkpoints/step_000002 (step 2)" in text
    last = text.strip().splitlines()[-1]
    assert last.startswith("[train] done: 3 steps, held-out accuracy ") and "peak memory" in last
    assert f"model {out}/final_model" in last
    resumed = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert latest_checkpoint(str(out)).endswith("step_000003")

    code, text, err = run_cli(capsys, *argv, "--overwrite")
    assert code == 0, err
    moved = [p for p in os.listdir(tmp_path) if p.startswith("run.replaced-")]
    assert len(moved) == 1 and f"moved the previous run in {out} to {tmp_path / moved[0]}" in text
    assert read_metrics(str(tmp_path / moved[0] / "metrics.jsonl")) == resumed  # the old run, whole
    fresh = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in fresh] == [0, 1, 2, 3]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in fresh[1:])


@pytest.mark.parametrize("error", [ValueError, RuntimeError])
def test_a_crash_mid_run_says_how_to_resume_and_keeps_its_traceback(tmp_path, capsys, tiny_model, monkeypatch, error):
    """An error inside a training step (a reward function's bug, out of memory while generating) is not a
    setting: the CLI lets it out with its traceback (a ValueError too, not the settings' one line, exit 2),
    after a line naming the last checkpoint and the command that continues the run."""
    out = tmp_path / "run"
    real_update, calls = update.update_policy, {"n": 0}

    def crashes_at_step_3(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise error("something broke inside the step")
        return real_update(*args, **kwargs)

    monkeypatch.setattr(update, "update_policy", crashes_at_step_3)
    with pytest.raises(error, match="something broke inside the step"):
        main(["train", "--model", tiny_model, "--output-dir", str(out), "--max-steps", "4", *TINY_RUN])
    err = capsys.readouterr().err
    assert (f"[train] stopped by {error.__name__} after step 2 (the last one finished); the last checkpoint is "
            f"{out}/checkpoints/step_000002 (step 2); resume with: pacs train --config {out}/config.yaml --resume"
            ) in err
    assert "pacs train: error:" not in err


@pytest.mark.parametrize("value, message", [
    ("flash", "PACS_PACKED_ATTENTION='flash': expected one of auto, loop, varlen"),
    ("varlen", "PACS_PACKED_ATTENTION=varlen: the packed rows' attention cannot run as one flash varlen call here: "
               "no varlen kernel on cpu"),
])
def test_a_packed_attention_engine_that_cannot_run_is_refused_before_any_work(tmp_path, capsys, monkeypatch,
                                                                              value, message):
    monkeypatch.setenv("PACS_PACKED_ATTENTION", value)
    code, _, err = run_cli(capsys, "train", "--output-dir", str(tmp_path / "o"))
    assert code == 2 and message in one_error_line(err)
    assert not (tmp_path / "o").exists()


def test_the_prompt_cut_warning_gets_a_line_of_its_own(tmp_path, tiny_model, monkeypatch):
    """Printed on a console where the progress bar (stderr) and the trainer's lines (stdout) share the
    screen, the warning starts a line of its own, not the bar's line (issue #26)."""
    import io
    import sys

    screen = io.StringIO()
    monkeypatch.setattr(sys, "stdout", screen)
    monkeypatch.setattr(sys, "stderr", screen)
    code = main(["train", "--model", tiny_model, "--output-dir", str(tmp_path / "run"), "--max-steps", "1",
                 *TINY_RUN, "rollout.max_prompt_len=2", "rollout.truncate_prompts=true"])  # cut, not refused
    text = screen.getvalue()
    assert code == 0, text
    at = text.index("[warning] prompts longer than rollout.max_prompt_len=2 tokens")
    assert "rollout steps" in text[:at]  # the bar was drawn before it
    assert text[at - 1] in "\r\n", repr(text[max(0, at - 80):at + 20])
