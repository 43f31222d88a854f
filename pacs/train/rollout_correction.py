"""The sampler is not the trainer: measure how far the rollout engine's log-probs are from the trainer's, and
drop (mask) what lies too far or weigh each token by its truncated ratio, for any objective
(``advanced.rollout_correction``; docs/rollout-correction.md).

The rollout engine (vLLM, HF generate) returns each sampled token's log-prob as it computed it,
``sampler_logp`` (``q``); the trainer's old-policy pass computes the same tokens' log-probs, ``old_logp``
(``p``, :func:`pacs.train.old_policy.old_policy_logprobs`). In exact arithmetic they agree (same weights, same
temperature); in 16-bit, with other kernels, they do not, and the rollouts are then slightly off-policy.
Per response token ``t`` of response ``i`` (``m[i,t]`` its mask):

    delta[i,t] = p - q = old_logp[i,t] - sampler_logp[i,t]      the log of the ratio rho = pi_trainer / pi_sampler
    token ratio:    rho[i,t] = exp(delta[i,t])
    sequence ratio: rho[i]   = exp(sum_t m delta)   ("product": TRL's sequence_* modes)
                             = exp(sum_t m delta / sum_t m)   ("geometric": its per-token geometric mean)

Measured every step (the metrics row's ``mismatch_*`` columns, ratios of sums over every response token of
the step on every rank):

    mismatch_kl              k3 = mean_t (rho - 1 - delta), the estimator of KL(pi_sampler || pi_trainer) that
                             is unbiased for tokens drawn from the sampler and never negative (Schulman's k3)
    mismatch_logp_diff_mean  mean_t |delta|;  mismatch_logp_diff_max: max_t |delta|
    mismatch_token_out_frac  share of tokens whose rho[i,t] lies outside [c_min, c_max]
    mismatch_response_out_frac  share of responses whose sequence ratio lies outside [c_min, c_max]
    mismatch_masked_token_frac, mismatch_masked_response_frac  what the correction dropped (0 under "none")

Correction by masking (the modes, ``advanced.rollout_correction.mode``):

- ``token_mask``: tokens outside the band leave the token mask: no objective sees them. A response left
  with no token is masked as a whole (as below).
- ``sequence_mask``: responses outside the band are dropped: PACS through the loss's ``valid`` (weight 0, out
  of the class counts; its score stays in the group's baseline, as ``valid`` defines); any other objective
  through the token mask (the response adds nothing; its reward stays in the group's advantage baseline,
  as in TRL, where the masked response's weight is 0 after the advantages are computed).

Correction by truncated importance weights (TRL's ``*_truncate``, verl's TIS): each token's policy term is
multiplied by a constant weight, an input of the loss engine (``token_weights=`` of the fused entries):

- ``token_truncate``:    w[i,t] = clamp(rho[i,t], c_min, c_max)
- ``sequence_truncate``: w[i,t] = clamp(rho[i], c_min, c_max) for every token of response i

(TRL: ``torch.clamp(ratio, min=clip_min, max=clip_max)``; the ratio formed as above, the sequence ratio by
``sequence_ratio``). What a weight means for each objective: pacs_kernels/objectives/pacs.py (PACS's score) and
grpo_math.py (the GRPO family's per-token term).

TRL's ``vllm_importance_sampling_*`` (``PACSTrainer``) weigh the kept samples of its mask modes by their ratio
too (masked importance sampling): :func:`importance_weights` gives TRL's ratio tensor for its four modes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from pacs.train.batch import Batch

MASK_MODES = ("token_mask", "sequence_mask")
TRUNCATE_MODES = ("token_truncate", "sequence_truncate")
MODES = ("none", *MASK_MODES, *TRUNCATE_MODES)
COLUMNS = ("mismatch_kl", "mismatch_logp_diff_mean", "mismatch_logp_diff_max", "mismatch_token_out_frac",
           "mismatch_response_out_frac", "mismatch_masked_token_frac", "mismatch_masked_response_frac")


@dataclass
class Band:
    """The ratio band [c_min, c_max] and how a response's ratio is formed ("product" | "geometric")."""

    c_min: float = 0.0
    c_max: float = 3.0
    sequence_ratio: str = "product"

    @classmethod
    def of(cls, cfg) -> "Band":
        c = cfg.rollout_correction
        return cls(c.c_min, c.c_max, c.sequence_ratio)

    def log_bounds(self) -> tuple[float, float]:
        """[log c_min, log c_max] (-inf for c_min = 0)."""
        return (math.log(self.c_min) if self.c_min > 0 else -math.inf,
                math.log(self.c_max) if math.isfinite(self.c_max) else math.inf)

    def outside(self, log_ratio: torch.Tensor) -> torch.Tensor:
        """Where exp(log_ratio) lies outside [c_min, c_max] (compared in log space: no overflow)."""
        low, high = self.log_bounds()
        return (log_ratio < low) | (log_ratio > high)


def token_log_ratio(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, L) float64: log(pi_trainer / pi_sampler) of each response token, 0 off ``mask``."""
    return torch.where(mask, old_logp.double() - sampler_logp.double(), torch.zeros((), dtype=torch.float64,
                                                                                      device=old_logp.device))


def sequence_log_ratio(delta: torch.Tensor, mask: torch.Tensor, sequence_ratio: str) -> torch.Tensor:
    """(B,) float64: the log of each response's ratio: the sum of its tokens' log-ratios ("product") or their mean
    ("geometric"; an empty response: 0)."""
    total = delta.sum(1)
    if sequence_ratio == "product":
        return total
    if sequence_ratio == "geometric":
        return total / mask.sum(1).clamp(min=1).to(total.dtype)
    raise ValueError(f"sequence_ratio must be 'product' or 'geometric', got {sequence_ratio!r}")


def mode_log_ratio(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, mode: str,
                   band: Band) -> torch.Tensor:
    """(B, L) float64 log-ratio at ``mode``'s level: each token's (token_*), or its response's broadcast over the
    tokens (sequence_*); 0 off ``mask`` for token_*."""
    delta = token_log_ratio(old_logp, sampler_logp, mask)
    if mode.startswith("sequence_"):
        return sequence_log_ratio(delta, mask, band.sequence_ratio)[:, None].expand_as(delta)
    return delta


@dataclass
class MismatchSums:
    """The step's mismatch as sums (so that ranks add up): see the module docstring for each column."""

    k3: float = 0.0
    abs_diff: float = 0.0
    abs_diff_max: float = 0.0
    tokens: float = 0.0
    tokens_out: float = 0.0
    responses: float = 0.0
    responses_out: float = 0.0
    masked_tokens: float = 0.0
    masked_responses: float = 0.0

    def columns(self) -> dict[str, float]:
        t, r = max(self.tokens, 1.0), max(self.responses, 1.0)
        return {"mismatch_kl": self.k3 / t, "mismatch_logp_diff_mean": self.abs_diff / t,
                "mismatch_logp_diff_max": self.abs_diff_max, "mismatch_token_out_frac": self.tokens_out / t,
                "mismatch_response_out_frac": self.responses_out / r,
                "mismatch_masked_token_frac": self.masked_tokens / t,
                "mismatch_masked_response_frac": self.masked_responses / r}

    def all_ranks(self, device, world_size: int) -> "MismatchSums":
        """The sums over every rank (the max: the largest); this rank's where there is one process."""
        if world_size <= 1:
            return self
        import torch.distributed as dist

        names = [n for n in self.__dataclass_fields__ if n != "abs_diff_max"]
        sums = torch.tensor([getattr(self, n) for n in names], dtype=torch.float64, device=device)
        largest = torch.tensor([self.abs_diff_max], dtype=torch.float64, device=device)
        dist.all_reduce(sums)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        return MismatchSums(**dict(zip(names, sums.tolist())), abs_diff_max=float(largest))


def measure(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, band: Band) -> MismatchSums:
    """The mismatch of ``sampler_logp`` against ``old_logp`` over the response tokens ``mask`` ((B, L) each)."""
    delta = token_log_ratio(old_logp, sampler_logp, mask)
    selected = delta[mask]
    # k3 = rho - 1 - log rho >= 0, an unbiased estimate of KL(sampler || trainer) for tokens drawn by the sampler
    k3 = torch.expm1(selected) - selected
    responses = mask.any(1)
    sequence_out = band.outside(sequence_log_ratio(delta, mask, band.sequence_ratio)) & responses
    return MismatchSums(
        k3=float(k3.sum()), abs_diff=float(selected.abs().sum()),
        abs_diff_max=float(selected.abs().max()) if selected.numel() else 0.0,
        tokens=float(selected.numel()), tokens_out=float(band.outside(selected).sum()),
        responses=float(responses.sum()), responses_out=float(sequence_out.sum()))


def truncated_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, mode: str,
                      band: Band) -> torch.Tensor:
    """(B, L) float64 weights of ``mode`` (token_truncate / sequence_truncate): the token's or its response's
    ratio clamped to [c_min, c_max], 0 off ``mask``. Clamped in log space first (a long response's product never
    overflows), then exponentiated."""
    if mode not in ("token_truncate", "sequence_truncate"):
        raise ValueError(f"truncated weights need mode token_truncate or sequence_truncate, got {mode!r}")
    low, high = band.log_bounds()
    weights = torch.exp(mode_log_ratio(old_logp, sampler_logp, mask, mode, band).clamp(min=low, max=high))
    return torch.where(mask, weights, torch.zeros((), dtype=weights.dtype, device=weights.device))


TRL_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def importance_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, mode: str,
                       band: Band) -> torch.Tensor:
    """(B, L) float64: TRL's ``vllm_importance_sampling_ratio`` for ``vllm_importance_sampling_mode`` ``mode``,
    broadcast over the tokens, 0 off ``mask``: the ratio (token, or the response's product) clamped to
    [c_min, c_max] (``*_truncate``), or kept where it lies inside the band and 0 outside (``*_mask``)."""
    if mode in TRUNCATE_MODES:
        return truncated_weights(old_logp, sampler_logp, mask, mode, band)
    if mode not in MASK_MODES:
        raise ValueError(f"vllm_importance_sampling_mode must be one of {', '.join(TRL_MODES)}, got {mode!r}")
    delta = mode_log_ratio(old_logp, sampler_logp, mask, mode, band)
    inside = ~band.outside(delta) & mask
    weights = torch.exp(torch.where(inside, delta, torch.zeros((), dtype=delta.dtype, device=delta.device)))
    return torch.where(inside, weights, torch.zeros((), dtype=weights.dtype, device=weights.device))


def keep_masks(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, mode: str,
               band: Band) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens kept (B, L) bool, responses kept (B,) bool) under ``mode``. token_mask: the tokens inside the band
    (a response with none left: not kept); sequence_mask: the responses whose ratio is inside it."""
    keep_tokens, keep_responses = mask.clone(), torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device)
    if mode == "none" or mode in TRUNCATE_MODES:
        return keep_tokens, keep_responses
    delta = token_log_ratio(old_logp, sampler_logp, mask)
    if mode == "token_mask":
        keep_tokens &= ~band.outside(delta)
        keep_responses = keep_tokens.any(1) | ~mask.any(1)
    elif mode == "sequence_mask":
        keep_responses = ~band.outside(sequence_log_ratio(delta, mask, band.sequence_ratio))
    else:
        raise ValueError(f"rollout_correction.mode must be one of {', '.join(MODES)}; got {mode!r}")
    return keep_tokens, keep_responses


def correct(batch: Batch, old_logp: torch.Tensor, mode: str, band: Band, *,
            response_valid: bool) -> tuple[Batch, MismatchSums]:
    """The batch the loss learns from under ``mode``, and the step's mismatch (this rank's sums).

    ``batch.sampler_logp`` must be set. A truncate mode sets ``batch.token_weights`` (every token kept).
    ``response_valid``: the objective takes a response validity (PACS's
    ``valid``): a dropped response gets ``valid`` False and keeps its tokens; otherwise its tokens leave the mask.
    """
    if batch.sampler_logp is None:
        raise ValueError("the batch holds no sampler log-probs (Batch.sampler_logp)")
    sums = measure(old_logp, batch.sampler_logp, batch.mask, band)
    keep_tokens, keep_responses = keep_masks(old_logp, batch.sampler_logp, batch.mask, mode, band)
    has_tokens = batch.mask.any(1)
    sums.masked_responses = float((~keep_responses & has_tokens).sum())
    if response_valid:  # a dropped response keeps its tokens (mean_logp needs them); valid takes it out
        mask = torch.where(keep_responses[:, None], keep_tokens, batch.mask)
        valid = keep_responses if batch.valid is None else batch.valid & keep_responses
    else:
        mask, valid = keep_tokens & keep_responses[:, None], batch.valid
    sums.masked_tokens = float((batch.mask & ~(mask & keep_responses[:, None])).sum())
    if mode == "none":
        return batch, sums
    if mode in TRUNCATE_MODES:
        return replace(batch, token_weights=truncated_weights(old_logp, batch.sampler_logp, batch.mask, mode,
                                                              band)), sums
    return replace(batch, mask=mask, valid=valid), sums

