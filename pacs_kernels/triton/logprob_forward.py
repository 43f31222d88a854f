"""Forward: per-token log-prob of the target and entropy, tiled, never holding the logits.

Program (i, s) takes BLOCK_N tokens and the s-th slice of the vocabulary. It walks that slice
in BLOCK_V tiles; each logits tile z = (h @ W_tile.T + b) / tau is built from BLOCK_D slices of
the model width (fp32 accumulation) and folded into three running numbers per token, with
-inf as the identity of the running max m:

    s = sum_v exp(z_v - m)                  (online log-sum-exp)
    t = sum_v exp(z_v - m) * (z_v - m)      (for the entropy)
    when m grows to m':  s' = a*s,  t' = a*(t + (m - m')*s),  a = exp(m - m')

and the target's logit z_y is picked out of whichever tile holds it. The slice's
lse_s = m + log s and negative entropy B_s = t/s - log s are written out; a tiny O(N x splits)
combine in PyTorch (torch_chunked.combine_vocab_chunks) merges the slices.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..torch_chunked import combine_vocab_chunks
from .launch_config import dot_precision, tile_config, upcast_dots, vocab_split


@triton.jit
def _logprob_forward_kernel(
    hidden_ptr, weight_ptr, bias_ptr, targets_ptr,
    lse_part_ptr, negent_part_ptr, target_logit_part_ptr,
    n_tokens, vocab, width,
    stride_hn, stride_hd, stride_wv, stride_wd,
    inv_tau, tiles_per_split,
    HAS_BIAS: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    # int64 offsets: N * d exceeds 2**31 at long contexts
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_tokens
    y = tl.load(targets_ptr + rows, mask=row_ok, other=0).to(tl.int64)

    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    t = tl.zeros((BLOCK_N,), tl.float32)
    target_logit = tl.zeros((BLOCK_N,), tl.float32)

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
        z = tl.where(col_ok[None, :], acc * inv_tau, float("-inf"))

        target_logit += tl.sum(tl.where(cols[None, :] == y[:, None], z, 0.0), axis=1)

        m_new = tl.maximum(m, tl.max(z, axis=1))
        alpha = tl.exp(m - m_new)
        e = tl.exp(z - m_new[:, None])
        if WITH_ENTROPY:
            shift = tl.where(m == float("-inf"), 0.0, m - m_new)
            centred = tl.where(col_ok[None, :], z - m_new[:, None], 0.0)
            t = alpha * (t + shift * s) + tl.sum(e * centred, axis=1)
        s = alpha * s + tl.sum(e, axis=1)
        m = m_new

    out = pid_s.to(tl.int64) * n_tokens + rows
    log_s = tl.log(s)
    tl.store(lse_part_ptr + out, m + log_s, mask=row_ok)
    tl.store(target_logit_part_ptr + out, target_logit, mask=row_ok)
    if WITH_ENTROPY:
        tl.store(negent_part_ptr + out, t / s - log_s, mask=row_ok)


def logprob_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    with_entropy: bool,
    vocab_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """hidden (N, d), weight (V, d), targets (N,) -> (logp, entropy or None, lse), float32 (N,)."""
    n_tokens, width = hidden.shape
    vocab = weight.shape[0]
    cfg = tile_config("forward")
    tiles_per_split, n_splits = vocab_split(n_tokens, vocab, cfg, hidden.device, vocab_splits)
    parts = torch.empty((3 if with_entropy else 2, n_splits, n_tokens), dtype=torch.float32,
                        device=hidden.device)
    if n_tokens > 0:
        grid = (triton.cdiv(n_tokens, cfg.block_n), n_splits)
        _logprob_forward_kernel[grid](
            hidden, weight, bias if bias is not None else hidden, targets,
            parts[0], parts[2] if with_entropy else parts[0], parts[1],
            n_tokens, vocab, width,
            hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
            1.0 / temperature, tiles_per_split,
            HAS_BIAS=bias is not None,
            WITH_ENTROPY=with_entropy,
            DOT_PRECISION=dot_precision(hidden.dtype),
            UPCAST_DOTS=upcast_dots(hidden.dtype),
            BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_D=cfg.block_d,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    if n_splits == 1:
        lse = parts[0, 0]
        entropy = -parts[2, 0] if with_entropy else None
    else:
        lse, entropy = combine_vocab_chunks(parts[0].T, parts[2].T if with_entropy else None)
    logp = parts[1].sum(0) - lse
    return logp, entropy, lse
