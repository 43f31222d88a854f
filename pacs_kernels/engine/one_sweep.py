"""One sweep: the first optimizer step after a rollout, from the rollout's log-sum-exp (3 matmuls, one sweep).

While the weights are those that produced old_logp, logp == old_logp, so a loss that is a function of the
log-probs alone has its value and its per-token gradient g = dloss/dlogp before any logits are built: the
objective's loss at logp = old_logp, by autograd on N scalars. The sweep (known_grad.py) then rebuilds each
logits tile once from old_lse and forms dh, dW from g:

    dloss/dz[t, v] = g[t] * (onehot(y_t)[v] - exp(z[t, v] - old_lse[t])) / tau;   dh = dz @ W,  dW = dz^T @ h

The returned tensor has the loss's value and the sweep's gradients: loss + (S - S.detach()), S = sum_t g_t logp_t.
The sweep's own log-probs tell whether old_lse belongs to these weights: where they drift from old_logp by more
than rounding, the plan's fallback (the usual path) runs instead, after a RuntimeWarning.

Also the route of a :class:`~pacs_kernels.pieces.KnownGradient` piece: its loss and gradient were computed
elsewhere (on whole groups), the sweep gives this piece's share of the weights' gradient.
"""

from __future__ import annotations

import warnings

import torch

from ..known_grad import KnownGradSweep
from .plan import Plan


def run_one_sweep(batch, plan: Plan, loss, options):
    """The one sweep for an engine ``loss`` (objectives/protocol.py) -> its result ``(loss, stats)``, or None where
    old_lse turns out stale (after a RuntimeWarning; the caller runs ``plan.fallback``). A loss that knows its
    gradient already (``known_gradient()``: a :class:`~pacs_kernels.pieces.KnownGradient` piece) gives it, its
    lse and the log-probs it was computed at; a stale sweep is then an error (the weights moved)."""
    cdt = torch.float64 if batch.weight.dtype == torch.float64 else torch.float32
    known = getattr(loss, "known_gradient", None)
    if known is not None:
        value, grad_logp, lse, expected, agree, stats = known()
        value = torch.as_tensor(value, dtype=cdt, device=batch.hidden.device)
    else:  # the loss at logp = old_logp, and its gradient there, by autograd on N_sel scalars
        expected, lse, agree = batch.old_logp.detach(), batch.old_lse, None
        at_old = expected.to(cdt).clone().requires_grad_()
        with torch.enable_grad():
            value, stats_of = loss.first_step(at_old)
            (grad_logp,) = torch.autograd.grad(value, at_old)
    with torch.autocast(batch.hidden.device.type, enabled=False):
        surrogate, logp = KnownGradSweep.apply(
            batch.hidden, batch.weight, None if batch.bias is None else batch.bias.contiguous(),
            batch.targets.contiguous(), grad_logp.to(cdt).contiguous(), lse.to(cdt).contiguous(),
            options.temperature, plan.backend, options.logit_softcap)
    if expected is not None:
        drift = logprob_drift(logp, expected)
        drift = float(drift if agree is None else agree(drift))
        if not drift <= stale_lse_tolerance(batch.weight.dtype):
            if known is not None:
                raise RuntimeError(
                    f"the one sweep's log-probs differ from the ones the loss's gradient was computed at by up to "
                    f"{drift:.3g} x (1 + |logp|), more than rounding: the weights changed since then")
            warnings.warn(
                f"old_lse does not belong to these weights: the log-probs recomputed in the one sweep differ from "
                f"old_logp by up to {drift:.3g} x (1 + |old_logp|), more than rounding; the loss was computed on "
                "the usual path instead (exact for these weights). Pass old_lse only on the first optimizer step "
                "after the rollout that produced it.", RuntimeWarning, stacklevel=4)
            return None
    total = value.detach().to(cdt) + (surrogate - surrogate.detach())
    return total, (stats if known is not None else stats_of(total))


def logprob_drift(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """How far the one sweep's log-probs sit from old_logp: the largest |logp - old| / (1 + |old|), each token
    against its own scale, so that a likely token's drift is not hidden by a rare one's (0-d float32; 0 for
    no tokens). Compared with :func:`stale_lse_tolerance`."""
    if not logp.numel():
        return logp.new_zeros((), dtype=torch.float32)
    old32 = old_logp.float()
    return ((logp - old32).abs() / (1.0 + old32.abs())).max()


def stale_lse_tolerance(dtype: torch.dtype) -> float:
    """How far (each token relative to 1 + |old_logp|) the one sweep's log-probs may sit from old_logp and
    still count as the same weights. Two forward passes over the same weights agree to float32 rounding in
    float32; in 16 bits a different batch composition (another GEMM tiling, other attention kernels)
    rounds every layer's output differently, and log-probs of one weight state differ by 1e-2 and more,
    so there the check catches only large moves: an optimizer step's few hundredths go unseen (pass
    old_lse only on the first step after the rollout)."""
    return 1e-3 if dtype in (torch.float32, torch.float64) else 5e-2
