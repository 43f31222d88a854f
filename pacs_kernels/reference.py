"""Naive reference implementations: they materialize the N x V logits.

Ground truth for tests and the baseline in benchmarks. Plain PyTorch autograd does the
backward, so these are correct by construction; they are just memory hungry.
"""

from __future__ import annotations

import torch


def naive_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``targets`` and entropy under ``softmax((hidden @ weight.T + bias) / temperature)``.

    hidden (..., d), weight (V, d), targets (...) int, bias (V,) or None.
    Computes in ``compute_dtype`` (default: float32, or float64 when the inputs are float64)
    and returns ``(logp, entropy)`` in that dtype, shape (...).
    """
    if compute_dtype is None:
        compute_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    logits = hidden.to(compute_dtype) @ weight.to(compute_dtype).T
    if bias is not None:
        logits = logits + bias.to(compute_dtype)
    logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    logp = log_probs.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logp, entropy
