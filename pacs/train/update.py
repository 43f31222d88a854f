"""A rollout step's policy update, top to bottom: the old policy's log-probs (pacs/train/old_policy.py: the
batch from then on carried to the loss by one :class:`~pacs.train.update_batch.UpdateBatch`), the groups whose
gradient is exactly 0 planned out; then, for each mini-batch of whole groups, its plan (:func:`plan_mini_batch`:
its micro-batches, whole groups within the token budget, a group over it in parts made exact by its log-prob
gradients known first: :func:`known_gradients`), each micro-batch cut from the batch in its layout
(:func:`micro_batch`) and its loss taken through the one call to the loss engine (:func:`policy_loss`), their
gradients accumulated, clipped and applied by AdamW; a non-finite loss or gradient skips the update."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pacs.config import Config, micro_batch_groups
from pacs.model.memory import activation_offload
from pacs.model.packing import (
    PackedMicroBatch,
    forward_micro_batch,
    is_part_of_a_group,
    micro_batch_ranges,
    same_count_on_every_rank,
    slice_micro_batch,
)
from pacs.model.policy import DistInfo
from pacs.model.sequence_parallel import reduce_over_group, whole_micro_batch
from pacs.model.varlen_attention import new_decisions as new_attention_decisions
from pacs.run import TrainingStopped
from pacs.run.checkpoint import latest_checkpoint
from pacs.train.batch import Batch
from pacs.train.loss_objective import loss_objective, one_sweep_first_step, token_mean
from pacs.train.loss_statistics import LossStatistics
from pacs.train.old_policy import old_policy_logprobs, old_policy_pass, old_policy_ranges
from pacs.train.preflight import TrainerSteps
from pacs.train.single_label_groups import group_losses_at_zero, plan_group_skips, skip_rules
from pacs.train.training import Training
from pacs.train.update_batch import UpdateBatch
from pacs.train.weight_updates import UpdateMonitor
from pacs_kernels import GatheredLogprobs, KnownGradient, LossOptions, fused_linear_objective_loss
from pacs_kernels.pieces import known_gradient_on_rows


@dataclass
class UpdateResult:
    """What one rollout step's updates produced: every micro-batch loss and how many groups it held
    (a part of a group: its share; GRPO's token mean: times their tokens per response), the grad norm of
    each update that was applied, each loss statistic over the micro-batches that ran and every rank's
    (pacs/train/loss_statistics.py), and the last mini-batch's mean loss per group (what the progress bar
    shows: the first mini-batch after a rollout always reads ln 2 for PACS, as the policy still equals the
    old one). Groups not run (a gradient of exactly 0) count in the loss at their value, one group each."""

    losses: list[float]
    loss_groups: list[float]
    grad_norms: list[float]
    stats: dict[str, float]
    last_loss: float
    split_groups: int = 0  # groups larger than the token budget, run in parts (:func:`known_gradients`)
    skipped_groups: int | None = None  # groups whose gradient is exactly 0, not run (None: not planned)
    skipped_losses: list[float] = dataclasses.field(default_factory=list)  # their loss values, one per group
    # per applied update: the share of (sampled) weights with a gradient that the step changed (weight_updates.py)
    update_nonzero_fracs: list[float] = dataclasses.field(default_factory=list)
    lr: float = math.nan  # the learning rate the step's first update ran at

    def mean_loss(self) -> float:
        """The step's loss: the mean over groups (each micro-batch's loss weighs the groups it held)."""
        return weighted_mean(self.losses + self.skipped_losses, self.loss_groups + [1.0] * len(self.skipped_losses))


def weighted_mean(values: list[float], weights: list[float]) -> float:
    total = sum(weights)
    return sum(v * w for v, w in zip(values, weights)) / total if total else float("nan")


def preflight_steps() -> TrainerSteps:
    """The trainer's own old-policy pass and update, as the preflight runs them (looked up now: a test's
    stand-in for one of them is what the preflight gets)."""
    return TrainerSteps(old_policy_logprobs=old_policy_logprobs, old_policy_ranges=old_policy_ranges,
                        update_policy=update_policy)


def update_step(t: Training, step: int, batch: Batch) -> tuple[UpdateResult, float]:
    """The old policy's log-probs (:func:`old_policy_pass`: the batch from then on carried to the loss by one
    :class:`UpdateBatch`), the groups whose gradient is exactly 0 this step planned out, then the updates
    (NaN-skipping). Returns the update and the old policy's mean entropy over the response tokens."""
    cfg, o, r, dist_info = t.cfg, t.cfg.optim, t.cfg.rollout, t.dist_info
    data, entropy = old_policy_pass(t, step, batch)
    # groups whose gradient is exactly 0 this step (single-label ones after a reset) are not run:
    # moved behind the others within their mini-batch (pacs/train/single_label_groups.py)
    skip_first, skip_every = skip_rules(cfg, reference_is_current=data.rollout_logp is None)
    groups_run = at_zero = None
    if skip_first or skip_every:
        order, groups_run = plan_group_skips(data.batch.rewards, r.group_size, o.mini_batches_per_step,
                                             skip_first=skip_first, skip_every=skip_every)
        groups_run = most_on_any_rank(groups_run, dist_info)
        if order is not None:
            data = data.select(order)
        # what a group not run counts in the metrics: its loss at psi = 0
        at_zero = group_losses_at_zero(data.batch.rewards, data.valid, r.group_size, o.weighting).tolist()
    update = update_policy(cfg, t.policy, t.optimizer, t.scheduler, data, t.state, dist_info, step, t.say,
                           groups_run=groups_run, losses_at_zero=at_zero)
    if t.packed and (attention := new_attention_decisions(dist_info.device)):  # once per configuration
        t.say(f"[train] packed attention: {attention}")
    return update, entropy


def update_policy(cfg: Config, policy, optimizer, scheduler, data: UpdateBatch, state: dict, dist_info: DistInfo,
                  step: int, say=print, *, groups_run: list[int] | None = None,
                  losses_at_zero: list[float] | None = None) -> UpdateResult:
    """For each mini-batch of whole groups of ``data``, its micro-batches' losses (each through
    :func:`micro_batch_loss`), their gradients accumulated, clipped and applied; a non-finite loss or gradient
    on any rank skips the update on every rank (:func:`skip_non_finite`). ``groups_run``: per mini-batch, the
    groups that run (those after them: a gradient of exactly 0); None: all. ``losses_at_zero``: with
    ``groups_run``, each group's loss at psi = 0, what a group not run counts in the metrics."""
    o, group, rows_per_mini = cfg.optim, cfg.rollout.group_size, mini_batch_rows(cfg, dist_info)
    skipped = None if groups_run is None else rows_per_mini // group * o.mini_batches_per_step - sum(groups_run)
    update = UpdateResult([], [], [], {}, float("nan"), skipped_groups=skipped, lr=optimizer.param_groups[0]["lr"])
    statistics = LossStatistics()
    if (groups_run is None) != (losses_at_zero is None):
        raise ValueError("update_policy: groups_run and losses_at_zero go together (both None: every group runs)")
    # weights that a step leaves where they are, though they have a gradient: updates that rounded away
    monitor = UpdateMonitor(policy.parameters(), distributed=dist_info.world_size > 1)
    for m in range(o.mini_batches_per_step):
        mini = plan_mini_batch(cfg, policy, data, m, dist_info, losses_at_zero, groups_run)
        update.skipped_losses += mini.skipped_losses
        update.split_groups += len(set(mini.part_of) - {None})
        for i, (lo, hi) in enumerate(mini.micro_batches):
            with activation_offload(cfg.train.offload_activations, dist_info.device):
                loss = micro_batch_loss(cfg, policy, data, mini, i)
                (loss.to_backward * loss_scale(loss, mini, rows_per_mini, dist_info)).backward()
            update.losses.append(loss.value)
            # its weight in the step's loss: the groups it held (a part: its share); a token mean: their tokens
            update.loss_groups.append((hi - lo) / group * (1.0 if mini.tokens is None else loss.tokens / loss.rows))
            statistics.add(loss.stats, loss.rows, loss.tokens)
        here = slice(len(update.losses) - len(mini.micro_batches), None)  # this mini-batch's micro-batches
        update.last_loss = weighted_mean(update.losses[here] + mini.skipped_losses,
                                         update.loss_groups[here] + [1.0] * len(mini.skipped_losses))
        grad_norm = clipped_grad_norm(policy, o.max_grad_norm)
        if skip_non_finite(cfg, optimizer, state, update.losses[here], grad_norm, dist_info, step, say):
            scheduler.step()  # the schedule counts planned updates: a skipped one leaves it where it would be
            continue
        update.grad_norms.append(float(grad_norm))
        update.update_nonzero_fracs.append(optimizer_step(optimizer, scheduler, monitor))
    update.stats = statistics.means(distributed=dist_info.world_size > 1, device=dist_info.device)
    return update


# ----------------------------------------------------------------- mini-batches
#
# A group larger than the micro-batch token budget is trained exactly in parts. PACS couples the responses of a
# group (the RLOO baseline, the class-weighted BCE on psi), and GRPO's token terms depend on the group through
# the advantages, so a backward over part of a group is not the gradient of anything by itself; but the
# gradient splits exactly in phases (pacs_kernels/pieces.py, KnownGradient):
#   1. the group's log-probs under the current weights, without gradient: from the old-policy pass on the first
#      mini-batch after a rollout (the weights have not moved), else one more no-grad pass over its parts;
#   2. the group's loss L on them and g_t = dL/dlogp_t on every token (pacs_kernels.known_gradient_on_rows);
#   3. each part: forward with gradient and one vocabulary sweep of sum_t g_t logp_t (g held fixed), whose
#      gradient in the weights is the part's share of dL/dweights (a KnownGradient piece: loss_piece below).
# Under FSDP every rank runs as many no-grad forwards (those with fewer repeat a small one).


@dataclass
class GroupGradients:
    """Phases 1-2 for the split groups of one mini-batch (or the micro-batches of a sequence-parallel first step):
    per token (the whole batch's padded layout, 0 elsewhere) the gradient g of their loss and the log-sum-exp of
    the current weights; per group (its first row), the loss value and its statistics."""

    grad_logp: torch.Tensor
    lse: torch.Tensor
    losses: dict[int, float]
    stats: dict[int, dict[str, float]]


@dataclass
class MiniBatch:
    """One mini-batch's plan: its micro-batches (row ranges, the same count on every rank), for each the first
    row of the group it is a part of (None: it holds whole groups), the log-prob gradients known before they run
    (:func:`known_gradients`; None: none), the loss values of its groups not run (a gradient of exactly 0),
    ``first_step``: the one sweep on weights still the rollout's (logp = old_logp), and ``tokens``: the GRPO token
    mean's denominator, the response tokens of the mini-batch on every data rank (None: the loss is a mean over
    responses)."""

    micro_batches: list[tuple[int, int]]
    part_of: list[int | None]
    known: GroupGradients | None
    skipped_losses: list[float]
    first_step: bool
    tokens: int | None = None


def most_on_any_rank(counts: list[int], dist_info: DistInfo) -> list[int]:
    """Each count's largest value over the ranks (FSDP: every rank runs as many groups per mini-batch)."""
    if dist_info.world_size <= 1:
        return counts
    shared = torch.tensor(counts, dtype=torch.int64, device=dist_info.device)
    dist.all_reduce(shared, op=dist.ReduceOp.MAX)
    return shared.tolist()


def mini_batch_rows(cfg: Config, dist_info: DistInfo) -> int:
    """Rows of one mini-batch on this rank: its share of the step's groups, split into the mini-batches."""
    return cfg.rollout.prompts_per_step // dist_info.dp_size // cfg.optim.mini_batches_per_step * cfg.rollout.group_size


def plan_mini_batch(cfg: Config, policy, data: UpdateBatch, mini: int, dist_info: DistInfo,
                    losses_at_zero: list[float] | None, groups_run: list[int] | None) -> MiniBatch:
    """Mini-batch ``mini``: the rows of its groups that run (those not run, a gradient of exactly 0, sit behind
    them: pacs/train/single_label_groups.py) cut into micro-batches of whole groups (at most
    ``micro_batch_groups`` groups and ``train.max_tokens_per_micro_batch`` tokens; a group larger than that in
    parts, made exact by its log-prob gradients, known first: :func:`known_gradients`)."""
    o, tr, group = cfg.optim, cfg.train, cfg.rollout.group_size
    rows_per_mini = mini_batch_rows(cfg, dist_info)
    first = mini * rows_per_mini
    last = first + (rows_per_mini if groups_run is None else groups_run[mini] * group)
    skipped = [] if losses_at_zero is None else losses_at_zero[last // group:(first + rows_per_mini) // group]
    micro_batches = micro_batch_ranges(
        data.batch.attention_mask.sum(1).tolist(), first, last, group_size=group,
        rows_per_micro=micro_batch_groups(cfg) * group, max_tokens=tr.max_tokens_per_micro_batch, packed=data.packed)
    micro_batches = same_count_on_every_rank(micro_batches, group, dist_info.world_size, dist_info.device)
    part_of = [lo - lo % group if is_part_of_a_group(lo, hi, group) else None for lo, hi in micro_batches]
    # one vocabulary sweep needs every psi to be 0 on the first mini-batch: reference = current weights
    objective = loss_objective(cfg)
    first_step = (mini == 0 and one_sweep_first_step(objective) and o.one_sweep_first_step
                  and data.rollout_logp is None)
    known = known_gradients(cfg, policy, data, micro_batches, part_of, dist_info, first_mini_batch=mini == 0,
                            first_step=first_step)
    tokens = None
    if token_mean(objective):  # one token mean over the whole mini-batch (GRPO's token_mean, DAPO, CISPO, ...)
        tokens = mini_batch_tokens(data.batch.mask[first:first + rows_per_mini], dist_info)
    return MiniBatch(micro_batches, part_of, known, skipped, first_step, tokens)


def known_gradients(cfg: Config, policy, data: UpdateBatch, micro_batches: list[tuple[int, int]],
                    part_of: list[int | None], dist_info: DistInfo, *, first_mini_batch: bool,
                    first_step: bool) -> GroupGradients | None:
    """The per-token log-prob gradients of the mini-batch's loss known before its micro-batches run (phases 1-2
    above), keyed by their rows' first row: each group it runs in parts (only token
    budgets cut groups), on their log-probs under the current weights (the rollout-time pass's on the first
    mini-batch after a rollout: ``rollout_logp``, or ``old_logp`` itself when the reference is that policy; else
    a no-grad pass over their parts, the same number of forwards on every rank); and under sequence parallelism
    on the first step each whole micro-batch (the weights are still the rollout's: from old_logp, psi = 0).
    None: no token budget and no such first step."""
    group, budget = cfg.rollout.group_size, cfg.train.max_tokens_per_micro_batch
    sp_first = data.sp is not None and first_step
    if budget is None and not sp_first:
        return None
    parts = [rows for rows, group_lo in zip(micro_batches, part_of) if group_lo is not None]
    known = [(lo, lo + group) for lo in sorted({group_lo for group_lo in part_of if group_lo is not None})]
    if sp_first:
        known += [rows for rows, group_lo in zip(micro_batches, part_of) if group_lo is None]
    current_logp = data.old_logp if data.rollout_logp is None else data.rollout_logp
    current_lse = data.old_lse
    if budget is not None and not first_mini_batch:
        count = most_on_any_rank([len(parts)], dist_info)[0]  # FSDP: every rank runs as many no-grad forwards
        if count:
            first = micro_batches[0][0]  # a rank without (enough) parts repeats a one-row forward
            current_logp, current_lse, _ = old_policy_logprobs(policy, data.batch, parts, cfg.rollout.temperature,
                                                               cfg.optim.logprob_backend, data.packed, data.sp,
                                                               fillers=[(first, first + 1)] * (count - len(parts)))
    batch, objective, grad = data.batch, loss_objective(cfg), torch.zeros_like(current_logp)
    losses, stats = {}, {}
    for lo, hi in known:  # phase 2: each whole group's (or micro-batch's) loss and g, as the loss engine takes them
        valid = None if data.valid is None else data.valid[lo:hi]
        loss, g, stats[lo] = known_gradient_on_rows(objective, current_logp[lo:hi], data.old_logp[lo:hi],
                                                    batch.rewards[lo:hi], batch.mask[lo:hi], group_size=group,
                                                    valid=valid)
        grad[lo:hi], losses[lo] = g.to(grad.dtype), float(loss)
    return GroupGradients(grad, current_lse, losses, stats)


def mini_batch_tokens(mask: torch.Tensor, dist_info: DistInfo) -> int:
    """The response tokens of a mini-batch whose rows on this rank hold ``mask``, on every data rank (the ranks of
    a sequence-parallel group hold the same rows)."""
    tokens = torch.tensor([int(mask.sum())], dtype=torch.int64, device=dist_info.device)
    if dist_info.world_size > 1:
        dist.all_reduce(tokens)
    return int(tokens) // dist_info.sp_size


# --------------------------------------------------------- a micro-batch's loss


@dataclass
class MicroBatch:
    """Rows ``[lo, hi)`` of an :class:`UpdateBatch` in its layout. part: the model's inputs (padded rows, trimmed to
    the longest, or a :class:`~pacs.model.packing.PackedMicroBatch`, under sequence parallelism this rank's slice);
    index: where its tokens sit in the whole batch, so that ``padded[index]`` is any (B, L) per-token tensor in the
    layout of ``part`` ((N,) packed: the tokens' rows and columns; (b, T) padded: the rows and the first T columns);
    old_logp, old_lse, token_weights (the rollout correction's; None: none): per token, in that layout; valid: (b,)
    the rows' validity in the loss (None: all count)."""

    part: Batch | PackedMicroBatch
    lo: int
    hi: int
    index: tuple
    old_logp: torch.Tensor
    old_lse: torch.Tensor
    token_weights: torch.Tensor | None
    valid: torch.Tensor | None


def micro_batch(data: UpdateBatch, lo: int, hi: int) -> MicroBatch:
    """Rows ``[lo, hi)`` of ``data`` cut in the layout it carries, with their per-token inputs of the loss."""
    part = slice_micro_batch(data.batch, lo, hi, data.packed, data.sp)
    if isinstance(part, PackedMicroBatch):
        index = (part.rows, part.cols)
    else:
        index = (slice(lo, hi), slice(0, part.targets.shape[1]))
    weights = data.batch.token_weights
    return MicroBatch(part, lo, hi, index, data.old_logp[index], data.old_lse[index],
                      None if weights is None else weights[index], None if data.valid is None else data.valid[lo:hi])


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


def micro_batch_loss(cfg: Config, policy, data: UpdateBatch, mini: MiniBatch, i: int) -> MicroBatchLoss:
    """The loss of the mini-batch's micro-batch ``i``: cut from ``data`` in its layout (:func:`micro_batch`), then
    one call to the loss engine (:func:`policy_loss`) with the piece of the loss's batch it holds, if any
    (:func:`loss_piece`); on the first step without one, the one sweep (an objective whose capabilities allow it:
    :func:`pacs.train.loss_objective.one_sweep_first_step`)."""
    (lo, hi), group_lo = mini.micro_batches[i], mini.part_of[i]
    micro = micro_batch(data, lo, hi)
    piece, rows = loss_piece(cfg, data, mini, micro, group_lo)
    # the first mini-batch still has the old-policy weights: one vocabulary sweep suffices
    lse = micro.old_lse if mini.first_step and piece is None else None
    loss, stats = policy_loss(cfg, policy, micro.part, micro.old_logp, lse, piece, micro.valid, micro.token_weights)
    first = lo if group_lo is None else group_lo  # a part of a group: the whole group's
    tokens = int(data.batch.mask[first:first + rows].sum())
    return MicroBatchLoss(loss, float(loss.detach()), rows, stats, tokens)


def loss_piece(cfg: Config, data: UpdateBatch, mini: MiniBatch, micro: MicroBatch, group_lo: int | None):
    """What the loss engine needs beyond the micro-batch's tokens, and the rows its loss is a mean over: a part of
    a group over the token budget (its group's first row: ``group_lo``) gets its group's known log-prob gradients
    (phase 3 of the split groups, above); under sequence parallelism the first step's gradients are known from old_logp
    (psi = 0: the whole micro-batch as the "group"), and later steps gather every rank's log-probs; else nothing
    (None)."""
    lo, hi, known = micro.lo, micro.hi, mini.known
    if group_lo is not None:  # a group over the token budget: its log-prob gradients are known (phase 3,
        # above): the group's loss value, its statistics on its first part only
        return KnownGradient(known.grad_logp[micro.index], known.lse[micro.index], known.losses[group_lo],
                             known.stats.pop(group_lo, {})), cfg.rollout.group_size
    if data.sp is None:
        return None, hi - lo
    if mini.first_step:  # the weights are still the rollout's: the loss and its gradient known from old_logp

        def agree(drift):  # every rank of the group stops, or none
            reduce_over_group([drift], data.sp, op=dist.ReduceOp.MAX)
            return drift

        return KnownGradient(known.grad_logp[micro.index], known.lse[micro.index], known.losses[lo],
                             known.stats.pop(lo, {}), expected_logp=micro.old_logp, agree=agree), hi - lo
    width = data.old_logp.shape[1]  # the loss couples the tokens of a group: gathered over the group's ranks
    return GatheredLogprobs(lambda logp: whole_micro_batch(micro.part, logp, lo, width), data.old_logp[lo:hi],
                            data.batch.mask[lo:hi], micro.part.rewards), hi - lo


# statistics of the objectives' optional regularizers: NaN when their input is absent (pacs_kernels/objectives)
ABSENT_WHEN_NAN = frozenset({"kl_mean", "entropy_mean"})


def policy_loss(cfg: Config, policy, part: Batch | PackedMicroBatch, old_logp: torch.Tensor,
                old_lse: torch.Tensor | None = None, piece=None, valid: torch.Tensor | None = None,
                token_weights: torch.Tensor | None = None):
    """The configured objective's loss (pacs/train/loss_objective.py) of one micro-batch (padded rows or packed),
    straight from hidden states; old_logp/old_lse in the micro-batch's layout. ``old_lse`` (weights unchanged
    since the old-policy pass, an objective whose capabilities allow it): the one-sweep first step. ``piece``
    (:func:`loss_piece`): the micro-batch holds a piece of the loss's batch (part of a group, or this rank's
    tokens under sequence parallelism). ``valid``: the micro-batch's rows of ``UpdateBatch.valid``, the responses
    that count in the loss (PACS's; None: all, and for any other objective). ``token_weights``: the rollout
    correction's truncated weights in the micro-batch's layout (None: none).

    The one call to the loss engine, the same for every objective (PACS, the GRPO family, a user's): the
    objective, the options and the batch's optional inputs go to ``fused_linear_objective_loss``, and the engine
    plans from the capabilities the objective declares (pacs_kernels/objectives/protocol.py)."""
    hidden, weight, bias = forward_micro_batch(policy, part)
    if piece is None and not bool(part.mask.any()):  # the rollout correction dropped every token: no loss term
        return hidden.sum() * 0.0, {}  # (the forward ran: FSDP's collectives are the same on every rank)
    o, group = cfg.optim, cfg.rollout.group_size
    options = LossOptions(**policy.head_options(cfg.rollout.temperature), backend=o.logprob_backend,
                          chunk_budget_mib=cfg.train.loss_chunk_mib)
    if piece is not None and token_weights is not None:
        raise ValueError(f"advanced.rollout_correction.mode={cfg.rollout_correction.mode} needs whole groups in a "
                         "micro-batch: not yet with groups split over the token budget or sequence parallelism")
    packed = isinstance(part, PackedMicroBatch) and piece is None
    loss, stats = fused_linear_objective_loss(hidden, weight, part.targets, part.mask, old_logp, part.rewards,
                                              objective=loss_objective(cfg), group_size=group, options=options,
                                              old_lse=old_lse, cu_seqlens=part.cu_seqlens if packed else None,
                                              bias=bias, valid=valid, piece=piece, token_weights=token_weights)
    # a regularizer the objective has no input for (no reference model, no entropy asked) reports NaN: left out
    return loss, {k: v for k, v in stats.items() if not (k in ABSENT_WHEN_NAN and v != v)}


def loss_scale(loss: MicroBatchLoss, mini: MiniBatch, rows_per_mini: int, dist_info: DistInfo) -> float:
    """What a micro-batch's loss is multiplied by before its backward, so that the gradients add up to the
    mini-batch loss's: a mean over rows weighs its rows' share of the mini-batch; GRPO's token mean its tokens'
    share of every data rank's (FSDP averages gradients over the ranks: times their number). A
    sequence-parallel group's ranks each hold a part of a micro-batch: times the group's size."""
    if mini.tokens is None:
        return dist_info.sp_size * loss.rows / rows_per_mini
    return dist_info.world_size * loss.tokens / max(mini.tokens, 1)


# ----------------------------------------------------------- the optimizer step


def clipped_grad_norm(policy, max_norm: float) -> torch.Tensor:
    """The gradient's norm before clipping it to ``max_norm`` (a plain tensor, also under FSDP2)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), max_norm)
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
        grad_norm = grad_norm.full_tensor()
    return grad_norm


def skip_non_finite(cfg: Config, optimizer, state: dict, losses: list[float], grad_norm: torch.Tensor,
                    dist_info: DistInfo, step: int, say) -> bool:
    """Skip this update? Yes (gradients dropped) after a non-finite loss or gradient on any rank, on every rank
    together (or the shards diverge); ``max_consecutive_nan`` skips in a row raise TrainingStopped. Counts the
    skips in ``state``."""
    bad = torch.tensor([0.0 if all(math.isfinite(x) for x in losses) else 1.0,
                        0.0 if torch.isfinite(grad_norm) else 1.0], device=dist_info.device)
    if dist_info.world_size > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if not bad.any():
        state["consecutive_nan"] = 0
        return False
    state["consecutive_nan"] += 1
    state["skipped_updates"] += 1
    say(f"[warning] step {step}: non-finite {'loss' if bad[0] else 'gradient'}; "
        f"update skipped ({state['consecutive_nan']} in a row)")
    optimizer.zero_grad(set_to_none=True)
    if state["consecutive_nan"] >= cfg.max_consecutive_nan:
        last = latest_checkpoint(cfg.output_dir)
        raise TrainingStopped(
            f"{state['consecutive_nan']} non-finite updates in a row at step {step}: stopping. "
            f"The last good checkpoint is {last or '(none written yet)'}; resume from it "
            "with a lower optim.lr or check the data")
    return True


def optimizer_step(optimizer, scheduler, monitor: UpdateMonitor) -> float:
    """AdamW's step and the schedule's; returns the share of (sampled) weights with a gradient that it moved."""
    monitor.before()
    optimizer.step()
    moved = monitor.after()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return moved
