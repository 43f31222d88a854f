"""Token aggregations and the two optional regularizers every built-in objective can add.

Aggregations of a per-token quantity x over the masked tokens (m the mask, n_i = sum_t m[i,t]):

    token_mean:        sum_{i,t} m x / sum_{i,t} m          (every token of the batch weighs the same)
    sequence_mean:     (1/B) sum_i (sum_t m x / n_i)        (every response weighs the same; n_i = 0: adds 0)
    constant_length:   sum_{i,t} m x / (B * L)              (Dr. GRPO: L a fixed length, not n_i)

Regularizers, added with the objective's own aggregation:

    k3 KL to a reference (Schulman's estimator, >= 0, unbiased for KL(pi || ref)):
        kl[i,t] = exp(ref - logp) - (ref - logp) - 1;   d kl / d logp = 1 - exp(ref - logp)
    entropy bonus: loss -= entropy_coef * aggregate(entropy)   (higher entropy lowers the loss)

The log-ratio is zeroed outside the mask BEFORE exp, so garbage there never becomes NaN. A response whose mask is
all False (a truncated completion masked out, TRL's ``mask_truncated_completions``) is a zero-loss response in
every aggregation: it adds nothing and still counts in the 1/B of the per-response means (as TRL and Liger).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .batch import GroupBatch, check_group_batch, check_nonnegative, check_unit_interval
from .protocol import Capabilities


def weighted(values: torch.Tensor, batch: GroupBatch) -> torch.Tensor:
    """values (B, T) times the batch's token weights (values itself without weights)."""
    return values if batch.token_weights is None else values * batch.token_weights


def masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def token_mean(values: torch.Tensor, batch: GroupBatch) -> torch.Tensor:
    return masked(values, batch.mask).sum() / batch.counts.sum().to(values.dtype)


def sequence_mean(values: torch.Tensor, batch: GroupBatch) -> torch.Tensor:
    return (masked(values, batch.mask).sum(-1) / batch.counts.clamp(min=1).to(values.dtype)).mean()


def constant_length_mean(values: torch.Tensor, batch: GroupBatch, length: int) -> torch.Tensor:
    return masked(values, batch.mask).sum() / (batch.n_responses * length)


def k3_kl(batch: GroupBatch) -> torch.Tensor:
    """(B, T) k3 KL estimator per token, 0 outside the mask; differentiable in logp."""
    delta = masked(batch.ref_logp - batch.logp, batch.mask)
    return torch.exp(delta) - delta - 1.0


def add_regularizers(loss: torch.Tensor, batch: GroupBatch, aggregate, *, kl_coef: float, entropy_coef: float,
                     add_kl: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """loss + kl_coef * aggregate(k3) - entropy_coef * aggregate(entropy); also the token means of both
    (detached; NaN when absent). ``add_kl=False``: the objective already holds the KL term."""
    nan = torch.full((), float("nan"), dtype=batch.logp.dtype, device=batch.logp.device)
    stats = {"kl_mean": nan, "entropy_mean": nan}
    if batch.ref_logp is not None:
        kl = k3_kl(batch)
        if add_kl and kl_coef > 0:
            loss = loss + kl_coef * aggregate(kl, batch)
        stats["kl_mean"] = token_mean(kl.detach(), batch)
    if batch.entropy is not None:
        if entropy_coef > 0:
            loss = loss - entropy_coef * aggregate(batch.entropy, batch)
        stats["entropy_mean"] = token_mean(batch.entropy.detach(), batch)
    return loss, stats


def as_floats(stats: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """Tensor statistics -> plain floats in one device sync."""
    keys = [k for k, v in stats.items() if isinstance(v, torch.Tensor)]
    values = torch.stack([stats[k].detach().double().reshape(()) for k in keys]).tolist() if keys else []
    return {**{k: float(v) for k, v in stats.items() if not isinstance(v, torch.Tensor)}, **dict(zip(keys, values))}


@dataclass(frozen=True, kw_only=True)
class RegularizedObjective:
    """The coefficients every built-in objective takes: kl_coef (k3 KL to ``ref_logp``, >= 0; > 0 needs
    ref_logp) and entropy_coef (entropy bonus, >= 0; > 0 makes the fused entry compute the entropy)."""

    kl_coef: float = 0.0
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        check_nonnegative("kl_coef", self.kl_coef)
        check_nonnegative("entropy_coef", self.entropy_coef)

    @property
    def uses_entropy(self) -> bool:
        return self.entropy_coef > 0

    @property
    def capabilities(self) -> Capabilities:
        """On padded rows (objectives/rows.py): chunks checked to add up; takes ``token_weights=``."""
        return Capabilities(chunking="batch", uses_entropy=self.uses_entropy, one_sweep=not self.uses_entropy,
                            token_weights=True)

    def checked(self, logp, old_logp, rewards, mask, group_size, ref_logp, entropy,
                token_weights=None) -> GroupBatch:
        return check_group_batch(logp, old_logp, rewards, mask, group_size=group_size, ref_logp=ref_logp,
                                 entropy=entropy, kl_coef=self.kl_coef, entropy_coef=self.entropy_coef,
                                 advantage=getattr(self, "advantage", "grpo"), token_weights=token_weights)


@dataclass(frozen=True, kw_only=True)
class ClippedRatioObjective(RegularizedObjective):
    """The regularizers plus a clip range: eps_low in [0, 1], eps_high >= 0 clip a ratio to
    [1 - eps_low, 1 + eps_high] (each objective sets its own defaults)."""

    eps_low: float = 0.2
    eps_high: float = 0.2

    def __post_init__(self) -> None:
        super().__post_init__()
        check_unit_interval("eps_low", self.eps_low)
        check_nonnegative("eps_high", self.eps_high)


def reference_regularizer_terms(objective: RegularizedObjective, lp: torch.Tensor, ref_logp, entropy, row: int,
                                tokens: torch.Tensor) -> torch.Tensor:
    """Float64, for the references: response ``row``'s per-token regularizer terms on its masked ``tokens``
    (``lp``: their log-probs), kl_coef * k3(ref - lp) - entropy_coef * entropy; 0 where the input is absent."""
    terms = torch.zeros_like(lp)
    if ref_logp is not None:
        delta = ref_logp[row][tokens].double() - lp
        terms = terms + objective.kl_coef * (torch.exp(delta) - delta - 1)
    if entropy is not None:
        terms = terms - objective.entropy_coef * entropy[row][tokens].double()
    return terms
