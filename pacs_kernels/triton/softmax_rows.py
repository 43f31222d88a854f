"""Row kernels of the single pass: log-sum-exp of a logits tile, then dz, reading it twice in all.

The single pass (single_pass.py) gets one strip of a chunk's logits z (S, V) in float32 from a cuBLAS
GEMM. In eager PyTorch, turning them into dz = g * (onehot(y) - softmax(z)) / tau takes about nine
passes over the tile (max, shift, exp, sum, scale, cast ...). These kernels take two reads and two
writes, and let the chunk be held in 16 bits between them:

    row_lse:   per row, one read with an online max / sum (and, optionally, the entropy):
               zt = (z + b) / tau;  lse = log sum_v exp(zt_v);  target = zt[y];
               H = lse - sum_v softmax(zt)_v zt_v
               With ``probs_out`` it also writes, in that same read, the row's unnormalised
               probabilities in the tile's dtype (bf16 on a GPU), slice by slice,
                   e_v = exp(zt_v - m_s) * slope_v,   m_s = max of the BLOCK_V slice s holding v,
               with m_s kept per slice (float32, V / BLOCK_V per row) and, per row, the target's
               coefficient (1 - p_y) * slope_y in float32 (slope: the soft-cap's, else 1), 1 - p_y
               summed as the other entries' share: exact to float32 even where p_y rounds to 1.
    row_grad_from_probs:  dz_v = -(g / tau) * e_v * exp(m_s - lse)   (v != y)
                          dz_y =  (g / tau) * (1 - p_y) * slope_y      (float32, no cancellation)
               one read of e and one write of dz (in place: dz over e).
    row_grad:  the same dz from the float32 logits themselves (a tile rebuilt once g is known):
               dz_v = (g / tau) * ([v == y] - exp(zt_v - lse)) * slope_v

Why 16 bits are enough: on a GPU dz is rounded to the GEMM dtype anyway before dh = dz W and
dW = dz^T h. Storing e_v in bf16 adds one more rounding of the same size (relative 2^-9) to every
entry but the target's, which is kept in float32 because 1 - p_y cancels when p_y is near 1. The
chunk then costs 2 bytes per logit instead of 6 (float32 logits + a bf16 dz copy): after its
float32 strip (a quarter of the budget) the same budget holds 2.25x the tokens.

The bias, the temperature and an optional Gemma-style soft-cap (c * tanh(x / c), before the
temperature; its slope 1 - tanh^2 multiplies dz) are applied inside the kernels, so they cost no
pass of their own. One program per row walks the vocabulary in BLOCK_V slices (int64 row offsets:
S * V may exceed 2^31).
"""

from __future__ import annotations

from typing import NamedTuple

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


@triton.heuristics({"HAS_BIAS": lambda args: args["bias_ptr"] is not None,
                    "WITH_ENTROPY": lambda args: args["entropy_ptr"] is not None,
                    "WRITE_PROBS": lambda args: args["probs_ptr"] is not None,
                    "HAS_SOFTCAP": lambda args: args["softcap"] > 0})
@triton.jit
def _row_lse_kernel(z_ptr, y_ptr, bias_ptr, lse_ptr, target_ptr, entropy_ptr, probs_ptr, slice_max_ptr, coef_ptr,
                    V, stride_z, stride_p, n_slices, inv_tau, softcap,
                    BLOCK_V: tl.constexpr, HAS_BIAS: tl.constexpr, WITH_ENTROPY: tl.constexpr,
                    WRITE_PROBS: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * stride_z
    y = tl.load(y_ptr + row).to(tl.int32)
    running_max = tl.zeros((), dtype=tl.float32) - float("inf")
    running_sum = tl.zeros((), dtype=tl.float32)
    running_dot = tl.zeros((), dtype=tl.float32)  # sum_v exp(zt_v - max) * zt_v, for the entropy
    running_other = tl.zeros((), dtype=tl.float32)  # the sum without the target: 1 - p_y, no cancellation
    target = tl.zeros((), dtype=tl.float32)  # read in the sweep: probs_out may overwrite z in place
    target_tanh = tl.zeros((), dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        inside = offs < V
        x, t = _capped_logits(base, bias_ptr, offs, inside, softcap, HAS_BIAS, HAS_SOFTCAP)
        z = tl.where(inside, x * inv_tau, float("-inf"))
        is_target = offs == y
        target += tl.sum(tl.where(is_target, z, 0.0), axis=0)
        if HAS_SOFTCAP:
            target_tanh += tl.sum(tl.where(is_target, t, 0.0), axis=0)
        # the slice's own max (0 for a slice of -inf logits, e.g. a bias masking tokens), then the
        # running one: e is taken once, relative to the slice, and rescaled as a sum
        slice_max = tl.max(z, axis=0)
        slice_max = tl.where(slice_max == float("-inf"), 0.0, slice_max)
        e = tl.exp(z - slice_max)
        new_max = tl.maximum(running_max, slice_max)
        rescale = tl.exp(running_max - new_max)
        weight = tl.exp(slice_max - new_max)
        running_sum = running_sum * rescale + tl.sum(e, axis=0) * weight
        if WRITE_PROBS:
            running_other = running_other * rescale + tl.sum(tl.where(is_target, 0.0, e), axis=0) * weight
        if WITH_ENTROPY:
            running_dot = running_dot * rescale + tl.sum(tl.where(e > 0.0, e * z, 0.0), axis=0) * weight
        running_max = new_max
        if WRITE_PROBS:
            q = e
            if HAS_SOFTCAP:  # the cap's slope 1 - tanh^2, folded into what the gradient will read
                q = e * (1.0 - t * t)
            tl.store(probs_ptr + row.to(tl.int64) * stride_p + offs, q.to(probs_ptr.dtype.element_ty), mask=inside)
            tl.store(slice_max_ptr + row.to(tl.int64) * n_slices + v0 // BLOCK_V, slice_max)
    lse = running_max + tl.log(running_sum)
    tl.store(lse_ptr + row, lse)
    tl.store(target_ptr + row, target)
    if WITH_ENTROPY:
        tl.store(entropy_ptr + row, lse - running_dot / running_sum)
    if WRITE_PROBS:
        coef = running_other / running_sum  # = 1 - p_y to float32's relative precision, even at p_y ~ 1
        if HAS_SOFTCAP:
            coef = coef * (1.0 - target_tanh * target_tanh)
        tl.store(coef_ptr + row, coef)


@triton.jit
def _row_grad_probs_kernel(probs_ptr, dz_ptr, y_ptr, slice_max_ptr, lse_ptr, coef_ptr, g_ptr, V, stride_p, stride_dz,
                           n_slices, inv_tau, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    p_base = probs_ptr + row.to(tl.int64) * stride_p
    dz_base = dz_ptr + row.to(tl.int64) * stride_dz
    m_base = slice_max_ptr + row.to(tl.int64) * n_slices
    g = tl.load(g_ptr + row).to(tl.float32) * inv_tau
    lse = tl.load(lse_ptr + row)
    y = tl.load(y_ptr + row).to(tl.int32)
    target_dz = g * tl.load(coef_ptr + row)
    for s in range(0, n_slices):
        offs = s * BLOCK_V + tl.arange(0, BLOCK_V)
        inside = offs < V
        e = tl.load(p_base + offs, mask=inside, other=0.0).to(tl.float32)
        scale = -g * tl.exp(tl.load(m_base + s) - lse)  # -(g / tau) * exp(m_s - lse), once per slice
        dz = tl.where(offs == y, target_dz, e * scale)
        tl.store(dz_base + offs, dz.to(dz_ptr.dtype.element_ty), mask=inside)


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


class RowProbs(NamedTuple):
    """A logits tile held as what its gradient needs (written by ``row_lse(..., probs_out=...)``):
    e (C, V) in the tile's dtype (row-contiguous), the float32 slice maxima (C, V / BLOCK_V) and
    the float32 target coefficients (C,)."""

    probs: torch.Tensor
    slice_max: torch.Tensor
    target_coef: torch.Tensor

    @classmethod
    def empty(cls, rows: int, vocab: int, dtype: torch.dtype, device: torch.device,
              probs: torch.Tensor | None = None) -> "RowProbs":
        """Room for ``rows`` rows; ``probs`` may be given (e.g. the float32 logits, overwritten in place)."""
        if probs is None:
            probs = torch.empty(rows, vocab, dtype=dtype, device=device)
        return cls(probs, torch.empty(rows, slices_per_row(vocab), dtype=torch.float32, device=device),
                   torch.empty(rows, dtype=torch.float32, device=device))

    def rows(self, r0: int, r1: int) -> "RowProbs":
        """Rows r0:r1 (views)."""
        return RowProbs(self.probs[r0:r1], self.slice_max[r0:r1], self.target_coef[r0:r1])


def _block_v(vocab: int) -> int:
    return min(BLOCK_V, triton.next_power_of_2(vocab))


def slices_per_row(vocab: int) -> int:
    """How many BLOCK_V slices (hence float32 slice maxima) one row of ``vocab`` logits has."""
    return triton.cdiv(vocab, _block_v(vocab))


def row_lse(z: torch.Tensor, targets: torch.Tensor, bias: torch.Tensor | None, temperature: float,
            with_entropy: bool, softcap: float | None = None, probs_out: RowProbs | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """z (C, V) float32 raw logits (no bias, no temperature) -> (lse, target logit, entropy or None),
    each (C,) float32, of the tempered logits (z + bias) / temperature, soft-capped first
    (c * tanh((z + bias) / c)) when ``softcap`` is given. With ``probs_out`` (``RowProbs.empty``; its
    ``probs`` any float dtype, and may be ``z`` itself) the same read also writes the tile as its
    gradient will read it (:func:`row_grad_from_probs`)."""
    rows, vocab = z.shape
    lse = torch.empty(rows, dtype=torch.float32, device=z.device)
    target = torch.empty_like(lse)
    entropy = torch.empty_like(lse) if with_entropy else None
    if probs_out is not None and (probs_out.probs.shape != z.shape or probs_out.probs.stride(1) != 1
                                  or probs_out.slice_max.shape != (rows, slices_per_row(vocab))):
        raise ValueError(f"probs_out must hold {rows} row-contiguous rows of {vocab} (RowProbs.empty), got probs "
                         f"{tuple(probs_out.probs.shape)} and slice maxima {tuple(probs_out.slice_max.shape)}")
    if rows:
        p = probs_out
        _row_lse_kernel[(rows,)](z, targets, bias, lse, target, entropy, None if p is None else p.probs,
                                 None if p is None else p.slice_max, None if p is None else p.target_coef,
                                 vocab, z.stride(0), 0 if p is None else p.probs.stride(0),
                                 slices_per_row(vocab), 1.0 / temperature, float(softcap or 0.0),
                                 BLOCK_V=_block_v(vocab))
    return lse, target, entropy


def row_grad_from_probs(probs: RowProbs, targets: torch.Tensor, temperature: float, lse: torch.Tensor,
                        grad_logp: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """dz = grad_logp * (onehot(targets) - softmax) / temperature (times the soft-cap's slope, already
    folded into ``probs``) from a tile written by ``row_lse(..., probs_out=...)``, into ``out`` (C, V),
    any float dtype; ``out`` may be ``probs.probs`` itself (in place)."""
    rows, vocab = probs.probs.shape
    if rows:
        _row_grad_probs_kernel[(rows,)](probs.probs, out, targets, probs.slice_max, lse, probs.target_coef,
                                        grad_logp.float().contiguous(), vocab, probs.probs.stride(0), out.stride(0),
                                        slices_per_row(vocab), 1.0 / temperature, BLOCK_V=_block_v(vocab))
    return out


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
                                  BLOCK_V=_block_v(vocab))
    return out
