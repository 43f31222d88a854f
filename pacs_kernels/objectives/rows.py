"""Any objective on the engine's selected tokens, through its ``__call__`` on padded rows (objectives/protocol.py).

The engine hands an objective without an ``engine_loss`` of its own (DAPO, Dr.GRPO, GSPO, CISPO, a user's, or a
built-in one with a KL or entropy term) to :class:`RowsLoss`: the selected tokens' log-probs become left-aligned
(B, width) rows (:class:`~pacs_kernels.response_rows.ResponseRows`) and the objective runs on them.

Single pass: chunk k's share is objective(rows with chunk k live, the rest at a constant filler) -
objective(all at the filler). For a loss whose groups interact only through constants (rewards, mask,
counts) these shares add up to the loss and each chunk's gradient is exact; the sum is checked against the
objective on all the log-probs, and an objective that couples groups through their log-probs is refused
(explicit ``path="single_pass"``) or rerun on two passes (``"auto"``: ``single_pass_result`` returns None).
The filler is old_logp (0 on-policy). Per-token weights (the batch's ``token_weights``) go to the objective as
``token_weights=`` rows, on every path, where it declares ``Capabilities(token_weights=True)``.
"""

from __future__ import annotations

import warnings

import torch

from ..loss_inputs import check_group_size, check_response_rewards
from ..response_rows import ResponseRows
from .protocol import Capabilities


def engine_objective(objective):
    """``objective`` as the engine takes it: itself where it has an ``engine_loss`` (the built-in ones), else a
    :class:`RowsObjective` that runs its ``__call__`` on padded rows (any callable satisfying the protocol)."""
    if not callable(objective):
        raise TypeError("objective must be a callable satisfying the Objective protocol, "
                        f"got {type(objective).__name__}")
    return objective if hasattr(objective, "engine_loss") else RowsObjective(objective)


class RowsObjective:
    """Any objective without an engine loss of its own: :class:`RowsLoss` on the engine's tokens."""

    def __init__(self, objective) -> None:
        self.objective = objective

    def engine_loss(self, batch, options, *, with_entropy: bool = False):
        return RowsLoss(self.objective, batch, options)


class RowsLoss:
    """``objective(logp_rows, old_rows, rewards, mask_rows, group_size=, ref_logp=, entropy=)`` for each path.
    Results ``(loss, stats dict)`` as the objective returns them."""

    def __init__(self, objective, batch, options) -> None:
        if not callable(objective):
            raise TypeError("objective must be a callable satisfying the Objective protocol, "
                            f"got {type(objective).__name__}")
        n_responses, n_selected = len(batch.shape.counts), batch.shape.n_selected
        check_response_rewards(batch.rewards, n_responses, batch.hidden.device)
        check_group_size(batch.group_size, n_responses, getattr(objective, "advantage", "grpo"))
        if n_responses == 0 or n_selected == 0:
            raise ValueError("mask must select at least one response token")
        if batch.valid is not None:
            raise ValueError("valid= needs an objective that takes a per-response validity mask (it declares "
                             f"Capabilities(response_validity=True), as PACS does); {type(objective).__name__} "
                             "does not")
        uses_entropy = bool(getattr(objective, "uses_entropy", False))
        declared = getattr(objective, "capabilities", None)
        # a declared token or group chunking is the objective's own engine loss's; on rows the sum is checked
        self.capabilities = Capabilities(chunking="batch", uses_entropy=uses_entropy, one_sweep=not uses_entropy) \
            if declared is None else Capabilities("batch", declared.uses_entropy, declared.one_sweep,
                                                  declared.token_weights)
        self.with_entropy = uses_entropy
        self.objective, self.batch, self.path = objective, batch, options.path
        self.rows = ResponseRows(batch.counts)
        self.ref_rows = None if batch.ref_logp is None else self.rows(batch.ref_logp.detach())
        self.old_rows = None if batch.old_logp is None else self.rows(batch.old_logp).detach()
        # passed only where given: an objective without weights keeps the protocol's plain call
        self.weight_keywords = {} if batch.token_weights is None else \
            {"token_weights": self.rows(batch.token_weights.detach())}
        self.cdt = torch.float64 if batch.weight.dtype == torch.float64 else torch.float32
        self.filler = torch.zeros(n_selected, dtype=self.cdt, device=batch.hidden.device) \
            if batch.old_logp is None else batch.old_logp.detach().to(self.cdt)
        self._at_filler = None

    def call(self, logp_rows, entropy_rows=None):
        result = self.objective(logp_rows, self.old_rows, self.batch.rewards, self.rows.mask,
                                group_size=self.batch.group_size, ref_logp=self.ref_rows, entropy=entropy_rows,
                                **self.weight_keywords)
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.Tensor)
                and result[0].dim() == 0 and isinstance(result[1], dict)):
            raise TypeError("objective must return (loss, stats): a 0-d tensor and a dict, "
                            f"got {type(result).__name__}")
        return result

    def at_filler(self) -> torch.Tensor:
        if self._at_filler is None:
            with torch.no_grad():
                self._at_filler = self.call(self.rows(self.filler))[0].detach()
        return self._at_filler

    def chunk_loss(self, logp, chunk):
        filler = self.filler
        live = torch.cat([filler[:chunk.tok0], logp.to(self.cdt), filler[chunk.tok1:]])
        return self.call(self.rows(live))[0] - self.at_filler(), None

    def single_pass_result(self, loss, extras, logp, entropy):
        """The chunks' loss plus the filler's, checked against the objective on all the log-probs; None where
        they differ (``path="auto"``: the engine reruns on two passes)."""
        at_filler = self.at_filler()
        loss = loss + at_filler.to(loss.dtype)
        with torch.no_grad():
            whole, stats = self.call(self.rows(logp.to(self.cdt)))
        # rounding: each chunk's share is a difference of two objective values of the filler's size
        scale = (1.0 + abs(float(whole)) + abs(float(at_filler))) * max(len(extras), 1)
        tolerance = (1e-10 if self.cdt == torch.float64 else 1e-5) * scale
        if abs(float(loss.detach()) - float(whole)) > tolerance:
            message = (f"the objective's loss over chunks of whole groups ({float(loss.detach()):.6g}) differs from "
                       f"its loss on the whole batch ({float(whole):.6g}): it couples groups through their "
                       "log-probs, which the single pass cannot split")
            if self.path == "single_pass":
                raise ValueError(message + "; use LossOptions(path='two_pass')")
            warnings.warn(message + "; computed on two passes instead", RuntimeWarning, stacklevel=5)
            return None
        loss = loss.float() if loss.dtype != torch.float64 else loss
        return loss, {**stats, "loss": float(loss.detach())}

    def two_pass_result(self, logp, entropy):
        return self.call(self.rows(logp), self.rows(entropy))

    def first_step(self, at_old):
        loss, stats = self.call(self.rows(at_old))
        return loss, lambda total: {**stats, "loss": float(total.detach())}

    def as_objective_stats(self, loss, stats) -> dict:
        return stats
