"""A tiny training-like loop over pacs.run.checkpoint and pacs.train.metrics, for tests/test_fault_injection.py.

Each step changes a 1 MiB float32 state with draws from a generator, writes the step's metrics row
(the state's sum), then a checkpoint of the state and the generator (the trainer's order). A run
resumes from the newest verified checkpoint, like ``pacs train --resume``, so a resumed run must
log exactly what an uninterrupted one does. Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import os
import signal

import torch

from pacs.run import checkpoint as ck
from pacs.run import durable
from pacs.train.metrics import MetricsLog

SHAPE = (256, 1024)
KEEP = 2


def die_on_call(name: str, call: int, when: str) -> None:
    """SIGKILL this process on the ``call``-th call of ``name`` (a pacs.run.checkpoint function, or
    ``os.rename`` / ``os.replace`` / ``rmtree``), ``before`` or ``after`` the call itself."""
    owners = {"rename": [(os, "rename")], "replace": [(os, "replace")], "rmtree": [(ck.shutil, "rmtree")],
              # called by the checkpoint module and by pacs.run.durable's replace_dir: one count over both
              "fsync_dir": [(ck, "fsync_dir"), (durable, "fsync_dir")]}.get(name, [(ck, name)])
    original = getattr(*owners[0])
    calls = {"n": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call and when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        result = original(*args, **kwargs)
        if calls["n"] == call and when == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    for owner, attr in owners:
        setattr(owner, attr, wrapped)


def run(out: str, steps: int, die_at: tuple[str, int, str] | None = None, ready=None) -> None:
    """Train (or resume) the toy loop in ``out`` up to ``steps``; optionally die at a call."""
    choice = ck.find_checkpoint(out)
    generator = torch.Generator()
    if choice.path is not None:
        state = torch.load(os.path.join(choice.path, "model.pt"), weights_only=True)["x"]
        generator.set_state(torch.load(os.path.join(choice.path, "rng_rank0.pt"), weights_only=True))
        start = choice.step
    else:
        generator.manual_seed(1234)
        state = torch.randn(SHAPE, generator=generator)
        start = 0
    os.makedirs(out, exist_ok=True)
    log = MetricsLog(os.path.join(out, "metrics.jsonl"), resume_step=start if choice.path else None, warn=print)
    if choice.path is None:
        log.write({"step": 0, "value": float(state.double().sum())})
    if die_at is not None:
        die_on_call(*die_at)
    if ready is not None:
        ready.set()
    for step in range(start + 1, steps + 1):
        state = state * 0.999 + 0.01 * torch.randn(SHAPE, generator=generator)
        log.write({"step": step, "value": float(state.double().sum())})

        def write_files(tmp: str, state=state, step=step) -> None:
            ck.save_torch({"x": state}, os.path.join(tmp, "model.pt"))
            ck.save_torch(generator.get_state(), os.path.join(tmp, "rng_rank0.pt"))
            ck.save_json({"step": step}, os.path.join(tmp, "state.json"))

        ck.write_checkpoint_files(os.path.join(out, "checkpoints"), step, write_files, keep=KEEP)
