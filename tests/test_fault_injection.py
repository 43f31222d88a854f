"""Faults during checkpointing never lose a run: kill -9 anywhere in a checkpoint write (a chain
of killed and resumed runs, one seed per kill), truncated or corrupted checkpoint files, torn
metrics lines, a stale ``latest``, rotation by step number. The toy loop is tests/fault_worker.py;
the real trainer's kill-and-resume equality is tests/test_trainer_e2e.py."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import signal

import fault_worker
import pytest
import torch

from pacs.run import checkpoint as ck
from pacs.train.metrics import MetricsLog, read_metrics

STEPS = 40
# every call of a checkpoint write where a kill leaves a different state behind
KILL_POINTS = ["save_torch", "save_json", "write_manifest", "fsync_dir", "rename", "replace", "rotate", "rmtree"]


@pytest.fixture(scope="module")
def forkserver():
    """Children forked from one server that imported torch and pacs once: a child starts in
    milliseconds (a fresh interpreter takes 5-10 s on the 2-core CI machine)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "pacs.run.checkpoint", "pacs.train.metrics", "fault_worker"])
    return ctx


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("uninterrupted"))
    fault_worker.run(out, STEPS)
    return out, read_metrics(os.path.join(out, "metrics.jsonl"))


def _state_value(path: str) -> float:
    return float(torch.load(os.path.join(path, "model.pt"), weights_only=True)["x"].double().sum())


def check_invariants(out: str, expected: list[dict]) -> int:
    """What a kill at any moment must leave: every step_N directory verifies; the newest holds
    the uninterrupted run's state of its step; the log is a prefix of the uninterrupted log (bar
    a torn last line) and at most the one step after the newest checkpoint is lost. Returns the
    newest checkpoint's step."""
    for step, path in ck.checkpoint_steps(out):
        assert ck.verify_checkpoint(path) is None, (path, ck.verify_checkpoint(path))
    choice = ck.find_checkpoint(out)
    assert not choice.skipped
    rows, _torn = read_metrics(os.path.join(out, "metrics.jsonl"), allow_torn_tail=True)
    assert rows == expected[:len(rows)]
    if choice.path is not None:
        assert _state_value(choice.path) == expected[choice.step]["value"]
        assert choice.step >= rows[-1]["step"] - 1
    return choice.step


def test_kill_9_anywhere_in_checkpoint_writes_then_resume_equals_uninterrupted(tmp_path, forkserver, uninterrupted):
    _, expected = uninterrupted
    out = str(tmp_path / "run")
    kills = 0
    for seed in range(14):
        rng = random.Random(seed)
        ready = forkserver.Event()
        if seed % 3 == 2:  # a timer: SIGKILL from outside at a random moment
            child = forkserver.Process(target=fault_worker.run, args=(out, STEPS, None, ready))
            child.start()
            assert ready.wait(60)
            child.join(rng.uniform(0.0, 0.5))
            if child.is_alive():
                os.kill(child.pid, signal.SIGKILL)
        else:  # a chosen call of the write sequence, before or after it
            die_at = (rng.choice(KILL_POINTS), rng.randint(1, 4), rng.choice(["before", "after"]))
            child = forkserver.Process(target=fault_worker.run, args=(out, STEPS, die_at, ready))
            child.start()
        child.join(60)
        kills += child.exitcode == -signal.SIGKILL
        assert child.exitcode in (0, -signal.SIGKILL), child.exitcode
        check_invariants(out, expected)
        if child.exitcode == 0:  # the chain reached the end: start a new one, so later kills land mid-run
            shutil.rmtree(out)
    assert kills >= 6, kills  # most runs were really killed before finishing (the timer may miss a fast run)
    fault_worker.run(out, STEPS)  # the last resume runs to the end
    assert read_metrics(os.path.join(out, "metrics.jsonl")) == expected
    assert check_invariants(out, expected) == STEPS
    assert [step for step, _ in ck.checkpoint_steps(out)] == [STEPS - 1, STEPS]


@pytest.mark.parametrize("victim", ["model.pt", "rng_rank0.pt", "state.json", "manifest.json"])
@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, uninterrupted, victim, damage):
    source, expected = uninterrupted
    out = str(tmp_path / "run")
    shutil.copytree(source, out)
    newest = os.path.join(out, "checkpoints", f"step_{STEPS:06d}")
    path = os.path.join(newest, victim)
    data = open(path, "rb").read()
    if damage == "truncate":
        open(path, "wb").write(data[:len(data) // 2])
    elif damage == "flip":
        middle = len(data) // 2
        open(path, "wb").write(data[:middle] + bytes([data[middle] ^ 0x55]) + data[middle + 1:])
    else:
        os.remove(path)
    choice = ck.find_checkpoint(out)
    assert choice.step == STEPS - 1 and choice.path.endswith(f"step_{STEPS - 1:06d}")
    assert len(choice.skipped) == 1 and choice.skipped[0][0] == newest
    lines = choice.describe()
    assert lines[0].startswith(f"[resume] skipping {newest}: ") and lines[-1].endswith(f"(step {STEPS - 1})")
    reason = choice.skipped[0][1]
    if victim != "manifest.json" or damage != "flip":  # a flipped manifest may still parse: then a file mismatches
        assert victim in reason, reason
    # resuming from the previous checkpoint redoes the last step: the log equals the uninterrupted one,
    # and the damaged checkpoint is replaced only by a verified one of the same step
    fault_worker.run(out, STEPS)
    assert read_metrics(os.path.join(out, "metrics.jsonl")) == expected
    assert ck.verify_checkpoint(newest) is None and _state_value(newest) == expected[STEPS]["value"]


def test_torn_metrics_line_is_dropped_with_a_warning(tmp_path, uninterrupted, capsys):
    source, expected = uninterrupted
    out = str(tmp_path / "run")
    shutil.copytree(source, out)
    shutil.rmtree(os.path.join(out, "checkpoints", f"step_{STEPS:06d}"))  # killed after step 12's row
    metrics = os.path.join(out, "metrics.jsonl")
    with open(metrics, "a") as fh:
        fh.write('{"step": 13, "val')  # and killed mid-write of a next row
    fault_worker.run(out, STEPS)
    assert "dropped a torn last line" in capsys.readouterr().out
    assert read_metrics(metrics) == expected


def test_metrics_errors_name_the_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl line 2 is not JSON"):
        read_metrics(str(path))
    with pytest.raises(ValueError, match=r"line 2 is not JSON"):
        MetricsLog(str(path), resume_step=1)
    path.write_text('{"step": 0}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"line 2 is not a JSON object"):
        read_metrics(str(path))
    path.write_text('{"step": 0}\n{"step": 1}')  # a whole last row without its newline is kept
    assert read_metrics(str(path)) == [{"step": 0}, {"step": 1}]


def test_stale_latest_pointer_is_ignored(tmp_path, uninterrupted):
    source, _ = uninterrupted
    out = str(tmp_path / "run")
    shutil.copytree(source, out)
    with open(os.path.join(out, "checkpoints", "latest"), "w") as fh:
        fh.write("step_000099")  # names a checkpoint that does not exist
    assert ck.latest_checkpoint(out).endswith(f"step_{STEPS:06d}")


def _fake_checkpoint(root: str, step: int) -> str:
    def write_files(tmp: str) -> None:
        ck.save_torch({"x": torch.full((3,), float(step))}, os.path.join(tmp, "model.pt"))
        ck.save_json({"step": step}, os.path.join(tmp, "state.json"))

    return ck.write_checkpoint_files(root, step, write_files, keep=0)


def test_rotation_orders_by_step_number_and_spares_newer_checkpoints(tmp_path):
    root = str(tmp_path / "checkpoints")
    for step in (2, 9, 10, 50, 60):  # "step_000009" < "step_000010" by name and by number alike,
        _fake_checkpoint(root, step)  # so also name some without zero padding below
    os.rename(os.path.join(root, "step_000009"), os.path.join(root, "step_9"))
    os.rename(os.path.join(root, "step_000010"), os.path.join(root, "step_10"))
    # steps 9 and 10: the manifests name their step, so the renamed directories still verify
    assert [s for s, _ in ck.checkpoint_steps(str(tmp_path))] == [2, 9, 10, 50, 60]
    doomed = ck.rotate(root, 10, keep=2)
    assert [os.path.basename(p) for p in doomed] == ["step_000002"]  # 9 stays (the newest older one)
    assert [s for s, _ in ck.checkpoint_steps(str(tmp_path))] == [9, 10, 50, 60]  # newer ones untouched
    doomed = ck.rotate(root, 60, keep=2)
    assert [os.path.basename(p) for p in doomed] == ["step_9", "step_10"]


def test_manifest_names_every_file_with_size_and_checksum(tmp_path):
    path = _fake_checkpoint(str(tmp_path / "checkpoints"), 7)
    manifest = json.load(open(os.path.join(path, ck.MANIFEST)))
    assert manifest["step"] == 7 and sorted(manifest["files"]) == ["model.pt", "state.json"]
    for name, entry in manifest["files"].items():
        assert entry["size"] == os.path.getsize(os.path.join(path, name))
        assert entry["sha256"] == ck.file_sha256(os.path.join(path, name))
    assert not [n for n in os.listdir(tmp_path / "checkpoints") if n.endswith(".tmp")]
    # a manifest that names another step does not verify (a directory renamed by hand)
    moved = str(tmp_path / "checkpoints" / "step_000008")
    os.rename(path, moved)
    assert "names step 7" in ck.verify_checkpoint(moved)


def test_messages_name_a_checkpoint_without_reading_it_all_and_resume_reads_it_all(tmp_path):
    """A flipped byte (the size unchanged) is seen by the full check that a resume uses; the quick one
    behind the resume hint (said within a grace period, or as a crashed run ends) checks manifests and
    sizes only, and still skips a checkpoint whose file is cut short."""
    root = str(tmp_path / "checkpoints")
    older, newest = _fake_checkpoint(root, 3), _fake_checkpoint(root, 4)
    model = os.path.join(newest, "model.pt")
    data = bytearray(open(model, "rb").read())
    data[len(data) // 2] ^= 0x55
    open(model, "wb").write(bytes(data))
    assert ck.find_checkpoint(str(tmp_path)).path == older
    assert ck.find_checkpoint(str(tmp_path), checksums=False).path == newest
    open(model, "wb").write(bytes(data[:-1]))
    assert ck.find_checkpoint(str(tmp_path), checksums=False).path == older
