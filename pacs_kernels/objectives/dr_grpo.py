"""Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective").

GRPO without its two biases: no division by the group's reward std, and no division by each
response's own length (which favours long wrong answers), replaced by one constant L:

    A[i]     = R[i] - mean_group R
    rho[i,t] = exp(logp - old_logp)
    l[i,t]   = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high)) + kl_coef * k3[i,t]
    loss     = sum_{i,t} m l / (B * L)          L = max_completion_length (a constant of the run)

dloss/dlogp[i,t] = m * (-A rho [unclipped branch active] + kl_coef (1 - exp(ref - logp))) / (B L)
(the clipped branch is flat in logp). The per-token surrogate is grpo.py's ``grpo_token_terms``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .grpo_math import group_centred_rewards, grpo_token_terms
from .regularizers import (
    ClippedRatioObjective,
    add_regularizers,
    as_floats,
    constant_length_mean,
    reference_regularizer_terms,
)


def group_centred_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) R - group mean R (no std division); 0 in a group of equal rewards."""
    return group_centred_rewards(rewards, group_size).reshape(-1)


@dataclass(frozen=True, kw_only=True)
class DrGRPO(ClippedRatioObjective):
    """max_completion_length: L, the constant the token sum is divided by (with B), e.g. the rollout's
    max_new_tokens; eps_low in [0, 1], eps_high >= 0 (default: both 0.2, PPO's clip)."""

    max_completion_length: int
    eps_low: float = 0.2
    eps_high: float = 0.2

    def __post_init__(self) -> None:
        super().__post_init__()
        length = self.max_completion_length
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"max_completion_length must be an int >= 1 (the rollout's maximum response length), "
                             f"got {length!r}")

    def __call__(self, logp, old_logp, rewards, mask, *, group_size, ref_logp=None, entropy=None,
                 token_weights=None):
        batch = self.checked(logp, old_logp, rewards, mask, group_size, ref_logp, entropy, token_weights)
        longest = int(batch.counts.max())
        if longest > self.max_completion_length:
            raise ValueError(f"max_completion_length = {self.max_completion_length} is shorter than a response "
                             f"of the batch ({longest} masked tokens)")
        adv = group_centred_advantages(batch.rewards, group_size)
        terms = grpo_token_terms(batch.logp, batch.old_logp, adv[:, None], batch.ref_logp, batch.mask,
                                 low=self.eps_low, high=self.eps_high, kl_coef=self.kl_coef,
                                 token_weights=batch.token_weights)

        def aggregate(values, batch_):
            return constant_length_mean(values, batch_, self.max_completion_length)

        loss = aggregate(terms.per_token, batch)
        loss, extra = add_regularizers(loss, batch, aggregate, kl_coef=self.kl_coef, entropy_coef=self.entropy_coef,
                                       add_kl=False)
        n_tokens = batch.counts.sum()
        return loss, as_floats({"loss": loss.detach(), "clip_frac": terms.clip_active.sum().double() / n_tokens,
                                "ratio_mean": terms.ratio.sum() / n_tokens,
                                "advantage_abs_mean": adv.abs().mean(), **extra})


def reference_dr_grpo_loss(objective: DrGRPO, logp, old_logp, rewards, mask, *, group_size, ref_logp=None,
                           entropy=None) -> torch.Tensor:
    """Float64, per-response loops, from the paper's Dr. GRPO objective (negated) plus the regularizers."""
    logp = logp.double()
    old = logp.detach() if old_logp is None else old_logp.detach().double()
    rewards = rewards.double()
    total = 0.0
    for i in range(logp.shape[0]):
        group = rewards[(i // group_size) * group_size:(i // group_size + 1) * group_size]
        adv = rewards[i] - group.mean()
        tokens = mask[i] != 0
        lp = logp[i][tokens]
        ratio = torch.exp(lp - old[i][tokens])
        term = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - objective.eps_low, 1 + objective.eps_high) * adv)
        term = term + reference_regularizer_terms(objective, lp, ref_logp, entropy, i, tokens)
        total = total + term.sum()
    return total / (logp.shape[0] * objective.max_completion_length)
