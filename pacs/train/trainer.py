"""The PACS training loop, top to bottom.

One rollout step:
  1. sample prompts (each rank its share); generate ``group_size`` responses per prompt, groups
     contiguous from here on;
  2. score every response with the task's 0/1 reward;
  3. old-policy log-probs of every response token: one no-grad pass of the current policy through
     the fused log-prob kernel (PACS's reference, reset every rollout step);
  4. for each mini-batch of whole groups: accumulate gradients over micro-batches of whole groups
     (each loss divided by the number of micro-batches), clip the gradient norm, step AdamW and the
     learning-rate schedule; a NaN loss or gradient skips the step (:func:`update_policy`);
  5. push the new weights into the rollout engine; log; evaluate and checkpoint every k steps.

What happens before the first step (checks, output directory, model, task, tokenizer) is
:func:`start_run`, shared in part with ``pacs eval`` through pacs/train/run_setup.py.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from pacs.config import Config, micro_batch_groups, save_config, use_packing
from pacs.eval.evaluate import decode_response, encode_prompts, evaluate
from pacs.model.memory import activation_offload
from pacs.model.mixed_precision import rounding_warning, share_frozen_by_rounding
from pacs.model.packing import (
    PackedMicroBatch,
    forward_micro_batch,
    is_part_of_a_group,
    micro_batch_ranges,
    response_positions,
    same_count_on_every_rank,
    to_layout,
)
from pacs.model.policy import DistInfo, check_model_path, full_named_tensors, load_policy, setup_distributed
from pacs.model.reference_policy import ReferenceSnapshot, is_reset_step
from pacs.model.sequence_parallel import (
    SequenceParallel,
    backend_for,
    gather_rollouts,
    prompt_share,
    reduce_over_group,
    slice_micro_batch,
    whole_micro_batch,
)
from pacs.model.varlen_attention import new_decisions as new_attention_decisions
from pacs.rollout import engine_kind, make_rollout_engine
from pacs.rollout.sampled import SampledResponses
from pacs.train.batch import Batch, build_batch
from pacs.train.checkpoint import KEEP as CHECKPOINTS_KEPT
from pacs.train.checkpoint import (
    checkpoint_steps,
    find_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    load_reference_state,
    save_checkpoint,
)
from pacs.train.console import hide_progress_bars
from pacs.train.disk_space import NoSpaceLeft, check_checkpoint_space
from pacs.train.export import export_hf
from pacs.train.health import health_lines, mixed_reward_group_frac, progress_fields
from pacs.train.loss_objective import loss_objective, one_sweep_first_step, token_mean
from pacs.train.loss_statistics import LossStatistics
from pacs.train.metrics import MetricsLog, plot_metrics, read_metrics
from pacs.train.preflight import TrainerSteps, preflight_enabled, run_preflight
from pacs.train.resume_check import apply_optimizer_settings, plan_resume, record_resume, resume_command
from pacs.train.rollout_correction import Band, both_valid
from pacs.train.rollout_correction import correct as correct_rollouts
from pacs.train.run_dir import RunDir
from pacs.train.run_lock import abandon_run_directory, check_no_other_holder, lock_run_directory
from pacs.train.run_setup import (
    Run,
    apply_torch_threads,
    check_config,
    engine_options,
    packed_attention_for,
    prepare_run,
)
from pacs.train.single_label_groups import group_losses_at_zero, loss_valid, plan_group_skips, single_label, skip_rules
from pacs.train.split_groups import GroupGradients, group_gradients, loss_gradient, part_of_a_group, split_group_rows
from pacs.train.stop_signals import StopSignals
from pacs.train.training_errors import TrainingInterrupted, TrainingPreempted, TrainingStopped
from pacs.train.weight_updates import UpdateMonitor
from pacs_kernels import (
    GRPO,
    PACS,
    GatheredLogprobs,
    KnownGradient,
    LossOptions,
    fused_linear_grpo_loss,
    fused_linear_objective_loss,
    fused_linear_pacs_loss,
    linear_logprobs,
)

# statistics of the objectives' optional regularizers: NaN when their input is absent (pacs_kernels/objectives)
ABSENT_WHEN_NAN = frozenset({"kl_mean", "entropy_mean"})


@dataclass
class TrainResult:
    """What :func:`train` returns: the last metrics row and the trained policy (still sharded
    under FSDP; :func:`pacs.model.policy.full_named_tensors` gathers it)."""

    metrics: dict
    policy: torch.nn.Module
    output_dir: str


def preflight_steps() -> TrainerSteps:
    """The trainer's own old-policy pass and update, as the preflight runs them (looked up now: a test's
    stand-in for one of them is what the preflight gets)."""
    return TrainerSteps(old_policy_logprobs=old_policy_logprobs, old_policy_ranges=old_policy_ranges,
                        update_policy=update_policy)


def lr_lambda(cfg: Config, total_updates: int):
    """Multiplier of the base lr at optimizer step ``k``: linear warm-up, then the schedule."""
    o = cfg.optim

    def factor(k: int) -> float:
        if o.lr_warmup_steps and k < o.lr_warmup_steps:
            return (k + 1) / o.lr_warmup_steps
        progress = min(1.0, (k - o.lr_warmup_steps) / max(1, total_updates - o.lr_warmup_steps))
        if o.lr_schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * progress))
        if o.lr_schedule == "linear":
            return 1.0 - progress
        return 1.0

    return factor


def all_reduce_mean(values: dict[str, float], dist_info: DistInfo,
                    weights: dict[str, float] | None = None) -> dict[str, float]:
    """Mean of each value over the ranks, ignoring ranks where it is NaN (undefined there, e.g. a
    statistic of correct responses on a rank that had none); NaN where no rank has it. ``weights``: what
    a value is a mean over on this rank (e.g. its tokens), 1 where not given. Every rank must pass the
    same keys."""
    if dist_info.world_size == 1:
        return values
    keys = sorted(values)
    weights = weights or {}
    finite = [math.isfinite(float(values[k])) for k in keys]
    weight = [float(weights.get(k, 1.0)) if ok else 0.0 for k, ok in zip(keys, finite)]
    t = torch.tensor([float(values[k]) * w if ok else 0.0 for k, ok, w in zip(keys, finite, weight)] + weight,
                     dtype=torch.float64, device=dist_info.device)
    dist.all_reduce(t)
    sums, counts = t[:len(keys)].tolist(), t[len(keys):].tolist()
    return {k: (total / count if count else float("nan")) for k, total, count in zip(keys, sums, counts)}


def most_on_any_rank(counts: list[int], dist_info: DistInfo) -> list[int]:
    """Each count's largest value over the ranks (FSDP: every rank runs as many groups per mini-batch)."""
    if dist_info.world_size <= 1:
        return counts
    shared = torch.tensor(counts, dtype=torch.int64, device=dist_info.device)
    dist.all_reduce(shared, op=dist.ReduceOp.MAX)
    return shared.tolist()


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def step_seed(seed: int, step: int, first_row: int = 0) -> int:
    """Sampling seed of rollout ``step`` for a call whose first response is global row ``first_row``.

    A function of (seed, step, row) only: a resumed run samples exactly what the uninterrupted run
    did, and engines that seed row j with ``seed + j`` sample the same rows on any number of ranks.
    """
    return (seed * 1_000_003 + step * 7_919_993) % (2**31 - 1) + first_row


@torch.no_grad()
def old_policy_logprobs(policy, batch: Batch, ranges: list[tuple[int, int]], temperature: float, backend: str,
                        packed: bool = False, sp: SequenceParallel | None = None,
                        fillers: list[tuple[int, int]] = ()):
    """(B, L) log-probs of the targets under the current policy (0 off the mask), their (B, L)
    log-sum-exp (for the one-sweep first step), and the mean entropy of the policy over response
    tokens. One no-grad pass in chunks: the row ranges ``ranges``, packed or padded; with ``sp`` each
    rank of the group does its tokens of each chunk and the group adds up the results. ``fillers``: more
    forwards whose results are dropped (FSDP: a rank with fewer chunks than another runs as many)."""
    old_logp = torch.zeros(batch.targets.shape, dtype=torch.float32, device=batch.targets.device)
    old_lse = torch.zeros_like(old_logp)
    entropy_sum, tokens = 0.0, 0
    for i, (lo, hi) in enumerate([*ranges, *fillers]):
        part = slice_micro_batch(batch, lo, hi, packed, sp)
        hidden, weight, bias = forward_micro_batch(policy, part)
        selected = part.mask
        logp, entropy, lse = linear_logprobs(hidden[selected], weight, part.targets[selected], bias=bias,
                                             **policy.head_options(temperature), return_entropy=True, return_lse=True,
                                             backend=backend_for(selected, backend))
        if i >= len(ranges):  # a filler: under sequence parallelism its tokens may sit on other ranks than in
            continue          # the chunk that wrote them, and the group's sum would count them twice
        rows, cols = response_positions(part, lo)
        old_logp[rows, cols] = logp.to(old_logp.dtype)  # float32 buffers, also for a float64 model
        old_lse[rows, cols] = lse.to(old_lse.dtype)
        entropy_sum += float(entropy.sum())
        tokens += int(part.mask.sum())
    if sp is not None:  # each token was written by one rank of the group, 0 elsewhere
        totals = torch.tensor([entropy_sum, tokens], dtype=torch.float64, device=old_logp.device)
        reduce_over_group([old_logp, old_lse, totals], sp)
        entropy_sum, tokens = float(totals[0]), int(totals[1])
    return old_logp, old_lse, entropy_sum / max(tokens, 1)


def policy_loss(cfg: Config, policy, part: Batch | PackedMicroBatch, old_logp: torch.Tensor,
                old_lse: torch.Tensor | None = None, piece=None, valid_rows: torch.Tensor | None = None,
                token_weights: torch.Tensor | None = None):
    """The configured objective's loss (pacs/train/loss_objective.py) of one micro-batch (padded rows or packed),
    straight from hidden states; old_logp/old_lse in the micro-batch's layout. ``old_lse`` (PACS, weights
    unchanged since the old-policy pass): the one-sweep first step. ``piece`` (:func:`loss_piece`): the
    micro-batch holds a piece of the loss's batch (part of a group, or this rank's tokens under sequence
    parallelism). The one place in this module that calls the fused losses: the objective and the options go to
    the engine, which does the rest (PACS through its own entry, which takes old_lse and the validity mask; GRPO
    through its own; any other objective, a user's included, through fused_linear_objective_loss).
    ``valid_rows``: the micro-batch's rows of ``Batch.valid`` (responses the rollout correction dropped);
    ``token_weights``: the rollout correction's truncated weights in the micro-batch's layout (None: none)."""
    hidden, weight, bias = forward_micro_batch(policy, part)
    if piece is None and not bool(part.mask.any()):  # the rollout correction dropped every token: no loss term
        return hidden.sum() * 0.0, {}  # (the forward ran: FSDP's collectives are the same on every rank)
    o, group = cfg.optim, cfg.rollout.group_size
    options = LossOptions(**policy.head_options(cfg.rollout.temperature), backend=o.logprob_backend,
                          chunk_budget_mib=cfg.train.loss_chunk_mib)
    if piece is not None and token_weights is not None:
        raise ValueError(f"advanced.rollout_correction.mode={cfg.rollout_correction.mode} needs whole groups in a "
                         "micro-batch: not yet with groups split over the token budget or sequence parallelism")
    inputs = dict(old_logp=old_logp, rewards=part.rewards, bias=bias, piece=piece, token_weights=token_weights)
    if isinstance(part, PackedMicroBatch) and piece is None:
        inputs["cu_seqlens"] = part.cu_seqlens
    objective, fused_loss = loss_objective(cfg), fused_linear_objective_loss
    if isinstance(objective, PACS):
        fused_loss = fused_linear_pacs_loss
        inputs.update(old_lse=old_lse, valid=both_valid(loss_valid(part.rewards, group, o.drop_single_label_groups),
                                                        valid_rows), return_stats=True)
    elif isinstance(objective, GRPO) and objective.entropy_coef == 0:
        fused_loss = fused_linear_grpo_loss
        inputs.update(return_stats=True)
    loss, stats = fused_loss(hidden, weight, part.targets, part.mask, group_size=group, objective=objective,
                             options=options, **inputs)
    if not isinstance(stats, dict):
        stats = stats.as_dict()
    # a regularizer the objective has no input for (no reference model, no entropy asked) reports NaN: left out
    return loss, {k: v for k, v in stats.items() if not (k in ABSENT_WHEN_NAN and v != v)}


def loss_piece(cfg: Config, data: UpdateData, mini: MiniBatch, part, lo: int, hi: int,
               sp: SequenceParallel | None):
    """What the loss engine needs beyond micro-batch rows [lo, hi)'s tokens, and the rows its loss is a mean
    over: a part of a group over the token budget gets its group's known log-prob gradients
    (pacs/train/split_groups.py); under sequence parallelism the first step's gradients are known from
    old_logp (psi = 0: the whole micro-batch as the "group"), and later steps gather every rank's log-probs;
    else nothing (None)."""
    group, batch = cfg.rollout.group_size, data.batch
    if is_part_of_a_group(lo, hi, group):  # a group over the token budget: its log-prob gradients are known
        return part_of_a_group(part, lo, mini.split, lo - lo % group), group
    if sp is None:
        return None, hi - lo
    if mini.first_step:  # the weights are still the rollout's: the loss and its gradient from old_logp
        grad_logp = torch.zeros_like(data.old_logp)
        loss, stats = loss_gradient(cfg, batch, slice(lo, hi), data.old_logp, data.old_logp, grad_logp)

        def agree(drift):  # every rank of the group stops, or none
            reduce_over_group([drift], sp, op=dist.ReduceOp.MAX)
            return drift

        return KnownGradient(to_layout(part, lo, grad_logp), to_layout(part, lo, data.old_lse), loss, stats,
                             expected_logp=to_layout(part, lo, data.old_logp), agree=agree), hi - lo
    width = data.old_logp.shape[1]  # the loss couples the tokens of a group: gathered over the group's ranks
    return GatheredLogprobs(lambda logp: whole_micro_batch(part, logp, lo, width), data.old_logp[lo:hi],
                            batch.mask[lo:hi], part.rewards), hi - lo


def evaluate_policy(cfg: Config, engine, run: Run, dist_info: DistInfo, step: int) -> dict:
    """Held-out accuracy (and pass@k) with the rollout engine; each rank scores its share with
    :func:`pacs.eval.evaluate.evaluate` (the evaluator of ``pacs eval``) and the shares are averaged."""
    e = cfg.eval
    every = run.task.eval_problems(e.num_problems)
    share = math.ceil(len(every) / dist_info.world_size)
    first = dist_info.rank * share
    problems = every[first:first + share]
    sums = [0.0] * (2 + len(e.ks))
    if problems:
        result = evaluate(engine, run.task, run.tokenizer, problems, n_samples=e.n_samples, temperature=e.temperature,
                          top_p=e.top_p, ks=e.ks, max_new_tokens=cfg.rollout.max_new_tokens,
                          stop_token_ids=run.stop_ids,
                          seed=step_seed(cfg.seed + 1, step, first * e.n_samples),
                          template=cfg.task.prompt_template, use_chat_template=cfg.task.use_chat_template,
                          max_prompt_len=cfg.rollout.max_prompt_len)
        n = len(problems)
        sums = [result["accuracy"] * n * e.n_samples, float(n)] + [result[f"pass@{k}"] * n for k in e.ks]
    if dist_info.world_size > 1:
        t = torch.tensor(sums, dtype=torch.float64, device=dist_info.device)
        dist.all_reduce(t)
        sums = t.tolist()
    out = {"eval_accuracy": sums[0] / (sums[1] * e.n_samples)}
    for k, total in zip(e.ks, sums[2:]):
        out[f"eval_pass@{k}"] = total / sums[1]
    return out


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
    split_groups: int = 0  # groups larger than the token budget, run in parts (pacs/train/split_groups.py)
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


def old_policy_ranges(cfg: Config, batch: Batch, dist_info: DistInfo, packed: bool) -> list[tuple[int, int]]:
    """Row ranges of the no-grad old-policy pass: whole groups, within ``train.old_policy_max_tokens``
    (else the micro-batch token budget), the same count on every rank (FSDP's collectives)."""
    tr, group = cfg.train, cfg.rollout.group_size
    lengths = batch.attention_mask.sum(1).tolist()
    ranges = micro_batch_ranges(
        lengths, 0, len(lengths), group_size=group, rows_per_micro=micro_batch_groups(cfg) * group,
        max_tokens=tr.old_policy_max_tokens or tr.max_tokens_per_micro_batch, packed=packed,
        setting="train.old_policy_max_tokens" if tr.old_policy_max_tokens else "train.max_tokens_per_micro_batch")
    return same_count_on_every_rank(ranges, group, dist_info.world_size, dist_info.device)


@dataclass
class UpdateData:
    """What one rollout step's updates learn from (the arguments of :func:`update_policy`): the batch, the
    reference's log-probs ``old_logp``, the rollout-time log-sum-exp ``old_lse``, the rollout-time log-probs
    ``rollout_logp`` where the reference is older (None: it is the rollout's policy), per mini-batch the number
    of groups that run (``groups_run``; None: all), and whether micro-batches are packed."""

    batch: Batch
    old_logp: torch.Tensor
    old_lse: torch.Tensor
    rollout_logp: torch.Tensor | None
    groups_run: list[int] | None
    packed: bool


@dataclass
class MiniBatch:
    """One mini-batch's plan: its micro-batches (row ranges, the same count on every rank), the log-prob
    gradients of its groups that run in parts (None: no token budget, no parts), the loss values of its groups
    not run (a gradient of exactly 0), ``first_step``: PACS on weights still the rollout's (every psi 0), and
    ``tokens``: the GRPO token mean's denominator, the response tokens of the mini-batch on every data rank
    (None: the loss is a mean over responses)."""

    micro_batches: list[tuple[int, int]]
    split: GroupGradients | None
    skipped_losses: list[float]
    first_step: bool
    tokens: int | None = None


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


def split_group_gradients(cfg: Config, policy, data: UpdateData, micro_batches: list[tuple[int, int]],
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
                                                               cfg.optim.logprob_backend, data.packed, dist_info.sp,
                                                               fillers=[(first, first + 1)] * (count - len(parts)))
    return group_gradients(cfg, batch, split_group_rows(micro_batches, group), current_logp, current_lse,
                           data.old_logp)


def plan_mini_batch(cfg: Config, policy, data: UpdateData, mini: int, dist_info: DistInfo,
                    losses_at_zero: list[float] | None) -> MiniBatch:
    """Mini-batch ``mini``: the rows of its groups that run (those not run, a gradient of exactly 0, sit behind
    them: pacs/train/single_label_groups.py) cut into micro-batches of whole groups (at most
    ``micro_batch_groups`` groups and ``train.max_tokens_per_micro_batch`` tokens; a group larger than that in
    parts, made exact by its log-prob gradients, known first: pacs/train/split_groups.py)."""
    o, tr, group = cfg.optim, cfg.train, cfg.rollout.group_size
    rows_per_mini = mini_batch_rows(cfg, dist_info)
    first = mini * rows_per_mini
    last = first + (rows_per_mini if data.groups_run is None else data.groups_run[mini] * group)
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


def loss_scale(loss: MicroBatchLoss, mini: MiniBatch, rows_per_mini: int, dist_info: DistInfo) -> float:
    """What a micro-batch's loss is multiplied by before its backward, so that the gradients add up to the
    mini-batch loss's: a mean over rows weighs its rows' share of the mini-batch; GRPO's token mean its tokens'
    share of every data rank's (FSDP averages gradients over the ranks: times their number). A
    sequence-parallel group's ranks each hold a part of a micro-batch: times the group's size."""
    if mini.tokens is None:
        return dist_info.sp_size * loss.rows / rows_per_mini
    return dist_info.world_size * loss.tokens / max(mini.tokens, 1)


def mini_batch_rows(cfg: Config, dist_info: DistInfo) -> int:
    """Rows of one mini-batch on this rank: its share of the step's groups, split into the mini-batches."""
    return cfg.rollout.prompts_per_step // dist_info.dp_size // cfg.optim.mini_batches_per_step * cfg.rollout.group_size


def micro_batch_loss(cfg: Config, policy, data: UpdateData, mini: MiniBatch, lo: int, hi: int,
                     sp: SequenceParallel | None) -> MicroBatchLoss:
    """The loss of micro-batch rows [lo, hi): one call to the loss engine (:func:`policy_loss`) with the piece of
    the loss's batch it holds, if any (:func:`loss_piece`); on the first step without one, PACS's one sweep."""
    part = slice_micro_batch(data.batch, lo, hi, data.packed, sp)
    piece, rows = loss_piece(cfg, data, mini, part, lo, hi, sp)
    # the first mini-batch still has the old-policy weights: one vocabulary sweep suffices
    lse = to_layout(part, lo, data.old_lse) if mini.first_step and piece is None else None
    valid_rows = None if data.batch.valid is None else data.batch.valid[lo:hi]
    weights = None if data.batch.token_weights is None else to_layout(part, lo, data.batch.token_weights)
    loss, stats = policy_loss(cfg, policy, part, to_layout(part, lo, data.old_logp), lse, piece, valid_rows, weights)
    group = cfg.rollout.group_size
    first = lo - lo % group if is_part_of_a_group(lo, hi, group) else lo  # a part of a group: the whole group's
    tokens = int(data.batch.mask[first:first + rows].sum())
    return MicroBatchLoss(loss, float(loss.detach()), rows, stats, tokens)


def losses_at_zero(cfg: Config, batch: Batch, groups_run: list[int] | None) -> list[float] | None:
    """Each group's loss value at psi = 0: what a group not run (a gradient of exactly 0) counts in the
    metrics; None when every group runs."""
    if groups_run is None:
        return None
    o, group = cfg.optim, cfg.rollout.group_size
    valid = both_valid(loss_valid(batch.rewards, group, o.drop_single_label_groups), batch.valid)
    return group_losses_at_zero(batch.rewards, valid, group, o.weighting).tolist()


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


def update_policy(cfg: Config, policy, optimizer, scheduler, batch: Batch, old_logp: torch.Tensor,
                  old_lse: torch.Tensor, state: dict, dist_info: DistInfo, step: int, say=print, *,
                  packed: bool = False, rollout_logp: torch.Tensor | None = None,
                  groups_run: list[int] | None = None) -> UpdateResult:
    """Step 4: for each mini-batch of whole groups, its micro-batches' losses (each through
    :func:`micro_batch_loss`), their gradients accumulated, clipped and applied; a non-finite loss or gradient
    on any rank skips the update on every rank (:func:`skip_non_finite`). ``old_logp``: the reference's
    log-probs; ``old_lse``: the rollout-time log-sum-exp; ``rollout_logp``, ``groups_run``: see :class:`UpdateData`."""
    data = UpdateData(batch, old_logp, old_lse, rollout_logp, groups_run, packed)
    o, group, rows_per_mini = cfg.optim, cfg.rollout.group_size, mini_batch_rows(cfg, dist_info)
    skipped = None if groups_run is None else rows_per_mini // group * o.mini_batches_per_step - sum(groups_run)
    update = UpdateResult([], [], [], {}, float("nan"), skipped_groups=skipped, lr=optimizer.param_groups[0]["lr"])
    statistics, at_zero = LossStatistics(), losses_at_zero(cfg, batch, groups_run)
    # weights that a step leaves where they are, though they have a gradient: updates that rounded away
    monitor = UpdateMonitor(policy.parameters(), distributed=dist_info.world_size > 1)
    for m in range(o.mini_batches_per_step):
        mini = plan_mini_batch(cfg, policy, data, m, dist_info, at_zero)
        update.skipped_losses += mini.skipped_losses
        update.split_groups += 0 if mini.split is None else len(mini.split.losses)
        for lo, hi in mini.micro_batches:
            with activation_offload(cfg.train.offload_activations, dist_info.device):
                loss = micro_batch_loss(cfg, policy, data, mini, lo, hi, dist_info.sp)
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


def step_metrics(step: int, batch: Batch, responses: list[list[int]], entropy: float, update: UpdateResult,
                 state: dict, times: dict[str, float], dist_info: DistInfo,
                 extra: dict[str, float] | None = None, group_size: int = 1) -> dict:
    """One rollout step's metrics row: the per-rank statistics averaged over ranks, each weighed by what it is
    a mean over (``extra``: the task's reward counters, e.g. math-verify timeouts, each scored 0), then the
    optimizer's, the throughput, the timings and the peak memory."""
    response_tokens = sum(len(x) for x in responses)
    extra = dict(extra or {})
    if update.skipped_groups is not None:  # the loss's statistics then cover the groups that ran
        single = single_label(batch.rewards, group_size)
        extra["frac_single_label_groups"] = float(single.double().mean())
        extra["skipped_group_frac"] = update.skipped_groups / single.numel()
    extra["mixed_reward_group_frac"] = mixed_reward_group_frac(batch.rewards, group_size)
    local = {"reward_mean": float(batch.rewards.mean()), "entropy": entropy,
             "response_length": response_tokens / len(responses),
             "loss": update.mean_loss(),
             "split_groups": float(update.split_groups), **extra,
             **{k: v for k, v in update.stats.items() if k not in ("loss", "reward_mean", *extra)}}
    # the entropy is a mean over this rank's response tokens, the loss over its groups (or tokens: GRPO's token
    # mean); the loss's statistics are the whole step's already (pacs/train/loss_statistics.py)
    weights = {"entropy": response_tokens, "loss": sum(update.loss_groups) + len(update.skipped_losses)}
    row = {"step": step, **all_reduce_mean(local, dist_info, weights)}
    row.update({
        "grad_norm": sum(update.grad_norms) / len(update.grad_norms) if update.grad_norms else float("nan"),
        # over the updates with a gradient (an update whose groups were all skipped has none)
        "update_nonzero_frac": weighted_mean([f for f in update.update_nonzero_fracs if math.isfinite(f)],
                                             [1.0 for f in update.update_nonzero_fracs if math.isfinite(f)]),
        "lr": update.lr, "skipped_updates": state["skipped_updates"],
        # every data rank's responses (as many on each), at the mean length over all of them
        "tokens_per_s": row["response_length"] * len(responses) * dist_info.dp_size / times["step_time"], **times,
        "peak_memory_mib": peak_memory_mib(dist_info.device), "prompts_seen": state["data_position"],
    })
    return row


def start_run(cfg: Config, dist_info: DistInfo, say=print,
              change: tuple[str, ...] = ()) -> tuple[Run, object, object]:
    """Everything before the model loads: config checks, a usable output directory that holds
    no other run (unless ``resume`` / ``overwrite``) and no other process, a resume's settings
    compared with the run's (``change``: the keys named with --change; pacs/train/resume_check.py), the
    checkpoint to resume from, the model directory, task and tokenizer. Returns the run, the
    :class:`~pacs.train.checkpoint.CheckpointChoice` and the :class:`~pacs.train.resume_check.ResumePlan` (both None
    when not resuming). Nothing is written on a resume: its record is appended once the checkpoint loaded."""
    check_config(cfg, dist_info.world_size)
    loss_objective(cfg)  # the objective built (a user's module:Class imported) before any work
    run_dir = RunDir(cfg.output_dir)
    created = not os.path.exists(run_dir.path)
    run_dir.check_usable()
    fresh = not run_dir.contents()  # (a refusal below leaves a fresh directory as it found it)
    # one process per run directory (pacs/train/run_lock.py), before anything there is read
    on_main_rank(lambda: lock_run_directory(run_dir.path), dist_info)
    run_dir.check_free_for_run(resume=cfg.resume, overwrite=cfg.overwrite)
    choice = plan = None
    start_over = False  # --resume of a run killed before its first checkpoint: nothing to continue
    if cfg.resume:
        plan = on_main_rank(lambda: plan_resume(cfg, run_dir.path, change), dist_info)
        choice = find_checkpoint(run_dir.path) if dist_info.is_main else None
        if dist_info.world_size > 1:  # rank 0 verifies; every rank resumes from its choice
            shared = [choice]
            dist.broadcast_object_list(shared, src=0)
            choice = shared[0]
        for line in choice.describe():
            say(line)
        if choice.path is None:
            found = run_dir.contents()
            if found and choice.skipped:
                raise ValueError(
                    f"--resume: {run_dir.path!r} holds a run ({', '.join(found)}) but no checkpoint that "
                    "verifies (reasons above); pass --overwrite instead of --resume to move it aside and "
                    "start afresh")
            # killed before its first checkpoint (a scheduler's requeue resumes with the same command): the run
            # is moved aside, nothing deleted, and starts again
            start_over = bool(found)
            say(f"[resume] no checkpoint under {run_dir.checkpoints}: starting from scratch"
                + (f" (the run there wrote none: {', '.join(found)} moved aside)" if found else ""))
            choice = plan = None
    apply_torch_threads(cfg, dist_info.device)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    try:  # its refusals (a prompt too long, a held-out split too small) before anything is written in the directory
        run = prepare_run(cfg, dist_info, log=say)
    except ValueError:
        if fresh and dist_info.is_main:  # a refused run leaves no trace: the same command, mended, starts there
            abandon_run_directory(run_dir.path, remove_directory=created)
        raise
    if cfg.overwrite or start_over:  # a live `pacs eval` in the run (its eval/.lock) is not moved away under it
        on_main_rank(lambda: check_no_other_holder(run_dir.path), dist_info)
    if dist_info.world_size > 1:  # every rank has checked the directory before rank 0 changes it
        dist.barrier()
    if dist_info.is_main:
        if cfg.overwrite or start_over:
            moved = run_dir.move_aside()
            if moved:
                lock_run_directory(run_dir.path)  # the lock file went aside with the old run: lock the new one
                say(f"[train] {'--overwrite' if cfg.overwrite else '--resume'}: moved the previous run in "
                    f"{run_dir.path} to {moved}")
        # the saved config resumes this run: `pacs train --config OUTPUT_DIR/config.yaml --resume`; written once,
        # when the run starts (a resume's settings go to config_history.jsonl)
        if choice is None or not os.path.isfile(run_dir.config):
            save_config(dataclasses.replace(cfg, resume=False, overwrite=False), run_dir.config)
    return run, choice, plan


def on_main_rank(check, dist_info: DistInfo):
    """``check()`` on rank 0, its result shared with every rank; its ValueError raised on every rank (one
    that only rank 0 raised would leave the others waiting in the next collective)."""
    result, refusal = None, None
    if dist_info.is_main:
        try:
            result = check()
        except ValueError as exc:
            if dist_info.world_size == 1:
                raise
            refusal = str(exc)
    if dist_info.world_size > 1:
        shared = [result, refusal]
        dist.broadcast_object_list(shared, src=0)
        result, refusal = shared
    if refusal is not None:
        raise ValueError(refusal)
    return result


def resume_hint(cfg: Config) -> str:
    """Where the last checkpoint is and the command that continues the run. (Manifests and sizes checked,
    not checksums: said within a scheduler's grace period or as a crashed run ends; --resume verifies all.)"""
    last = find_checkpoint(cfg.output_dir, checksums=False)
    command = resume_command(cfg.output_dir)
    if last.path is None:
        return f"no checkpoint was written yet; start again with {command.replace('--resume', '--overwrite')}"
    return f"the last checkpoint is {last.path} (step {last.step}); resume with: {command}"


def summary_line(run_dir: RunDir, steps: int, seconds: float, peak_mib: float, plot: str | None) -> str:
    """The run's last console line: steps, held-out accuracy first -> last, wall time, peak memory,
    where the model, metrics and curves are."""
    evals = [r["eval_accuracy"] for r in read_metrics(run_dir.metrics) if r.get("eval_accuracy") is not None]
    accuracy = f"held-out accuracy {evals[0]:.3f} -> {evals[-1]:.3f}" if evals else "no held-out evaluation"
    minutes, secs = divmod(int(round(seconds)), 60)
    where = f"model {run_dir.final_model}, metrics {run_dir.metrics}"
    if plot:
        where += f", curves {plot}"
    return (f"[train] done: {steps} steps, {accuracy}, {minutes}m{secs:02d}s, peak memory {peak_mib:.0f} MiB; "
            f"{where}")


checkpoint_clock = time.monotonic  # what checkpoint_minutes is measured with (a module name: tests replace it)


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
    last_checkpoint_time: float
    progress: object = None  # the progress bar (tqdm), once the loop starts
    warned_cut: bool = False  # prompts cut to rollout.max_prompt_len were reported
    row: dict = dataclasses.field(default_factory=dict)  # the last metrics row
    mismatch: dict = dataclasses.field(default_factory=dict)  # the step's mismatch_* columns (rollout_correction.py)


@dataclass
class StepEnd:
    """What every rank agreed on at the end of a step (pacs/train/stop_signals.py)."""

    stop_signal: str | None  # a signal's name: checkpoint this step and stop
    out_of_time: bool  # max_minutes reached
    checkpoint_due: bool  # checkpoint_minutes passed since the last checkpoint
    last_step: bool


def load_training_policy(cfg: Config, run: Run, dist_info: DistInfo, say) -> tuple[bool, torch.nn.Module, object,
                                                                                  object]:
    """The policy (packed where the loss takes padding-free micro-batches and they are exact for the model),
    its AdamW optimizer over the trainable parameters (all, or the LoRA adapters) and the lr schedule."""
    o = cfg.optim
    packed = use_packing(cfg, check_model_path(run.model_dir, cfg.model.trust_remote_code),
                         packed_attention_for(cfg.train.sequence_parallel_size, dist_info.device))
    policy = load_policy(run.model_dir, dtype=cfg.model.dtype, gradient_checkpointing=cfg.model.gradient_checkpointing,
                         dist_info=dist_info, trust_remote_code=cfg.model.trust_remote_code, packed_attention=packed,
                         liger_patches=cfg.train.liger_patches, fsdp_cpu_offload=cfg.train.fsdp_cpu_offload,
                         tiled_mlp=cfg.train.tiled_mlp, mlp_tile_tokens=cfg.train.mlp_tile_tokens,
                         master_dtype=o.master_dtype, lora=cfg.model.lora)
    if policy.precision.steps_16_bit_weights:  # asked for by name (optim.master_dtype): say what it costs
        say(rounding_warning(share_frozen_by_rounding(policy.parameters(), o.lr), o.lr, policy.precision.master,
                             f"optim.master_dtype={o.master_dtype}"))
    if (cfg.model.lora.rank and policy.precision.compute.itemsize < 4 and cfg.rollout.dtype != "float32"
            and not engine_shares_policy(cfg, dist_info)):
        say(f"[train] LoRA over a {str(policy.precision.compute).removeprefix('torch.')} base: the rollout engine "
            "serves the merged weights rounded to it, where small adapter changes round away, so rollouts lag "
            "the trained policy by that rounding (the loss's log-probs are the trainer's own); "
            "advanced.rollout.dtype=float32 serves them unrounded (docs/mixed-precision.md)")
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=o.lr, betas=tuple(o.betas),
                                  weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, cfg.max_steps * o.mini_batches_per_step))
    return packed, policy, optimizer, scheduler


def engine_shares_policy(cfg: Config, dist_info: DistInfo) -> bool:
    """Whether the rollouts run on the policy itself: Hugging Face generate on one process (no copy of the
    weights; under FSDP each rank's engine needs whole weights of its own)."""
    return engine_kind(cfg.rollout.engine) == "hf" and dist_info.world_size == 1


def set_up_training(cfg: Config, dist_info: DistInfo, say, run: Run, resume, resume_plan) -> Training:
    """The policy, optimizer and schedule (a checkpoint's state when resuming), PACS's reference, the disk
    space check, the rollout engine serving the current weights and the metrics log (cut back on a resume)."""
    packed, policy, optimizer, scheduler = load_training_policy(cfg, run, dist_info, say)
    run_dir = RunDir(cfg.output_dir)
    state = {"step": 0, "data_position": 0, "consecutive_nan": 0, "skipped_updates": 0}
    if resume is not None:
        state.update(load_checkpoint(resume.path, policy, optimizer, scheduler, dist_info))
        # this run's lr / betas / decay and its schedule's current rate (a longer run re-plans the schedule)
        apply_optimizer_settings(cfg, optimizer, scheduler)
        if resume_plan is not None and dist_info.is_main:  # the checkpoint fits the model: the resume is recorded
            record_resume(run_dir.path, resume_plan, resume.step, say)
    # PACS's reference, when it is kept for optim.ref_reset_every > 1 rollout steps (pacs/model/reference_policy.py)
    reference = ReferenceSnapshot(policy) if cfg.optim.ref_reset_every > 1 else None
    if reference is not None and resume is not None:
        saved = load_reference_state(resume.path)
        if saved is not None:
            reference.load_full_state(saved)
    # the checkpoints this run keeps and its final model fit on the disk: said, or refused, before any rollout
    check_checkpoint_space(run_dir.path, policy, keep=CHECKPOINTS_KEPT, reference_kept=reference is not None,
                           existing=len(checkpoint_steps(run_dir.path)), say=say)
    engine = make_rollout_engine(**engine_options(cfg, run.model_dir, cfg.seed + dist_info.rank, log=say),
                                 policy=policy if engine_shares_policy(cfg, dist_info) else None)
    hide_progress_bars()  # again: a vLLM engine's start turns transformers' back on
    if resume is not None:
        engine.sync_weights(full_named_tensors(policy))
    metrics = MetricsLog(run_dir.metrics, resume_step=state["step"] if resume is not None else None,
                         enabled=dist_info.is_main, warn=say)
    return Training(cfg, dist_info, say, run, run_dir, packed, policy, optimizer, scheduler, reference, engine,
                    metrics, state, start_time=time.time(), last_checkpoint_time=checkpoint_clock())


def before_the_first_step(t: Training, resume) -> None:
    """The preflight (the largest steps these settings allow, once: out of memory now, not hours in;
    pacs/train/preflight.py), then a fresh run's step-0 evaluation and the progress bar."""
    from tqdm import tqdm

    cfg, dist_info = t.cfg, t.dist_info
    if preflight_enabled(cfg, dist_info.device) and t.state["step"] < cfg.max_steps:
        run_preflight(cfg, t.policy, t.optimizer, t.run.pad_id, dist_info, packed=t.packed, say=t.say,
                      steps=preflight_steps())
    if resume is None:
        t.row = {"step": 0, "rollout_engine": type(t.engine).__name__,
                 **evaluate_policy(cfg, t.engine, t.run, dist_info, 0)}
        t.metrics.write(t.row)
        t.say(f"[eval] step 0: held-out accuracy {t.row['eval_accuracy']:.3f}")
    t.progress = tqdm(total=cfg.max_steps, initial=t.state["step"], desc="rollout steps",
                      disable=not dist_info.is_main, dynamic_ncols=True)


def generate_rollouts(t: Training, step: int) -> tuple[list, list, list, int, int]:
    """This rank's share of the step's prompts and G responses each, groups contiguous; seeds depend on
    (seed, step, row) only, so a resumed run samples what the uninterrupted one did. Returns the problems,
    their encoded prompts, the responses of the share ``[start, stop)`` this rank generated (the ranks of a
    sequence-parallel group each generate a part), start and stop."""
    cfg, r, dist_info = t.cfg, t.cfg.rollout, t.dist_info
    per_rank = r.prompts_per_step // dist_info.dp_size  # a sequence-parallel group shares its data
    problems = t.run.task.train_batch(t.state["data_position"] + dist_info.dp_rank * per_rank, per_rank)
    t.state["data_position"] += r.prompts_per_step
    prompts, cut = encode_prompts(t.run.tokenizer, problems, template=cfg.task.prompt_template,
                                  use_chat_template=cfg.task.use_chat_template, max_prompt_len=r.max_prompt_len)
    if cut and not r.truncate_prompts:  # (a generated task's prompt beyond the ones measured)
        raise ValueError(f"rollout.max_prompt_len={r.max_prompt_len}: a prompt of rollout step {step} is "
                         "longer; raise it or set rollout.truncate_prompts=true")
    if cut and not t.warned_cut and dist_info.is_main:
        t.warned_cut = True  # (tqdm's write: on a line of its own above the progress bar, not after it)
        t.progress.write(f"[warning] prompts longer than rollout.max_prompt_len={r.max_prompt_len} tokens "
                         "are cut to their last max_prompt_len tokens")
    start, stop = prompt_share(per_rank, dist_info.sp)
    # with the sampler's log-prob of each token: the mismatch with the trainer's (pacs/train/rollout_correction.py)
    sampler_temperature = cfg.rollout_correction.sampler_temperature  # None: the trainer's (a mismatch on purpose)
    temperature = r.temperature if sampler_temperature is None else sampler_temperature
    outputs = t.engine.generate(prompts[start:stop], r.group_size, temperature=temperature, top_p=r.top_p,
                                max_new_tokens=r.max_new_tokens, stop_token_ids=t.run.stop_ids,
                                seed=step_seed(cfg.seed, step, (dist_info.dp_rank * per_rank + start) * r.group_size),
                                return_logprobs=True) if stop > start else SampledResponses([], [])
    return problems, prompts, outputs, start, stop


def score_rollouts(t: Training, problems: list, prompts: list, sampled: SampledResponses, start: int,
                   stop: int) -> tuple[Batch, list[list[int]]]:
    """One verifiable reward per response, scored once, where it was generated (a reward with a timeout could
    score differently elsewhere), then gathered with it within a sequence-parallel group. Returns the step's
    batch and its responses."""
    group_size, (outputs, logprobs) = t.cfg.rollout.group_size, sampled
    scores = [[t.run.task.reward(decode_response(t.run.tokenizer, resp), problem) for resp in group_out]
              for problem, group_out in zip(problems[start:stop], outputs)]
    outputs, scores = gather_rollouts(outputs, scores, t.dist_info.sp)
    logprobs, _ = gather_rollouts(logprobs, [], t.dist_info.sp)
    responses = [resp for group_out in outputs for resp in group_out]
    rewards = [reward for group_scores in scores for reward in group_scores]
    batch = build_batch([p for p in prompts for _ in range(group_size)], responses, rewards, t.run.pad_id,
                        sampler_logprobs=[values for group_values in logprobs for values in group_values])
    return batch.to(t.dist_info.device), responses


def update_step(t: Training, step: int, batch: Batch) -> tuple[UpdateResult, float, float, float]:
    """Old-policy log-probs (the policy that sampled; PACS's reference, reset every optim.ref_reset_every rollout
    steps, in between the reference's own no-grad pass), the updates (NaN-skipping; groups whose gradient is
    exactly 0 not run), then the new weights into the rollout engine. Returns the update, the entropy, and the
    update's and the weight sync's seconds."""
    cfg, o, r, dist_info, reference = t.cfg, t.cfg.optim, t.cfg.rollout, t.dist_info, t.reference
    update_start = time.time()
    ranges = old_policy_ranges(cfg, batch, dist_info, t.packed)
    old_logp, old_lse, entropy = old_policy_logprobs(t.policy, batch, ranges, r.temperature, o.logprob_backend,
                                                     t.packed, dist_info.sp)
    # the sampler's log-probs against the policy that sampled: measured; masked by advanced.rollout_correction.mode
    batch, mismatch = correct_rollouts(batch, old_logp, cfg.rollout_correction.mode, Band.of(cfg),
                                       response_valid=isinstance(loss_objective(cfg), PACS))
    t.mismatch = mismatch.all_ranks(dist_info.device, dist_info.world_size).columns()
    rollout_logp = None
    if reference is not None:
        if reference.weights is None and not is_reset_step(step, o.ref_reset_every):
            t.say(f"[train] step {step}: the checkpoint kept no reference weights (written with "
                  "advanced.optim.ref_reset_every=1?): the reference is reset to the current policy now")
        if reference.weights is None or is_reset_step(step, o.ref_reset_every):
            reference.take(step)
        else:
            rollout_logp = old_logp
            with reference.weights_in():
                old_logp, _, _ = old_policy_logprobs(t.policy, batch, ranges, r.temperature, o.logprob_backend,
                                                     t.packed, dist_info.sp)
    # groups whose gradient is exactly 0 this step (single-label ones after a reset) are not run:
    # moved behind the others within their mini-batch (pacs/train/single_label_groups.py)
    skip_first, skip_every = skip_rules(cfg, reference_is_current=rollout_logp is None)
    groups_run = None
    if skip_first or skip_every:
        order, groups_run = plan_group_skips(batch.rewards, r.group_size, o.mini_batches_per_step,
                                             skip_first=skip_first, skip_every=skip_every)
        groups_run = most_on_any_rank(groups_run, dist_info)
        if order is not None:
            batch, old_logp, old_lse = batch.select(order), old_logp[order], old_lse[order]
            rollout_logp = None if rollout_logp is None else rollout_logp[order]
    update = update_policy(cfg, t.policy, t.optimizer, t.scheduler, batch, old_logp, old_lse, t.state, dist_info,
                           step, t.say, packed=t.packed, rollout_logp=rollout_logp, groups_run=groups_run)
    update_time = time.time() - update_start
    if t.packed and (attention := new_attention_decisions(dist_info.device)):  # once per configuration
        t.say(f"[train] packed attention: {attention}")
    sync_start = time.time()
    t.engine.sync_weights(full_named_tensors(t.policy))
    return update, entropy, update_time, time.time() - sync_start


def log_step(t: Training, step: int, batch: Batch, responses: list, entropy: float, update: UpdateResult,
             times: dict, stop_signals: StopSignals) -> StepEnd:
    """The step's metrics (averaged over ranks), what every rank agrees on (a stop signal, the wall-clock
    limit, a checkpoint due), the held-out evaluation every eval.every steps and at the end, the progress bar."""
    cfg, dist_info = t.cfg, t.dist_info
    extra = t.run.task.reward_metrics()
    if t.reference is not None:  # rollout steps since the reference was reset (0: this step)
        extra["ref_age"] = float(step - t.reference.step)
    extra.update(t.mismatch)  # sampler vs trainer log-probs, the same on every rank (pacs/train/rollout_correction.py)
    row = step_metrics(step, batch, responses, entropy, update, t.state, times, dist_info,
                       extra=extra, group_size=cfg.rollout.group_size)
    # every rank, every step: the same answer on all of them (a stop signal, the wall-clock limit)
    stop_signal, out_of_time, checkpoint_due = stop_signals.agreed(
        dist_info.world_size, dist_info.device,
        out_of_time=cfg.max_minutes is not None and time.time() - t.start_time > 60 * cfg.max_minutes,
        checkpoint_due=(cfg.checkpoint_minutes is not None
                        and checkpoint_clock() - t.last_checkpoint_time > 60 * cfg.checkpoint_minutes))
    if step == cfg.max_steps:
        stop_signal = None  # the run is done anyway: it ends as usual (evaluated, exported)
    last_step = step == cfg.max_steps or out_of_time or stop_signal is not None
    # a preempted run keeps only the scheduled evaluations (its resumed run then logs what an
    # uninterrupted one does, and a scheduler's grace period is better spent on the checkpoint)
    if (cfg.eval.every and step % cfg.eval.every == 0) or (last_step and stop_signal is None):
        row.update(evaluate_policy(cfg, t.engine, t.run, dist_info, step))
    t.metrics.write(row)
    t.row = row
    # what moves when the run learns (pacs/train/health.py); not the loss: PACS's on-policy loss is ln 2 by design
    t.progress.set_postfix(progress_fields(row))
    t.progress.update(1)
    t.state["step"] = step
    return StepEnd(stop_signal, out_of_time, checkpoint_due, last_step)


def checkpoint_if_due(t: Training, step: int, end: StepEnd) -> None:
    """Every checkpoint_every steps, once checkpoint_minutes have passed since the last one, and at the end."""
    if (t.cfg.checkpoint_every and step % t.cfg.checkpoint_every == 0) or end.checkpoint_due or end.last_step:
        save_checkpoint(t.run_dir.path, step, t.policy, t.optimizer, t.scheduler, t.state, t.dist_info,
                        reference_state=None if t.reference is None else t.reference.full_state())
        t.last_checkpoint_time = checkpoint_clock()


def stopped_training(t: Training, exc: BaseException) -> BaseException | None:
    """A run stopped by ``exc``: the progress bar and the engine closed; a Ctrl-C becomes the returned
    TrainingInterrupted; a crash mid-run (out of memory in generation, a reward function's bug, a lost rank)
    says on this rank where the run can be continued from, and the error itself follows (None returned)."""
    if t.progress is not None:
        t.progress.close()
    try:
        t.engine.close()
    except Exception:  # the error that stopped the run is the one to report
        pass
    if isinstance(exc, KeyboardInterrupt):
        return TrainingInterrupted(f"interrupted at step {t.state['step'] + 1}; {resume_hint(t.cfg)}")
    said = (TrainingInterrupted, TrainingStopped, NoSpaceLeft)  # their own line says how to resume
    if isinstance(exc, Exception) and not isinstance(exc, said):
        rank = f" on rank {t.dist_info.rank}" if t.dist_info.world_size > 1 else ""
        try:  # (the hint must not replace the error)
            hint = resume_hint(t.cfg)
        except Exception as hint_error:
            hint = f"the last checkpoint could not be listed ({type(hint_error).__name__})"
        print(f"[train] stopped by {type(exc).__name__}{rank} after step {t.state['step']} (the last one "
              f"finished); {hint}", file=sys.stderr, flush=True)
        try:
            exc.pacs_during_training = True  # the CLI then shows the whole traceback, not one line
        except AttributeError:
            pass
    return None


def finish_training(t: Training) -> TrainResult:
    """The final export (HF format, servable by vLLM), the curves, one summary line."""
    export_hf(t.policy, t.run.tokenizer, t.run_dir.final_model, t.dist_info)
    t.engine.close()
    png = None
    if t.dist_info.is_main and t.cfg.plot and os.path.isfile(t.run_dir.metrics):
        png = plot_metrics(t.run_dir.metrics, t.run_dir.metrics_plot,
                           title=f"{t.cfg.optim.algo} on {t.cfg.task.name} ({t.run_dir.path})")
    if t.dist_info.is_main:
        for line in health_lines(read_metrics(t.run_dir.metrics)):
            t.say(line)
        t.say(summary_line(t.run_dir, t.state["step"], time.time() - t.start_time,
                           peak_memory_mib(t.dist_info.device), png))
    return TrainResult(metrics=t.row, policy=t.policy, output_dir=t.run_dir.path)


def train(cfg: Config, change: tuple[str, ...] = ()) -> TrainResult:
    """Run (or resume) training as configured. ``change``: the settings a resume may change although they
    change what the run is (``pacs train --resume --change KEY=VALUE``; pacs/train/resume_check.py)."""
    dist_info = setup_distributed(cfg.train.sequence_parallel_size, cfg.train.distributed_timeout_minutes)
    say = print if dist_info.is_main else (lambda *a, **k: None)
    run, resume, resume_plan = start_run(cfg, dist_info, say, change)  # checks; the run directory; task, tokenizer
    try:
        t = set_up_training(cfg, dist_info, say, run, resume, resume_plan)  # policy, optimizer, engine, metrics log
    except ValueError:  # refused (the disk too small for the checkpoints, ...): a new run leaves no config.yaml
        if resume is None and dist_info.is_main:
            abandon_run_directory(cfg.output_dir, remove_directory=False, config_too=True)
        raise
    # SIGTERM / SIGUSR1 (a scheduler's preemption), Ctrl-C: finish the step, checkpoint it, stop
    # (pacs/train/stop_signals.py)
    with StopSignals(notice_prefix="[train]" if dist_info.is_main else None) as stop_signals:
        try:
            before_the_first_step(t, resume)  # out of memory now rather than hours in; the step-0 evaluation
            for step in range(t.state["step"] + 1, cfg.max_steps + 1):
                step_start = time.time()
                rollout = generate_rollouts(t, step)  # 1. prompts, G responses each, from the current policy
                rollout_time = time.time() - step_start
                batch, responses = score_rollouts(t, *rollout)  # 2. a verifiable reward for each response
                update, entropy, update_time, sync_time = update_step(t, step, batch)  # 3. learn from them
                times = {"rollout_time": rollout_time, "update_time": update_time, "sync_time": sync_time,
                         "step_time": time.time() - step_start, "elapsed": time.time() - t.start_time}
                end = log_step(t, step, batch, responses, entropy, update, times, stop_signals)  # 4. metrics, eval
                checkpoint_if_due(t, step, end)  # 5. so that a stopped run resumes from here
                if end.stop_signal is not None:
                    raise TrainingPreempted(f"{end.stop_signal} received: stopped after step {step}, its checkpoint "
                                            f"written; {resume_hint(cfg)}", end.stop_signal)
                if end.out_of_time:
                    say(f"[train] max_minutes={cfg.max_minutes} reached after step {step}: stopping")
                    break
        except BaseException as exc:
            interrupted = stopped_training(t, exc)  # the engine closed; where to resume said
            if interrupted is not None:
                raise interrupted from None
            raise
        t.progress.close()
    return finish_training(t)  # the final model, the curves, a summary line
