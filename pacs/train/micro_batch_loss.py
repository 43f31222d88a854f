"""One micro-batch's loss: its rows in the step's layout (packed or padded), the piece of the loss's batch it
holds (a part of a group, a rank's tokens under sequence parallelism), and the one call to the loss engine."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from pacs.config import Config
from pacs.model.packing import PackedMicroBatch, forward_micro_batch, is_part_of_a_group, to_layout
from pacs.model.policy import DistInfo
from pacs.model.sequence_parallel import reduce_over_group, whole_micro_batch
from pacs.train.batch import Batch
from pacs.train.loss_objective import loss_objective
from pacs.train.mini_batches import MiniBatch
from pacs.train.rollout_correction import both_valid
from pacs.train.single_label_groups import loss_valid
from pacs.train.split_groups import loss_gradient, part_of_a_group
from pacs.train.update_batch import UpdateBatch
from pacs_kernels import GatheredLogprobs, KnownGradient, LossOptions, fused_linear_objective_loss


# statistics of the objectives' optional regularizers: NaN when their input is absent (pacs_kernels/objectives)
ABSENT_WHEN_NAN = frozenset({"kl_mean", "entropy_mean"})


@dataclass
class MicroBatchLoss:
    """One micro-batch's loss: what its backward runs on (the loss, or a surrogate whose gradient is the loss's),
    the loss value, the rows its mean is over (a part of a group: the whole group's), their response tokens and
    its statistics."""

    to_backward: torch.Tensor
    value: float
    rows: int
    stats: dict[str, float]
    tokens: int = 0


def policy_loss(cfg: Config, policy, part: Batch | PackedMicroBatch, old_logp: torch.Tensor,
                old_lse: torch.Tensor | None = None, piece=None, valid_rows: torch.Tensor | None = None):
    """The configured objective's loss (pacs/train/loss_objective.py) of one micro-batch (padded rows or packed),
    straight from hidden states; old_logp/old_lse in the micro-batch's layout. ``old_lse`` (weights unchanged
    since the old-policy pass, an objective whose capabilities allow it): the one-sweep first step. ``piece``
    (:func:`loss_piece`): the micro-batch holds a piece of the loss's batch (part of a group, or this rank's
    tokens under sequence parallelism). ``valid_rows``: the micro-batch's rows of ``Batch.valid`` (responses the
    rollout correction dropped; PACS's, None for any other objective).

    The one call to the loss engine, the same for every objective (PACS, the GRPO family, a user's): the
    objective, the options and the batch's optional inputs go to ``fused_linear_objective_loss``, and the engine
    plans from the capabilities the objective declares (pacs_kernels/objectives/protocol.py)."""
    hidden, weight, bias = forward_micro_batch(policy, part)
    if piece is None and not bool(part.mask.any()):  # the rollout correction dropped every token: no loss term
        return hidden.sum() * 0.0, {}  # (the forward ran: FSDP's collectives are the same on every rank)
    o, group = cfg.optim, cfg.rollout.group_size
    options = LossOptions(**policy.head_options(cfg.rollout.temperature), backend=o.logprob_backend,
                          chunk_budget_mib=cfg.train.loss_chunk_mib)
    packed = isinstance(part, PackedMicroBatch) and piece is None
    valid = both_valid(loss_valid(part.rewards, group, o.drop_single_label_groups), valid_rows)  # (None: all count)
    loss, stats = fused_linear_objective_loss(hidden, weight, part.targets, part.mask, old_logp, part.rewards,
                                              objective=loss_objective(cfg), group_size=group, options=options,
                                              old_lse=old_lse, cu_seqlens=part.cu_seqlens if packed else None,
                                              bias=bias, valid=valid, piece=piece)
    # a regularizer the objective has no input for (no reference model, no entropy asked) reports NaN: left out
    return loss, {k: v for k, v in stats.items() if not (k in ABSENT_WHEN_NAN and v != v)}


def loss_piece(cfg: Config, data: UpdateBatch, mini: MiniBatch, part, lo: int, hi: int):
    """What the loss engine needs beyond micro-batch rows [lo, hi)'s tokens, and the rows its loss is a mean
    over: a part of a group over the token budget gets its group's known log-prob gradients
    (pacs/train/split_groups.py); under sequence parallelism the first step's gradients are known from
    old_logp (psi = 0: the whole micro-batch as the "group"), and later steps gather every rank's log-probs;
    else nothing (None)."""
    group, batch = cfg.rollout.group_size, data.batch
    if is_part_of_a_group(lo, hi, group):  # a group over the token budget: its log-prob gradients are known
        return part_of_a_group(part, lo, mini.split, lo - lo % group), group
    if data.sp is None:
        return None, hi - lo
    if mini.first_step:  # the weights are still the rollout's: the loss and its gradient from old_logp
        grad_logp = torch.zeros_like(data.old_logp)
        loss, stats = loss_gradient(cfg, batch, slice(lo, hi), data.old_logp, data.old_logp, grad_logp)

        def agree(drift):  # every rank of the group stops, or none
            reduce_over_group([drift], data.sp, op=dist.ReduceOp.MAX)
            return drift

        return KnownGradient(to_layout(part, lo, grad_logp), to_layout(part, lo, data.old_lse), loss, stats,
                             expected_logp=to_layout(part, lo, data.old_logp), agree=agree), hi - lo
    width = data.old_logp.shape[1]  # the loss couples the tokens of a group: gathered over the group's ranks
    return GatheredLogprobs(lambda logp: whole_micro_batch(part, logp, lo, width), data.old_logp[lo:hi],
                            batch.mask[lo:hi], part.rewards), hi - lo


def micro_batch_loss(cfg: Config, policy, data: UpdateBatch, mini: MiniBatch, lo: int, hi: int) -> MicroBatchLoss:
    """The loss of micro-batch rows [lo, hi): one call to the loss engine (:func:`policy_loss`) with the piece of
    the loss's batch it holds, if any (:func:`loss_piece`); on the first step without one, the one sweep
    (an objective whose capabilities allow it: :func:`pacs.train.loss_objective.one_sweep_first_step`)."""
    part = data.micro_batch(lo, hi)  # in the batch's layout
    piece, rows = loss_piece(cfg, data, mini, part, lo, hi)
    # the first mini-batch still has the old-policy weights: one vocabulary sweep suffices
    lse = to_layout(part, lo, data.old_lse) if mini.first_step and piece is None else None
    valid_rows = None if data.batch.valid is None else data.batch.valid[lo:hi]
    loss, stats = policy_loss(cfg, policy, part, to_layout(part, lo, data.old_logp), lse, piece, valid_rows)
    group = cfg.rollout.group_size
    first = lo - lo % group if is_part_of_a_group(lo, hi, group) else lo  # a part of a group: the whole group's
    tokens = int(data.batch.mask[first:first + rows].sum())
    return MicroBatchLoss(loss, float(loss.detach()), rows, stats, tokens)


def loss_scale(loss: MicroBatchLoss, mini: MiniBatch, rows_per_mini: int, dist_info: DistInfo) -> float:
    """What a micro-batch's loss is multiplied by before its backward, so that the gradients add up to the
    mini-batch loss's: a mean over rows weighs its rows' share of the mini-batch; GRPO's token mean its tokens'
    share of every data rank's (FSDP averages gradients over the ranks: times their number). A
    sequence-parallel group's ranks each hold a part of a micro-batch: times the group's size."""
    if mini.tokens is None:
        return dist_info.sp_size * loss.rows / rows_per_mini
    return dist_info.world_size * loss.tokens / max(mini.tokens, 1)
