"""Row kernels of the single pass: log-sum-exp of a logits tile, then dz, reading it twice in all.

The single pass (single_pass.py) holds one chunk's logits z (C, V) in float32 from a cuBLAS GEMM.
In eager PyTorch, turning them into dz = g * (onehot(y) - softmax(z)) / tau takes about nine
passes over the tile (max, shift, exp, sum, scale, cast ...). These two kernels take two reads
and one write of the low-precision dz:

    row_lse:   per row, one read with an online max / sum (and, optionally, the entropy):
               zt = (z + b) / tau;  lse = log sum_v exp(zt_v);  target = zt[y];
               H = lse - sum_v softmax(zt)_v zt_v
    row_grad:  per row, one read and one write (in place when dz is z itself):
               dz_v = (g / tau) * ([v == y] - exp(zt_v - lse))

The bias, the temperature and an optional Gemma-style soft-cap (c * tanh(x / c), before the
temperature; its slope 1 - tanh^2 multiplies dz) are applied inside both kernels, so they cost no
pass of their own.
One program per row walks the vocabulary in BLOCK_V slices (int64 row offsets: C * V may exceed 2^31).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 1024


@triton.jit
def _tanh(x):
    """tanh(x) = 1 - 2 / (exp(2x) + 1): exact limits +-1 for large |x| (exp overflowing to inf or to 0)."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _capped_logits(row_base, bias_ptr, offs, inside, softcap, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """(capped logits, tanh(x / c)) over one slice of a row, float32: x = z + b, capped c * tanh(x / c)
    when HAS_SOFTCAP (else x, and the second value is unused)."""
    x = tl.load(row_base + offs, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(bias_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    t = x
    if HAS_SOFTCAP:
        t = _tanh(x / softcap)
        x = softcap * t
    return x, t


@triton.jit
def _tempered_slice(row_base, bias_ptr, offs, inside, inv_tau, softcap, HAS_BIAS: tl.constexpr,
                    HAS_SOFTCAP: tl.constexpr):
    """(capped (z + b)) / tau over one slice of a row, float32 (0 where ``inside`` is False)."""
    x, _ = _capped_logits(row_base, bias_ptr, offs, inside, softcap, HAS_BIAS, HAS_SOFTCAP)
    return x * inv_tau


@triton.heuristics({"HAS_BIAS": lambda args: args["bias_ptr"] is not None,
                    "WITH_ENTROPY": lambda args: args["entropy_ptr"] is not None,
                    "HAS_SOFTCAP": lambda args: args["softcap"] > 0})
@triton.jit
def _row_lse_kernel(z_ptr, y_ptr, bias_ptr, lse_ptr, target_ptr, entropy_ptr, V, stride_z, inv_tau, softcap,
                    BLOCK_V: tl.constexpr, HAS_BIAS: tl.constexpr, WITH_ENTROPY: tl.constexpr,
                    HAS_SOFTCAP: tl.constexpr):
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * stride_z
    running_max = tl.zeros((), dtype=tl.float32) - float("inf")
    running_sum = tl.zeros((), dtype=tl.float32)
    running_dot = tl.zeros((), dtype=tl.float32)  # sum_v exp(zt_v - max) * zt_v, for the entropy
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        inside = offs < V
        z = tl.where(inside, _tempered_slice(base, bias_ptr, offs, inside, inv_tau, softcap, HAS_BIAS, HAS_SOFTCAP),
                     float("-inf"))
        new_max = tl.maximum(running_max, tl.max(z, axis=0))
        rescale = tl.exp(running_max - new_max)
        e = tl.exp(z - new_max)
        running_sum = running_sum * rescale + tl.sum(e, axis=0)
        if WITH_ENTROPY:
            running_dot = running_dot * rescale + tl.sum(tl.where(inside, e * z, 0.0), axis=0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    y = tl.load(y_ptr + row).to(tl.int64)
    tl.store(lse_ptr + row, lse)
    tl.store(target_ptr + row, _tempered_slice(base, bias_ptr, y, y >= 0, inv_tau, softcap, HAS_BIAS, HAS_SOFTCAP))
    if WITH_ENTROPY:
        tl.store(entropy_ptr + row, lse - running_dot / running_sum)


@triton.heuristics({"HAS_BIAS": lambda args: args["bias_ptr"] is not None,
                    "HAS_SOFTCAP": lambda args: args["softcap"] > 0})
@triton.jit
def _row_grad_kernel(z_ptr, dz_ptr, y_ptr, bias_ptr, lse_ptr, g_ptr, V, stride_z, stride_dz, inv_tau, softcap,
                     BLOCK_V: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    row = tl.program_id(0)
    z_base = z_ptr + row.to(tl.int64) * stride_z
    dz_base = dz_ptr + row.to(tl.int64) * stride_dz
    g = tl.load(g_ptr + row).to(tl.float32) * inv_tau
    lse = tl.load(lse_ptr + row).to(tl.float32)
    y = tl.load(y_ptr + row).to(tl.int64)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        inside = offs < V
        x, t = _capped_logits(z_base, bias_ptr, offs, inside, softcap, HAS_BIAS, HAS_SOFTCAP)
        dz = -g * tl.exp(x * inv_tau - lse)
        dz = tl.where(offs == y, dz + g, dz)
        if HAS_SOFTCAP:  # through the cap: d(c tanh(x / c))/dx = 1 - tanh^2
            dz = dz * (1.0 - t * t)
        tl.store(dz_base + offs, dz.to(dz_ptr.dtype.element_ty), mask=inside)


def row_lse(z: torch.Tensor, targets: torch.Tensor, bias: torch.Tensor | None, temperature: float,
            with_entropy: bool, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """z (C, V) float32 raw logits (no bias, no temperature) -> (lse, target logit, entropy or None),
    each (C,) float32, of the tempered logits (z + bias) / temperature, soft-capped first
    (c * tanh((z + bias) / c)) when ``softcap`` is given."""
    rows, vocab = z.shape
    lse = torch.empty(rows, dtype=torch.float32, device=z.device)
    target = torch.empty_like(lse)
    entropy = torch.empty_like(lse) if with_entropy else None
    if rows:
        _row_lse_kernel[(rows,)](z, targets, bias, lse, target, entropy, vocab, z.stride(0), 1.0 / temperature,
                                 float(softcap or 0.0), BLOCK_V=min(BLOCK_V, triton.next_power_of_2(vocab)))
    return lse, target, entropy


def row_grad(z: torch.Tensor, targets: torch.Tensor, bias: torch.Tensor | None, temperature: float,
             lse: torch.Tensor, grad_logp: torch.Tensor, out: torch.Tensor,
             softcap: float | None = None) -> torch.Tensor:
    """dz = grad_logp * (onehot(targets) - softmax((z + bias) / temperature)) / temperature written
    into ``out`` (C, V), any float dtype; ``out`` may be ``z`` itself (in place). With ``softcap``
    the logits are c * tanh((z + bias) / c) and dz carries the cap's slope 1 - tanh^2."""
    rows, vocab = z.shape
    if rows:
        _row_grad_kernel[(rows,)](z, out, targets, bias, lse, grad_logp.float().contiguous(), vocab, z.stride(0),
                                  out.stride(0), 1.0 / temperature, float(softcap or 0.0),
                                  BLOCK_V=min(BLOCK_V, triton.next_power_of_2(vocab)))
    return out
