"""A run's infrastructure, apart from what it trains: its directory and lock, durable writes, disk space,
checkpoints, stop signals, resume checks, the console, and the set-up ``pacs train`` and ``pacs eval`` share.

``pacs train`` (pacs/train/), ``pacs eval`` (pacs/cli.py) and ``PACSTrainer`` (pacs/integrations/trl.py) use it
through the names below. Each is imported from its module when first used (``from pacs.run import RunDir`` loads
pacs/run/run_dir.py only), so that the command line starts without loading models and tasks. Nothing here
imports ``pacs.train``.
"""

from __future__ import annotations

import importlib

# each public name, by the module that defines it
PUBLIC = {
    # the run directory and its lock (run_dir.py, run_lock.py)
    "RunDir": "run_dir", "run_of_config_file": "run_dir",
    "lock_run_directory": "run_lock", "RunDirectoryLocked": "run_lock",
    # checking and preparing a run (run_setup.py): config, model directory, task, tokenizer, engine
    "Run": "run_setup", "check_config": "run_setup", "prepare_run": "run_setup", "engine_options": "run_setup",
    "apply_torch_threads": "run_setup",
    # checkpoints (checkpoint.py) and how a run ends early (stop_signals.py, training_errors.py, disk_space.py)
    "save_checkpoint": "checkpoint", "load_checkpoint": "checkpoint", "find_checkpoint": "checkpoint",
    "resume_hint": "checkpoint",
    "StopSignals": "stop_signals", "StoppedBySignal": "stop_signals", "Terminated": "stop_signals",
    "sigterm_raises": "stop_signals",
    "TrainingStopped": "training_errors", "TrainingInterrupted": "training_errors",
    "TrainingPreempted": "training_errors", "NoSpaceLeft": "disk_space",
    # the console (console.py)
    "quiet_third_party": "console",
}
__all__ = sorted(PUBLIC)


def __getattr__(name: str):
    if name not in PUBLIC:
        raise AttributeError(f"module 'pacs.run' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"pacs.run.{PUBLIC[name]}"), name)
    globals()[name] = value  # looked up once
    return value
