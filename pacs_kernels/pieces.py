"""A piece of a batch: the loss engine's route for tokens whose loss is completed elsewhere.

The engine's paths (pacs_kernels/engine/) take whole groups of responses. A trainer sometimes holds only a piece of
them on one call, and the loss is still exact, in one of two ways:

* :class:`KnownGradient`: the loss L and its gradient g_t = dL/dlogp_t on every token were computed
  first, on the log-probs of whole groups (a group larger than one micro-batch, run in parts; the first
  step after a rollout under sequence parallelism, where logp = old_logp). The piece's share of the
  weights' gradient is then

      dL/dtheta = sum_t g_t dlogp_t/dtheta      (g_t held fixed)

  the gradient of the surrogate S = sum_t g_t logp_t, which one vocabulary sweep gives (known_grad.py: the
  log-sum-exp is known, 3 matmuls). The returned loss has L's value and S's gradient.
* :class:`GatheredLogprobs`: the piece's log-probs are one part of the rows the objective sees (sequence
  parallelism: each rank of a group holds some of a micro-batch's tokens). Its log-probs (two passes'
  first, differentiable) are gathered into the whole rows, where the objective's loss is evaluated; its
  gradient flows back through the gather to this piece's tokens.

Neither route needs the piece to hold whole responses: it selects the ``mask`` tokens of any layout.
A piece with no selected token still returns a loss connected to ``hidden`` (a rank of a
sequence-parallel group may hold only prompt tokens, and its backward must still run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .checks import FLOAT_DTYPES, check_tensor
from .objectives.protocol import Capabilities


@dataclass(frozen=True)
class KnownGradient:
    """The loss and its per-token log-prob gradient, computed before this call (see the module docstring).

    grad_logp, lse: laid out like ``targets``: g_t, and the log-sum-exp of the tempered logits under THESE
    weights. loss: the loss value this piece reports (a float or a 0-d tensor); stats: its statistics.
    expected_logp: optional, laid out like ``targets``: the log-probs g was computed at, which the sweep's
    must reproduce to rounding (a RuntimeError otherwise: the weights moved). agree: optional, maps this
    call's drift (0-d float32) to the one every cooperating process acts on (e.g. an all-reduce of the
    maximum over a sequence-parallel group), so that all of them stop together."""

    grad_logp: torch.Tensor
    lse: torch.Tensor
    loss: float | torch.Tensor
    stats: dict
    expected_logp: torch.Tensor | None = None
    agree: Callable[[torch.Tensor], torch.Tensor] | None = None

    kind = "known_gradient"

    def with_objective(self, objective) -> "PieceLoss":
        return PieceLoss(self, objective)


@dataclass(frozen=True)
class GatheredLogprobs:
    """The piece's log-probs gathered into the rows the objective sees (see the module docstring).

    gather: maps the piece's log-probs (one per ``mask`` token, in order; differentiable) to the whole
    batch's (B, T) rows, differentiably. old_logp, mask: (B, T) of the whole batch; rewards: (B,)."""

    gather: Callable[[torch.Tensor], torch.Tensor]
    old_logp: torch.Tensor
    mask: torch.Tensor
    rewards: torch.Tensor

    kind = "gathered_logprobs"

    def with_objective(self, objective) -> "PieceLoss":
        return PieceLoss(self, objective)


PIECES = (KnownGradient, GatheredLogprobs)


def group_loss_on_rows(objective, logp, old_logp, rewards, mask, *, group_size: int, valid=None):
    """The objective's loss on (B, T) log-prob rows -> ``(loss, stats dict)``: through its ``loss_on_rows``
    where it has one (PACS: ``pacs_loss``, which takes ``valid``; GRPO: ``grpo_loss``; their statistics, as the
    fused entries report them), else as it is."""
    own = getattr(objective, "loss_on_rows", None)
    if own is not None:
        return own(logp, old_logp, rewards, mask, group_size=group_size, valid=valid)
    if valid is not None:
        raise ValueError(f"valid= is a PACS input; {type(objective).__name__} takes no validity mask")
    return objective(logp, old_logp, rewards, mask, group_size=group_size)


def known_gradient_on_rows(objective, logp, old_logp, rewards, mask, *, group_size: int, valid=None):
    """Phases 1-2 of a :class:`KnownGradient`, for whole groups: the objective's loss on their (B, T) log-prob rows
    ``logp`` (under the current weights, no graph needed) and its gradient g = dloss/dlogp on every token, 0 off
    ``mask`` -> ``(loss 0-d detached, g like logp, stats dict)``. Any slice of g's rows, with the matching
    log-sum-exp, makes a piece of those rows (``KnownGradient(g[rows], lse[rows], loss, stats)``)."""
    logp = logp.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        loss, stats = group_loss_on_rows(objective, logp, old_logp, rewards, mask, group_size=group_size,
                                         valid=valid)
        (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad * mask.to(grad.dtype), stats


def check_piece(piece, *, token_shape: tuple | None = None, **refused) -> None:
    """A piece of a batch: a :class:`KnownGradient` or a :class:`GatheredLogprobs`; the fused entries' inputs it
    has no use for (``refused``: cu_seqlens, group_ids, old_lse, ref_logp, with_entropy) refused by name (a piece
    is selected by its mask and its loss is completed on the whole batch); with ``token_shape``, a known
    gradient's per-token tensors laid out like targets."""
    if not isinstance(piece, PIECES):
        raise TypeError(f"piece must be a KnownGradient or a GatheredLogprobs, got {type(piece).__name__}")
    for name, value in refused.items():
        if name == "with_entropy" and value:
            raise ValueError("with_entropy=True cannot go with piece=")
        if name != "with_entropy" and value is not None:
            raise ValueError(f"{name}= cannot go with piece=: a piece is selected by its mask and its loss is "
                             "completed on the whole batch")
    if token_shape is None or not isinstance(piece, KnownGradient):
        return
    for name in ("grad_logp", "lse", "expected_logp"):
        value = getattr(piece, name)
        if value is None:
            continue
        check_tensor(f"piece.{name}", value, dtypes=FLOAT_DTYPES)
        if tuple(value.shape) != tuple(token_shape):
            raise ValueError(f"piece.{name} must be laid out like targets {tuple(token_shape)}, "
                             f"got {tuple(value.shape)}")


class PieceLoss:
    """A piece with the objective its batch's loss is completed with, as the engine takes a loss
    (objectives/protocol.py): ``engine_loss(batch, options)`` -> the piece's share on the engine's tokens."""

    def __init__(self, piece, objective) -> None:
        self.piece, self.objective = piece, objective

    def engine_loss(self, batch, options, *, with_entropy: bool = False):
        check_piece(self.piece, token_shape=batch.token_shape)
        if isinstance(self.piece, KnownGradient):
            return KnownGradientTokens(self.piece, batch)
        return GatheredTokens(self.piece, self.objective, batch)


class KnownGradientTokens:
    """A :class:`KnownGradient` piece on its selected tokens: the one sweep with the given gradient (the engine's
    one_sweep.py); a stale sweep is an error (the weights moved since the gradient was computed)."""

    capabilities = Capabilities(chunking="batch", uses_entropy=False, one_sweep=True)
    with_entropy = False
    strict = True

    def __init__(self, piece: KnownGradient, batch) -> None:
        self.piece, self.batch = piece, batch

    def known_gradient(self):
        """-> (loss value, g (N_sel,), lse (N_sel,), the log-probs g was computed at or None, agree, stats)."""
        batch, piece = self.batch, self.piece
        expected = None if piece.expected_logp is None else batch.per_token(piece.expected_logp)
        return (piece.loss, batch.per_token(piece.grad_logp), batch.per_token(piece.lse), expected, piece.agree,
                dict(piece.stats))


class GatheredTokens:
    """A :class:`GatheredLogprobs` piece on its selected tokens: their log-probs (two passes' first, differentiable)
    gathered into the whole batch's rows, where the objective's loss is evaluated -> ``(loss, stats dict)``."""

    capabilities = Capabilities(chunking="batch", uses_entropy=False, one_sweep=False)
    with_entropy = False

    def __init__(self, piece: GatheredLogprobs, objective, batch) -> None:
        self.piece, self.objective, self.batch = piece, objective, batch

    def two_pass_result(self, logp, entropy):
        rows = self.piece.gather(logp)
        return group_loss_on_rows(self.objective, rows, self.piece.old_logp, self.piece.rewards, self.piece.mask,
                                  group_size=self.batch.group_size, valid=self.batch.valid)
