"""GroupBatch: the checked inputs of an objective (padded (B, T) rows), shared by every built-in one.

Every failure is a one-line ``ValueError``/``TypeError`` naming the argument and what was expected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..checks import FLOAT_DTYPES, check_no_inf_where, check_tensor
from ..loss_inputs import check_group_size, check_token_tensors


@dataclass(frozen=True)
class GroupBatch:
    """logp (B, T) differentiable and old_logp (B, T) detached, both in the compute dtype (float64 for
    float64 logp, else float32); rewards (B,) in that dtype; mask (B, T) bool; counts (B,) int64 masked
    tokens per response; ref_logp (detached) and entropy (differentiable) (B, T) or None; token_weights (B, T)
    detached, >= 0, 0 outside the mask, or None (every weight 1)."""

    logp: torch.Tensor
    old_logp: torch.Tensor
    rewards: torch.Tensor
    mask: torch.Tensor
    counts: torch.Tensor
    group_size: int
    ref_logp: torch.Tensor | None
    entropy: torch.Tensor | None
    token_weights: torch.Tensor | None = None

    @property
    def n_responses(self) -> int:
        return self.logp.shape[0]


def check_unit_interval(name: str, value, *, upper_inclusive: bool = True) -> float:
    """A clip width: a finite number in [0, 1] (1 - eps must stay >= 0, the ratio is positive)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not (0 <= value <= 1 if upper_inclusive else 0 <= value < 1):
        raise ValueError(f"{name} must be a number in [0, 1{']' if upper_inclusive else ')'}, got {value!r}")
    return float(value)


def check_nonnegative(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _check_like(name: str, value, like: torch.Tensor) -> None:
    check_tensor(name, value, dtypes=FLOAT_DTYPES)
    if tuple(value.shape) != tuple(like.shape):
        raise ValueError(f"{name} must have the shape of logp {tuple(like.shape)}, got {tuple(value.shape)}")
    if value.device != like.device:
        raise ValueError(f"{name} must be on the device of logp ({like.device}), got {value.device}")


def check_group_batch(logp, old_logp, rewards, mask, *, group_size, ref_logp=None, entropy=None,
                      kl_coef: float = 0.0, entropy_coef: float = 0.0, advantage: str = "grpo",
                      token_weights=None) -> GroupBatch:
    """Check an objective's inputs (padded layout) -> GroupBatch; rewards may be any finite reals.
    ``advantage``: the objective's group estimator, which sets the smallest group ("naive": 1)."""
    check_tensor("logp", logp, dtypes=FLOAT_DTYPES)
    if logp.dim() != 2:
        raise ValueError(f"logp must be (B, T) padded rows, got shape {tuple(logp.shape)}")
    old = logp.detach() if old_logp is None else old_logp
    logp, old, mask, _ = check_token_tensors(logp, old, mask, None)
    n = logp.shape[0]
    if not isinstance(rewards, torch.Tensor):
        raise TypeError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    check_tensor("rewards", rewards, ndim=1)
    if rewards.shape[0] != n:
        raise ValueError(f"rewards must have shape (B,) = ({n},), one per response, got {tuple(rewards.shape)}")
    if rewards.device != logp.device:
        raise ValueError(f"rewards must be on the device of logp ({logp.device}), got {rewards.device}")
    check_group_size(group_size, n, advantage)
    if n == 0:
        raise ValueError("the batch must hold at least one group of responses, got B = 0")
    cdt = torch.float64 if logp.dtype == torch.float64 else torch.float32
    values = rewards.detach().to(cdt)
    if not bool(torch.isfinite(values).all()):
        raise ValueError("rewards must be finite (no NaN or inf)")
    counts = mask.sum(-1)
    if int(counts.sum()) == 0:
        raise ValueError("mask must select at least one response token")
    if ref_logp is not None:
        _check_like("ref_logp", ref_logp, logp)
        check_no_inf_where("ref_logp", ref_logp, mask)
        ref_logp = ref_logp.detach().to(cdt)
    elif kl_coef > 0:
        raise ValueError(f"kl_coef = {kl_coef} > 0 needs ref_logp (the reference model's log-probs)")
    if entropy is not None:
        _check_like("entropy", entropy, logp)
        entropy = entropy.to(cdt)
    elif entropy_coef > 0:
        raise ValueError(f"entropy_coef = {entropy_coef} > 0 needs entropy (the policy's token entropy; "
                         "fused_linear_objective_loss computes it)")
    if token_weights is not None:
        _check_like("token_weights", token_weights, logp)
        token_weights = torch.where(mask, token_weights.detach().to(cdt), torch.zeros((), dtype=cdt,
                                                                                    device=logp.device))
        if not bool(torch.isfinite(token_weights).all()) or bool((token_weights < 0).any()):
            raise ValueError("token_weights must be finite and >= 0 on the response tokens (mask == 1)")
    return GroupBatch(logp.to(cdt), old.detach().to(cdt), values, mask, counts, group_size, ref_logp, entropy,
                      token_weights)
