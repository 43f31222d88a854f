"""The two gradient matmuls of the backward, from a staged dz chunk, without atomics.

Given dz (C, V) for a chunk of C tokens (written by the dz kernel in logprob_backward.py, input
dtype, already divided by the temperature):

    dh[chunk] = dz @ W          (C, d): program (i, j) owns BLOCK_M tokens x BLOCK_D columns of
                                dh, walks the whole vocabulary, and stores its tile once.
    dW       += dz.T @ h[chunk] (V, d): program (i, j) owns BLOCK_M vocabulary rows x BLOCK_D
                                columns of dW, walks every token of the chunk, and stores once
                                per chunk (reading the previous chunks' float32 sum first).
    db       += sum_t dz[t]     (V,): the column sums, by the dW programs with j == 0.

Every output element has exactly one owner, so there are no atomics and the result is bitwise
reproducible for a fixed tile configuration. Each kernel costs 2 C V d FLOPs.

Program order. Both grids are one-dimensional and walk their output tiles in bands of
``GROUP_ROWS`` tile rows (``grouped_tile``): inside a band the row index runs fastest, then the
column, so the programs resident at once cover a few rows times many columns and share their
operand strips through L2. For dW the rows are vocabulary tiles: the d/BLOCK_D programs that read
one dz strip (C x BLOCK_M) run together, instead of one wave apart per vocabulary sweep as when the
vocabulary was the fastest grid axis (at d=3584 and 128-wide tiles every dz strip was then read
from memory 28 times: about 29 GB per 1 GiB chunk, against about 5 GB in bands of 8). For dh the
rows are token blocks (the dz row strips), the columns d tiles (W's column strips). The order only
decides which program runs when: each tile's own reduction is unchanged, so the results are
bitwise those of any other order.

With gradient filtering the dz kernel leaves one int8 flag per (DZ_BLOCK_N x DZ_BLOCK_V) dz tile,
0 when the whole tile is negligible; the matmuls skip those reduction steps (their BLOCK_M and
BLOCK_K divide the dz tile, so a step never straddles two flags).

Register budget (see logits_tile.py): 64-bit block starts, 32-bit offsets inside a tile, pointers
advanced per step. Along a tensor's contiguous dimension (dz's vocabulary, W's and h's width) the
indices stay a plain ``tl.arange`` so loads and stores vectorize, with a mask only when the block
does not divide the dimension (``EVEN_*``); along the other dimension they are clamped onto a
valid row (no mask). Scalarized loads of a 128 x 64 tile need a 64-bit address per element: that
alone spills.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .launch_config import (
    GRAD_GROUP_ROWS,
    RestoreOutputs,
    dot_precision,
    float32_gets_one_tile,
    grad_matmul_configs,
    upcast_dots,
)
from .logits_tile import clamped_block

_DZ_FLAGS = {
    "FILTER": lambda args: args["flags_ptr"] is not None,
    "EVEN_D": lambda args: args["width"] % args["BLOCK_D"] == 0,
    "DOT_PRECISION": lambda args: dot_precision(args["dz_ptr"].dtype),
    "UPCAST_DOTS": lambda args: upcast_dots(args["dz_ptr"].dtype),
    "GROUP_ROWS": lambda args: GRAD_GROUP_ROWS,
}


@triton.jit
def grouped_tile(pid, n_rows, n_cols, GROUP_ROWS: tl.constexpr):
    """(row, column) of the output tile program ``pid`` owns, for a one-dimensional grid of
    n_rows x n_cols programs walked in bands of GROUP_ROWS rows (the last band may be narrower):
    inside a band the row runs fastest, then the column. A bijection onto the tile grid."""
    per_band = GROUP_ROWS * n_cols
    band = pid // per_band
    first_row = band * GROUP_ROWS
    band_rows = tl.minimum(n_rows - first_row, GROUP_ROWS)
    local = pid - band * per_band
    return first_row + local % band_rows, local // band_rows


@triton.autotune(configs=grad_matmul_configs(), key=["width", "vocab"],
                 prune_configs_by={"early_config_prune": float32_gets_one_tile("grad_matmul", "dz_ptr")})
@triton.heuristics({**_DZ_FLAGS, "EVEN_K": lambda args: args["vocab"] % args["BLOCK_K"] == 0})
@triton.jit
def dh_kernel(
    dz_ptr, weight_ptr, dh_ptr, flags_ptr,
    row0, chunk_len, vocab, width,
    stride_wv, stride_wd, n_flag_cols,
    FLAG_N: tl.constexpr,
    FLAG_V: tl.constexpr,
    FILTER: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOTS: tl.constexpr,
    GROUP_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """dh[row0 + t, :] = sum_v dz[t, v] W[v, :] for the chunk's tokens t; dh (N, d) contiguous,
    stored in its own dtype (float32 accumulation). Grid: cdiv(chunk_len, BLOCK_M) x cdiv(width,
    BLOCK_D) programs in one dimension (token blocks in bands, see ``grouped_tile``)."""
    pid_m, pid_d = grouped_tile(tl.program_id(0), tl.cdiv(chunk_len, BLOCK_M), tl.cdiv(width, BLOCK_D), GROUP_ROWS)
    local_start = pid_m.to(tl.int64) * BLOCK_M  # first row of this block in the chunk
    row_ok, row_idx = clamped_block(local_start, chunk_len, BLOCK_M)
    d_start = pid_d * BLOCK_D
    ds = tl.arange(0, BLOCK_D)
    d_ok = ds < width - d_start
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = dz_ptr + local_start * vocab + (row_idx[:, None] * vocab + ks[None, :])
    b_ptrs = weight_ptr + d_start * stride_wd + (ks[:, None] * stride_wv + ds[None, :] * stride_wd)
    flag_row = (pid_m * BLOCK_M) // FLAG_N
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for k0 in range(0, vocab, BLOCK_K):
        live = True
        if FILTER:
            live = tl.load(flags_ptr + flag_row * n_flag_cols + k0 // FLAG_V) != 0
        if live:
            if EVEN_K:
                a = tl.load(a_ptrs)
                if EVEN_D:
                    b = tl.load(b_ptrs)
                else:
                    b = tl.load(b_ptrs, mask=d_ok[None, :], other=0.0)
            else:
                k_ok = ks < vocab - k0
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
            if UPCAST_DOTS:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_wv
    out = dh_ptr + (row0 + local_start) * width + d_start + (tl.arange(0, BLOCK_M)[:, None] * width + ds[None, :])
    if EVEN_D:
        tl.store(out, acc.to(dh_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        tl.store(out, acc.to(dh_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


_DW_RESTORE = RestoreOutputs("dw_ptr", "db_ptr")  # db_ptr (no bias) or dw_ptr (dW not wanted) may be None


@triton.autotune(configs=grad_matmul_configs(), key=["width", "vocab"],
                 pre_hook=_DW_RESTORE.pre_hook, post_hook=_DW_RESTORE.post_hook,
                 prune_configs_by={"early_config_prune": float32_gets_one_tile("grad_matmul", "dz_ptr")})
@triton.heuristics({
    **_DZ_FLAGS,
    "HAS_DW": lambda args: args["dw_ptr"] is not None,
    "HAS_DB": lambda args: args["db_ptr"] is not None,
    "EVEN_K": lambda args: args["chunk_len"] % args["BLOCK_K"] == 0,
    "EVEN_V": lambda args: args["vocab"] % args["BLOCK_M"] == 0,
})
@triton.jit
def dw_kernel(
    dz_ptr, hidden_ptr, dw_ptr, db_ptr, flags_ptr,
    chunk_len, vocab, width,
    stride_hn, stride_hd, n_flag_cols,
    ACCUMULATE: tl.constexpr,
    FLAG_N: tl.constexpr,
    FLAG_V: tl.constexpr,
    FILTER: tl.constexpr,
    HAS_DW: tl.constexpr,
    HAS_DB: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_V: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOTS: tl.constexpr,
    GROUP_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """dW[v, :] (+)= sum_t dz[t, v] h[t, :] and db[v] (+)= sum_t dz[t, v] over the chunk's tokens t
    (``hidden_ptr`` points at the chunk's first row: the host passes the slice, so no 32-bit
    row0 * stride product can overflow at long contexts).

    dW (V, d) and db (V,) contiguous; with ACCUMULATE the previous value is read first (one
    read and one write of the owned tile per chunk). The RestoreOutputs hooks let the autotuner
    benchmark candidates without adding their results into the buffers.

    Grid: cdiv(vocab, BLOCK_M) x (cdiv(width, BLOCK_D) with dW, else 1) programs in one dimension,
    vocabulary tiles in bands (``grouped_tile``): the programs that read one dz strip run together.
    """
    n_d_tiles = 1
    if HAS_DW:
        n_d_tiles = tl.cdiv(width, BLOCK_D)
    pid_v, pid_d = grouped_tile(tl.program_id(0), tl.cdiv(vocab, BLOCK_M), n_d_tiles, GROUP_ROWS)
    col_start = pid_v.to(tl.int64) * BLOCK_M
    cs = tl.arange(0, BLOCK_M)
    col_ok = cs < vocab - col_start
    d_start = pid_d * BLOCK_D
    ds = tl.arange(0, BLOCK_D)
    d_ok = ds < width - d_start
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = dz_ptr + col_start + (ks[None, :] * vocab + cs[:, None])  # dz.T tile (BLOCK_M, BLOCK_K)
    b_ptrs = hidden_ptr + d_start * stride_hd + (ks[:, None] * stride_hn + ds[None, :] * stride_hd)
    flag_col = (pid_v * BLOCK_M) // FLAG_V
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    bias_acc = tl.zeros((BLOCK_M,), tl.float32)
    for k0 in range(0, chunk_len, BLOCK_K):
        live = True
        if FILTER:
            live = tl.load(flags_ptr + (k0 // FLAG_N) * n_flag_cols + flag_col) != 0
        if live:
            # the token mask runs along the non-contiguous dimension of both tiles (cheap); the
            # vocabulary and width masks along contiguous ones, only where a block overhangs
            k_ok = ks < chunk_len - k0
            if EVEN_K and EVEN_V:
                a = tl.load(a_ptrs)
            elif EVEN_V:
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if HAS_DB:
                bias_acc += tl.sum(a.to(tl.float32), axis=1)
            if HAS_DW:
                if EVEN_K and EVEN_D:
                    b = tl.load(b_ptrs)
                elif EVEN_D:
                    b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
                else:
                    b = tl.load(b_ptrs, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
                if UPCAST_DOTS:
                    a, b = a.to(tl.float32), b.to(tl.float32)
                acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * vocab
        b_ptrs += BLOCK_K * stride_hn
    if HAS_DW:
        out = dw_ptr + col_start * width + d_start + (cs[:, None] * width + ds[None, :])
        if EVEN_D:
            ok = col_ok[:, None]
        else:
            ok = col_ok[:, None] & d_ok[None, :]
        if ACCUMULATE:
            acc += tl.load(out, mask=ok, other=0.0).to(tl.float32)
        tl.store(out, acc.to(dw_ptr.dtype.element_ty), mask=ok)
    if HAS_DB:
        if pid_d == 0:
            if ACCUMULATE:
                bias_acc += tl.load(db_ptr + col_start + cs, mask=col_ok, other=0.0).to(tl.float32)
            tl.store(db_ptr + col_start + cs, bias_acc.to(db_ptr.dtype.element_ty), mask=col_ok)
