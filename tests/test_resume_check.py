"""A resumed run stays the run it was (pacs/run/resume_check.py, issue #26 items 2, 3): settings that change what
the run is are refused before any write, listing each difference, unless named with --change (recorded with
the step it took effect at); settings that do not are accepted and recorded; config.yaml is never rewritten;
a model that does not fit the checkpoint is refused in one line before any write, and the resume command the
trainer prints keeps working."""

from __future__ import annotations

import json
import math
import os

import pytest

from pacs.cli import main
from pacs.config import Config
from pacs.run.resume_check import HISTORY_NAME, changes_what_the_run_is, resume_command
from pacs.tasks.embedded import build_model, build_tokenizer
from pacs.train.metrics import read_metrics

TINY_RUN = ["advanced.task.digits=1", "rollout.engine=hf", "rollout.prompts_per_step=2", "rollout.group_size=2",
            "rollout.max_new_tokens=3", "optim.mini_batches_per_step=1", "optim.micro_batch_groups=1",
            "eval.num_problems=4", "eval.every=0", "checkpoint_every=1", "advanced.plot=false",
            "advanced.torch_threads=1"]


def _model(path, hidden_size: int) -> str:
    task = Config().task
    task.hidden_size = hidden_size
    build_model(task, len(build_tokenizer()), seed=3).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two randomly initialised models of the embedded architecture: hidden size 64, and 96."""
    return _model(tmp_path_factory.mktemp("h64"), 64), _model(tmp_path_factory.mktemp("h96"), 96)


@pytest.fixture
def run_of_2_steps(tmp_path, capsys, models):
    out = tmp_path / "run"
    assert main(["train", "--model", models[0], "--output-dir", str(out), "--max-steps", "2", *TINY_RUN]) == 0
    capsys.readouterr()
    return out


def _snapshot(out) -> dict:
    """What a refused resume must leave as it was: every file's bytes, and no history."""
    found = {}
    for name in ("config.yaml", "metrics.jsonl", HISTORY_NAME):
        path = out / name
        found[name] = path.read_bytes() if path.exists() else None
    found["checkpoints"] = sorted(os.listdir(out / "checkpoints"))
    return found


def _error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("rollout steps")]
    assert len(lines) == 1, err
    return lines[0]


def test_which_settings_change_what_a_run_is():
    for key in ("model.path", "optim.algo", "optim.lr", "optim.lr_schedule", "optim.beta", "rollout.group_size",
                "task.data_path", "seed", "model.dtype", "optim.master_dtype"):
        assert changes_what_the_run_is(key), key
    for key in ("max_steps", "eval.every", "checkpoint_every", "plot", "train.packing", "rollout.engine"):
        assert not changes_what_the_run_is(key), key


@pytest.mark.slow
def test_a_resume_with_other_settings_is_refused_before_any_write(run_of_2_steps, capsys, models):
    out = run_of_2_steps
    before = _snapshot(out)
    code = main(["train", "--model", models[0], "--output-dir", str(out), "--max-steps", "3", "--resume", *TINY_RUN,
                 "optim.lr=1e-3", "rollout.group_size=4", "--algo", "grpo"])
    line = _error_line(capsys.readouterr().err)
    assert code == 2
    assert line == (
        f"pacs train: error: --resume: 3 setting(s) differ from the run's in {out} and change what the run is: "
        'rollout.group_size 2 -> 4, optim.algo "pacs" -> "grpo", optim.lr 0.0002 -> 0.001; resume with the '
        f"run's settings (pacs train --config {out}/config.yaml --resume), or name each change with --change "
        "KEY=VALUE to make it from the resumed step on")
    assert _snapshot(out) == before


@pytest.mark.slow
def test_accepted_and_named_changes_are_recorded_and_the_printed_command_continues(run_of_2_steps, capsys, models):
    out = run_of_2_steps
    config = (out / "config.yaml").read_bytes()
    # more steps and another evaluation cadence change nothing the run is: accepted, recorded
    assert main(["train", "--config", str(out / "config.yaml"), "--resume", "--max-steps", "3", "eval.every=1"]) == 0
    assert "[resume] from step 3 on, accepted: max_steps 2 -> 3, eval.every 0 -> 1" in capsys.readouterr().out
    # a new learning rate, named: from step 4 on, in the optimizer too
    assert main(["train", "--config", str(out / "config.yaml"), "--resume", "--change", "optim.lr=1e-3",
                 "max_steps=5", "eval.every=1"]) == 0
    assert "[resume] from step 4 on, changed (--change): optim.lr 0.0002 -> 0.001" in capsys.readouterr().out
    assert (out / "config.yaml").read_bytes() == config  # the run's original config, never rewritten
    history = [json.loads(line) for line in (out / HISTORY_NAME).read_text().splitlines()]
    assert [(h["resumed_from_step"], h["takes_effect_at_step"]) for h in history] == [(2, 3), (3, 4)]
    assert history[0]["accepted"] == {"max_steps": [2, 3], "eval.every": [0, 1]} and history[0]["changed"] == {}
    assert history[1]["changed"] == {"optim.lr": [0.0002, 0.001]} and history[1]["config"]["optim"]["lr"] == 0.001
    rows = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    # each row's lr is the rate its update ran at: update k of a cosine over max_steps updates
    cosine = lambda k, total: 0.5 * (1 + math.cos(math.pi * k / total))  # noqa: E731
    assert rows[1]["lr"] == pytest.approx(2e-4) and rows[2]["lr"] == pytest.approx(2e-4 * cosine(1, 2))
    # the longer run re-plans the schedule from its first update (not the old schedule's final rate, 0)
    assert rows[3]["lr"] == pytest.approx(2e-4 * cosine(2, 3))
    assert rows[4]["lr"] == pytest.approx(1e-3 * cosine(3, 5))  # cosine at the new rate
    # the command the trainer prints continues with the settings in effect, and the same lr again is no change
    command = resume_command(str(out))
    assert command == (f"pacs train --config {out}/config.yaml --resume --change optim.lr=0.001 max_steps=5 "
                       "eval.every=1")
    assert main(command.split()[1:]) == 0
    assert "[resume] from step" not in capsys.readouterr().out  # nothing differs from the settings in effect


@pytest.mark.slow
def test_another_model_is_refused_in_one_line_before_any_write(run_of_2_steps, capsys, models):
    out = run_of_2_steps
    before = _snapshot(out)
    # another model directory changes what the run is
    code = main(["train", "--model", models[1], "--output-dir", str(out), "--resume", "--max-steps", "3", *TINY_RUN])
    assert code == 2 and "model.path" in _error_line(capsys.readouterr().err)
    # named with --change, it still cannot load the checkpoint: one line, nothing written
    code = main(["train", "--config", str(out / "config.yaml"), "--resume", "--change", f"model.path={models[1]}"])
    line = _error_line(capsys.readouterr().err)
    assert code == 2
    assert line.startswith(f"pacs train: error: --resume: the model does not match checkpoint "
                           f"{out}/checkpoints/step_000002 (")
    assert "64) there, (" in line and "96) in the model" in line and line.endswith("nothing was written"), line
    assert _snapshot(out) == before
    # and the resume command the trainer printed still works
    assert main(["train", "--config", str(out / "config.yaml"), "--resume", "--max-steps", "3"]) == 0


@pytest.mark.slow
def test_a_runs_config_resumes_that_run_from_any_directory(tmp_path, capsys, models, monkeypatch):
    """A run started with a relative --output-dir records it as typed; `--config THAT_RUN/config.yaml --resume`
    from another directory resumes that run (it started a new one there, silently, before)."""
    first, elsewhere = tmp_path / "first", tmp_path / "elsewhere"
    first.mkdir(), elsewhere.mkdir()
    monkeypatch.chdir(first)
    assert main(["train", "--model", models[0], "--output-dir", "runs/x", "--max-steps", "2", *TINY_RUN]) == 0
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert main(["train", "--config", str(first / "runs/x/config.yaml"), "--resume", "--max-steps", "3"]) == 0
    out = capsys.readouterr().out
    assert (f"[resume] --config {first}/runs/x/config.yaml is the run in {first}/runs/x: resuming it there (its "
            f"recorded output_dir 'runs/x' is {elsewhere}/runs/x from here; --output-dir chooses another)") in out
    assert [r["step"] for r in read_metrics(str(first / "runs/x/metrics.jsonl"))] == [0, 1, 2, 3]
    assert not (elsewhere / "runs").exists()


def test_a_resume_recorded_after_a_torn_line_takes_effect(tmp_path):
    """A crash mid-append leaves config_history.jsonl without its last newline; the next resume's record must
    not be glued onto that line (it would not parse, and the run would silently go back to older settings)."""
    from pacs.config import save_config, to_user_dict
    from pacs.run.resume_check import ResumePlan, record_resume, settings_in_effect

    out = tmp_path / "run"
    out.mkdir()
    save_config(Config(), str(out / "config.yaml"))
    (out / HISTORY_NAME).write_text('{"time": "2026-01-01T00:00:00+00:00", "resumed_from_st')
    changed = Config()
    changed.optim.lr = 1e-5
    record_resume(str(out), ResumePlan({"optim.lr": [Config().optim.lr, 1e-5]}, {}, to_user_dict(changed)), 3,
                  say=lambda line: None)
    assert settings_in_effect(str(out)).optim.lr == 1e-5
    assert (out / HISTORY_NAME).read_text().splitlines()[1].startswith('{"time"')
