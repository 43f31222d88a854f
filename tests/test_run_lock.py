"""One process per run directory (pacs/run/run_lock.py, issue #26 item 1): a second ``pacs train`` on a directory
another process holds, a ``pacs eval`` on its eval directory and a PACSTrainer on its output directory are
refused in one line naming the holder's pid (exit 2), before anything there is read or written; a holder
killed with -9 leaves no stale lock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from trainer_helpers import repo_root

from pacs.cli import main
from pacs.run.run_lock import LOCK_NAME, RunDirectoryLocked, lock_run_directory, release_run_directory

HOLD = ("import sys, time\n"
        "from pacs.run.run_lock import lock_run_directory\n"
        "lock_run_directory(sys.argv[1])\n"
        "print('locked', flush=True)\n"
        "time.sleep(120)\n")


@pytest.fixture
def holder(tmp_path):
    """Another process holding the lock of tmp_path/run until the test ends (or kills it)."""
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": repo_root()}
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "locked"
    yield run, proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


def test_a_second_pacs_train_on_a_held_directory_exits_2_naming_the_holder(holder):
    run, proc = holder
    env = {**os.environ, "PYTHONPATH": repo_root()}
    done = subprocess.run([sys.executable, "-m", "pacs", "train", "--output-dir", str(run), "--resume"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stderr
    lines = _error_lines(done.stderr)
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"pacs train: error: --output-dir '{run}' is in use by process {proc.pid} ")
    assert sorted(os.listdir(run)) == [LOCK_NAME]  # nothing read or written there: no config, no metrics


def test_pacs_eval_on_a_held_eval_directory_exits_2(holder, capsys):
    run, proc = holder
    code = main(["eval", "--eval-dir", str(run), "--output-dir", str(run.parent / "other")])
    err = capsys.readouterr().err
    assert code == 2
    assert len(_error_lines(err)) == 1, err
    assert _error_lines(err)[0].startswith(f"pacs eval: error: --eval-dir '{run}' is in use by process {proc.pid} ")


def test_a_killed_holder_leaves_no_stale_lock(holder):
    run, proc = holder
    with pytest.raises(RunDirectoryLocked, match=f"process {proc.pid}"):
        lock_run_directory(str(run))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    lock_run_directory(str(run))  # the kernel released it with the process
    lock_run_directory(str(run))  # and taking it again in the holding process is a no-op
    with open(run / LOCK_NAME) as fh:
        assert fh.read().split()[0] == str(os.getpid())
    release_run_directory(str(run))


def test_pacs_trainer_refuses_a_held_output_dir(holder):
    pytest.importorskip("trl")
    import trl_helpers as helpers

    run, proc = holder
    with pytest.raises(RunDirectoryLocked, match=f"output_dir '{run}' is in use by process {proc.pid}"):
        helpers.trainer(run)
