"""Shared settings for the trainer tests: a tiny, fast configuration of the built-in run."""

import os
import pathlib

from pacs.config import Config, load_config

# 1-digit addition warmed up to 30% validation accuracy: rewards are mixed within groups, so every
# step really updates the weights (an all-zero reward would make the loss's gradient vanish and the
# resume and multi-process comparisons trivially true).
TINY = [
    "advanced.task.digits=1", "advanced.task.warmup_steps=600", "advanced.task.warmup_batch_size=32",
    "advanced.task.warmup_target_accuracy=0.3",
    "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=3",
    "optim.mini_batches_per_step=2", "optim.micro_batch_groups=1",
    "eval.num_problems=8", "eval.every=2", "checkpoint_every=2", "advanced.plot=false",
]


def tiny_config(output_dir, cache_dir, *extra: str) -> Config:
    cfg = load_config(None, TINY + [f"advanced.task.cache_dir={cache_dir}", *extra])
    cfg.output_dir = str(output_dir)
    return cfg


TIMING_KEYS = {"tokens_per_s", "rollout_time", "update_time", "sync_time", "step_time", "elapsed",
               "peak_memory_mib"}


def comparable(rows: list[dict]) -> list[dict]:
    """Metrics rows without the wall-clock fields."""
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in rows]


def repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_wheel(tmp_path, *, also=()) -> "pathlib.Path":
    """The wheel of a copy of the source tree (the checkout gets no build/ or egg-info), built without network
    or isolation into ``tmp_path/dist``; ``also``: more top-level folders copied beside the two packages (to show
    the wheel leaves them out)."""
    import shutil
    import subprocess
    import sys

    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "results")
    for name in ("pacs", "pacs_kernels", *also):
        shutil.copytree(os.path.join(repo_root(), name), src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(os.path.join(repo_root(), name), src / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            "-q", str(src), "-w", str(tmp_path / "dist")], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    return wheel


def run_torchrun(script_args: list[str], what: str, *, nproc: int = 2, timeout: int = 900):
    """``python -m torch.distributed.run --standalone --nproc-per-node=NPROC *script_args`` (one
    process: plain ``python *script_args``) from the repository root, one thread per rank; fails
    with :func:`check_ran`'s report. Returns the finished process."""
    import subprocess
    import sys

    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd = (launcher if nproc > 1 else [sys.executable]) + [str(a) for a in script_args]
    env = {**os.environ, "PYTHONPATH": repo_root(), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=repo_root(), env=env, capture_output=True, text=True, timeout=timeout)
    check_ran(done, what)
    return done


def check_ran(done, what: str) -> None:
    """Fail, when a subprocess failed, with the lines that say why: those naming an error (a
    Python exception, a C++ ``terminate``/``what()``, a signal) and the last lines of each stream,
    as a plain message (pytest cuts a long assertion repr in the middle, where the cause is)."""
    if done.returncode == 0:
        return
    import pytest

    err = (done.stderr or "").splitlines()
    words = ("Error", "error:", "terminate", "what()", "Signal", "Traceback", "Exception", "Aborted")
    named = [line for line in err if any(w in line for w in words)]
    pytest.fail(f"{what} exited with {done.returncode}\n"
                + "--- stderr lines naming an error:\n" + "\n".join(named[-40:])
                + "\n--- stdout, last 20 lines:\n" + "\n".join((done.stdout or "").splitlines()[-20:])
                + "\n--- stderr, last 60 lines:\n" + "\n".join(err[-60:]), pytrace=False)


def full_weights(model) -> dict:
    """{name: full tensor of every parameter, detached, on the CPU}; FSDP2's DTensor shards are gathered
    (a collective: every rank calls it)."""
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
            for name, p in model.named_parameters()}


def leave_distributed_run() -> None:
    """End one rank of a torchrun test worker once its results are on disk: every rank waits at a
    barrier (so all of them have written theirs), then the process exits at once with status 0,
    without ``destroy_process_group`` or interpreter teardown.

    Why: CI and this suite have seen a rank that had written its results abort during teardown
    (std::terminate, "terminate called without an active exception", SIGABRT), after the work
    was done, failing the test on nothing it checks (1 run in about 30 of the 2-rank TRL test,
    2026-12-01, and a 2-rank trainer run before). Background threads of gloo and of the libraries
    are then destroyed while the interpreter shuts down. The test workers only; ``pacs train``
    ends with pacs.model.policy.close_distributed."""
    import sys

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

