"""ResponseRows: the selected tokens of a batch (in order) as left-aligned padded rows, one per response.

Objectives see per-token log-probs as (B, width) rows with their own mask; the engine builds them from
the selected tokens with one scatter (differentiable in the values).
"""

from __future__ import annotations

import torch


class ResponseRows:
    """Scatter of the selected tokens (in order) into left-aligned (B, width) rows."""

    def __init__(self, counts: torch.Tensor) -> None:
        n_responses = counts.shape[0]
        offsets = torch.zeros(n_responses + 1, dtype=torch.int64, device=counts.device)
        torch.cumsum(counts, 0, out=offsets[1:])
        n_selected = int(offsets[-1])
        self.rows = torch.repeat_interleave(torch.arange(n_responses, device=counts.device), counts,
                                            output_size=n_selected)
        self.cols = torch.arange(n_selected, device=counts.device) - offsets[self.rows]
        self.shape = (n_responses, max(int(counts.max()), 1))
        self.mask = torch.zeros(self.shape, dtype=torch.bool, device=counts.device).index_put(
            (self.rows, self.cols), torch.ones((), dtype=torch.bool, device=counts.device))

    def __call__(self, values: torch.Tensor | None) -> torch.Tensor | None:
        """(N_sel,) -> (B, width), zeros outside the mask; differentiable in ``values``."""
        if values is None:
            return None
        return values.new_zeros(self.shape).index_put((self.rows, self.cols), values)
