"""GRPO (Shao et al. 2024, DeepSeekMath) as an objective: ``pacs_kernels.grpo_loss`` unchanged, plus
the entropy bonus.

    A[i]     = (R[i] - mean_group R) / (std_group(R, unbiased) + 1e-6)
    rho[i,t] = exp(logp - old_logp)
    l[i,t]   = max(-A rho, -A clip(rho, 1 - clip_eps, 1 + clip_eps_high)) + kl_coef * k3[i,t]
    loss     = aggregate(l) - entropy_coef * aggregate(entropy)
               aggregate: "token_mean" (grpo_loss's default) or "seq_mean" (the paper's 1/G sum_i 1/|o_i| sum_t)

The surrogate's math lives in ``pacs_kernels/grpo.py``; this file only adapts it to the protocol.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_choice
from ..grpo import AGGREGATIONS, grpo_loss
from ..reference import reference_grpo_loss
from .batch import check_nonnegative
from .regularizers import RegularizedObjective, add_regularizers, as_floats, sequence_mean, token_mean


@dataclass(frozen=True, kw_only=True)
class GRPO(RegularizedObjective):
    """clip_eps / clip_eps_high: the ratio is clipped to [1 - clip_eps, 1 + clip_eps_high] (high defaults
    to clip_eps); aggregation: "token_mean" | "seq_mean"; kl_coef, entropy_coef: see RegularizedObjective."""

    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    aggregation: str = "token_mean"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_nonnegative("clip_eps", self.clip_eps)
        if self.clip_eps_high is not None:
            check_nonnegative("clip_eps_high", self.clip_eps_high)
        check_choice("aggregation", self.aggregation, AGGREGATIONS)

    def __call__(self, logp, old_logp, rewards, mask, *, group_size, ref_logp=None, entropy=None):
        batch = self.checked(logp, old_logp, rewards, mask, group_size, ref_logp, entropy)
        loss, stats = grpo_loss(batch.logp, batch.old_logp, batch.rewards, batch.mask, group_size=group_size,
                                clip_eps=self.clip_eps, clip_eps_high=self.clip_eps_high,
                                aggregation=self.aggregation, ref_logp=batch.ref_logp, kl_coef=self.kl_coef,
                                return_stats=True)
        aggregate = token_mean if self.aggregation == "token_mean" else sequence_mean
        loss, extra = add_regularizers(loss, batch, aggregate, kl_coef=self.kl_coef,
                                       entropy_coef=self.entropy_coef, add_kl=False)
        return loss, as_floats({**stats.as_dict(), **extra, "loss": loss.detach()})


def reference_grpo_objective(objective: GRPO, logp, old_logp, rewards, mask, *, group_size, ref_logp=None,
                             entropy=None) -> torch.Tensor:
    """Float64: ``reference_grpo_loss`` (pacs_kernels/reference.py, per-response loops) minus the entropy bonus."""
    old = logp.detach() if old_logp is None else old_logp
    loss = reference_grpo_loss(logp.double(), old.double(), rewards, mask, group_size=group_size,
                               clip_eps=objective.clip_eps, clip_eps_high=objective.clip_eps_high,
                               aggregation=objective.aggregation,
                               ref_logp=None if ref_logp is None else ref_logp.double(), kl_coef=objective.kl_coef)
    if entropy is None or objective.entropy_coef == 0:
        return loss
    per_response = [entropy[i].double()[mask[i] != 0] for i in range(logp.shape[0])]
    if objective.aggregation == "token_mean":
        bonus = sum(h.sum() for h in per_response) / sum(h.numel() for h in per_response)
    else:
        bonus = sum(h.mean() for h in per_response) / len(per_response)
    return loss - objective.entropy_coef * bonus
