"""A rollout step's policy update: the old policy's log-probs, the rollout correction, PACS's reference, the
groups whose gradient is exactly 0 planned out; then, for each mini-batch of whole groups, its micro-batches'
losses (one loss call each: pacs/train/micro_batch_loss.py), their gradients accumulated, clipped and applied
by AdamW; a non-finite loss or gradient skips the update."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pacs.config import Config
from pacs.model.memory import activation_offload
from pacs.model.policy import DistInfo
from pacs.model.varlen_attention import new_decisions as new_attention_decisions
from pacs.run.checkpoint import latest_checkpoint
from pacs.run.training_errors import TrainingStopped
from pacs.train.batch import Batch
from pacs.train.loss_statistics import LossStatistics
from pacs.train.micro_batch_loss import loss_scale, micro_batch_loss
from pacs.train.mini_batches import losses_at_zero, mini_batch_rows, most_on_any_rank, plan_mini_batch
from pacs.train.old_policy import old_policy_logprobs, old_policy_pass, old_policy_ranges
from pacs.train.preflight import TrainerSteps
from pacs.train.single_label_groups import plan_group_skips, skip_rules
from pacs.train.training import Training
from pacs.train.update_batch import UpdateBatch
from pacs.train.weight_updates import UpdateMonitor


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
    groups_run = None
    if skip_first or skip_every:
        order, groups_run = plan_group_skips(data.batch.rewards, r.group_size, o.mini_batches_per_step,
                                             skip_first=skip_first, skip_every=skip_every)
        groups_run = most_on_any_rank(groups_run, dist_info)
        if order is not None:
            data = data.select(order)
    update = update_policy(cfg, t.policy, t.optimizer, t.scheduler, data, t.state, dist_info, step, t.say,
                           groups_run=groups_run)
    if t.packed and (attention := new_attention_decisions(dist_info.device)):  # once per configuration
        t.say(f"[train] packed attention: {attention}")
    return update, entropy


def update_policy(cfg: Config, policy, optimizer, scheduler, data: UpdateBatch, state: dict, dist_info: DistInfo,
                  step: int, say=print, *, groups_run: list[int] | None = None) -> UpdateResult:
    """For each mini-batch of whole groups of ``data``, its micro-batches' losses (each through
    :func:`micro_batch_loss`), their gradients accumulated, clipped and applied; a non-finite loss or gradient
    on any rank skips the update on every rank (:func:`skip_non_finite`). ``groups_run``: per mini-batch, the
    groups that run (those after them: a gradient of exactly 0); None: all."""
    o, group, rows_per_mini = cfg.optim, cfg.rollout.group_size, mini_batch_rows(cfg, dist_info)
    skipped = None if groups_run is None else rows_per_mini // group * o.mini_batches_per_step - sum(groups_run)
    update = UpdateResult([], [], [], {}, float("nan"), skipped_groups=skipped, lr=optimizer.param_groups[0]["lr"])
    statistics, at_zero = LossStatistics(), losses_at_zero(cfg, data.batch, groups_run)
    # weights that a step leaves where they are, though they have a gradient: updates that rounded away
    monitor = UpdateMonitor(policy.parameters(), distributed=dist_info.world_size > 1)
    for m in range(o.mini_batches_per_step):
        mini = plan_mini_batch(cfg, policy, data, m, dist_info, at_zero, groups_run)
        update.skipped_losses += mini.skipped_losses
        update.split_groups += 0 if mini.split is None else len(mini.split.losses)
        for lo, hi in mini.micro_batches:
            with activation_offload(cfg.train.offload_activations, dist_info.device):
                loss = micro_batch_loss(cfg, policy, data, mini, lo, hi)
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
