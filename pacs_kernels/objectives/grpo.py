"""GRPO (Shao et al. 2024, DeepSeekMath) as an objective: ``pacs_kernels.grpo_loss`` unchanged, plus
the entropy bonus.

    A[i]     = (R[i] - mean_group R) / (std_group(R, unbiased) + 1e-6)
    rho[i,t] = exp(logp - old_logp)
    l[i,t]   = max(-A rho, -A clip(rho, 1 - clip_eps, 1 + clip_eps_high)) + kl_coef * k3[i,t]
    loss     = aggregate(l) - entropy_coef * aggregate(entropy)
               aggregate: "token_mean" (grpo_loss's default) or "seq_mean" (the paper's 1/G sum_i 1/|o_i| sum_t)

The surrogate's math lives in grpo_math.py (``grpo_loss``); this file adapts it to the protocol and the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_choice, check_no_inf_where
from ..loss_inputs import check_response_rewards
from ..reference import reference_grpo_loss
from .batch import check_nonnegative
from .grpo_math import (
    AGGREGATIONS,
    GRPOStats,
    check_grpo_options,
    group_normalized_advantages,
    grpo_loss,
    grpo_token_terms,
)
from .protocol import Capabilities
from .regularizers import RegularizedObjective, add_regularizers, as_floats, sequence_mean, token_mean
from .rows import RowsLoss


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

    @property
    def capabilities(self) -> Capabilities:
        """Token-separable once the advantages and the normaliser are fixed: any run of tokens is a chunk."""
        return Capabilities(chunking="tokens" if self.entropy_coef == 0 else "batch", uses_entropy=self.uses_entropy,
                            one_sweep=not self.uses_entropy, token_weights=True)

    def engine_loss(self, batch, options, *, with_entropy: bool = False):
        """The loss on the engine's selected tokens (objectives/protocol.py): GRPO's own token terms, or, with an
        entropy bonus, this objective on padded rows like any other (rows.py)."""
        return GRPOTokens(self, batch) if self.entropy_coef == 0 else RowsLoss(self, batch, options)

    def loss_on_rows(self, logp, old_logp, rewards, mask, *, group_size: int, valid=None):
        """``grpo_loss`` on (B, T) rows -> ``(loss, GRPOStats as a dict)`` (a piece's gathered rows, pieces.py);
        with an entropy bonus, ``__call__``."""
        if valid is not None:
            raise ValueError("valid= is a PACS input; GRPO takes no validity mask")
        if self.entropy_coef > 0:
            return self(logp, old_logp, rewards, mask, group_size=group_size)
        loss, stats = grpo_loss(logp, old_logp, rewards, mask, group_size=group_size, clip_eps=self.clip_eps,
                                clip_eps_high=self.clip_eps_high, aggregation=self.aggregation,
                                kl_coef=self.kl_coef, return_stats=True)
        return loss, stats.as_dict()

    def __call__(self, logp, old_logp, rewards, mask, *, group_size, ref_logp=None, entropy=None,
                 token_weights=None):
        batch = self.checked(logp, old_logp, rewards, mask, group_size, ref_logp, entropy, token_weights)
        loss, stats = grpo_loss(batch.logp, batch.old_logp, batch.rewards, batch.mask, group_size=group_size,
                                clip_eps=self.clip_eps, clip_eps_high=self.clip_eps_high,
                                aggregation=self.aggregation, ref_logp=batch.ref_logp, kl_coef=self.kl_coef,
                                return_stats=True, token_weights=batch.token_weights)
        aggregate = token_mean if self.aggregation == "token_mean" else sequence_mean
        loss, extra = add_regularizers(loss, batch, aggregate, kl_coef=self.kl_coef,
                                       entropy_coef=self.entropy_coef, add_kl=False)
        return loss, as_floats({**stats.as_dict(), **extra, "loss": loss.detach()})


class GRPOTokens:
    """GRPO's clipped surrogate (grpo.py) on the engine's selected tokens: per token, its response's advantage and
    its share of the normaliser, known up front; each chunk of tokens adds its terms. Results ``(loss, GRPOStats)``.
    An empty-mask response adds nothing (TRL's and Liger's convention) and still counts in seq_mean's 1/B."""

    with_entropy = False

    def __init__(self, objective: GRPO, batch) -> None:
        self.capabilities = objective.capabilities
        n, counts, aggregation = len(batch.shape.counts), batch.counts, objective.aggregation
        like = batch.ref_logp if batch.ref_logp is not None else batch.targets  # the per-token shape, selected
        self.low, self.high, self.kl_coef = check_grpo_options(batch.group_size, n, objective.clip_eps,
                                                               objective.clip_eps_high, objective.kl_coef,
                                                               batch.ref_logp, like)
        check_response_rewards(batch.rewards, n, batch.hidden.device)
        if int(counts.sum()) == 0:
            raise ValueError("mask must select at least one response token")
        cdt = torch.float64 if batch.weight.dtype == torch.float64 else torch.float32
        values = batch.rewards.detach().to(cdt)
        if not bool(torch.isfinite(values).all()):
            raise ValueError("rewards must be finite (no NaN or inf)")
        segment = batch.layout.segment_ids()
        self.adv = group_normalized_advantages(values, batch.group_size)
        self.token_adv = self.adv[segment]
        if aggregation == "token_mean":
            self.token_coef = torch.full_like(self.token_adv, 1.0 / int(counts.sum()))
        else:  # an empty response has no token: it adds 0, and B still counts it
            self.token_coef = (1.0 / (counts.clamp(min=1).to(cdt) * n))[segment]
        if batch.ref_logp is not None:
            check_no_inf_where("ref_logp", batch.ref_logp, torch.ones_like(batch.ref_logp, dtype=torch.bool))
        self.batch, self.cdt, self.terms = batch, cdt, []

    def _share(self, logp, t0: int, t1: int):
        batch, cdt = self.batch, self.cdt
        old = logp.detach() if batch.old_logp is None else batch.old_logp[t0:t1].detach().to(cdt)
        ref = None if batch.ref_logp is None else batch.ref_logp[t0:t1].detach().to(cdt)
        weights = None if batch.token_weights is None else batch.token_weights[t0:t1].to(cdt)
        terms = grpo_token_terms(logp.to(cdt), old, self.token_adv[t0:t1], ref, None, low=self.low, high=self.high,
                                 kl_coef=self.kl_coef, token_weights=weights)
        return (terms.per_token * self.token_coef[t0:t1]).sum(), terms

    def chunk_loss(self, logp, chunk):
        return self._share(logp, chunk.tok0, chunk.tok1)

    def single_pass_result(self, loss, extras, logp, entropy):
        return loss, self._stats(loss, extras)

    def two_pass_result(self, logp, entropy):
        loss, terms = self._share(logp, 0, logp.shape[0])
        return loss, self._stats(loss, [terms])

    def first_step(self, at_old):
        loss, terms = self._share(at_old, 0, at_old.shape[0])
        return loss, lambda total: self._stats(total, [terms])

    def _stats(self, loss, all_terms) -> GRPOStats:
        clipped, ratio_sum, kl_sum = torch.tensor([t.stat_sums() for t in all_terms],
                                                  dtype=torch.float64).sum(0).tolist()
        n_tokens = max(int(self.batch.counts.sum()), 1)
        return GRPOStats(loss=float(loss.detach()), clip_frac=clipped / n_tokens, ratio_mean=ratio_sum / n_tokens,
                         advantage_abs_mean=float(self.adv.abs().mean()), kl_mean=kl_sum / n_tokens)

    def as_objective_stats(self, loss, stats) -> dict:
        """The stats dict GRPO's ``__call__`` returns (fused_linear_objective_loss)."""
        kl = stats.kl_mean if self.batch.ref_logp is not None else float("nan")
        return {**stats.as_dict(), "kl_mean": kl, "entropy_mean": float("nan"), "loss": float(loss.detach())}


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
        bonus = sum(h.mean() if h.numel() else h.new_zeros(()) for h in per_response) / len(per_response)
    return loss - objective.entropy_coef * bonus
