"""The one logits tile every log-prob kernel builds: z = (h @ W.T + b) / tau for a block of
tokens and a block of vocabulary columns, fp32 accumulation over the model width.

Shared by the forward (online log-sum-exp) and the backward's dz kernel, which is also the
known-gradient one-sweep path. ``INPUT_FLAGS`` derives the compile-time flags of every kernel
that calls it from its arguments (``triton.heuristics``), so no placeholder tensors are passed.

Register budget (what keeps the tile on tensor cores without spilling on an H100/H200): the block
offsets are 64-bit scalars (N * d and N * V exceed 2**31 at long contexts) while the per-element
offsets inside a tile are 32-bit, the operand pointers advance by one step per iteration instead
of being rebuilt from 64-bit indices, rows and columns past the end are clamped onto a valid one
instead of masked, and the width loop carries no mask at all when BLOCK_D divides d (``EVEN_D``,
every real model). ``python -m pacs_kernels.triton.compile_check`` reports registers and spills.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .launch_config import dot_precision, upcast_dots

# heuristics shared by the kernels that build logits tiles; keyed on their common argument names
# (BLOCK_D comes from the autotuner's config, which triton.heuristics sees among the arguments)
INPUT_FLAGS = {
    "HAS_BIAS": lambda args: args["bias_ptr"] is not None,
    "EVEN_D": lambda args: args["width"] % args["BLOCK_D"] == 0,
    "DOT_PRECISION": lambda args: dot_precision(args["hidden_ptr"].dtype),
    "UPCAST_DOTS": lambda args: upcast_dots(args["hidden_ptr"].dtype),
}


@triton.jit
def clamped_block(start, limit, BLOCK: tl.constexpr):
    """Local indices 0..BLOCK-1 of the block starting at ``start`` (int64 scalar) of a dimension
    of size ``limit``: (in_range mask, indices with the out-of-range ones replaced by 0), int32.
    Loading through the clamped indices needs no mask; the caller masks what it keeps."""
    local = tl.arange(0, BLOCK)
    ok = local < limit - start
    return ok, tl.where(ok, local, 0)


@triton.jit
def logits_tile(
    hidden_ptr, weight_ptr, bias_ptr,
    row_start, row_idx, col_start, col_idx, width,
    stride_hn, stride_hd, stride_wv, stride_wd, inv_tau,
    HAS_BIAS: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """(BLOCK_N, BLOCK_V) float32 tempered logits of tokens ``row_start + row_idx`` over columns
    ``col_start + col_idx``: block starts are int64 scalars, ``row_idx`` / ``col_idx`` int32
    local indices already clamped into range (see ``clamped_block``; callers mask the result).

    hidden (N, d) and weight (V, d) in any strides and in float16/bfloat16/float32; bias (V,).
    Costs 2 * BLOCK_N * BLOCK_V * d FLOPs (one tensor-core matmul tile).
    """
    ks = tl.arange(0, BLOCK_D)
    h_ptrs = hidden_ptr + row_start * stride_hn + (row_idx[:, None] * stride_hn + ks[None, :] * stride_hd)
    w_ptrs = weight_ptr + col_start * stride_wv + (col_idx[:, None] * stride_wv + ks[None, :] * stride_wd)
    acc = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
    for k0 in range(0, width, BLOCK_D):
        if EVEN_D:
            h = tl.load(h_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = ks < width - k0
            h = tl.load(h_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
        if UPCAST_DOTS:
            h, w = h.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(h, tl.trans(w), acc, input_precision=DOT_PRECISION)
        h_ptrs += BLOCK_D * stride_hd
        w_ptrs += BLOCK_D * stride_wd
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col_start + col_idx).to(tl.float32)[None, :]
    return acc * inv_tau
