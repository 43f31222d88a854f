"""How a training run ends other than by finishing: stopped (NaN losses, the preflight out of memory),
interrupted (a second Ctrl-C) or preempted (a signal: the step in progress finished and checkpointed)."""

from __future__ import annotations

from pacs.run.stop_signals import StoppedBySignal


class TrainingStopped(RuntimeError):
    """Raised when repeated NaN losses/gradients stop a run (the last good checkpoint is kept)."""


class TrainingInterrupted(RuntimeError):
    """A second Ctrl-C during training (the first one finishes the step: TrainingPreempted); the message
    says where the last checkpoint is and how to resume."""


class TrainingPreempted(TrainingInterrupted, StoppedBySignal):
    """SIGTERM / SIGUSR1 (a scheduler's preemption or time-limit warning) or a first Ctrl-C: the step in
    progress was finished and checkpointed (pacs/run/stop_signals.py); the message says how to resume.
    (Constructed as StoppedBySignal(message, signal_name).)"""
