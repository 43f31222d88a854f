"""A rollout step's mini-batches: each one's rows cut into micro-batches of whole groups (the same count on
every rank), the log-prob gradients of its groups that run in parts, the loss values of its groups not run,
and what its loss is a mean over."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from pacs.config import Config, micro_batch_groups
from pacs.model.packing import is_part_of_a_group, micro_batch_ranges, same_count_on_every_rank
from pacs.model.policy import DistInfo
from pacs.train.batch import Batch
from pacs.train.loss_objective import loss_objective, one_sweep_first_step, token_mean
from pacs.train.old_policy import old_policy_logprobs
from pacs.train.rollout_correction import both_valid
from pacs.train.single_label_groups import group_losses_at_zero, loss_valid
from pacs.train.split_groups import GroupGradients, group_gradients, split_group_rows
from pacs.train.update_batch import UpdateBatch


@dataclass
class MiniBatch:
    """One mini-batch's plan: its micro-batches (row ranges, the same count on every rank), the log-prob
    gradients of its groups that run in parts (None: no token budget, no parts), the loss values of its groups
    not run (a gradient of exactly 0), ``first_step``: the one sweep on weights still the rollout's (logp = old_logp), and
    ``tokens``: the GRPO token mean's denominator, the response tokens of the mini-batch on every data rank
    (None: the loss is a mean over responses)."""

    micro_batches: list[tuple[int, int]]
    split: GroupGradients | None
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


def split_group_gradients(cfg: Config, policy, data: UpdateBatch, micro_batches: list[tuple[int, int]],
                          dist_info: DistInfo, *, first_mini_batch: bool) -> GroupGradients:
    """Phases 1-2 of pacs/train/split_groups.py for the groups this mini-batch runs in parts: their
    log-probs under the current weights (the rollout-time pass's on the first mini-batch after a
    rollout: ``rollout_logp``, or ``old_logp`` itself when the reference is that policy; else a no-grad
    pass over their parts, the same number of forwards on every rank), then each group's loss and
    per-token gradient."""
    group, batch = cfg.rollout.group_size, data.batch
    parts = [(lo, hi) for lo, hi in micro_batches if is_part_of_a_group(lo, hi, group)]
    current_logp = data.old_logp if data.rollout_logp is None else data.rollout_logp
    current_lse = data.old_lse
    if not first_mini_batch:
        count = most_on_any_rank([len(parts)], dist_info)[0]  # FSDP: every rank runs as many no-grad forwards
        if count:
            first = micro_batches[0][0]  # a rank without (enough) parts repeats a one-row forward
            current_logp, current_lse, _ = old_policy_logprobs(policy, batch, parts, cfg.rollout.temperature,
                                                               cfg.optim.logprob_backend, data.packed, data.sp,
                                                               fillers=[(first, first + 1)] * (count - len(parts)))
    return group_gradients(cfg, batch, split_group_rows(micro_batches, group), current_logp, current_lse,
                           data.old_logp)


def plan_mini_batch(cfg: Config, policy, data: UpdateBatch, mini: int, dist_info: DistInfo,
                    losses_at_zero: list[float] | None, groups_run: list[int] | None) -> MiniBatch:
    """Mini-batch ``mini``: the rows of its groups that run (those not run, a gradient of exactly 0, sit behind
    them: pacs/train/single_label_groups.py) cut into micro-batches of whole groups (at most
    ``micro_batch_groups`` groups and ``train.max_tokens_per_micro_batch`` tokens; a group larger than that in
    parts, made exact by its log-prob gradients, known first: pacs/train/split_groups.py)."""
    o, tr, group = cfg.optim, cfg.train, cfg.rollout.group_size
    rows_per_mini = mini_batch_rows(cfg, dist_info)
    first = mini * rows_per_mini
    last = first + (rows_per_mini if groups_run is None else groups_run[mini] * group)
    skipped = [] if losses_at_zero is None else losses_at_zero[last // group:(first + rows_per_mini) // group]
    micro_batches = micro_batch_ranges(
        data.batch.attention_mask.sum(1).tolist(), first, last, group_size=group,
        rows_per_micro=micro_batch_groups(cfg) * group, max_tokens=tr.max_tokens_per_micro_batch, packed=data.packed)
    micro_batches = same_count_on_every_rank(micro_batches, group, dist_info.world_size, dist_info.device)
    split = None  # only token budgets cut groups
    if tr.max_tokens_per_micro_batch is not None:
        split = split_group_gradients(cfg, policy, data, micro_batches, dist_info, first_mini_batch=mini == 0)
    # one vocabulary sweep needs every psi to be 0 on the first mini-batch: reference = current weights
    objective = loss_objective(cfg)
    first_step = (mini == 0 and one_sweep_first_step(objective) and o.one_sweep_first_step
                  and data.rollout_logp is None)
    tokens = None
    if token_mean(objective):  # one token mean over the whole mini-batch (GRPO's token_mean, DAPO, CISPO, ...)
        tokens = mini_batch_tokens(data.batch.mask[first:first + rows_per_mini], dist_info)
    return MiniBatch(micro_batches, split, skipped, first_step, tokens)


def mini_batch_tokens(mask: torch.Tensor, dist_info: DistInfo) -> int:
    """The response tokens of a mini-batch whose rows on this rank hold ``mask``, on every data rank (the ranks of
    a sequence-parallel group hold the same rows)."""
    tokens = torch.tensor([int(mask.sum())], dtype=torch.int64, device=dist_info.device)
    if dist_info.world_size > 1:
        dist.all_reduce(tokens)
    return int(tokens) // dist_info.sp_size


def losses_at_zero(cfg: Config, batch: Batch, groups_run: list[int] | None) -> list[float] | None:
    """Each group's loss value at psi = 0: what a group not run (a gradient of exactly 0) counts in the
    metrics; None when every group runs."""
    if groups_run is None:
        return None
    o, group = cfg.optim, cfg.rollout.group_size
    valid = both_valid(loss_valid(batch.rewards, group, o.drop_single_label_groups), batch.valid)
    return group_losses_at_zero(batch.rewards, valid, group, o.weighting).tolist()
