"""Metrics as durable as the checkpoints they precede, and a full disk in one line (issue #26 items 4, 5):
each metrics row is fsynced before the checkpoint that follows it is published; rows lost behind a
checkpoint that survived (a power loss before the fix, a hand edit) are said on resume; a write that fails
with ENOSPC removes the unfinished checkpoint and names the path, the bytes needed and the bytes free; the
run resumes from its last good checkpoint; free space is checked before training."""

from __future__ import annotations

import errno
import json
import os

import fault_worker
import pytest
import test_run_errors

import pacs.run.checkpoint as ck
import pacs.run.disk_space as disk_space
from pacs.cli import main
from pacs.run.disk_space import NoSpaceLeft
from pacs.train.metrics import read_metrics

TINY_RUN = test_run_errors.TINY_RUN
tiny_model = test_run_errors.tiny_model  # the same module-scoped fixture: a random copy of the embedded model


def test_each_metrics_row_is_fsynced_before_the_checkpoint_that_follows(tmp_path, monkeypatch):
    out = str(tmp_path / "run")
    events = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rename(src, dst):
        events.append(("rename", str(dst)))
        return real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    fault_worker.run(out, 3)
    published = [i for i, (kind, path) in enumerate(events) if kind == "rename" and path.endswith(
        tuple(f"step_{s:06d}" for s in (1, 2, 3)))]
    assert len(published) == 3
    before = 0
    for i in published:  # the step's row reached the disk after the previous checkpoint and before this one
        assert any(kind == "fsync" and path.endswith("metrics.jsonl") for kind, path in events[before:i]), events
        before = i


def test_rows_lost_behind_a_durable_checkpoint_are_said_on_resume(tmp_path, capsys):
    out = str(tmp_path / "run")
    fault_worker.run(out, 7)
    metrics = os.path.join(out, "metrics.jsonl")
    rows = read_metrics(metrics)
    with open(metrics, "w") as fh:  # a power loss kept the checkpoint of step 7, not the rows of steps 6-7
        fh.writelines(json.dumps(row) + "\n" for row in rows[:6])
    capsys.readouterr()
    fault_worker.run(out, 9)
    said = [line for line in capsys.readouterr().out.splitlines() if "no rows" in line]
    assert said == [f"[resume] {metrics} has no rows for steps 6-7 behind the checkpoint of step 7 (lost before "
                    "they reached the disk, or removed): the log keeps that gap"]
    assert [row["step"] for row in read_metrics(metrics)] == [0, 1, 2, 3, 4, 5, 8, 9]


def _write_files(fail_with: BaseException | None):
    def write_files(tmp: str) -> None:
        ck.save_json({"step": 1}, os.path.join(tmp, "state.json"))
        if fail_with is not None:
            raise fail_with
        ck.save_json({"x": 1}, os.path.join(tmp, "model.pt"))
    return write_files


@pytest.mark.parametrize("error", [
    OSError(errno.ENOSPC, "No space left on device"),
    RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0"),  # torch.save's report
])
def test_a_full_disk_mid_checkpoint_removes_the_unfinished_one_and_keeps_the_last(tmp_path, error):
    root = str(tmp_path / "checkpoints")
    ck.write_checkpoint_files(root, 1, _write_files(None))
    with pytest.raises(NoSpaceLeft) as raised:
        ck.write_checkpoint_files(root, 2, _write_files(error), expected_bytes=3 * 2**20)
    message = str(raised.value)
    assert message.startswith(f"no space left on the device writing checkpoint {root}/step_000002: it needs "
                              "about 3.0 MiB, ")
    assert " free there; the unfinished " in message and "\n" not in message
    assert sorted(os.listdir(root)) == ["latest", "step_000001"]
    assert ck.find_checkpoint(str(tmp_path)).step == 1


def test_a_full_disk_at_the_latest_pointer_keeps_the_published_checkpoint_and_rotates(tmp_path, monkeypatch):
    """The disk fills after the checkpoint's rename, writing the `latest` pointer: the checkpoint is complete
    (resume scans the step directories), so the write succeeds without the pointer and rotation makes room
    (it raised, saying the checkpoint had been removed, and kept every old one)."""
    root = str(tmp_path / "checkpoints")
    for step in (1, 2):
        ck.write_checkpoint_files(root, step, _write_files(None), keep=2)
    real = ck._write_durably

    def full_at_the_pointer(path, write):
        if path.endswith("latest.tmp"):
            open(path, "wb").close()
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real(path, write)

    monkeypatch.setattr(ck, "_write_durably", full_at_the_pointer)
    assert ck.write_checkpoint_files(root, 3, _write_files(None), keep=2) == os.path.join(root, "step_000003")
    assert sorted(os.listdir(root)) == ["step_000002", "step_000003"]  # no stale pointer to step 2
    assert ck.find_checkpoint(str(tmp_path)).step == 3


@pytest.mark.slow
def test_pacs_train_on_a_full_disk_says_one_line_then_resumes(tmp_path, capsys, monkeypatch, tiny_model):
    out = tmp_path / "run"
    argv = ["train", "--model", tiny_model, "--output-dir", str(out), "--max-steps", "3", *TINY_RUN]
    real_save, calls = ck.save_torch, {"n": 0}

    def full_at_the_second_checkpoint(obj, path):
        if os.path.basename(path) == "model.pt":
            calls["n"] += 1
            if calls["n"] == 2:
                with open(path, "wb") as fh:
                    fh.write(b"partial")
                raise OSError(errno.ENOSPC, "No space left on device", path)
        return real_save(obj, path)

    monkeypatch.setattr(ck, "save_torch", full_at_the_second_checkpoint)
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2
    lines = [line for line in captured.err.splitlines() if line.strip() and not line.startswith("rollout steps")]
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"pacs train: error: no space left on the device writing checkpoint "
                               f"{out}/checkpoints/step_000002: it needs about ")
    assert lines[0].endswith(f"the last checkpoint is {out}/checkpoints/step_000001 (step 1); resume with: "
                             f"pacs train --config {out}/config.yaml --resume")
    assert "[train] disk: 3 checkpoints of about " in captured.out  # said before training
    assert not [name for name in os.listdir(out / "checkpoints") if name.endswith(".tmp")]

    monkeypatch.setattr(ck, "save_torch", real_save)
    code = main(["train", "--config", str(out / "config.yaml"), "--resume"])
    assert code == 0, capsys.readouterr().err
    assert [row["step"] for row in read_metrics(str(out / "metrics.jsonl"))] == [0, 1, 2, 3]


def test_checkpoints_that_do_not_fit_are_refused_before_training(tmp_path, capsys, monkeypatch, tiny_model):
    out = tmp_path / "run"

    class Usage:
        free = 1000

    monkeypatch.setattr(disk_space.shutil, "disk_usage", lambda path: Usage)
    code = main(["train", "--model", tiny_model, "--output-dir", str(out), "--max-steps", "2", *TINY_RUN])
    err = capsys.readouterr().err
    assert code == 2
    assert f"pacs train: error: --output-dir '{out}' has 1000 B free, but the checkpoints this run keeps" in err
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()


def test_the_disk_estimate_counts_what_checkpoints_and_the_export_hold():
    """A LoRA checkpoint holds the adapters and their AdamW moments, not the frozen base; the export holds the
    base with the adapters merged, in the compute dtype (a LoRA run on a big model was refused for disk space
    its checkpoints would never take)."""
    import torch
    from torch import nn

    from pacs.model.mixed_precision import Precision

    class Adapted(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(100, 50, bias=False).requires_grad_(False)  # the frozen base: 5,000 weights
            self.proj.lora_A = nn.ModuleDict({"default": nn.Linear(100, 4, bias=False)})  # 400
            self.proj.lora_B = nn.ModuleDict({"default": nn.Linear(4, 50, bias=False)})  # 200
            self.precision = Precision(compute=torch.bfloat16, master=torch.float32)

    policy = Adapted()
    assert disk_space.checkpoint_bytes(policy, reference_kept=False) == 600 * 4 * 3
    assert disk_space.checkpoint_bytes(policy, reference_kept=True) == 600 * 4 * 4
    assert disk_space.final_model_bytes(policy) == 5000 * 2
