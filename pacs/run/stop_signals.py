"""Preemption without lost steps: SIGTERM, SIGUSR1 and Ctrl-C stop a run at the end of the step in progress.

Schedulers send SIGTERM before they kill a job (SLURM on preemption, ``scancel`` and time limits;
Kubernetes on eviction), and SLURM sends SIGUSR1 ahead of the time limit with
``#SBATCH --signal=USR1@SECONDS``. Without a handler either ends the process at once, and the run
resumes from its last periodic checkpoint (up to ``checkpoint_every`` steps or ``checkpoint_minutes``
lost). Ctrl-C (SIGINT) is the same at a terminal. Inside :class:`StopSignals` they only set a flag; the training loop
finishes the step in progress, writes its checkpoint and stops with a line that says how to resume.
A second one of these signals, REPEAT_SECONDS or more after the first, does at once what it would have
done without the handler (SIGTERM and SIGUSR1 end the process; Ctrl-C raises KeyboardInterrupt: the
run stops with its last periodic checkpoint), for a run that must not wait for its step; one sooner is
taken for the same request delivered twice (``srun torchrun``: SLURM signals every process of the
step and torchrun forwards the signal too). A signal the process was started with ignored (``nohup``,
``&`` in a script) stays ignored.

Under torchrun every rank must stop after the same step (the checkpoint is written collectively),
but a signal reaches the ranks at different moments: :meth:`StopSignals.agreed` takes the flag of
every rank (one all-reduce a step) and stops all of them if any was signalled. torchrun forwards
SIGTERM and SIGINT to its workers, SIGUSR1 only with ``--signals-to-handle
SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1``, and kills them ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds (30
by default) after forwarding: that limit too must cover a step and its checkpoint.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
REPEAT_SECONDS = 2.0  # a second signal sooner than this after the first is the same request delivered twice


class StoppedBySignal(RuntimeError):
    """A run stopped by one of STOP_SIGNALS after checkpointing its last step; the message says how to resume."""

    def __init__(self, message: str, signal_name: str):
        super().__init__(message)
        self.signal_name = signal_name


class StopSignals:
    """While inside the ``with`` block: SIGTERM / SIGUSR1 / SIGINT set :attr:`received` (the signal's
    name) instead of ending the process, and a notice (``notice_prefix``, on stderr) says what will
    happen, written unbuffered from the handler (``print`` could re-enter a write it interrupted);
    the previous handlers are put back on leaving it. Handlers can only be installed from the main
    thread; elsewhere the block changes nothing. ``notice_prefix=None``: no notice (other ranks)."""

    def __init__(self, notice_prefix: str | None = None, what_stops: str = "the step in progress is finished "
                 "and checkpointed, then the run stops") -> None:
        self.received: str | None = None
        self._received_at = 0.0
        self._notice = None if notice_prefix is None else (
            f"{notice_prefix} {{name}} received: {what_stops} (a second signal, {REPEAT_SECONDS:.0f} s or more "
            "later, stops at once)")
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                if signal.getsignal(sig) is signal.SIG_IGN:  # ignored on purpose (nohup, a script's &): left so
                    continue
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.received is not None:
            if time.monotonic() - self._received_at < REPEAT_SECONDS:
                return  # the same request delivered twice (scheduler and launcher)
            # a second request: what it would have done without us, now
            previous = self._previous.get(signum)
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received, self._received_at = signal.Signals(signum).name, time.monotonic()
        if self._notice is not None:
            try:
                os.write(2, ("\n" + self._notice.format(name=self.received) + "\n").encode())
            except OSError:
                pass

    def agreed(self, world_size: int, device: torch.device, *, out_of_time: bool = False,
               checkpoint_due: bool = False) -> Agreement:
        """The signal that stops the run after this step (or None), whether any rank is out of time, whether
        any rank finds a time-based checkpoint due: under torchrun the same answer on every rank (a
        collective: every rank calls it once a step). Wall-clock limits are decided per rank, so they are
        agreed on here too: ranks that disagreed on the last step or on a checkpoint would wait for each
        other in its collectives."""
        names = [sig.name for sig in STOP_SIGNALS]
        code = 0 if self.received is None else names.index(self.received) + 1
        if world_size > 1:
            flags = torch.tensor([code, int(out_of_time), int(checkpoint_due)], device=device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            code, out_of_time, checkpoint_due = int(flags[0]), bool(flags[1]), bool(flags[2])
        return Agreement(None if code == 0 else names[code - 1], out_of_time, checkpoint_due)


class Agreement(NamedTuple):
    """What every rank decided after a step (:meth:`StopSignals.agreed`)."""

    signal: str | None      # the stop signal's name (SIGTERM, SIGUSR1, SIGINT), or None
    out_of_time: bool       # max_minutes reached on some rank
    checkpoint_due: bool    # checkpoint_minutes passed since the last checkpoint on some rank


class Terminated(Exception):
    """SIGTERM received inside :func:`sigterm_raises`: raised where the process was."""


@contextmanager
def sigterm_raises():
    """Inside the block, SIGTERM raises :class:`Terminated` at once (instead of ending the process without a
    word), so that the caller can say what was kept (``pacs eval``: its journal) and exit with 143, the shell's
    code for SIGTERM. A SIGTERM ignored on purpose (nohup) stays ignored; outside the main thread nothing
    changes."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        yield
        return

    def handle(signum, frame):
        raise Terminated("SIGTERM")

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
