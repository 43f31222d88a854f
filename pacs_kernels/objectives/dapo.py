"""DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"), the loss part.

    A[i]     = (R[i] - mean_group R) / (std_group(R) + 1e-6)         (GRPO's group-normalized advantage)
    rho[i,t] = exp(logp - old_logp)
    l[i,t]   = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))   ("clip-higher": eps_high > eps_low)
    loss     = sum_{i,t} m l / sum_{i,t} m                            (token-level mean over the whole batch)

Defaults eps_low = 0.2, eps_high = 0.28 (the paper's). The paper drops the KL term; kl_coef (default 0)
adds it back if wanted. Dynamic sampling (dropping groups whose rewards are all equal) and overlong
reward shaping act on the data and the rewards, not on this loss: an all-equal group has A = 0 here.
The math is grpo_loss's with these settings; the reference below re-derives it with loops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .grpo_math import grpo_loss
from .regularizers import ClippedRatioObjective, add_regularizers, as_floats, reference_regularizer_terms, token_mean


@dataclass(frozen=True, kw_only=True)
class DAPO(ClippedRatioObjective):
    """eps_low in [0, 1], eps_high >= 0: the ratio is clipped to [1 - eps_low, 1 + eps_high]."""

    aggregation: ClassVar[str] = "token_mean"  # one mean over the batch's tokens, by definition

    eps_low: float = 0.2
    eps_high: float = 0.28

    def __call__(self, logp, old_logp, rewards, mask, *, group_size, ref_logp=None, entropy=None,
                 token_weights=None):
        batch = self.checked(logp, old_logp, rewards, mask, group_size, ref_logp, entropy, token_weights)
        loss, stats = grpo_loss(batch.logp, batch.old_logp, batch.rewards, batch.mask, group_size=group_size,
                                clip_eps=self.eps_low, clip_eps_high=self.eps_high, aggregation="token_mean",
                                ref_logp=batch.ref_logp, kl_coef=self.kl_coef, return_stats=True,
                                token_weights=batch.token_weights)
        loss, extra = add_regularizers(loss, batch, token_mean, kl_coef=self.kl_coef, entropy_coef=self.entropy_coef,
                                       add_kl=False)
        return loss, as_floats({**stats.as_dict(), **extra, "loss": loss.detach()})


def reference_dapo_loss(objective: DAPO, logp, old_logp, rewards, mask, *, group_size, ref_logp=None,
                        entropy=None) -> torch.Tensor:
    """Float64, per-response loops, from the paper's Eq. (token-level J_DAPO, negated) plus the regularizers."""
    logp = logp.double()
    old = logp.detach() if old_logp is None else old_logp.detach().double()
    rewards = rewards.double()
    total, n_tokens = 0.0, 0
    for i in range(logp.shape[0]):
        group = rewards[(i // group_size) * group_size:(i // group_size + 1) * group_size]
        adv = (rewards[i] - group.mean()) / (group.std() + 1e-6)
        tokens = mask[i] != 0
        lp = logp[i][tokens]
        ratio = torch.exp(lp - old[i][tokens])
        surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - objective.eps_low, 1 + objective.eps_high) * adv)
        term = -surrogate
        term = term + reference_regularizer_terms(objective, lp, ref_logp, entropy, i, tokens)
        total = total + term.sum()
        n_tokens += int(tokens.sum())
    return total / n_tokens
