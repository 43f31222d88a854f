"""Training: the loop (loop.py), the policy update (update.py), what comes before the first step (start.py) and
after the last (finish.py), preflight and metrics. A run's directory, checkpoints and stop signals: pacs/run/.

``from pacs.train import train`` loads the loop when first asked for, so that importing one of the trainer's
pieces (``pacs.train.loss_objective``, say) does not load them all."""

from __future__ import annotations

import importlib

PUBLIC = {"train": "loop", "TrainResult": "loop"}  # each public name, by the module that defines it
__all__ = sorted(PUBLIC)


def __getattr__(name: str):
    if name not in PUBLIC:
        raise AttributeError(f"module 'pacs.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"pacs.train.{PUBLIC[name]}"), name)
    globals()[name] = value  # looked up once
    return value
