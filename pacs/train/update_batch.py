"""A rollout step's batch as its updates learn from it: one object from the old-policy pass to the loss.

It carries the step's rows (:class:`~pacs.train.batch.Batch`: prompt + response, right-padded, groups contiguous),
per response token the log-probs the loss compares against, and the layout its micro-batches take
(``pacs.model.sequence_parallel.slice_micro_batch``), decided once for the run (pacs/train/start.py): padded rows,
or the rows' real tokens packed into one row (pacs/model/packing.py), each rank of a sequence-parallel group
holding a slice of them (pacs/model/sequence_parallel.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pacs.model.sequence_parallel import SequenceParallel
from pacs.train.batch import Batch


@dataclass
class UpdateBatch:
    """batch: the step's rows; old_logp: (B, L) the reference's log-probs of the targets (the rollout's policy,
    or PACS's reference kept across rollout steps), 0 off the mask; old_lse: (B, L) the rollout-time log-sum-exp
    (the one-sweep first step); rollout_logp: (B, L) the rollout-time log-probs where the reference is older (None:
    the reference is the rollout's policy); packed: micro-batches are packed rows; sp: this rank's sequence-parallel
    group (None: none)."""

    batch: Batch
    old_logp: torch.Tensor
    old_lse: torch.Tensor
    rollout_logp: torch.Tensor | None = None
    packed: bool = False
    sp: SequenceParallel | None = None

    def select(self, rows: torch.Tensor) -> UpdateBatch:
        """The rows in the order ``rows`` (a permutation): the batch and every per-token tensor alike."""
        rollout_logp = None if self.rollout_logp is None else self.rollout_logp[rows]
        return UpdateBatch(self.batch.select(rows), self.old_logp[rows], self.old_lse[rows], rollout_logp,
                           self.packed, self.sp)
