"""Forward: per-token log-prob of the target and entropy, tiled, never holding the logits.

Program (i, s) takes BLOCK_N tokens and the s-th slice of the vocabulary (``split_size``
columns). It walks that slice in BLOCK_V tiles; each logits tile z = (h @ W_tile.T + b) / tau
comes from the shared ``logits_tile`` helper and is folded into three running numbers per token,
with -inf as the identity of the running max m:

    s = sum_v exp(z_v - m)                  (online log-sum-exp)
    t = sum_v exp(z_v - m) * (z_v - m)      (for the entropy)
    when m grows to m':  s' = a*s,  t' = a*(t + (m - m')*s),  a = exp(m - m')

and the target's logit z_y is picked out of whichever tile holds it. The slice's
lse_s = m + log s and negative entropy B_s = t/s - log s are written out; a tiny O(N x splits)
combine in PyTorch (lse_math.combine_vocab_chunks) merges the slices.

Cost: 2 N V d matmul FLOPs; HBM traffic: W is read once per token block (V d * itemsize *
N / BLOCK_N), h once per (token block, split).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..lse_math import combine_vocab_chunks
from .launch_config import float32_gets_one_tile, forward_configs, vocab_split, with_int32_tile_offsets
from .logits_tile import INPUT_FLAGS, clamped_block, logits_tile


@triton.autotune(configs=forward_configs(), key=["width", "vocab"],
                 prune_configs_by={"early_config_prune": float32_gets_one_tile("forward", "hidden_ptr")})
@triton.heuristics({**INPUT_FLAGS, "HAS_ENTROPY": lambda args: args["negent_part_ptr"] is not None})
@triton.jit
def _logprob_forward_kernel(
    hidden_ptr, weight_ptr, bias_ptr, targets_ptr,
    lse_part_ptr, negent_part_ptr, target_logit_part_ptr,
    n_tokens, vocab, width,
    stride_hn, stride_hd, stride_wv, stride_wd,
    inv_tau, split_size,
    HAS_BIAS: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    # int64 block starts (N * d and N * V exceed 2**31 at long contexts), int32 offsets inside
    row_start = pid_n.to(tl.int64) * BLOCK_N
    row_ok, row_idx = clamped_block(row_start, n_tokens, BLOCK_N)
    y = tl.load(targets_ptr + row_start + row_idx).to(tl.int64)

    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    t = tl.zeros((BLOCK_N,), tl.float32)
    target_logit = tl.zeros((BLOCK_N,), tl.float32)

    split_start = pid_s.to(tl.int64) * split_size
    split_end = tl.minimum(vocab, split_start + split_size)  # every split starts inside the vocabulary
    local_cols = tl.arange(0, BLOCK_V)
    for col_start in range(split_start, split_end, BLOCK_V):
        col_ok, col_idx = clamped_block(col_start, split_end, BLOCK_V)
        z = logits_tile(hidden_ptr, weight_ptr, bias_ptr, row_start, row_idx, col_start, col_idx, width,
                        stride_hn, stride_hd, stride_wv, stride_wd, inv_tau,
                        HAS_BIAS, EVEN_D, DOT_PRECISION, UPCAST_DOTS, BLOCK_N, BLOCK_V, BLOCK_D)
        z = tl.where(col_ok[None, :], z, float("-inf"))

        y_local = (y - col_start).to(tl.int32)  # in (-V, V): the target's column in this tile, if any
        # (col_ok: a target past this split's end must not meet a clamped column's -inf)
        hit = (local_cols[None, :] == y_local[:, None]) & col_ok[None, :]
        target_logit += tl.sum(tl.where(hit, z, 0.0), axis=1)

        m_new = tl.maximum(m, tl.max(z, axis=1))
        alpha = tl.exp(m - m_new)
        e = tl.exp(z - m_new[:, None])
        if HAS_ENTROPY:
            shift = tl.where(m == float("-inf"), 0.0, m - m_new)
            centred = tl.where(col_ok[None, :], z - m_new[:, None], 0.0)
            t = alpha * (t + shift * s) + tl.sum(e * centred, axis=1)
        s = alpha * s + tl.sum(e, axis=1)
        m = m_new

    out = pid_s.to(tl.int64) * n_tokens + row_start + tl.arange(0, BLOCK_N)
    log_s = tl.log(s)
    tl.store(lse_part_ptr + out, m + log_s, mask=row_ok)
    tl.store(target_logit_part_ptr + out, target_logit, mask=row_ok)
    if HAS_ENTROPY:
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
    """Log-prob of each target, its entropy and the log-sum-exp of the tempered logits.

    Args:
        hidden: (N, d) float16/bfloat16/float32, any strides.
        weight: (V, d) same dtype as hidden, any strides.
        targets: (N,) contiguous integer ids in [0, V).
        bias: (V,) contiguous, or None.
        temperature: > 0.
        with_entropy: also compute the entropy.
        vocab_splits: vocabulary slices per token block (None: enough programs to fill the GPU).

    Returns:
        (logp, entropy or None, lse), float32, shape (N,) each.
    """
    hidden = with_int32_tile_offsets("hidden", hidden)
    weight = with_int32_tile_offsets("weight", weight)
    n_tokens, width = hidden.shape
    vocab = weight.shape[0]
    split_size, n_splits = vocab_split(n_tokens, vocab, hidden.device, vocab_splits)
    parts = torch.empty((3 if with_entropy else 2, n_splits, n_tokens), dtype=torch.float32,
                        device=hidden.device)
    if n_tokens > 0:
        _logprob_forward_kernel[lambda meta: (triton.cdiv(n_tokens, meta["BLOCK_N"]), n_splits)](
            hidden, weight, bias, targets,
            parts[0], parts[2] if with_entropy else None, parts[1],
            n_tokens, vocab, width,
            hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
            1.0 / temperature, split_size,
        )
    if n_splits == 1:
        lse = parts[0, 0]
        entropy = -parts[2, 0] if with_entropy else None
    else:
        lse, entropy = combine_vocab_chunks(parts[0].T, parts[2].T if with_entropy else None)
    logp = parts[1].sum(0) - lse
    return logp, entropy, lse
