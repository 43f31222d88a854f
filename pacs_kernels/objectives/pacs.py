"""PACS as an objective: ``pacs_kernels.pacs_loss`` (semantics: docs/pacs-algorithm.md) behind the protocol.

    r[i]   = beta * sum_t m (logp - old_logp)      (score="log_ratio"; or beta * mean_t m logp, "mean_logp")
    psi[i] = r[i] - mean_{j in group, j != i} r[j]  (advantage="rloo"; or "grpo", "naive")
    loss   = (1/B) sum_i w[i] (softplus(psi) - R psi) + kl_coef * token_mean(k3) - entropy_coef * token_mean(H)

Rewards must be 0/1 labels (``pacs_loss`` refuses anything else unless weighting="none", which takes
[0, 1]). No validity mask here: ``fused_linear_pacs_loss`` (``valid=``) or ``pacs_loss`` take one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_choice
from ..loss import pacs_loss
from ..loss_inputs import ADVANTAGES, LOSS_BACKENDS, SCORES, WEIGHTINGS, check_beta
from ..reference import reference_pacs_loss
from .regularizers import RegularizedObjective, add_regularizers, as_floats, reference_regularizer_terms, token_mean


@dataclass(frozen=True, kw_only=True)
class PACS(RegularizedObjective):
    """beta, score, advantage, weighting, score_function_term, backend: as in :func:`pacs_kernels.pacs_loss`."""

    beta: float = 1.0
    score: str = "log_ratio"
    advantage: str = "rloo"
    weighting: str = "balanced"
    score_function_term: bool = False
    backend: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_beta(self.beta)
        check_choice("score", self.score, SCORES)
        check_choice("advantage", self.advantage, ADVANTAGES)
        check_choice("weighting", self.weighting, WEIGHTINGS)
        check_choice("backend", self.backend, LOSS_BACKENDS)
        if not isinstance(self.score_function_term, bool):
            raise TypeError(f"score_function_term must be a bool, got {self.score_function_term!r}")

    def group_settings(self) -> dict:
        """The group loss's settings as loss.py takes them (the engine's PACS route)."""
        return dict(beta=self.beta, score=self.score, advantage=self.advantage, weighting=self.weighting,
                    score_function_term=self.score_function_term)

    def __call__(self, logp, old_logp, rewards, mask, *, group_size, ref_logp=None, entropy=None):
        batch = self.checked(logp, old_logp, rewards, mask, group_size, ref_logp, entropy)
        loss, stats = pacs_loss(batch.logp, batch.old_logp, rewards, batch.mask, group_size=group_size,
                                beta=self.beta, score=self.score, advantage=self.advantage, weighting=self.weighting,
                                score_function_term=self.score_function_term, backend=self.backend,
                                return_stats=True)
        loss, extra = add_regularizers(loss.to(batch.logp.dtype), batch, token_mean, kl_coef=self.kl_coef,
                                       entropy_coef=self.entropy_coef)
        stats = stats.as_dict()
        stats.pop("entropy_mean")  # pacs_loss has no entropy; the regularizers' is the one
        return loss, as_floats({**stats, **extra, "loss": loss.detach()})


def reference_pacs_objective(objective: PACS, logp, old_logp, rewards, mask, *, group_size, ref_logp=None,
                             entropy=None) -> torch.Tensor:
    """Float64: ``reference_pacs_loss`` (pacs_kernels/reference.py, per-group loops) plus the regularizers."""
    logp = logp.double()
    old = logp.detach() if old_logp is None else old_logp.double()
    loss, _ = reference_pacs_loss(logp, old, rewards, mask, group_size=group_size, beta=objective.beta,
                                  score=objective.score, advantage=objective.advantage, weighting=objective.weighting)
    extra, n_tokens = 0.0, 0
    for i in range(logp.shape[0]):
        tokens = mask[i] != 0
        extra = extra + reference_regularizer_terms(objective, logp[i][tokens], ref_logp, entropy, i, tokens).sum()
        n_tokens += int(tokens.sum())
    return loss + extra / n_tokens
