"""The known-gradient fast path: log-probs and their gradients in ONE sweep over the vocabulary.

The usual path costs four (N x V x d) matmuls: the forward builds the logits to get the
log-sum-exp (1), the backward rebuilds them (2) and forms dh (3) and dW (4). When the gradient
on each token's log-prob is known before the forward, and the log-sum-exp is known too, one
sweep does it all: rebuild the logits once, read off logp = z_y - lse, form
dz = g * (onehot(y) - softmax(z)) / tau and multiply out dh and dW: three matmuls.

PACS meets both conditions on the first optimizer step after a rollout: the weights are those
that produced the old-policy log-probs, so ``lse`` from that no-grad pass
(``linear_logprobs(..., return_lse=True)``) is exact, every psi is 0, and the per-token gradient
follows from the loss alone (``pacs_loss`` evaluated at ``logp = old_logp``).

The result is a differentiable scalar ``surrogate = sum_t grad_logp[t] * logp[t]`` whose backward
delivers the precomputed gradients (scaled by its upstream gradient), so it slots into autograd:
``surrogate.backward()`` sends dh into the backbone and dW into the LM head.
"""

from __future__ import annotations

import torch

from .checks import check_linear_inputs, check_targets_in_range, check_temperature, check_tensor
from .forward_grads import scaled_saved_grads
from .logprobs import Kernels, LogprobOptions, check_softcap, resolve_backend


class KnownGradSweep(torch.autograd.Function):
    """The sweep on checked (N, d) / (N,) inputs with a resolved backend: -> (sum g logp, logp). The engine's
    one sweep (engine/one_sweep.py) calls it on a checked batch; ``linear_logprobs_known_grad`` checks first."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, grad_logp, lse, temperature, backend, softcap):
        cdt = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        logp = torch.empty(hidden.shape[0], dtype=cdt, device=hidden.device)
        grads = Kernels(backend).backward(hidden, weight, targets, bias, temperature, lse, None, grad_logp, None,
                                          needs=tuple(ctx.needs_input_grad[:3]),
                                          options=LogprobOptions(softcap=softcap), logp_out=logp)
        ctx.save_for_backward(*grads)  # freed after one backward, kept by retain_graph=True
        surrogate = (grad_logp.to(cdt) * logp).sum()
        ctx.mark_non_differentiable(logp)
        return surrogate, logp

    @staticmethod
    def backward(ctx, grad_surrogate, _grad_logp):
        return scaled_saved_grads(ctx.saved_tensors, grad_surrogate) + (None,) * 6


def linear_logprobs_known_grad(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    grad_logp: torch.Tensor,
    lse: torch.Tensor,
    *,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    backend: str = "auto",
    logit_softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One-sweep log-probs and gradients for a per-token gradient known in advance.

    Args:
        hidden: (..., d), as in linear_logprobs.
        weight: (V, d), as in linear_logprobs.
        targets: (...), as in linear_logprobs.
        temperature: as in linear_logprobs.
        bias: as in linear_logprobs.
        grad_logp: (...) the gradient of the loss with respect to each token's log-prob.
        lse: (...) log-sum-exp of each token's (tempered) logits under THESE weights,
            e.g. from ``linear_logprobs(..., return_lse=True)`` under torch.no_grad() on the same
            inputs. A stale lse gives wrong results: check that the returned logp matches.

    Returns:
        (surrogate, logp): ``surrogate`` a 0-d float32 tensor (float64 for float64 inputs), value
        sum(grad_logp * logp), whose backward delivers d/dhidden, d/dweight, d/dbias of that sum (computed
        during this call);
        ``logp`` (...) in the surrogate's dtype, detached.
    """
    check_linear_inputs(hidden, weight, targets, bias)
    temperature = check_temperature(temperature)
    for name, value in (("grad_logp", grad_logp), ("lse", lse)):
        check_tensor(name, value, dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64))
        if tuple(value.shape) != tuple(targets.shape):
            raise ValueError(f"{name} must have the shape of targets {tuple(targets.shape)}, "
                             f"got {tuple(value.shape)}")
        if value.device != hidden.device:
            raise ValueError(f"{name} must be on {hidden.device} like hidden, got {value.device}")
    logit_softcap = check_softcap(logit_softcap)
    backend = resolve_backend(backend, hidden.device, hidden.dtype, softcap=logit_softcap is not None,
                              matmul_kernels=True)
    if backend == "naive":
        raise ValueError("backend='naive' has no known-gradient fast path; use 'auto', 'triton' or 'torch'")
    check_targets_in_range(targets, weight.shape[0])
    width = weight.shape[1]
    cdt = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    surrogate, logp = KnownGradSweep.apply(
        hidden.reshape(-1, width), weight, bias.contiguous() if bias is not None else None,
        targets.reshape(-1).contiguous(), grad_logp.reshape(-1).to(cdt).contiguous(),
        lse.reshape(-1).to(cdt).contiguous(), temperature, backend, logit_softcap)
    return surrogate, logp.reshape(targets.shape)
