"""The loss's statistics over a rollout step's updates: each micro-batch's, combined as the whole step's.

The loss engine reports a micro-batch's statistics as means over its own responses or tokens. Averaged
plainly, a micro-batch of two short responses would weigh as much as one of eight long ones, and a rank with
few tokens as much as one with many. Here each mean weighs what it is a mean over (responses, tokens, the
correct or the incorrect responses), minima and maxima combine as such, a standard deviation is pooled, and
the sums are added over every rank before the division: the step's metrics row is the statistic of the
step's batch. A statistic undefined in a micro-batch (NaN: no correct response there) weighs nothing.
``single_label_grad_share`` (a ratio of sums over the micro-batch, whose denominator the loss does not report)
is combined as a mean over responses: an approximation of the step's share, not the share itself.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

TOKEN_MEANS = frozenset({"clip_frac", "ratio_mean", "kl_mean", "entropy_mean"})  # GRPO's, and the entropy
MINIMA, MAXIMA = frozenset({"weight_min"}), frozenset({"weight_max"})
POOLED_STD = {"psi_std": "psi_mean"}  # a population standard deviation, and the mean it is taken about
# means over the responses labelled 1 (0): weighed by their number, the micro-batch's reward mean times its rows
CORRECT, INCORRECT = "sigmoid_psi_correct_mean", "sigmoid_psi_incorrect_mean"


class LossStatistics:
    """Add each micro-batch's statistics with :meth:`add`; :meth:`means` gives the step's."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}

    def add(self, stats: dict[str, float], rows: int, tokens: int) -> None:
        """One micro-batch's (or one group's, run in parts) statistics; ``rows``, ``tokens``: the responses
        and response tokens they are over."""
        for key, value in stats.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            if key in MINIMA or key in MAXIMA:  # kept as the extreme itself, weight 1 once seen
                self.sums.setdefault(key, math.inf if key in MINIMA else -math.inf)
                self.weights.setdefault(key, 0.0)
                if math.isfinite(value):
                    pick = min if key in MINIMA else max
                    self.sums[key], self.weights[key] = pick(self.sums[key], value), 1.0
                continue
            self.sums.setdefault(key, 0.0)
            self.weights.setdefault(key, 0.0)
            weight = _weight(key, stats, rows, tokens)
            if key in POOLED_STD:  # summed as the mean of squares about 0: std^2 + mean^2
                mean = stats.get(POOLED_STD[key], math.nan)
                value = value * value + mean * mean
            if not math.isfinite(value) or not weight > 0:
                continue
            self.sums[key] += weight * value
            self.weights[key] += weight

    def means(self, distributed: bool = False, device: torch.device | None = None) -> dict[str, float]:
        """Each statistic over everything added (with ``distributed``: on every rank of the process group, whose
        sums are added first; every rank must call it). NaN where nothing defined it."""
        if distributed and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._reduce(device)
        out = {}
        for key, total in self.sums.items():
            weight = self.weights[key]
            if key in MINIMA or key in MAXIMA:
                out[key] = total if weight > 0 else math.nan
            else:
                out[key] = total / weight if weight > 0 else math.nan
        for key, mean_key in POOLED_STD.items():
            if key in out and mean_key in out:
                out[key] = math.sqrt(max(out[key] - out[mean_key] ** 2, 0.0)) if math.isfinite(out[key]) else math.nan
        return out

    def _reduce(self, device: torch.device | None) -> None:
        # every rank the same keys in the same order (a rank may have seen a statistic only as NaN, or none)
        everyone: list[list[str]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, sorted(self.sums))
        keys = sorted(set().union(*everyone))
        for key in keys:
            self.sums.setdefault(key, math.inf if key in MINIMA else -math.inf if key in MAXIMA else 0.0)
            self.weights.setdefault(key, 0.0)
        additive = [k for k in keys if k not in MINIMA and k not in MAXIMA]
        sums = torch.tensor([self.sums[k] for k in additive] + [self.weights[k] for k in keys], dtype=torch.float64,
                            device=device)
        dist.all_reduce(sums)
        for op, extreme in ((dist.ReduceOp.MIN, MINIMA), (dist.ReduceOp.MAX, MAXIMA)):
            group = sorted(extreme & set(keys))
            if group:
                extremes = torch.tensor([self.sums[k] for k in group], dtype=torch.float64, device=device)
                dist.all_reduce(extremes, op=op)
                self.sums.update(zip(group, extremes.tolist()))
        values = sums.tolist()
        self.sums.update(zip(additive, values[:len(additive)]))
        self.weights.update(zip(keys, values[len(additive):]))


def _weight(key: str, stats: dict[str, float], rows: int, tokens: int) -> float:
    """What the micro-batch's value of ``key`` is a mean over."""
    if key in TOKEN_MEANS:
        return float(tokens)
    if key in (CORRECT, INCORRECT):
        share = stats.get("reward_mean", math.nan)  # 0/1 rewards: the share labelled 1
        if not math.isfinite(share):
            return 0.0
        return rows * (share if key == CORRECT else 1.0 - share)
    return float(rows)
