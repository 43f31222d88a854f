"""Backward: recompute each logits tile and apply the per-token upstream gradients.

For a token with logits z = (h @ W.T + b) / tau, p = softmax(z), log p = z - lse, entropy H,
and upstream gradients g_l (on logp) and g_H (on the entropy):

    dlogp/dz_k = onehot(y)_k - p_k
    dH/dz_k    = -p_k * (log p_k + H)
    dz_k       = g_l * onehot(y)_k - p_k * (g_l + g_H * (log p_k + H))

and with dlogits = dz / tau:  dh = dlogits @ W,  dW = dlogits.T @ h,  dbias = column sums.

Program (i, s) takes BLOCK_N tokens and the s-th vocabulary slice, rebuilds each logits tile
from the saved per-token lse (one matmul), forms dz in registers, and adds its share of dh and
dW, BLOCK_D columns at a time, into float32 buffers with atomic adds (two more matmuls). The
matmul count is 2NVd forward + 6NVd backward, and nothing of size N x V ever exists.

Opt-in gradient filtering (as in Cut Cross-Entropy): a tile whose every |dz| is below
``filter_eps`` and that holds no target contributes nothing and skips its two matmuls.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch_config import dot_precision, tile_config, upcast_dots, vocab_split


@triton.jit
def _logprob_backward_kernel(
    hidden_ptr, weight_ptr, bias_ptr, targets_ptr,
    lse_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr,
    d_hidden_ptr, d_weight_ptr, d_bias_ptr, logp_out_ptr,
    n_tokens, vocab, width,
    stride_hn, stride_hd, stride_wv, stride_wd,
    inv_tau, tiles_per_split, filter_eps,
    HAS_BIAS: tl.constexpr,
    HAS_GRAD_LOGP: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    NEED_D_HIDDEN: tl.constexpr,
    NEED_D_WEIGHT: tl.constexpr,
    NEED_D_BIAS: tl.constexpr,
    FILTER: tl.constexpr,
    WRITE_LOGP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_tokens
    y = tl.load(targets_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    if HAS_GRAD_LOGP:
        g_l = tl.load(grad_logp_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    else:
        g_l = tl.zeros((BLOCK_N,), tl.float32)
    if HAS_GRAD_ENTROPY:
        g_h = tl.load(grad_entropy_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        ent = tl.load(entropy_ptr + rows, mask=row_ok, other=0.0)

    split_start = pid_s.to(tl.int64) * tiles_per_split * BLOCK_V
    for tile in range(0, tiles_per_split):
        cols = split_start + tile * BLOCK_V + tl.arange(0, BLOCK_V)
        col_ok = cols < vocab
        acc = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
        for k0 in range(0, width, BLOCK_D):
            ks = k0 + tl.arange(0, BLOCK_D)
            k_ok = ks < width
            h = tl.load(hidden_ptr + rows[:, None] * stride_hn + ks[None, :] * stride_hd,
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(weight_ptr + cols[:, None] * stride_wv + ks[None, :] * stride_wd,
                        mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if UPCAST_DOTS:
                h, w = h.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(h, tl.trans(w), acc, input_precision=DOT_PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        valid = row_ok[:, None] & col_ok[None, :]
        log_p = tl.where(valid, acc * inv_tau - lse[:, None], 0.0)
        p = tl.where(valid, tl.exp(log_p), 0.0)
        coef = g_l[:, None]
        if HAS_GRAD_ENTROPY:
            coef = coef + g_h[:, None] * (log_p + ent[:, None])
        is_target = (cols[None, :] == y[:, None]) & valid
        if WRITE_LOGP:  # known-gradient fast path: the forward's log-prob falls out of the same tile
            in_tile = row_ok & (y >= split_start + tile * BLOCK_V) & (y < split_start + (tile + 1) * BLOCK_V)
            tl.store(logp_out_ptr + rows, tl.sum(tl.where(is_target, log_p, 0.0), axis=1), mask=in_tile)
        dz = tl.where(is_target, g_l[:, None], 0.0) - p * coef
        dz = dz * inv_tau

        skip = False
        if FILTER:
            skip = (tl.max(tl.abs(dz)) < filter_eps) & (tl.sum(is_target.to(tl.int32)) == 0)
        if not skip:
            dz_in = dz.to(hidden_ptr.dtype.element_ty)
            if UPCAST_DOTS:
                dz_in = dz_in.to(tl.float32)
            for k0 in range(0, width, BLOCK_D):
                ks = k0 + tl.arange(0, BLOCK_D)
                k_ok = ks < width
                if NEED_D_HIDDEN:
                    w = tl.load(weight_ptr + cols[:, None] * stride_wv + ks[None, :] * stride_wd,
                                mask=col_ok[:, None] & k_ok[None, :], other=0.0)
                    if UPCAST_DOTS:
                        w = w.to(tl.float32)
                    part = tl.dot(dz_in, w, input_precision=DOT_PRECISION)
                    tl.atomic_add(d_hidden_ptr + rows[:, None] * width + ks[None, :], part,
                                  mask=row_ok[:, None] & k_ok[None, :])
                if NEED_D_WEIGHT:
                    h = tl.load(hidden_ptr + rows[:, None] * stride_hn + ks[None, :] * stride_hd,
                                mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                    if UPCAST_DOTS:
                        h = h.to(tl.float32)
                    part = tl.dot(tl.trans(dz_in), h, input_precision=DOT_PRECISION)
                    tl.atomic_add(d_weight_ptr + cols[:, None] * width + ks[None, :], part,
                                  mask=col_ok[:, None] & k_ok[None, :])
            if NEED_D_BIAS:
                tl.atomic_add(d_bias_ptr + cols, tl.sum(dz, axis=0), mask=col_ok)


def logprob_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    needs: tuple[bool, bool, bool] = (True, True, True),
    filter_eps: float | None = None,
    vocab_splits: int | None = None,
    logp_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients (dhidden, dweight, dbias) in the input dtypes, accumulated in float32.

    With ``logp_out`` (float32, (N,)) the kernel also writes each token's log-prob z_y - lse,
    from the same logits tiles (the known-gradient fast path).
    """
    n_tokens, width = hidden.shape
    vocab = weight.shape[0]
    need_h, need_w, need_b = needs
    need_b = need_b and bias is not None
    cfg = tile_config("backward")
    tiles_per_split, n_splits = vocab_split(n_tokens, vocab, cfg, hidden.device, vocab_splits)
    dev = hidden.device
    d_hidden = torch.zeros((n_tokens, width), dtype=torch.float32, device=dev) if need_h else None
    d_weight = torch.zeros((vocab, width), dtype=torch.float32, device=dev) if need_w else None
    d_bias = torch.zeros(vocab, dtype=torch.float32, device=dev) if need_b else None
    has_grad_entropy = grad_entropy is not None and entropy is not None
    if n_tokens > 0 and (need_h or need_w or need_b or logp_out is not None) and (
            grad_logp is not None or has_grad_entropy or logp_out is not None):
        dummy = lse
        grid = (triton.cdiv(n_tokens, cfg.block_n), n_splits)
        _logprob_backward_kernel[grid](
            hidden, weight, bias if bias is not None else dummy, targets,
            lse, entropy if has_grad_entropy else dummy,
            grad_logp.contiguous() if grad_logp is not None else dummy,
            grad_entropy.contiguous() if has_grad_entropy else dummy,
            d_hidden if need_h else dummy, d_weight if need_w else dummy, d_bias if need_b else dummy,
            logp_out if logp_out is not None else dummy,
            n_tokens, vocab, width,
            hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
            1.0 / temperature, tiles_per_split, float(filter_eps or 0.0),
            HAS_BIAS=bias is not None,
            HAS_GRAD_LOGP=grad_logp is not None,
            HAS_GRAD_ENTROPY=has_grad_entropy,
            NEED_D_HIDDEN=need_h, NEED_D_WEIGHT=need_w, NEED_D_BIAS=need_b,
            FILTER=filter_eps is not None and filter_eps > 0,
            WRITE_LOGP=logp_out is not None,
            DOT_PRECISION=dot_precision(hidden.dtype),
            UPCAST_DOTS=upcast_dots(hidden.dtype),
            BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_D=cfg.block_d,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return (
        d_hidden.to(hidden.dtype) if need_h else None,
        d_weight.to(weight.dtype) if need_w else None,
        d_bias.to(bias.dtype) if need_b else None,
    )
