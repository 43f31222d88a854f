"""Merging per-vocabulary-slice log-sum-exp and entropy partials (plain PyTorch, no kernels).

A kernel that walks only the slice c of the vocabulary can keep, per token, the slice's own
log-sum-exp ``lse_c = log sum_{v in c} exp(z_v)`` and its negative entropy
``B_c = sum_{v in c} softmax_c(z)_v * (z_v - lse_c)``. With ``w_c = exp(lse_c - lse)`` (the
probability mass of slice c) the slices combine without cancellation:

    lse     = logsumexp_c(lse_c)
    entropy = -sum_c w_c * (B_c + log w_c)

Used by the Triton forward (vocabulary split across programs) and by the chunked torch backend.
"""

from __future__ import annotations

import torch


def combine_vocab_chunks(
    lse_parts: torch.Tensor, negent_parts: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Merge per-slice partials into full-vocabulary values.

    Args:
        lse_parts: (N, C) float, the log-sum-exp of each token's logits over each of C slices.
        negent_parts: (N, C) float, each slice's B_c (see the module docstring), or None.

    Returns:
        (lse, entropy): (N,) each in the dtype of the inputs; entropy is None when
        ``negent_parts`` is None.
    """
    lse = torch.logsumexp(lse_parts, dim=-1)
    if negent_parts is None:
        return lse, None
    log_w = lse_parts - lse.unsqueeze(-1)
    w = log_w.exp()
    # slices with w == 0 contribute nothing (avoid 0 * -inf)
    entropy = -(w * (negent_parts + torch.where(w > 0, log_w, torch.zeros_like(log_w)))).sum(-1)
    return lse, entropy
