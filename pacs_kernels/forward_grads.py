"""Gradients computed in the forward, handed to autograd: the backward of a scalar loss L whose
gradients dL/dx were saved in the forward returns grad_out * dL/dx.

The common case is grad_out == 1 (``loss.backward()``, or a mean over micro-batches applied
elsewhere): then the saved gradients are returned as they are. Multiplying anyway would allocate a
second copy of each, a whole (V, d) float32 dW at the moment the first one is still saved, which
was the peak memory of the single pass at small chunk budgets. Returned unscaled, autograd's
gradient accumulation can take the buffer over (the saved copy is released after a backward without
``retain_graph``) or add it into an existing ``.grad``; it never writes into it, so a retained graph
still returns the same values on a second backward.
"""

from __future__ import annotations

import torch


def scaled_saved_grads(grads: tuple, grad_out: torch.Tensor) -> tuple:
    """Each saved gradient (or None) times the 0-d upstream gradient ``grad_out``, without a copy
    when it is exactly 1 (one host sync on a GPU, at the end of the loss's backward)."""
    if bool(grad_out == 1):
        return tuple(grads)
    return tuple(None if g is None else g * grad_out.to(g.dtype) for g in grads)
