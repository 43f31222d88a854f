"""Backward: recompute each logits tile once, stage dz per token chunk, two atomic-free matmuls.

Gradient. For a token with logits z = (h @ W.T + b) / tau, p = softmax(z), log p = z - lse,
entropy H, and upstream gradients g_l (on logp) and g_H (on the entropy):

    dlogp/dz_k = onehot(y)_k - p_k
    dH/dz_k    = -p_k * (log p_k + H)
    dz_k       = g_l * onehot(y)_k - p_k * (g_l + g_H * (log p_k + H))

and with dlogits = dz / tau:  dh = dlogits @ W,  dW = dlogits.T @ h,  dbias = column sums.

Design. The tokens are cut into chunks of C tokens (C * V dz elements fit ``DZ_CHUNK_BYTES``,
1 GiB by default). Per chunk:

1. the dz kernel (below): program (i, j) rebuilds the logits tile of token block i and vocabulary
   tile j with the shared ``logits_tile`` helper and the saved per-token lse, forms dlogits in
   registers and stores it in the input dtype into the (C, V) buffer. It sees every (token,
   vocabulary) pair exactly once, so it also writes the known-gradient path's log-probs
   (``logp_out``) and the gradient-filter flags.
2. ``grad_matmuls.dh_kernel``: programs own (token block, d tile) of dh, walk the vocabulary.
3. ``grad_matmuls.dw_kernel``: programs own (vocabulary tile, d tile) of dW (and dbias), walk
   the chunk's tokens; across chunks they add into one float32 (V, d) buffer they alone own.

Steps 2 and 3 are plain GEMMs on the staged chunk, so they can also run as ``torch.mm`` (cuBLAS on
CUDA: bf16 tensor cores, float32 accumulation, dW added in place into the float32 buffer with
``addmm(out_dtype=float32)``; ``grad_products``). Which one runs is the GEMM engine
(``dispatch.grad_gemms``): on CUDA what the committed GPU run measured faster at the shape, cuBLAS
until a run has measured it (a vendor GEMM is the safe guess for a plain GEMM); in the CPU
interpreter the Triton kernels (they are what the tests check); ``gemms=`` forces one
(``LossOptions(grad_gemms=...)``, ``linear_logprobs(grad_gemms=...)``).
Gradient filtering always uses the Triton kernels (only they skip the flagged tiles).

Cost: 3 matmuls of 2 N V d FLOPs each (recompute, dh, dW): 6 N V d, the same as a backward
that materializes the logits; the forward adds 2 N V d (8 N V d, four matmuls, for the two-pass
loss; the one-sweep path is this backward alone: three). Extra HBM traffic: dz written once
and read by each matmul (about 3 N V * itemsize bytes, ~3% of the matmul time at Qwen2.5-7B
shapes on an H200) plus, with more than one chunk, one float32 read+write of dW per chunk
(8 V d bytes each). Extra memory: the dz chunk (<= 1 GiB), and a float32 (V, d) buffer only
when there is more than one chunk; dh, and dW for a single chunk, are stored straight in the
input dtype.

Why not the alternatives. The previous kernel added every token block's dW tile into float32
dW with ``tl.atomic_add``: at N=32768, d=3584, V=152064 and 64-token blocks that is ~1e12 bytes
of contended atomic traffic, several times the matmul time. Recomputing the logits inside
programs that own output tiles (no staging) needs the full (BLOCK_V, d) dW row block, or the
(BLOCK_N, d) dh row block, in registers: at d = 3584 that does not fit, and tiling d in the grid
makes every d tile recompute the logits over the full width, multiplying the recompute FLOPs by
d / BLOCK_D (14-28x at d = 3584). Staging dz keeps the recompute at one matmul, leaves the two
gradient products as plain GEMMs with one owner per output tile, and is deterministic.

Opt-in gradient filtering (as in Cut Cross-Entropy): a dz tile whose every |dz| is below
``filter_eps`` and that holds no target is flagged, not stored, and skipped by both matmuls.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import dispatch
from ..matmul import addmm_f32_, gemm_in_input_dtype, has_out_dtype, mm_into
from .grad_matmuls import dh_kernel, dw_kernel
from .launch_config import (
    DZ_BLOCK_N,
    DZ_BLOCK_V,
    dz_chunk_tokens,
    dz_configs,
    float32_gets_one_tile,
    with_int32_tile_offsets,
)
from .logits_tile import INPUT_FLAGS, clamped_block, logits_tile


@triton.autotune(configs=dz_configs(), key=["width", "vocab"],
                 prune_configs_by={"early_config_prune": float32_gets_one_tile("dz", "hidden_ptr")})
@triton.heuristics({
    **INPUT_FLAGS,
    "HAS_GRAD_LOGP": lambda args: args["grad_logp_ptr"] is not None,
    "HAS_GRAD_ENTROPY": lambda args: args["grad_entropy_ptr"] is not None,
    "STORE_DZ": lambda args: args["dz_ptr"] is not None,
    "WRITE_LOGP": lambda args: args["logp_out_ptr"] is not None,
    "FILTER": lambda args: args["flags_ptr"] is not None,
    "EVEN_V": lambda args: args["vocab"] % args["BLOCK_V"] == 0,
})
@triton.jit
def _dz_kernel(
    hidden_ptr, weight_ptr, bias_ptr, targets_ptr,
    lse_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr,
    dz_ptr, flags_ptr, logp_out_ptr,
    row0, chunk_len, vocab, width,
    stride_hn, stride_hd, stride_wv, stride_wd,
    inv_tau, filter_eps,
    HAS_BIAS: tl.constexpr,
    HAS_GRAD_LOGP: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    STORE_DZ: tl.constexpr,
    WRITE_LOGP: tl.constexpr,
    FILTER: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_V: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    # int64 block starts, int32 offsets inside the tile (see logits_tile.py)
    local_start = pid_n.to(tl.int64) * BLOCK_N  # first row of this block in the chunk
    row_start = row0 + local_start
    row_ok, row_idx = clamped_block(local_start, chunk_len, BLOCK_N)
    col_start = pid_v.to(tl.int64) * BLOCK_V
    col_ok, col_idx = clamped_block(col_start, vocab, BLOCK_V)
    y_local = (tl.load(targets_ptr + row_start + row_idx).to(tl.int64) - col_start).to(tl.int32)
    lse = tl.load(lse_ptr + row_start + row_idx).to(tl.float32)

    z = logits_tile(hidden_ptr, weight_ptr, bias_ptr, row_start, row_idx, col_start, col_idx, width,
                    stride_hn, stride_hd, stride_wv, stride_wd, inv_tau,
                    HAS_BIAS, EVEN_D, DOT_PRECISION, UPCAST_DOTS, BLOCK_N, BLOCK_V, BLOCK_D)
    # Rows and columns past the end were clamped onto the block's first row / column, so their
    # entries are copies of real ones: finite, never masked in the arithmetic below, only at the
    # stores. They cannot change a filter flag either: a copied row repeats row 0 exactly; a copied
    # column holds no target (every target is < V), so its dz differs from column 0's only where
    # column 0 is a target, and such a tile is live anyway. Fewer 2-D masks and temporaries keep the
    # tile in registers.
    is_target = tl.arange(0, BLOCK_V)[None, :] == y_local[:, None]
    if WRITE_LOGP:  # known-gradient one-sweep path: the forward's log-prob falls out of this tile
        rows = row_start + tl.arange(0, BLOCK_N)
        in_tile = row_ok & (y_local >= 0) & (y_local < BLOCK_V)
        tl.store(logp_out_ptr + rows, tl.sum(tl.where(is_target, z, 0.0), axis=1) - lse, mask=in_tile)
    if STORE_DZ:
        log_p = z - lse[:, None]
        if HAS_GRAD_LOGP:
            g_l = tl.load(grad_logp_ptr + row_start + row_idx).to(tl.float32)
        else:
            g_l = tl.zeros((BLOCK_N,), tl.float32)
        if HAS_GRAD_ENTROPY:
            g_h = tl.load(grad_entropy_ptr + row_start + row_idx).to(tl.float32)
            ent = tl.load(entropy_ptr + row_start + row_idx).to(tl.float32)
            coef = g_l[:, None] + g_h[:, None] * (log_p + ent[:, None])
        else:
            coef = g_l[:, None]
        dz = (tl.where(is_target, g_l[:, None], 0.0) - tl.exp(log_p) * coef) * inv_tau
        dz_tile = dz_ptr + (local_start * vocab + col_start) + (tl.arange(0, BLOCK_N)[:, None] * vocab
                                                                 + tl.arange(0, BLOCK_V)[None, :])
        if EVEN_V:  # a mask along the contiguous vocabulary would scalarize the store
            store_ok = row_ok[:, None]
        else:
            store_ok = row_ok[:, None] & col_ok[None, :]
        if FILTER:
            live = (tl.max(tl.abs(dz)) >= filter_eps) | (tl.sum(is_target.to(tl.int32)) > 0)
            tl.store(flags_ptr + pid_n * tl.num_programs(1) + pid_v, live.to(tl.int8))
            if live:
                tl.store(dz_tile, dz.to(dz_ptr.dtype.element_ty), mask=store_ok)
        else:
            tl.store(dz_tile, dz.to(dz_ptr.dtype.element_ty), mask=store_ok)


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
    chunk_tokens: int | None = None,
    gemms: str | None = None,
    dispatch_table: str | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients (dhidden, dweight, dbias) of sum(g_l * logp + g_H * entropy).

    Args:
        hidden (N, d), weight (V, d): float16/bfloat16/float32, any strides.
        targets (N,) contiguous ints; bias (V,) contiguous or None; temperature > 0.
        lse (N,) float32: the forward's log-sum-exp. entropy (N,) float32 or None.
        grad_logp, grad_entropy: (N,) upstream gradients or None (None counts as zero; the
            entropy gradient is ignored when ``entropy`` is None).
        needs: which of (dhidden, dweight, dbias) to compute; the others come back None.
        filter_eps: skip dz tiles whose every |dz| < filter_eps and that hold no target.
        vocab_splits: accepted for the caller's uniform options; the backward's grid already
            covers every (token block, vocabulary tile) pair, so it splits nothing.
        logp_out: optional float32 (N,) receiving each token's log-prob z_y - lse, from the same
            logits tiles (the known-gradient one-sweep path).
        chunk_tokens: tokens per staged dz chunk (default: the chunk fits DZ_CHUNK_BYTES).
        gemms: "triton" | "torch": which GEMMs form dh and dW from the staged chunk (default:
            ``dispatch.grad_gemms`` with ``dispatch_table``, None: the packaged table); with
            ``filter_eps`` always "triton".

    Returns:
        (dhidden (N, d), dweight (V, d), dbias (V,)) in the input dtypes, float32 accumulation,
        None where not needed.
    """
    del vocab_splits  # see the docstring
    hidden = with_int32_tile_offsets("hidden", hidden)
    weight = with_int32_tile_offsets("weight", weight)
    n_tokens, width = hidden.shape
    vocab = weight.shape[0]
    need_h, need_w, need_b = needs
    need_b = need_b and bias is not None
    has_grad_entropy = grad_entropy is not None and entropy is not None
    has_upstream = grad_logp is not None or has_grad_entropy
    dev = hidden.device
    d_hidden = torch.empty((n_tokens, width), dtype=hidden.dtype, device=dev) if need_h else None
    if not (has_upstream and n_tokens > 0):  # no gradient flows: zeros, but logp_out still wanted
        if logp_out is not None and n_tokens > 0:
            _launch_chunks(hidden, weight, targets, bias, temperature, lse, None, None, None,
                           None, None, None, logp_out, None, n_tokens, store_dz=False, gemms="triton")
        return (
            d_hidden.zero_() if need_h else None,
            torch.zeros_like(weight, memory_format=torch.contiguous_format) if need_w else None,
            torch.zeros_like(bias) if need_b else None,
        )
    if not (need_h or need_w or need_b or logp_out is not None):
        return None, None, None
    chunk = dz_chunk_tokens(n_tokens, vocab, hidden.element_size(), chunk_tokens)
    multi = chunk < n_tokens
    filtering = filter_eps is not None and filter_eps > 0
    if gemms is None:
        rounds = multi and gemm_in_input_dtype(dev, hidden.dtype) and not has_out_dtype(dev, hidden.dtype)
        gemms = dispatch.grad_gemms(n_tokens, width, vocab, dispatch.dtype_name(hidden.dtype), dev.type,
                                    torch_accumulates_in_float32=not rounds, table=dispatch_table)
    elif gemms not in dispatch.GRAD_GEMMS:
        raise ValueError(f"gemms must be None or one of {dispatch.GRAD_GEMMS}, got {gemms!r}")
    d_weight = torch.empty((vocab, width), dtype=torch.float32 if multi else weight.dtype,
                           device=dev) if need_w else None
    d_bias = torch.empty(vocab, dtype=torch.float32 if multi else bias.dtype, device=dev) if need_b else None
    _launch_chunks(hidden, weight, targets, bias, temperature, lse,
                   entropy if has_grad_entropy else None,
                   grad_logp.contiguous() if grad_logp is not None else None,
                   grad_entropy.contiguous() if has_grad_entropy else None,
                   d_hidden, d_weight, d_bias, logp_out, filter_eps, chunk,
                   store_dz=need_h or need_w or need_b, gemms="triton" if filtering else gemms)
    return (
        d_hidden,
        d_weight.to(weight.dtype) if need_w else None,
        d_bias.to(bias.dtype) if need_b else None,
    )


def _launch_chunks(hidden, weight, targets, bias, temperature, lse, entropy, grad_logp, grad_entropy,
                   d_hidden, d_weight, d_bias, logp_out, filter_eps, chunk, *, store_dz, gemms):
    """Run the dz kernel and the two gradient matmuls over token chunks of ``chunk`` tokens."""
    n_tokens, width = hidden.shape
    vocab = weight.shape[0]
    dev = hidden.device
    dz = torch.empty((chunk, vocab), dtype=hidden.dtype, device=dev) if store_dz else None
    n_flag_cols = triton.cdiv(vocab, DZ_BLOCK_V)
    flags = None
    if store_dz and filter_eps is not None and filter_eps > 0:
        flags = torch.empty((triton.cdiv(chunk, DZ_BLOCK_N), n_flag_cols), dtype=torch.int8, device=dev)
    inv_tau = 1.0 / temperature
    for index, row0 in enumerate(range(0, n_tokens, chunk)):
        chunk_len = min(chunk, n_tokens - row0)
        _dz_kernel[(triton.cdiv(chunk_len, DZ_BLOCK_N), n_flag_cols)](
            hidden, weight, bias, targets, lse, entropy, grad_logp, grad_entropy,
            dz, flags, logp_out,
            row0, chunk_len, vocab, width,
            hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
            inv_tau, float(filter_eps or 0.0),
            BLOCK_N=DZ_BLOCK_N, BLOCK_V=DZ_BLOCK_V,
        )
        if store_dz:
            grad_products(dz[:chunk_len], weight, hidden, d_hidden, d_weight, d_bias, row0=row0,
                          accumulate=index > 0, gemms=gemms, flags=flags)


def grad_products(dz, weight, hidden, d_hidden, d_weight, d_bias, *, row0, accumulate, gemms, flags=None):
    """dh[row0:row0 + C] = dz @ W, dW (+)= dz.T @ h[row0:row0 + C], db (+)= column sums of dz.

    dz (C, V) is one staged chunk in the input dtype, already divided by the temperature; hidden and
    d_hidden are the whole (N, d) tensors. d_weight / d_bias: the input dtype when there is one chunk
    (written), float32 when there are several (``accumulate``: added to the previous chunks').
    ``gemms``: "triton" (grad_matmuls.py; ``flags`` skips filtered tiles) or "torch" (torch.mm:
    cuBLAS on CUDA, float32 accumulation; no filtering). Either may be None to skip that output.
    """
    chunk_len, vocab = dz.shape
    width = hidden.shape[1]
    if gemms == "torch":
        if flags is not None:
            raise ValueError("gradient filtering (flags) needs gemms='triton'")
        h_chunk = hidden[row0:row0 + chunk_len]
        if d_hidden is not None:
            mm_into(d_hidden[row0:row0 + chunk_len], dz, weight)
        if d_weight is not None:
            if accumulate:
                addmm_f32_(d_weight, dz.T, h_chunk)
            elif d_weight.dtype == dz.dtype:
                mm_into(d_weight, dz.T, h_chunk)
            else:  # the float32 buffer of several chunks: its first chunk
                addmm_f32_(d_weight.zero_(), dz.T, h_chunk)
        if d_bias is not None:
            sums = dz.sum(0, dtype=torch.float32)
            d_bias.add_(sums) if accumulate else d_bias.copy_(sums)
        return
    n_flag_cols = triton.cdiv(vocab, DZ_BLOCK_V)
    if d_hidden is not None:
        dh_kernel[lambda meta: (triton.cdiv(chunk_len, meta["BLOCK_M"]) * triton.cdiv(width, meta["BLOCK_D"]),)](
            dz, weight, d_hidden, flags,
            row0, chunk_len, vocab, width,
            weight.stride(0), weight.stride(1), n_flag_cols,
            FLAG_N=DZ_BLOCK_N, FLAG_V=DZ_BLOCK_V,
        )
    if d_weight is not None or d_bias is not None:
        d_tiles = (lambda meta: triton.cdiv(width, meta["BLOCK_D"])) if d_weight is not None else (lambda meta: 1)
        dw_kernel[lambda meta: (triton.cdiv(vocab, meta["BLOCK_M"]) * d_tiles(meta),)](
            dz, hidden[row0:row0 + chunk_len], d_weight, d_bias, flags,
            chunk_len, vocab, width,
            hidden.stride(0), hidden.stride(1), n_flag_cols,
            ACCUMULATE=accumulate, FLAG_N=DZ_BLOCK_N, FLAG_V=DZ_BLOCK_V,
        )
