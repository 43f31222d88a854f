"""CISPO (MiniMax-M1 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention").

Clip the importance-sampling weight, never the token: every token keeps a gradient.

    A[i]     = (R[i] - mean_group R) / (std_group(R) + 1e-6)
    rho[i,t] = exp(logp - old_logp)
    w[i,t]   = sg(clip(rho, 1 - eps_low, 1 + eps_high))          (sg: stop-gradient)
    loss     = - sum_{i,t} m w A logp / sum_{i,t} m  + kl_coef * token_mean(k3) - entropy_coef * token_mean(entropy)

dloss/dlogp[i,t] = -m w A / sum m: REINFORCE weighted by the clipped, constant IS weight. The paper
puts no lower bound on the weight, hence eps_low = 1.0 (1 - eps_low = 0) by default; eps_high = 0.28
(tune it: the paper only tunes the upper bound).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .grpo_math import group_normalized_advantages
from .regularizers import (
    ClippedRatioObjective,
    add_regularizers,
    as_floats,
    masked,
    reference_regularizer_terms,
    token_mean,
    weighted,
)


@dataclass(frozen=True, kw_only=True)
class CISPO(ClippedRatioObjective):
    """eps_low in [0, 1], eps_high >= 0: the IS weight is clipped to [1 - eps_low, 1 + eps_high]."""

    aggregation: ClassVar[str] = "token_mean"  # one mean over the batch's tokens, by definition

    eps_low: float = 1.0
    eps_high: float = 0.28

    def __call__(self, logp, old_logp, rewards, mask, *, group_size, ref_logp=None, entropy=None,
                 token_weights=None):
        batch = self.checked(logp, old_logp, rewards, mask, group_size, ref_logp, entropy, token_weights)
        adv = group_normalized_advantages(batch.rewards, group_size)[:, None]
        ratio = torch.exp(masked(batch.logp.detach() - batch.old_logp, batch.mask))
        weight = torch.clamp(ratio, 1.0 - self.eps_low, 1.0 + self.eps_high)  # built from detached logp: sg()
        loss = token_mean(weighted(-weight * adv * batch.logp, batch), batch)
        loss, extra = add_regularizers(loss, batch, token_mean, kl_coef=self.kl_coef, entropy_coef=self.entropy_coef)
        clipped = masked((weight != ratio).to(ratio.dtype), batch.mask)
        return loss, as_floats({"loss": loss.detach(), "clip_frac": token_mean(clipped, batch),
                                "ratio_mean": token_mean(ratio, batch), "advantage_abs_mean": adv.abs().mean(),
                                **extra})


def reference_cispo_loss(objective: CISPO, logp, old_logp, rewards, mask, *, group_size, ref_logp=None,
                         entropy=None) -> torch.Tensor:
    """Float64, per-response loops, from the paper's J_CISPO (negated) plus the regularizers."""
    logp = logp.double()
    old = logp.detach() if old_logp is None else old_logp.detach().double()
    rewards = rewards.double()
    total, n_tokens = 0.0, 0
    for i in range(logp.shape[0]):
        group = rewards[(i // group_size) * group_size:(i // group_size + 1) * group_size]
        adv = (rewards[i] - group.mean()) / (group.std() + 1e-6)
        tokens = mask[i] != 0
        lp = logp[i][tokens]
        is_weight = torch.exp(lp - old[i][tokens]).clamp(1 - objective.eps_low, 1 + objective.eps_high).detach()
        term = -is_weight * adv * lp
        term = term + reference_regularizer_terms(objective, lp, ref_logp, entropy, i, tokens)
        total = total + term.sum()
        n_tokens += int(tokens.sum())
    return total / n_tokens
