"""grpo_loss(): the clipped GRPO surrogate on the same per-token log-prob layout (the paper's baseline).

For B = n_groups * G responses with 0/1 (or any real) rewards R and response mask m:

    A[i]      = (R[i] - mean_group R) / (std_group(R, unbiased) + 1e-6)     (group-normalized)
    rho[i,t]  = exp(logp[i,t] - old_logp[i,t])
    l[i,t]    = max(-A[i] rho, -A[i] clip(rho, 1 - clip_eps, 1 + clip_eps_high))
              + kl_coef * (exp(ref - logp) - (ref - logp) - 1)               (k3 KL estimator, optional)
    token_mean: loss = sum_{i,t} m l / sum_{i,t} m          (every masked token of the batch weighs the same)
    seq_mean:   loss = mean_i ( sum_t m l / sum_t m )       (every response weighs the same)

The surrogate is elementwise, so plain autograd gives the gradient (one scalar per token, which
``linear_logprobs`` turns into the LM-head gradient in ``fused_linear_grpo_loss``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from .checks import FLOAT_DTYPES, check_choice, check_tensor
from .fused import FUSED_BACKENDS, _check_fused_tensors, selected_logprobs
from .loss_inputs import check_group_size, check_nonempty_responses, check_token_tensors

AGGREGATIONS = ("token_mean", "seq_mean")
GRPO_STD_EPS = 1e-6


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


def group_normalized_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) (R - group mean) / (group std, unbiased + 1e-6)."""
    grouped = rewards.reshape(-1, group_size)
    centred = grouped - grouped.mean(1, keepdim=True)
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
):
    """Clipped GRPO surrogate with group-normalized advantages.

    Args:
        logp: (B, T) float, differentiable; old_logp: (B, T) (constant); mask: (B, T) 0/1.
        rewards: (B,) finite rewards, each group's ``group_size`` responses contiguous.
        group_size: G >= 2.
        clip_eps / clip_eps_high: ratio clipped to [1 - clip_eps, 1 + clip_eps_high]
            (clip_eps_high defaults to clip_eps; a larger value is DAPO's "clip higher").
        aggregation: "token_mean" | "seq_mean" (see the module docstring).
        ref_logp: optional (B, T) reference-model log-probs for the k3 KL penalty (constant).
        kl_coef: weight of the KL penalty (>= 0; > 0 needs ref_logp).
        return_stats: also return a :class:`GRPOStats`.

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
    check_group_size(group_size, n, "grpo")
    low = _check_number("clip_eps", clip_eps, minimum=0.0)
    high = _check_number("clip_eps_high", clip_eps_high, minimum=0.0, allow_none=True)
    high = low if high is None else high
    kl_coef = _check_number("kl_coef", kl_coef, minimum=0.0)
    if ref_logp is not None:
        check_tensor("ref_logp", ref_logp, dtypes=FLOAT_DTYPES)
        if tuple(ref_logp.shape) != tuple(logp.shape):
            raise ValueError(f"ref_logp must have the shape of logp {tuple(logp.shape)}, got {tuple(ref_logp.shape)}")
        if ref_logp.device != logp.device:
            raise ValueError(f"ref_logp must be on the device of logp ({logp.device}), got {ref_logp.device}")
    elif kl_coef > 0:
        raise ValueError(f"kl_coef = {kl_coef} > 0 needs ref_logp (the reference model's log-probs)")
    counts = mask.sum(-1)
    if aggregation == "seq_mean":
        check_nonempty_responses(counts, "aggregation='seq_mean' (it averages over each response)")
    elif n and int(counts.sum()) == 0:
        raise ValueError("mask must select at least one token with aggregation='token_mean'")

    cdt = torch.float64 if logp.dtype == torch.float64 else torch.float32
    values = rewards.detach().to(cdt)
    if n and not bool(torch.isfinite(values).all()):
        raise ValueError("rewards must be finite (no NaN or inf)")
    adv = group_normalized_advantages(values, group_size)[:, None]
    zero = torch.zeros((), dtype=cdt, device=logp.device)
    logp_c = logp.to(cdt)
    # log-ratio zeroed at padding BEFORE exp: garbage there can never reach the gradient as NaN
    log_ratio = torch.where(mask, logp_c - old_logp.detach().to(cdt), zero)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    per_token = torch.maximum(unclipped, clipped)
    kl = None
    if ref_logp is not None:
        delta = torch.where(mask, ref_logp.detach().to(cdt) - logp_c, zero)
        kl = torch.exp(delta) - delta - 1.0
        if kl_coef > 0:
            per_token = per_token + kl_coef * kl
    per_token = torch.where(mask, per_token, zero)
    if aggregation == "token_mean":
        loss = per_token.sum() / counts.sum().clamp(min=1).to(cdt)
    else:
        loss = (per_token.sum(-1) / counts.to(cdt)).mean()
    if not return_stats:
        return loss
    with torch.no_grad():
        n_tokens = counts.sum().clamp(min=1).double()
        active_clip = (clipped > unclipped) & mask
        stats = torch.stack([
            loss.detach().double(), active_clip.sum().double() / n_tokens,
            torch.where(mask, ratio, zero).sum().double() / n_tokens, adv.abs().mean().double(),
            (torch.where(mask, kl, zero).sum().double() / n_tokens) if kl is not None
            else torch.zeros((), dtype=torch.float64, device=logp.device),
        ]).tolist()
    return loss, GRPOStats(*stats)


def fused_linear_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    old_logp: torch.Tensor,
    rewards: torch.Tensor,
    *,
    group_size: int,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    aggregation: str = "token_mean",
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    return_stats: bool = False,
    backend: str = "auto",
):
    """``grpo_loss`` straight from hidden states (B, T, d) and the LM head (V, d), padded layout only.

    Log-probs are computed at mask == 1 positions only (one ``linear_logprobs`` call) and
    scattered into a (B, T) float32 tensor; the rest as in :func:`grpo_loss`.
    """
    check_choice("backend", backend, FUSED_BACKENDS)
    hidden_2d, targets_1d, mask_1d, old_1d, _, n_responses = _check_fused_tensors(
        hidden, targets, mask, old_logp, None)
    check_group_size(group_size, n_responses, "grpo")
    logp_selected, index = selected_logprobs(
        hidden_2d, weight, targets_1d, mask_1d, temperature=temperature, bias=bias, backend=backend,
        logprob_options={})
    if index is None:
        logp = logp_selected
    else:
        logp = logp_selected.new_zeros(mask_1d.shape[0]).index_put((index,), logp_selected)
    shape = tuple(hidden.shape[:-1])
    return grpo_loss(
        logp.reshape(shape), old_logp, rewards, mask, group_size=group_size, clip_eps=clip_eps,
        clip_eps_high=clip_eps_high, aggregation=aggregation, ref_logp=ref_logp, kl_coef=kl_coef,
        return_stats=return_stats)
