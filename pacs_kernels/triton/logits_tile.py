"""The one logits tile every log-prob kernel builds: z = (h @ W.T + b) / tau for a block of
tokens and a block of vocabulary columns, fp32 accumulation over the model width.

Shared by the forward (online log-sum-exp) and the backward's dz kernel, which is also the
known-gradient one-sweep path. ``INPUT_FLAGS`` derives the compile-time flags of every kernel
that calls it from its arguments (``triton.heuristics``), so no placeholder tensors are passed.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .launch_config import dot_precision, upcast_dots

# heuristics shared by the kernels that build logits tiles; keyed on their common argument names
INPUT_FLAGS = {
    "HAS_BIAS": lambda args: args["bias_ptr"] is not None,
    "DOT_PRECISION": lambda args: dot_precision(args["hidden_ptr"].dtype),
    "UPCAST_DOTS": lambda args: upcast_dots(args["hidden_ptr"].dtype),
}


@triton.jit
def logits_tile(
    hidden_ptr, weight_ptr, bias_ptr,
    rows, row_ok, cols, col_ok, width,
    stride_hn, stride_hd, stride_wv, stride_wd, inv_tau,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """(BLOCK_N, BLOCK_V) float32 tempered logits of tokens ``rows`` (int64) over columns
    ``cols`` (int64). Entries outside ``row_ok`` / ``col_ok`` are finite junk: callers mask them.

    hidden (N, d) and weight (V, d) in any strides and in float16/bfloat16/float32; bias (V,).
    Costs 2 * BLOCK_N * BLOCK_V * d FLOPs (one tensor-core matmul tile).
    """
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
    return acc * inv_tau
