"""The matmuls of the torch paths: input-dtype GEMMs with float32 results.

On a GPU the (tokens x d) @ (d x vocab) products must run on tensor cores in the inputs' dtype
(bfloat16/float16), accumulate in float32 and hand back float32 logits: casting a weight chunk to
float32 first (what the torch backend did before) turns a bf16 GEMM into an fp32 one, over 10x
slower on an H100/H200, and copies the weight once per token chunk. PyTorch >= 2.8 exposes exactly
that product as ``torch.mm(a, b, out_dtype=torch.float32)`` (and ``addmm`` with ``out_dtype``) on
CUDA; whether this build and device have it is probed once, numerically, and otherwise the product
is taken in the input dtype and widened afterwards (float32 accumulation inside the GEMM, the result
rounded to the input dtype once).

On the CPU there are no tensor cores and bf16 GEMMs are slow or emulated, so low-precision inputs
are widened to float32 per chunk (float64 stays float64): exact and the fastest option there.

Every function here runs with autocast disabled: the kernels' dtype policy is "GEMMs in the inputs'
dtype, accumulation and softmax in float32", whatever autocast region the caller is in.
"""

from __future__ import annotations

import functools

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of logits, softmax and accumulators: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def gemm_in_input_dtype(device: torch.device, dtype: torch.dtype) -> bool:
    """True where the GEMMs run in the inputs' low-precision dtype (CUDA with fp16/bf16)."""
    return device.type == "cuda" and dtype in LOW_PRECISION


@functools.lru_cache(maxsize=None)
def _has_out_dtype(device_type: str, device_index: int | None, dtype: torch.dtype) -> bool:
    """Does ``torch.mm/addmm(..., out_dtype=float32)`` work (and add in place) here? Probed once."""
    device = torch.device(device_type, device_index) if device_index is not None else torch.device(device_type)
    try:
        a = torch.arange(6, device=device, dtype=torch.float32).reshape(2, 3).to(dtype)
        b = torch.ones(3, 2, device=device, dtype=dtype)
        product = torch.mm(a, b, out_dtype=torch.float32)
        acc = torch.ones(2, 2, device=device, dtype=torch.float32)
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        expected = torch.tensor([[3.0, 3.0], [12.0, 12.0]], device=device)
        return (product.dtype == torch.float32 and torch.equal(product, expected)
                and torch.equal(acc, expected + 1))
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def has_out_dtype(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether float32-output GEMMs on ``dtype`` inputs are available on ``device`` (probed once)."""
    return device.type == "cuda" and dtype in LOW_PRECISION and _has_out_dtype(device.type, device.index, dtype)


def operand(x: torch.Tensor) -> torch.Tensor:
    """A GEMM operand as the device's policy wants it: as it is on CUDA, widened on the CPU."""
    if gemm_in_input_dtype(x.device, x.dtype):
        return x
    cdt = compute_dtype(x.dtype)
    return x if x.dtype == cdt else x.to(cdt)


def mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with a float32 (float64 for float64) result; a, b in one dtype (prepared by ``operand``)."""
    with torch.autocast(a.device.type, enabled=False):
        cdt = compute_dtype(a.dtype)
        if a.dtype == cdt:
            return a @ b
        if has_out_dtype(a.device, a.dtype):
            return torch.mm(a, b, out_dtype=cdt)
        return (a @ b).to(cdt)


def addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, overwrite: bool = False) -> None:
    """acc += a @ b (``overwrite``: acc = a @ b, whatever acc held, so that an accumulator needs no zeroing
    before its first product), acc float32 (float64); a, b in one dtype; no (rows x cols) temporary where
    the device has float32-output GEMMs or the inputs are already in acc's dtype."""
    with torch.autocast(a.device.type, enabled=False):
        if a.dtype == acc.dtype:
            acc.addmm_(a, b, beta=0 if overwrite else 1)  # beta=0: acc's old values (even NaN) are ignored
        elif has_out_dtype(a.device, a.dtype):
            if overwrite:
                acc.zero_()
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
        elif overwrite:
            acc.copy_(a @ b)
        else:
            acc.add_(a @ b)


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out = a @ b written into ``out`` (any float dtype): in the GEMM's dtype when they match."""
    with torch.autocast(a.device.type, enabled=False):
        if out.dtype == a.dtype:
            torch.mm(a, b, out=out)
        else:
            out.copy_(a @ b)
