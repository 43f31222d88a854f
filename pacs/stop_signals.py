"""Preemption without lost steps: SIGTERM, SIGUSR1 and Ctrl-C stop a run at the end of the step in progress.

Schedulers send SIGTERM before they kill a job (SLURM on preemption, ``scancel`` and time limits;
Kubernetes on eviction), and SLURM sends SIGUSR1 ahead of the time limit with
``#SBATCH --signal=USR1@SECONDS``. Without a handler either ends the process at once, and the run
resumes from its last periodic checkpoint (up to ``checkpoint_every`` steps lost). Ctrl-C (SIGINT)
is the same at a terminal. Inside :class:`StopSignals` they only set a flag; the training loop
finishes the step in progress, writes its checkpoint and stops with a line that says how to resume.
The same signal a second time does at once what it would have done without the handler (SIGTERM
and SIGUSR1 end the process; Ctrl-C raises KeyboardInterrupt: the run stops with the last periodic
checkpoint), for a run that must not wait for its step.

Under torchrun every rank must stop after the same step (the checkpoint is written collectively),
but a signal reaches the ranks at different moments: :meth:`StopSignals.agreed` takes the flag of
every rank (one all-reduce of one number a step) and stops all of them if any was signalled.
"""

from __future__ import annotations

import os
import signal
import threading

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StoppedBySignal(RuntimeError):
    """A run stopped by one of STOP_SIGNALS after checkpointing its last step; the message says how to resume."""

    def __init__(self, message: str, signal_name: str):
        super().__init__(message)
        self.signal_name = signal_name


class StopSignals:
    """While inside the ``with`` block: SIGTERM / SIGUSR1 / SIGINT set :attr:`received` (the signal's
    name) instead of ending the process, and ``notice(name)`` is called once to say what will happen (from
    the signal handler: an unbuffered ``os.write``, as ``print`` could re-enter a write it interrupted);
    the previous handlers are put back on leaving it. Handlers can only be installed from the main
    thread; elsewhere the block changes nothing."""

    def __init__(self, notice=None) -> None:
        self.received: str | None = None
        self._notice = notice
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.received is not None:  # the second signal: what it would have done without us, now
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            os.kill(os.getpid(), signum)
            return
        self.received = signal.Signals(signum).name
        if self._notice is not None:
            self._notice(self.received)

    def agreed(self, world_size: int, device: torch.device) -> str | None:
        """The signal that stops the run after this step, or None; under torchrun the same answer on
        every rank (a collective: every rank calls it once a step)."""
        if world_size <= 1:
            return self.received
        names = [sig.name for sig in STOP_SIGNALS]
        code = torch.tensor([0 if self.received is None else names.index(self.received) + 1], device=device)
        dist.all_reduce(code, op=dist.ReduceOp.MAX)
        return None if int(code) == 0 else names[int(code) - 1]
