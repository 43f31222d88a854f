"""linear_logprobs(): per-token log-probs (and entropy) straight from hidden states and the LM head.

One autograd Function serves every backend; the backend only supplies ``forward`` and
``backward`` functions with the same signature (see torch_chunked.py for the math).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from . import dispatch, torch_chunked
from .checks import BACKENDS, check_choice, check_linear_inputs, check_targets_in_range, check_temperature
from .reference import naive_linear_logprobs


def _triton_module():
    """Import the Triton kernels, or raise a ValueError that says how to fix the set-up."""
    try:
        from . import triton as triton_kernels
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ValueError(
            "backend='triton' needs the triton package (pip install triton); "
            f"it could not be imported ({exc}). Use backend='torch' instead."
        ) from exc
    return triton_kernels


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype, *, choices=BACKENDS,
                    inputs: str = "hidden and weight", shape: tuple[int, int, int] | None = None,
                    softcap: bool = False, matmul_kernels: bool = False, dispatch_table: str | None = None) -> str:
    """'auto' -> 'triton' on CUDA (not float64) when triton imports, else 'torch'. Also 'torch' on CUDA
    where the committed GPU run measured it faster at ``shape`` = (N, d, V) (dispatch.py), where the
    logits are soft-capped (the Triton log-prob kernels have no soft-cap), and, for the log-prob
    matmul kernels (``matmul_kernels``), for float32 inputs: those kernels are built for 16-bit
    tensor-core tiles and multiply float32 exactly on CUDA cores, where cuBLAS is faster and keeps
    its tiles in registers (``compile_check`` shows the float32 tiles spilling). An explicit 'triton'
    is checked to be runnable here (CUDA tensors, or the interpreter) for ``inputs``, and to need no
    soft-cap."""
    check_choice("backend", backend, choices)
    if softcap and backend == "triton":
        raise ValueError("logit_softcap needs backend='torch' (or 'auto', which picks it): the Triton kernels have "
                         "no soft-cap yet")
    if softcap and backend == "auto":
        return "torch"
    if backend == "auto":
        if device.type == "cuda" and dtype != torch.float64:
            if matmul_kernels and dtype == torch.float32:
                return "torch"
            if shape is not None and dispatch.logprob_backend(*shape, dispatch.dtype_name(dtype),
                                                                     dispatch_table) == "torch":
                return "torch"
            try:
                _triton_module()
                return "triton"
            except ValueError:
                return "torch"
        return "torch"
    if backend == "triton":
        kernels = _triton_module()
        if device.type != "cuda" and not kernels.INTERPRETED:
            raise ValueError(
                f"backend='triton' needs CUDA tensors, got tensors on {device}. Use backend='torch' "
                "on this device, or set TRITON_INTERPRET=1 before importing pacs_kernels to run the "
                "Triton kernels in the (slow) interpreter"
                + (" (TRITON_INTERPRET=1 is set now, but was not when triton was first imported)"
                   if os.environ.get("TRITON_INTERPRET") == "1" else "")
            )
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(
                f"backend='triton' takes {inputs} in float16, bfloat16 or float32, got {dtype}; "
                "use backend='torch' for float64"
            )
    return backend


@dataclass(frozen=True)
class LogprobOptions:
    """Backend knobs of one linear_logprobs call (None: the backend's default)."""

    filter_eps: float | None = None  # triton backward: skip tiles whose |dz| < eps (approximate)
    chunk_elements: int | None = None  # torch: logits per chunk
    vocab_splits: int | None = None  # triton forward: vocabulary slices per token block
    softcap: float | None = None  # the math, not a knob: Gemma-style logit soft-cap (torch backend)
    grad_gemms: str | None = None  # triton backward: "torch" | "triton" GEMMs for dh, dW (None: the table's)
    dispatch_table: str | None = None  # a GPU dispatch table's path (None: the packaged one)


def check_softcap(logit_softcap) -> float | None:
    """None, or a finite number > 0 (the c of ``c * tanh(z / c)``)."""
    if logit_softcap is None:
        return None
    if isinstance(logit_softcap, bool) or not isinstance(logit_softcap, (int, float)) \
            or not 0 < logit_softcap < float("inf"):
        raise ValueError(f"logit_softcap must be None or a finite number > 0, got {logit_softcap!r}")
    return float(logit_softcap)


def result_dtype(values: torch.Tensor) -> torch.Tensor:
    """Per-token results in float32, or in float64 where they were computed in float64 (float64 inputs)."""
    return values if values.dtype == torch.float64 else values.float()


class Kernels:
    """The forward and backward of one backend, behind one interface: the only place that
    branches on the backend name (the known-gradient sweep is the backward with ``logp_out``)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.impl = _triton_module() if backend == "triton" else torch_chunked

    def forward(self, hidden, weight, targets, bias, temperature, with_entropy, options: LogprobOptions):
        """-> (logp, entropy or None, lse), each (N,)."""
        if self.backend == "triton":
            return self.impl.logprob_forward(hidden, weight, targets, bias, temperature, with_entropy,
                                             vocab_splits=options.vocab_splits)
        extra = {"chunk_elements": options.chunk_elements} if options.chunk_elements else {}
        return self.impl.forward(hidden, weight, targets, bias, temperature, with_entropy, softcap=options.softcap,
                                 **extra)

    def backward(self, hidden, weight, targets, bias, temperature, lse, entropy, grad_logp, grad_entropy, *,
                 needs, options: LogprobOptions, logp_out=None):
        """-> (dhidden, dweight, dbias), None where ``needs`` says so; writes logp_out when given."""
        if self.backend == "triton":
            return self.impl.logprob_backward(hidden, weight, targets, bias, temperature, lse, entropy, grad_logp,
                                              grad_entropy, needs=needs, filter_eps=options.filter_eps,
                                              vocab_splits=options.vocab_splits, logp_out=logp_out,
                                              gemms=options.grad_gemms, dispatch_table=options.dispatch_table)
        extra = {"chunk_elements": options.chunk_elements} if options.chunk_elements else {}
        return self.impl.backward(hidden, weight, targets, bias, temperature, lse, entropy, grad_logp, grad_entropy,
                                  needs=needs, logp_out=logp_out, softcap=options.softcap, **extra)


class LinearLogprobs(torch.autograd.Function):
    """Log-probs (and entropy, lse) of checked (N, d) / (N,) inputs with one backend's kernels. The engine's two
    passes (engine/two_pass.py) call it on a checked batch with a planned backend; ``linear_logprobs`` checks
    and resolves first."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, kernels, with_entropy, options):
        logp, entropy, lse = kernels.forward(hidden, weight, targets, bias, temperature, with_entropy, options)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature, ctx.kernels, ctx.options = temperature, kernels, options
        ctx.mark_non_differentiable(lse)
        return result_dtype(logp), None if entropy is None else result_dtype(entropy), lse

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, _grad_lse):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        d_hidden, d_weight, d_bias = ctx.kernels.backward(
            hidden, weight, targets, bias, ctx.temperature, lse, entropy, grad_logp,
            None if entropy is None else grad_entropy, needs=tuple(ctx.needs_input_grad[:3]), options=ctx.options)
        return d_hidden, d_weight, d_bias, None, None, None, None, None


def check_logprob_knobs(filter_eps, chunk_elements, vocab_splits) -> None:
    """``linear_logprobs``' tuning knobs (each None or): filter_eps a finite number >= 0, chunk_elements and
    vocab_splits positive ints (a bool is not one); checked by ``LossOptions`` too, whatever path runs."""
    number = isinstance(filter_eps, (int, float)) and not isinstance(filter_eps, bool)
    if filter_eps is not None and not (number and 0 <= filter_eps < float("inf")):
        raise ValueError(f"filter_eps must be None or a finite number >= 0, got {filter_eps!r}")
    for name, value in (("chunk_elements", chunk_elements), ("vocab_splits", vocab_splits)):
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    return_entropy: bool = False,
    backend: str = "auto",
    filter_eps: float | None = None,
    chunk_elements: int | None = None,
    vocab_splits: int | None = None,
    return_lse: bool = False,
    logit_softcap: float | None = None,
    grad_gemms: str | None = None,
    dispatch_table: str | None = None,
):
    """Log-prob of ``targets`` under ``softmax((hidden @ weight.T + bias) / temperature)``.

    Args:
        hidden: (..., d) float16/bfloat16/float32 (float64 on the torch and naive backends).
        weight: (V, d), same dtype as hidden (the LM-head weight; may be the tied embedding).
        targets: (...) integer token ids in [0, V).
        temperature: > 0, the sampling temperature the logits are divided by.
        bias: optional (V,) LM-head bias.
        return_entropy: also return the entropy of each token's distribution.
        backend: "auto" (triton on CUDA for 16-bit inputs, torch otherwise) | "triton" | "torch" | "naive".
        filter_eps: triton only, opt-in: skip backward tiles whose every |dlogit| < filter_eps
            (approximate; None means exact).
        chunk_elements: torch backend: logits per chunk (default 4M, 16 MiB in float32).
        vocab_splits: triton: vocabulary slices per token block (default: enough to fill the GPU).
        return_lse: also return each token's log-sum-exp of the tempered logits (float32, or float64
            for float64 inputs; detached), the input of the known-gradient fast path (known_grad.py).
        logit_softcap: optional c > 0: the logits are soft-capped as ``c * tanh(z / c)`` before the
            temperature (Gemma 2/3's ``final_logit_softcapping``); torch and naive backends ("auto"
            picks torch then).
        grad_gemms: triton backward: "torch" (cuBLAS) or "triton" GEMMs for dh and dW (None: as the
            dispatch table measured; cuBLAS where it has no entry).
        dispatch_table: path of a GPU dispatch table (benchmarks/dispatch_table.py) deciding "auto" on CUDA
            (None: the packaged one, pacs_kernels/gpu_dispatch.json).

    Returns:
        logp (...) float32 (float64 for float64 inputs on the torch and naive backends), or
        (logp, entropy) with ``return_entropy=True``, with lse appended
        when ``return_lse=True``. Differentiable with
        respect to hidden, weight and bias for any upstream gradient on either output;
        gradients come back in the input dtypes. Nothing of size N x V is allocated (except by
        the "naive" backend); under ``torch.no_grad()`` nothing is saved for backward.

    Non-finite inputs: a token whose hidden state holds an inf or a NaN gets NaN as its log-prob (and
    entropy and lse) on every backend, never a finite value or -inf that would look like a token the
    model rules out; its gradients are NaN or 0. (Without this rule the backends differed: an inf could
    give -inf on one, NaN on another.) Tokens with finite hidden states are unaffected.
    """
    check_linear_inputs(hidden, weight, targets, bias)
    temperature = check_temperature(temperature)
    check_logprob_knobs(filter_eps, chunk_elements, vocab_splits)
    if grad_gemms is not None:
        check_choice("grad_gemms", grad_gemms, dispatch.GRAD_GEMMS)
    vocab, width = weight.shape
    logit_softcap = check_softcap(logit_softcap)
    backend = resolve_backend(backend, hidden.device, hidden.dtype, shape=(hidden.numel() // width, width, vocab),
                              softcap=logit_softcap is not None, matmul_kernels=True, dispatch_table=dispatch_table)
    check_targets_in_range(targets, vocab)

    lead_shape = hidden.shape[:-1]
    if backend == "naive":
        logp, entropy = naive_linear_logprobs(hidden, weight, targets, temperature=temperature, bias=bias,
                                              softcap=logit_softcap)
        outputs = [result_dtype(logp)] + ([result_dtype(entropy)] if return_entropy else [])
        if return_lse:
            with torch.no_grad():
                cdt = torch.float64 if hidden.dtype == torch.float64 else torch.float32
                logits = hidden.to(cdt) @ weight.to(cdt).T + (0 if bias is None else bias.to(cdt))
                if logit_softcap is not None:
                    logits = logit_softcap * torch.tanh(logits / logit_softcap)
                outputs.append(torch.logsumexp(logits / temperature, -1))
        return nan_where_not_finite(hidden, outputs)

    hidden_2d = hidden.reshape(-1, width)
    targets_1d = targets.reshape(-1)
    if backend == "triton":
        # the kernels take any strides for hidden and weight; targets and bias are read densely
        targets_1d = targets_1d.contiguous()
        bias = bias.contiguous() if bias is not None else None
    options = LogprobOptions(filter_eps=filter_eps, chunk_elements=chunk_elements, vocab_splits=vocab_splits,
                             softcap=logit_softcap, grad_gemms=grad_gemms, dispatch_table=dispatch_table)
    kernels = Kernels(backend)

    needs_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    if needs_grad:
        logp, entropy, lse = LinearLogprobs.apply(
            hidden_2d, weight, bias, targets_1d, temperature, kernels, return_entropy, options)
    else:  # old-policy / reference log-probs: save nothing
        logp, entropy, lse = kernels.forward(hidden_2d, weight, targets_1d, bias, temperature, return_entropy,
                                             options)
        logp = result_dtype(logp)
        entropy = result_dtype(entropy) if entropy is not None else None

    outputs = [logp.reshape(lead_shape)]
    if return_entropy:
        outputs.append(entropy.reshape(lead_shape))
    if return_lse:
        outputs.append(result_dtype(lse.detach()).reshape(lead_shape))
    return nan_where_not_finite(hidden, outputs)


def nan_where_not_finite(hidden: torch.Tensor, outputs: list[torch.Tensor]):
    """NaN in every output of a token whose hidden state holds an inf or a NaN (see linear_logprobs), the
    outputs as linear_logprobs returns them. One reduction over ``hidden``, no (N, d) temporary, no sync."""
    with torch.no_grad():
        finite = torch.isfinite(torch.linalg.vector_norm(hidden, ord=float("inf"), dim=-1))
    nan = torch.tensor(float("nan"), device=hidden.device)
    outputs = [torch.where(finite, out, nan) for out in outputs]
    return tuple(outputs) if len(outputs) > 1 else outputs[0]
