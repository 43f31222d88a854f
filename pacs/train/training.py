"""What the training loop works on: the run, the policy and its optimizer, the rollout engine, the metrics log
and the state a checkpoint keeps; set up once (pacs/train/start.py), then changed by every step."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from pacs.config import Config
from pacs.model.policy import DistInfo
from pacs.model.reference_policy import ReferenceSnapshot
from pacs.run import Run, RunDir
from pacs.train.metrics import MetricsLog


@dataclass
class Training:
    """What the loop of :func:`train` works on, set up once by :func:`set_up_training`."""

    cfg: Config
    dist_info: DistInfo
    say: Callable
    run: Run
    run_dir: RunDir
    packed: bool  # padding-free micro-batches (pacs/model/packing.py)
    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    reference: ReferenceSnapshot | None  # PACS's reference when kept across steps (optim.ref_reset_every > 1)
    engine: object  # the rollout engine (pacs/rollout/)
    metrics: MetricsLog
    state: dict  # what a checkpoint keeps besides the weights: step, data position, NaN counters
    start_time: float
    last_checkpoint_time: float = 0.0  # on the loop's checkpoint clock (pacs/train/loop.py)
    progress: object = None  # the progress bar (tqdm), once the loop starts
    warned_cut: bool = False  # prompts cut to rollout.max_prompt_len were reported
    row: dict = dataclasses.field(default_factory=dict)  # the last metrics row
    mismatch: dict = dataclasses.field(default_factory=dict)  # the step's mismatch_* columns (rollout_correction.py)
