"""One rollout step's metrics row: the per-rank statistics averaged over the ranks, the optimizer's, the
throughput, the timings and the peak memory."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from pacs.model.policy import DistInfo
from pacs.train.batch import Batch
from pacs.train.health import mixed_reward_group_frac
from pacs.train.single_label_groups import single_label
from pacs.train.update import UpdateResult, weighted_mean


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


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


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
