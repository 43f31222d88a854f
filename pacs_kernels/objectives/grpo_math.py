"""grpo_loss(): the clipped GRPO surrogate on the same per-token log-prob layout (the paper's baseline).

For B = n_groups * G responses with 0/1 (or any real) rewards R and response mask m:

    A[i]      = (R[i] - mean_group R) / (std_group(R, unbiased) + 1e-6)     (group-normalized)
    rho[i,t]  = exp(logp[i,t] - old_logp[i,t])
    l[i,t]    = max(-A[i] rho, -A[i] clip(rho, 1 - clip_eps, 1 + clip_eps_high))
              + kl_coef * (exp(ref - logp) - (ref - logp) - 1)               (k3 KL estimator, optional)
    token_mean: loss = sum_{i,t} m l / sum_{i,t} m          (every masked token of the batch weighs the same)
    seq_mean:   loss = mean_i ( sum_t m l / max(sum_t m, 1) )  (every response weighs the same; an empty-mask
                                                               response is a zero-loss response, as in TRL and Liger)

The surrogate is elementwise, so plain autograd gives the gradient (one scalar per token, which
``linear_logprobs`` turns into the LM-head gradient in ``fused_linear_grpo_loss``, pacs_kernels/engine/).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from ..checks import (
    FLOAT_DTYPES,
    check_choice,
    check_tensor,
)
from ..loss_inputs import (
    GRPO_STD_EPS,
    check_group_size,
    check_token_tensors,
)

AGGREGATIONS = ("token_mean", "seq_mean")


@dataclass(frozen=True)
class GRPOStats:
    """loss; clip_frac: masked tokens whose clipped term was the active one; ratio_mean: mean rho over
    masked tokens; advantage_abs_mean: mean |A|; kl_mean: mean k3 KL over masked tokens (0 without ref)."""

    loss: float
    clip_frac: float
    ratio_mean: float
    advantage_abs_mean: float
    kl_mean: float

    def as_dict(self, prefix: str = "") -> dict[str, float]:
        return {prefix + key: value for key, value in asdict(self).items()}


def _check_number(name: str, value, *, minimum: float, allow_none: bool = False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < minimum:
        raise ValueError(f"{name} must be a finite number >= {minimum}, got {value!r}")
    return float(value)


def check_grpo_options(group_size, n_responses, clip_eps, clip_eps_high, kl_coef, ref_logp, like):
    """-> (clip low, clip high, kl_coef); ref_logp (optional) shaped and placed like ``like``."""
    check_group_size(group_size, n_responses, "grpo")
    if n_responses == 0:
        raise ValueError("the batch must hold at least one group of responses, got B = 0")
    low = _check_number("clip_eps", clip_eps, minimum=0.0)
    high = _check_number("clip_eps_high", clip_eps_high, minimum=0.0, allow_none=True)
    high = low if high is None else high
    kl_coef = _check_number("kl_coef", kl_coef, minimum=0.0)
    if ref_logp is not None:
        check_tensor("ref_logp", ref_logp, dtypes=FLOAT_DTYPES)
        if tuple(ref_logp.shape) != tuple(like.shape):
            raise ValueError(f"ref_logp must have the shape {tuple(like.shape)} of the per-token inputs, "
                             f"got {tuple(ref_logp.shape)}")
        if ref_logp.device != like.device:
            raise ValueError(f"ref_logp must be on {like.device} with the other tensors, got {ref_logp.device}")
    elif kl_coef > 0:
        raise ValueError(f"kl_coef = {kl_coef} > 0 needs ref_logp (the reference model's log-probs)")
    return low, high, kl_coef


def group_centred_rewards(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B / group_size, group_size): R - group mean R, exactly 0 in a group whose rewards are all equal.

    The float32 mean of equal rewards that are not dyadic (0.7, 1/3) can be 1 ulp off; that ulp over the
    group's std (also about 1 ulp) + 1e-6 would give every response of the group an advantage near 0.06,
    all of one sign, where the group carries no signal."""
    grouped = rewards.reshape(-1, group_size)
    centred = grouped - grouped.mean(1, keepdim=True)
    all_equal = grouped.amax(1, keepdim=True) == grouped.amin(1, keepdim=True)
    return torch.where(all_equal, torch.zeros_like(centred), centred)


def group_normalized_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) (R - group mean) / (group std, unbiased + 1e-6); 0 in a group of equal rewards."""
    grouped = rewards.reshape(-1, group_size)
    centred = group_centred_rewards(rewards, group_size)
    return (centred / (grouped.std(1, keepdim=True) + GRPO_STD_EPS)).reshape(-1)


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_size: int,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    aggregation: str = "token_mean",
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    return_stats: bool = False,
    token_weights: torch.Tensor | None = None,
):
    """Clipped GRPO surrogate with group-normalized advantages.

    Args:
        logp: (B, T) float, differentiable; old_logp: (B, T) (constant); mask: (B, T) 0/1.
        rewards: (B,) finite rewards, each group's ``group_size`` responses contiguous.
        group_size: G >= 2.
        clip_eps: the ratio is clipped to [1 - clip_eps, 1 + clip_eps_high].
        clip_eps_high: the upper clip range (defaults to clip_eps; a larger value is DAPO's "clip higher").
        aggregation: "token_mean" | "seq_mean" (see the module docstring).
        ref_logp: optional (B, T) reference-model log-probs for the k3 KL penalty (constant).
        kl_coef: weight of the KL penalty (>= 0; > 0 needs ref_logp).
        return_stats: also return a :class:`GRPOStats`.
        token_weights: optional (B, T) constant weights >= 0 multiplying each token's clipped surrogate (not its KL
            term), as TRL multiplies ``per_token_loss`` by its importance-sampling ratio; the normalisers unchanged.

    Returns:
        0-d loss in float32 (float64 for float64 logp), or ``(loss, GRPOStats)``.
    """
    check_choice("aggregation", aggregation, AGGREGATIONS)
    logp, old_logp, mask, layout = check_token_tensors(logp, old_logp, mask, None)
    if not isinstance(rewards, torch.Tensor):
        raise TypeError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    check_tensor("rewards", rewards, ndim=1)
    n = layout.n_responses
    if rewards.shape[0] != n:
        raise ValueError(f"rewards must have shape (B,) = ({n},), got {tuple(rewards.shape)}")
    if rewards.device != logp.device:
        raise ValueError(f"rewards must be on the device of logp ({logp.device}), got {rewards.device}")
    low, high, kl_coef = check_grpo_options(group_size, n, clip_eps, clip_eps_high, kl_coef, ref_logp, logp)
    counts = mask.sum(-1)
    if aggregation == "token_mean" and n and int(counts.sum()) == 0:
        raise ValueError("mask must select at least one token with aggregation='token_mean'")

    cdt = torch.float64 if logp.dtype == torch.float64 else torch.float32
    values = rewards.detach().to(cdt)
    if n and not bool(torch.isfinite(values).all()):
        raise ValueError("rewards must be finite (no NaN or inf)")
    adv = group_normalized_advantages(values, group_size)[:, None]
    if token_weights is not None:
        token_weights = token_weights.detach().to(cdt)
    terms = grpo_token_terms(logp.to(cdt), old_logp.detach().to(cdt), adv,
                             None if ref_logp is None else ref_logp.detach().to(cdt), mask,
                             low=low, high=high, kl_coef=kl_coef, token_weights=token_weights)
    if aggregation == "token_mean":
        loss = terms.per_token.sum() / counts.sum().clamp(min=1).to(cdt)
    else:
        # an empty-mask response (a truncated completion masked out) adds 0 and still counts in 1/B (TRL, Liger)
        loss = (terms.per_token.sum(-1) / counts.clamp(min=1).to(cdt)).mean()
    if not return_stats:
        return loss
    with torch.no_grad():
        n_tokens = max(int(counts.sum()), 1)
        clipped, ratio_sum, kl_sum = terms.stat_sums()
        return loss, GRPOStats(loss=float(loss.detach()), clip_frac=clipped / n_tokens, ratio_mean=ratio_sum / n_tokens,
                               advantage_abs_mean=float(adv.abs().mean()), kl_mean=kl_sum / n_tokens)


@dataclass
class GRPOTokenTerms:
    """Per-token GRPO quantities (zeros outside the mask): the loss term, whether the clipped branch
    was the active one, the ratio, and the k3 KL (None without a reference)."""

    per_token: torch.Tensor
    clip_active: torch.Tensor
    ratio: torch.Tensor
    kl: torch.Tensor | None

    def stat_sums(self) -> list[float]:
        """[clipped tokens, sum of ratios, sum of KL] over the masked tokens (floats)."""
        kl = self.kl.sum() if self.kl is not None else self.ratio.new_zeros(())
        return torch.stack([self.clip_active.sum().to(self.ratio.dtype), self.ratio.sum(), kl]).double().tolist()


def grpo_token_terms(logp, old_logp, adv, ref_logp, mask, *, low, high, kl_coef,
                     token_weights=None) -> GRPOTokenTerms:
    """The clipped surrogate (+ k3 KL) per token; any shapes that broadcast, mask None = all tokens.
    ``token_weights`` (constant, None: 1) multiply the surrogate, not the KL term (TRL's order).

    The log-ratio is zeroed outside the mask BEFORE exp, so garbage there never reaches the gradient
    as NaN.
    """
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    inside = (lambda t: t) if mask is None else (lambda t: torch.where(mask, t, zero))
    ratio = torch.exp(inside(logp - old_logp))
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    per_token = torch.maximum(unclipped, clipped)
    if token_weights is not None:
        per_token = per_token * inside(token_weights)
    kl = None
    if ref_logp is not None:
        delta = inside(ref_logp - logp)
        kl = torch.exp(delta) - delta - 1.0
        if kl_coef > 0:
            per_token = per_token + kl_coef * kl
    active = clipped > unclipped
    if mask is not None:
        active = active & mask
        ratio = inside(ratio)
        kl = None if kl is None else inside(kl)
    return GRPOTokenTerms(inside(per_token), active, ratio.detach(), None if kl is None else kl.detach())
