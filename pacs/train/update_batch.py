"""A rollout step's batch as its updates learn from it: one object from the old-policy pass to the loss.

:class:`UpdateBatch` carries the step's rows (:class:`~pacs.train.batch.Batch`: prompt + response, right-padded,
groups contiguous), per response token the log-probs the loss compares against, per response whether it counts in
the loss (computed once, when the batch is built: :func:`update_batch`), and the layout its micro-batches take,
decided once for the run (pacs/train/start.py): padded rows, or the rows' real tokens packed into one row, each rank
of a sequence-parallel group holding a slice of them (pacs/model/packing.py).

``pacs.train.update.micro_batch`` cuts rows ``[lo, hi)`` out of it in that layout: one ``MicroBatch`` holding the
model's inputs and every per-token input of the loss already in the same layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pacs.config import Config
from pacs.model.sequence_parallel import SequenceParallel
from pacs.train.batch import Batch
from pacs.train.single_label_groups import loss_valid


@dataclass
class UpdateBatch:
    """batch: the step's rows; old_logp: (B, L) the reference's log-probs of the targets (the rollout's policy,
    or PACS's reference kept across rollout steps), 0 off the mask; old_lse: (B, L) the rollout-time log-sum-exp
    (the one-sweep first step); rollout_logp: (B, L) the rollout-time log-probs where the reference is older (None:
    the reference is the rollout's policy); packed: micro-batches are packed rows; sp: this rank's sequence-parallel
    group (None: none); valid (keyword only, :func:`update_batch` computes it): (B,) bool, the responses that count
    in the loss (PACS's single-label groups dropped, the rollout correction's dropped responses), None: all."""

    batch: Batch
    old_logp: torch.Tensor
    old_lse: torch.Tensor
    rollout_logp: torch.Tensor | None = None
    packed: bool = False
    sp: SequenceParallel | None = None
    valid: torch.Tensor | None = field(kw_only=True)

    def select(self, rows: torch.Tensor) -> UpdateBatch:
        """The rows in the order ``rows`` (a permutation): the batch and every per-token tensor alike."""
        rollout_logp = None if self.rollout_logp is None else self.rollout_logp[rows]
        return UpdateBatch(self.batch.select(rows), self.old_logp[rows], self.old_lse[rows], rollout_logp,
                           self.packed, self.sp, valid=None if self.valid is None else self.valid[rows])


def update_batch(cfg: Config, batch: Batch, old_logp: torch.Tensor, old_lse: torch.Tensor,
                 rollout_logp: torch.Tensor | None = None, packed: bool = False,
                 sp: SequenceParallel | None = None) -> UpdateBatch:
    """The :class:`UpdateBatch` of ``batch`` and its old-policy log-probs, with each response's validity in the loss
    computed once for the step: PACS's single-label groups (optim.drop_single_label_groups,
    pacs/train/single_label_groups.py) and the responses the rollout correction dropped (``batch.valid``)."""
    kept = loss_valid(batch.rewards, cfg.rollout.group_size, cfg.optim.drop_single_label_groups)  # None: all
    corrected = batch.valid  # None: the rollout correction dropped none
    valid = corrected if kept is None else kept if corrected is None else kept & corrected
    return UpdateBatch(batch, old_logp, old_lse, rollout_logp, packed, sp, valid=valid)
