"""The PACS group part as Triton kernels: masked sums, score, psi, weights, BCE, and its backward.

Forward: one program per group. It walks its G responses' tokens in (BLOCK_G x BLOCK_T) tiles
(response j owns tokens offsets[j]:offsets[j+1] of the flat arrays: the padded (B, T) layout
has offsets j*T, the packed layout cu_seqlens) and keeps three float32 sums per response:
S[j] = sum m*logp, O[j] = sum m*old_logp, n[j] = sum m. Then, on G numbers:

    r    = beta (S - O)             | beta S / n                     (log_ratio | mean_logp)
    psi  = r - (sum r - r)/(G-1)    | d / (s + eps), d = r - mean r,  s = sqrt(sum d^2 / (G-1))
                                    | r                              (rloo | grpo | naive)
    w    = class weights (balanced | none | positive_only | negative_only)
    l    = softplus(psi) - R psi,   loss_g = sum_j w l / B

and the gradient, as the per-response coefficient c[j] with dloss/dlogp[j,t] = m[j,t] c[j]:

    g[j]      = dloss/dpsi[j] = w[j] (sigmoid(psi[j]) - R[j]) / B
    rloo:     dloss/dr[j] = g[j] - (sum_i g[i] - g[j]) / (G-1)
    grpo:     dpsi_i/dr_j = (delta_ij - 1/G)/(s+eps) - d_i d_j / ((G-1) s (s+eps)^2)
              dloss/dr[j] = (g[j] - mean g)/(s+eps) - d[j] sum_i g[i] d[i] / ((G-1) s (s+eps)^2)
              (the second term is taken as 0 when s == 0, as torch.std's backward does)
    naive:    dloss/dr[j] = g[j]
    c[j]      = beta dloss/dr[j]     | beta dloss/dr[j] / n[j]
              (+ w[j] l[j] / B with the score-function term of Eq. 6)

Backward: one program per response writes grad_loss * m[j,t] * c[j] over its tokens.
Everything accumulates in float32; logp may be float16/bfloat16/float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..loss_inputs import GRPO_STD_EPS
from .launch_config import INTERPRETED

SCORE_CODES = {"log_ratio": 0, "mean_logp": 1}
ADVANTAGE_CODES = {"rloo": 0, "grpo": 1, "naive": 2}
WEIGHTING_CODES = {"balanced": 0, "none": 1, "positive_only": 2, "negative_only": 3}
TILE_ELEMENTS = 1024 if INTERPRETED else 4096


@triton.jit
def _group_loss_forward_kernel(
    logp_ptr, old_ptr, mask_ptr, offsets_ptr, rewards_ptr,
    loss_part_ptr, per_response_ptr,
    n_responses, group_size, g_size, max_len, beta, inv_batch,
    SCORE: tl.constexpr,
    ADVANTAGE: tl.constexpr,
    WEIGHTING: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SCORE_FUNCTION_TERM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    group = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_G)
    j_ok = j < group_size
    response = group * group_size + j
    start = tl.load(offsets_ptr + response, mask=j_ok, other=0)
    length = tl.load(offsets_ptr + response + 1, mask=j_ok, other=0) - start

    sum_logp = tl.zeros((BLOCK_G,), tl.float32)
    sum_old = tl.zeros((BLOCK_G,), tl.float32)
    count = tl.zeros((BLOCK_G,), tl.float32)
    for t0 in range(0, max_len, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        ok = j_ok[:, None] & (t[None, :] < length[:, None])
        idx = start[:, None] + t[None, :]
        if HAS_MASK:
            ok = ok & (tl.load(mask_ptr + idx, mask=ok, other=0) != 0)
        lp = tl.load(logp_ptr + idx, mask=ok, other=0.0).to(tl.float32)
        sum_logp += tl.sum(tl.where(ok, lp, 0.0), axis=1)
        if SCORE == 0:
            old = tl.load(old_ptr + idx, mask=ok, other=0.0).to(tl.float32)
            sum_old += tl.sum(tl.where(ok, old, 0.0), axis=1)
        count += tl.sum(ok.to(tl.float32), axis=1)

    if SCORE == 0:
        proxy = beta * (sum_logp - sum_old)
    else:
        proxy = beta * sum_logp / tl.where(j_ok, tl.maximum(count, 1.0), 1.0)  # empty: score 0
    proxy = tl.where(j_ok, proxy, 0.0)

    if ADVANTAGE == 0:
        psi = proxy - (tl.sum(proxy, axis=0) - proxy) / (g_size - 1.0)
        std = 0.0
        centred = proxy
    elif ADVANTAGE == 1:
        centred = tl.where(j_ok, proxy - tl.sum(proxy, axis=0) / g_size, 0.0)
        std = tl.sqrt(tl.sum(centred * centred, axis=0) / (g_size - 1.0))
        psi = centred / (std + GRPO_STD_EPS)
    else:
        psi = proxy
        std = 0.0
        centred = proxy
    psi = tl.where(j_ok, psi, 0.0)

    labels = tl.load(rewards_ptr + response, mask=j_ok, other=0.0).to(tl.float32)
    if WEIGHTING == 0:
        n_pos = tl.sum(tl.where(j_ok, labels, 0.0), axis=0)
        n_neg = g_size - n_pos
        own = tl.maximum(tl.where(labels == 1.0, n_pos, n_neg), 1.0)
        mixed = (n_pos > 0.0) & (n_neg > 0.0)
        weight = tl.where(mixed, g_size / (2.0 * own), 1.0)
    elif WEIGHTING == 1:
        weight = tl.full((BLOCK_G,), 1.0, tl.float32)
    elif WEIGHTING == 2:
        weight = labels
    else:
        weight = 1.0 - labels
    weight = tl.where(j_ok, weight, 0.0)

    # softplus(psi) - R psi, stable for either sign of psi
    bce = tl.maximum(psi, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(psi))) - labels * psi
    bce = tl.where(j_ok, bce, 0.0)
    tl.store(loss_part_ptr + group, tl.sum(weight * bce, axis=0) * inv_batch)

    g_psi = weight * (tl.sigmoid(psi) - labels) * inv_batch
    g_psi = tl.where(j_ok, g_psi, 0.0)
    if ADVANTAGE == 0:
        g_proxy = g_psi - (tl.sum(g_psi, axis=0) - g_psi) / (g_size - 1.0)
    elif ADVANTAGE == 1:
        denom = std + GRPO_STD_EPS
        g_mean = tl.sum(g_psi, axis=0) / g_size
        through_std = centred * tl.sum(g_psi * centred, axis=0) / (
            (g_size - 1.0) * tl.where(std > 0.0, std, 1.0) * denom * denom)
        g_proxy = (g_psi - g_mean) / denom - tl.where(std > 0.0, through_std, 0.0)
    else:
        g_proxy = g_psi
    if SCORE == 0:
        coef = beta * g_proxy
    else:
        coef = beta * g_proxy / tl.where(j_ok, tl.maximum(count, 1.0), 1.0)
    if SCORE_FUNCTION_TERM:
        coef += weight * bce * inv_batch

    out = per_response_ptr + response
    tl.store(out, proxy, mask=j_ok)
    tl.store(out + n_responses, psi, mask=j_ok)
    tl.store(out + 2 * n_responses, weight, mask=j_ok)
    tl.store(out + 3 * n_responses, bce, mask=j_ok)
    tl.store(out + 4 * n_responses, coef, mask=j_ok)


@triton.jit
def _group_loss_backward_kernel(
    grad_loss_ptr, coef_ptr, mask_ptr, offsets_ptr, grad_ptr,
    max_len,
    HAS_MASK: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    response = tl.program_id(0).to(tl.int64)
    start = tl.load(offsets_ptr + response)
    length = tl.load(offsets_ptr + response + 1) - start
    scale = tl.load(coef_ptr + response) * tl.load(grad_loss_ptr)
    for t0 in range(0, max_len, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        ok = t < length
        value = tl.zeros((BLOCK_T,), tl.float32) + scale
        if HAS_MASK:
            value = tl.where(tl.load(mask_ptr + start + t, mask=ok, other=0) != 0, value, 0.0)
        tl.store(grad_ptr + start + t, value, mask=ok)


def _block_sizes(group_size: int, max_len: int) -> tuple[int, int]:
    block_g = triton.next_power_of_2(max(group_size, 1))
    block_t = max(16, min(triton.next_power_of_2(max(max_len, 1)), TILE_ELEMENTS // block_g))
    return block_g, block_t


def group_loss_forward(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    mask: torch.Tensor | None,
    offsets: torch.Tensor,
    rewards: torch.Tensor,
    *,
    group_size: int,
    max_len: int,
    beta: float,
    score: str,
    advantage: str,
    weighting: str,
    score_function_term: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat (N,) logp/old_logp, uint8 mask (N,) or None (all tokens), offsets (B+1,) int64,
    rewards (B,) float32 -> (loss 0-d float32, per_response (5, B) float32: score, psi, weight,
    bce, gradient coefficient c)."""
    n_responses = offsets.shape[0] - 1
    n_groups = n_responses // group_size
    device = logp.device
    loss_parts = torch.empty(n_groups, dtype=torch.float32, device=device)
    per_response = torch.empty((5, n_responses), dtype=torch.float32, device=device)
    block_g, block_t = _block_sizes(group_size, max_len)
    if n_groups > 0:
        _group_loss_forward_kernel[(n_groups,)](
            logp, old_logp, mask if mask is not None else logp, offsets, rewards,
            loss_parts, per_response,
            n_responses, group_size, float(group_size), max_len, float(beta), 1.0 / n_responses,
            SCORE=SCORE_CODES[score], ADVANTAGE=ADVANTAGE_CODES[advantage],
            WEIGHTING=WEIGHTING_CODES[weighting], HAS_MASK=mask is not None,
            SCORE_FUNCTION_TERM=bool(score_function_term),
            BLOCK_G=block_g, BLOCK_T=block_t,
        )
    return loss_parts.sum(), per_response


def group_loss_backward(
    grad_loss: torch.Tensor,
    coef: torch.Tensor,
    mask: torch.Tensor | None,
    offsets: torch.Tensor,
    n_tokens: int,
    max_len: int,
) -> torch.Tensor:
    """grad_loss (1,) float32, coef (B,) -> dloss/dlogp (N,) float32 (0 outside every response)."""
    n_responses = offsets.shape[0] - 1
    grad = torch.zeros(n_tokens, dtype=torch.float32, device=coef.device)
    block_t = max(16, min(triton.next_power_of_2(max(max_len, 1)), TILE_ELEMENTS))
    if n_responses > 0 and max_len > 0:
        _group_loss_backward_kernel[(n_responses,)](
            grad_loss, coef, mask if mask is not None else coef, offsets, grad,
            max_len, HAS_MASK=mask is not None, BLOCK_T=block_t,
        )
    return grad
