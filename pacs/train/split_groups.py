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
       computed in one vocabulary sweep (pacs_kernels.linear_logprobs_known_grad: the log-sum-exp
       of phase 1 is known, 3 matmuls).

The same holds for GRPO (its token terms depend on the group through the advantages only). The
cost is one more no-grad forward of the group's parts on later mini-batches, nothing on the first.
Under FSDP every rank runs the same number of no-grad forwards (those with fewer repeat a small one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from pacs.config import Config
from pacs.model.packing import forward_micro_batch, is_part_of_a_group, to_layout
from pacs.model.sequence_parallel import backend_for, reduce_over_group, slice_micro_batch
from pacs.train.loss_objective import loss_objective
from pacs.train.single_label_groups import loss_valid
from pacs_kernels import PACS, grpo_loss, linear_logprobs_known_grad, pacs_loss
from pacs_kernels.engine import logprob_drift, stale_lse_tolerance


@dataclass
class GroupGradients:
    """Phase 1-2 for the split groups of one mini-batch: per token (the whole batch's padded layout,
    0 elsewhere) the gradient g of the group loss and the log-sum-exp of the current weights; per
    split group (its first row), the loss value and its statistics."""

    grad_logp: torch.Tensor
    lse: torch.Tensor
    losses: dict[int, float]
    stats: dict[int, dict[str, float]]


def split_group_rows(micro_batches: list[tuple[int, int]], group_size: int) -> list[int]:
    """The first row of every group that the plan runs in parts."""
    return sorted({lo - lo % group_size for lo, hi in micro_batches if is_part_of_a_group(lo, hi, group_size)})


def group_loss_on_logprobs(cfg: Config, logp: torch.Tensor, old_logp: torch.Tensor, rewards: torch.Tensor,
                           mask: torch.Tensor):
    """The configured loss (PACS or GRPO) of one group from its (G, L) log-probs: (loss, stats dict)."""
    objective, group = loss_objective(cfg), cfg.rollout.group_size
    if isinstance(objective, PACS):
        loss, stats = pacs_loss(logp, old_logp, rewards, mask, group_size=group, **objective.group_settings(),
                                return_stats=True, backend="torch",
                                valid=loss_valid(rewards, group, cfg.optim.drop_single_label_groups))
    else:
        loss, stats = grpo_loss(logp, old_logp, rewards, mask, group_size=group, clip_eps=objective.clip_eps,
                                aggregation=objective.aggregation, return_stats=True)
    return loss, stats.as_dict()


def group_gradients(cfg: Config, batch, first_rows: list[int], current_logp: torch.Tensor,
                    current_lse: torch.Tensor, old_logp: torch.Tensor) -> GroupGradients:
    """Phase 2 for every split group: its loss on the current log-probs and g = dloss/dlogp."""
    group = cfg.rollout.group_size
    grad = torch.zeros_like(current_logp)
    losses, stats = {}, {}
    for lo in first_rows:
        loss, stats[lo] = loss_gradient(cfg, batch, slice(lo, lo + group), current_logp, old_logp, grad)
        losses[lo] = float(loss)
    return GroupGradients(grad, current_lse, losses, stats)


def loss_gradient(cfg: Config, batch, rows: slice, current_logp: torch.Tensor, old_logp: torch.Tensor,
                  grad_out: torch.Tensor):
    """The configured loss of ``rows`` (whole groups) on their current log-probs, and its gradient on each of
    them, written into ``grad_out[rows]`` (0 off the mask). Returns (loss, stats)."""
    logp = current_logp[rows].detach().clone().requires_grad_(True)
    with torch.enable_grad():
        loss, stats = group_loss_on_logprobs(cfg, logp, old_logp[rows], batch.rewards[rows], batch.mask[rows])
        (g,) = torch.autograd.grad(loss, logp)
    grad_out[rows] = g.to(grad_out.dtype) * batch.mask[rows]
    return loss.detach(), stats


def part_surrogate(cfg: Config, policy, batch, lo: int, hi: int, gradients: GroupGradients, *,
                   packed: bool, sp=None, expected_logp: torch.Tensor | None = None) -> torch.Tensor:
    """Phase 3 for rows [lo, hi) of a split group: forward with gradient, then the surrogate
    sum_t g_t logp_t over its response tokens (one vocabulary sweep); its backward is the part's
    share of the group loss's gradient. ``sp`` (sequence parallelism): this rank's tokens of the part,
    whose surrogate is this rank's share of it. ``expected_logp`` (the batch's layout, sequence parallelism's
    first step): the log-probs the gradients were computed at, which the sweep's must equal; checked by the
    group's ranks together (they run the same micro-batches), so that all of them stop, not one."""
    part = slice_micro_batch(batch, lo, hi, packed, sp)
    hidden, weight, bias = forward_micro_batch(policy, part)
    selected = part.mask
    surrogate, logp = linear_logprobs_known_grad(
        hidden[selected], weight, part.targets[selected], to_layout(part, lo, gradients.grad_logp)[selected],
        to_layout(part, lo, gradients.lse)[selected], **policy.head_options(cfg.rollout.temperature), bias=bias,
        backend=backend_for(selected, cfg.optim.logprob_backend))
    if expected_logp is not None:
        drift = logprob_drift(logp, to_layout(part, lo, expected_logp)[selected])
        if sp is not None:
            reduce_over_group([drift], sp, op=dist.ReduceOp.MAX)
        if not float(drift) <= stale_lse_tolerance(weight.dtype):
            raise RuntimeError(
                f"sequence parallelism's first step: the log-probs of the one sweep differ from the rollout-time ones "
                f"by up to {float(drift):.3g} x (1 + |old_logp|), more than rounding: the weights changed since the "
                "old-policy pass (a bug; advanced.optim.one_sweep_first_step=false avoids this path)")
    return surrogate
