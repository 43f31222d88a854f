"""Groups larger than the micro-batch token budget, trained exactly in parts.

PACS couples the responses of a group: the gradient on any token's log-prob depends, through the
RLOO baseline and the class-weighted BCE on psi, on the log-probs of every response of its group.
So a backward over part of a group is not the gradient of anything by itself. But the gradient
splits exactly in two phases:

    1. the group's log-probs logp_t under the current weights (no gradient): from the old-policy
       pass on the first mini-batch after a rollout (the weights have not moved), else from a
       no-grad pass over the group's parts;
    2. the group's loss L on them and g_t = dL/dlogp_t for every token (autograd on a few scalars);
    3. each part: forward with gradient, then the surrogate S = sum_t g_t * logp_t over its tokens,
       whose gradient in the weights is the part's share of dL/dweights:
           dL/dtheta = sum_t g_t * dlogp_t/dtheta   (g_t held fixed)
       computed in one vocabulary sweep: the loss engine's known-gradient piece
       (pacs_kernels.KnownGradient; the log-sum-exp of phase 1 is known, 3 matmuls).

The update plans phases 1-2 once per mini-batch (``known_gradients`` in pacs/train/update.py, which also
gives a sequence-parallel first step each micro-batch's gradient from old_logp) and builds each part's piece
from them (``loss_piece`` there).

The same holds for GRPO (its token terms depend on the group through the advantages only). The
cost is one more no-grad forward of the group's parts on later mini-batches, nothing on the first.
Under FSDP every rank runs the same number of no-grad forwards (those with fewer repeat a small one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pacs.config import Config
from pacs.train.loss_objective import loss_objective
from pacs.train.update_batch import UpdateBatch
from pacs_kernels.pieces import group_loss_on_rows


@dataclass
class GroupGradients:
    """Phase 1-2 for the split groups of one mini-batch (or the micro-batches of a sequence-parallel first step):
    per token (the whole batch's padded layout, 0 elsewhere) the gradient g of their loss and the log-sum-exp of
    the current weights; per group (its first row), the loss value and its statistics."""

    grad_logp: torch.Tensor
    lse: torch.Tensor
    losses: dict[int, float]
    stats: dict[int, dict[str, float]]


def group_gradients(cfg: Config, data: UpdateBatch, row_ranges: list[tuple[int, int]], current_logp: torch.Tensor,
                    current_lse: torch.Tensor) -> GroupGradients:
    """Phase 2 for each of ``row_ranges`` (whole groups: a split group's rows, or under sequence parallelism a
    micro-batch's), keyed by its first row: its loss on the current log-probs and g = dloss/dlogp."""
    grad = torch.zeros_like(current_logp)
    losses, stats = {}, {}
    for lo, hi in row_ranges:
        loss, stats[lo] = loss_gradient(cfg, data, slice(lo, hi), current_logp, grad)
        losses[lo] = float(loss)
    return GroupGradients(grad, current_lse, losses, stats)


def loss_gradient(cfg: Config, data: UpdateBatch, rows: slice, current_logp: torch.Tensor, grad_out: torch.Tensor):
    """The configured loss of ``rows`` (whole groups) of ``data`` on their current log-probs, as the loss engine
    computes it on gathered log-probs (pacs_kernels.pieces.group_loss_on_rows, with the rows' validity in the
    loss), and its gradient on each of them, written into ``grad_out[rows]`` (0 off the mask). Returns
    (loss, stats)."""
    batch, group = data.batch, cfg.rollout.group_size
    valid = None if data.valid is None else data.valid[rows]
    logp = current_logp[rows].detach().clone().requires_grad_(True)
    with torch.enable_grad():
        loss, stats = group_loss_on_rows(loss_objective(cfg), logp, data.old_logp[rows], batch.rewards[rows],
                                         batch.mask[rows], group_size=group, valid=valid)
        (g,) = torch.autograd.grad(loss, logp)
    grad_out[rows] = g.to(grad_out.dtype) * batch.mask[rows]
    return loss.detach(), stats

