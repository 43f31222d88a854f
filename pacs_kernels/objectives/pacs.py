"""PACS as an objective: ``pacs_kernels.pacs_loss`` (semantics: docs/pacs-algorithm.md) behind the protocol.

    r[i]   = beta * sum_t m (logp - old_logp)      (score="log_ratio"; or beta * mean_t m logp, "mean_logp")
    psi[i] = r[i] - mean_{j in group, j != i} r[j]  (advantage="rloo"; or "grpo", "naive")
    loss   = (1/B) sum_i w[i] (softplus(psi) - R psi) + kl_coef * token_mean(k3) - entropy_coef * token_mean(H)

Rewards must be 0/1 labels (``pacs_loss`` refuses anything else unless weighting="none", which takes
[0, 1]). No validity mask here: ``fused_linear_pacs_loss`` (``valid=``) or ``pacs_loss`` take one.

Per-token weights w[i,t] >= 0 (``token_weights=``, constants: rollout correction's truncated importance
weights, docs/rollout-correction.md) weigh each token's term of the score. The score is taken at the weighted
log-probs (:func:`weighted_logprobs`)

    logp_w[i,t] = old_logp + w (logp - old_logp)        so   r[i] = beta * sum_t m w (logp - old_logp)  (log_ratio)

Derivation: logp_w is affine in logp with slope w, so d r[i] / d logp[i,t] = beta m w (log_ratio; beta m w / n_i
for mean_logp), and the loss's chain rule gives

    dloss/dlogp[j,t] = w[j,t] * beta * m[j,t] * dloss/dr[j]        (dloss/dr[j] as without weights)

i.e. each token's policy-gradient term (score-function estimator with the group's BCE slope and baseline as its
advantage) multiplied by its weight: for a sequence weight w[j] = rho(o_j) = pi_old(o_j) / q(o_j) this is the
importance-sampled estimator of the on-policy gradient. At logp = old_logp (the first mini-batch after a
rollout) logp_w = old_logp, so every score, the loss's value (ln 2 per group) and its statistics are unchanged;
only the gradient is weighted. On later mini-batches the score sums the weighted log-ratios. With
``score="mean_logp"`` the score is beta * mean_t logp_w (its value at the rollout unchanged too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_choice
from ..loss_inputs import (
    ADVANTAGES,
    LOSS_BACKENDS,
    SCORES,
    WEIGHTINGS,
    ResponseLayout,
    check_beta,
)
from ..reference import reference_pacs_loss
from .pacs_math import check_group_inputs, compute_stats, pacs_group_loss, pacs_loss, pacs_loss_on_layout
from .protocol import Capabilities
from .regularizers import RegularizedObjective, add_regularizers, as_floats, reference_regularizer_terms, token_mean
from .rows import RowsLoss


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

    @property
    def capabilities(self) -> Capabilities:
        """Group-coupled (a response's score enters its group's advantages): chunks of whole groups; a function
        of the log-probs alone without the entropy bonus: the one sweep from the rollout's log-sum-exp."""
        return Capabilities(chunking="groups" if self.is_plain() else "batch", uses_entropy=self.uses_entropy,
                            one_sweep=not self.uses_entropy, token_weights=True, response_validity=True)

    def is_plain(self) -> bool:
        """No KL or entropy term: the engine runs the PACS loss of loss.py on its own layout (PACSTokens)."""
        return self.kl_coef == 0 and self.entropy_coef == 0

    def engine_loss(self, batch, options, *, with_entropy: bool = False):
        """The loss on the engine's selected tokens (see objectives/protocol.py): PACS's own, or, with a KL or
        entropy term, this objective on padded rows like any other (rows.py)."""
        if not self.is_plain():
            return RowsLoss(self, batch, options)
        return PACSTokens(self, batch, options, with_entropy=with_entropy)

    def loss_on_rows(self, logp, old_logp, rewards, mask, *, group_size: int, valid=None):
        """``pacs_loss`` on (B, T) rows (it takes ``valid``) -> ``(loss, PACSStats as a dict)``: the statistics the
        fused PACS entry reports (a piece's gathered rows, pieces.py)."""
        loss, stats = pacs_loss(logp, old_logp, rewards, mask, group_size=group_size, **self.group_settings(),
                                return_stats=True, backend="torch", valid=valid)
        if self.kl_coef > 0 or self.entropy_coef > 0:
            raise ValueError("PACS(kl_coef=, entropy_coef=) needs ref_logp / entropy rows: not on gathered pieces")
        return loss, stats.as_dict()

    def __call__(self, logp, old_logp, rewards, mask, *, group_size, ref_logp=None, entropy=None,
                 token_weights=None):
        batch = self.checked(logp, old_logp, rewards, mask, group_size, ref_logp, entropy, token_weights)
        logp = weighted_logprobs(batch.logp, batch.old_logp, batch.token_weights)
        loss, stats = pacs_loss(logp, batch.old_logp, rewards, batch.mask, group_size=group_size,
                                beta=self.beta, score=self.score, advantage=self.advantage, weighting=self.weighting,
                                score_function_term=self.score_function_term, backend=self.backend,
                                return_stats=True)
        loss, extra = add_regularizers(loss.to(batch.logp.dtype), batch, token_mean, kl_coef=self.kl_coef,
                                       entropy_coef=self.entropy_coef)
        stats = stats.as_dict()
        stats.pop("entropy_mean")  # pacs_loss has no entropy; the regularizers' is the one
        return loss, as_floats({**stats, **extra, "loss": loss.detach()})


class PACSTokens:
    """PACS on the engine's selected tokens (a LossBatch: packed, whole responses in order): each path's share of
    the work (protocol.py's engine losses). Results are ``(loss, PACSStats)``."""

    def __init__(self, objective: PACS, batch, options, *, with_entropy: bool = False) -> None:
        self.capabilities = objective.capabilities
        self.settings = dict(group_size=batch.group_size, **objective.group_settings())
        self.backend = "torch" if options.backend == "naive" else options.backend  # the group loss's kernels
        rewards, valid, beta = check_group_inputs(
            batch.rewards, batch.valid, batch.layout, batch.hidden.device, group_size=batch.group_size,
            beta=objective.beta, advantage=objective.advantage, weighting=objective.weighting,
            score_function_term=objective.score_function_term, group_ids=batch.group_ids)
        self.settings["beta"] = beta
        self.rewards, self.valid, self.batch, self.with_entropy = rewards, valid, batch, with_entropy

    def _old(self, logp, t0: int, t1: int):
        old = self.batch.old_logp
        return logp.detach() if old is None else old[t0:t1].detach()

    def _weighted(self, logp, t0: int, t1: int):
        """logp at the batch's token weights (module docstring); logp itself without weights."""
        weights = self.batch.token_weights
        return logp if weights is None else weighted_logprobs(logp, self._old(logp, t0, t1), weights[t0:t1])

    def chunk_loss(self, logp, chunk):
        """A chunk of whole groups' share: their loss over the whole batch's B."""
        r0, r1, counts = chunk.r0, chunk.r1, self.batch.counts
        full = torch.ones_like(logp, dtype=torch.bool)
        old = self._old(logp, chunk.tok0, chunk.tok1)
        return pacs_group_loss(self._weighted(logp, chunk.tok0, chunk.tok1), old, full, counts[r0:r1],
                               self.rewards[r0:r1], ResponseLayout.from_counts(counts[r0:r1]),
                               valid=None if self.valid is None else self.valid[r0:r1],
                               n_total=self.batch.n_responses, **self.settings)

    def single_pass_result(self, loss, extras, logp, entropy):
        per_response = tuple(torch.cat([extra[k] for extra in extras]) for k in range(4))
        return loss, self._stats(loss, per_response, entropy)

    def two_pass_result(self, logp, entropy):
        full_mask = torch.ones_like(logp, dtype=torch.bool)
        old = self._old(logp, 0, logp.shape[0])
        return pacs_loss_on_layout(self._weighted(logp, 0, logp.shape[0]), old, full_mask, self.rewards,
                                   self.batch.layout, return_stats=True, group_ids=None, backend=self.backend,
                                   counts=self.batch.counts, mask_is_full=True, valid=self.valid,
                                   entropy=None if entropy is None else entropy.detach(), **self.settings)

    def first_step(self, at_old):
        """The loss at logp = old_logp (``at_old``, a leaf) -> (loss, its stats)."""
        full_mask = torch.ones_like(at_old, dtype=torch.bool)
        loss, per_response = pacs_group_loss(self._weighted(at_old, 0, at_old.shape[0]), self.batch.old_logp.detach(),
                                             full_mask, self.batch.counts,
                                             self.rewards, self.batch.layout, valid=self.valid, **self.settings)
        return loss, lambda total: self._stats(total, per_response, None)

    def _stats(self, loss, per_response, entropy):
        return compute_stats(loss, per_response, self.rewards, self.batch.group_size,
                             advantage=self.settings["advantage"], valid=self.valid, entropy=entropy)

    def as_objective_stats(self, loss, stats) -> dict:
        """The stats dict PACS's ``__call__`` returns (fused_linear_objective_loss)."""
        values = stats.as_dict()
        values.pop("entropy_mean", None)
        return {**values, "kl_mean": float("nan"), "entropy_mean": float("nan"), "loss": float(loss.detach())}


def weighted_logprobs(logp: torch.Tensor, old_logp: torch.Tensor, token_weights: torch.Tensor | None) -> torch.Tensor:
    """old_logp + w (logp - old_logp): the log-probs PACS's score is taken at under per-token weights w (constants;
    None: logp). Equal to logp at logp = old_logp; its gradient in logp is w (the module docstring's derivation)."""
    if token_weights is None:
        return logp
    old = old_logp.detach().to(logp.dtype)
    return old + token_weights.detach().to(logp.dtype) * (logp - old)


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
