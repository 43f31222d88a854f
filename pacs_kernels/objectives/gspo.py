"""GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): one importance ratio per response.

    A[i]   = (R[i] - mean_group R) / (std_group(R) + 1e-6)
    s[i]   = exp( (1/n_i) sum_t m (logp - old_logp) )           (length-normalized sequence ratio)
    l[i]   = max(-A s, -A clip(s, 1 - eps_low, 1 + eps_high))  (the whole response clipped at once)
    loss   = (1/B) sum_i l[i] + kl_coef * seq_mean(k3) - entropy_coef * seq_mean(entropy)

d l[i] / d logp[i,t] = -A s[i] m[i,t] / n_i where the unclipped branch is active, else 0: every token of
a response shares one coefficient. Defaults eps_low = 3e-4, eps_high = 4e-4 (the paper's; a sequence
ratio moves far less than a token ratio). Every response needs at least one masked token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .grpo_math import group_normalized_advantages
from .regularizers import (
    ClippedRatioObjective,
    add_regularizers,
    as_floats,
    masked,
    reference_regularizer_terms,
    sequence_mean,
)


@dataclass(frozen=True, kw_only=True)
class GSPO(ClippedRatioObjective):
    """eps_low in [0, 1], eps_high >= 0: the sequence ratio is clipped to [1 - eps_low, 1 + eps_high]."""

    eps_low: float = 3e-4
    eps_high: float = 4e-4

    def __call__(self, logp, old_logp, rewards, mask, *, group_size, ref_logp=None, entropy=None,
                 token_weights=None):
        batch = self.checked(logp, old_logp, rewards, mask, group_size, ref_logp, entropy, token_weights)
        adv = group_normalized_advantages(batch.rewards, group_size)
        lengths = batch.counts.clamp(min=1).to(batch.logp.dtype)
        mean_log_ratio = masked(batch.logp - batch.old_logp, batch.mask).sum(-1) / lengths
        ratio = torch.exp(mean_log_ratio)
        unclipped = -adv * ratio
        clipped = -adv * torch.clamp(ratio, 1.0 - self.eps_low, 1.0 + self.eps_high)
        nonempty = (batch.counts > 0).to(batch.logp.dtype)  # an empty-mask response is a zero-loss response
        per_response = torch.maximum(unclipped, clipped) * nonempty
        if batch.token_weights is not None:  # l[i] spread over its tokens, each weighted: l[i] * mean_t m w
            per_response = per_response * batch.token_weights.sum(-1) / lengths
        loss = per_response.mean()
        loss, extra = add_regularizers(loss, batch, sequence_mean, kl_coef=self.kl_coef,
                                       entropy_coef=self.entropy_coef)
        return loss, as_floats({"loss": loss.detach(), "clip_frac": (clipped > unclipped).double().mean(),
                                "ratio_mean": ratio.detach().mean(), "advantage_abs_mean": adv.abs().mean(),
                                **extra})


def reference_gspo_loss(objective: GSPO, logp, old_logp, rewards, mask, *, group_size, ref_logp=None,
                        entropy=None) -> torch.Tensor:
    """Float64, per-response loops, from the paper's J_GSPO (negated) plus the regularizers."""
    logp = logp.double()
    old = logp.detach() if old_logp is None else old_logp.detach().double()
    rewards = rewards.double()
    terms = []
    for i in range(logp.shape[0]):
        group = rewards[(i // group_size) * group_size:(i // group_size + 1) * group_size]
        adv = (rewards[i] - group.mean()) / (group.std() + 1e-6)
        tokens = mask[i] != 0
        lp = logp[i][tokens]
        if not bool(tokens.any()):  # an empty-mask response: zero loss, still one of the B
            terms.append(logp.new_zeros(()))
            continue
        s = torch.exp((lp - old[i][tokens]).mean())
        term = -torch.minimum(s * adv, torch.clamp(s, 1 - objective.eps_low, 1 + objective.eps_high) * adv)
        term = term + reference_regularizer_terms(objective, lp, ref_logp, entropy, i, tokens).mean()
        terms.append(term)
    return torch.stack(terms).mean()
