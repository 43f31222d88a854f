"""A piece of a batch: the loss engine's route for tokens whose loss is completed elsewhere.

The engine's paths (engine.py) take whole groups of responses. A trainer sometimes holds only a piece of
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

from .checks import FLOAT_DTYPES, check_linear_inputs, check_same_device, check_tensor
from .engine import logprob_drift, stale_lse_tolerance
from .grpo import grpo_loss
from .known_grad import linear_logprobs_known_grad
from .logprobs import linear_logprobs
from .loss import pacs_loss
from .loss_inputs import MASK_DTYPES, check_mask_values
from .objectives.grpo import GRPO
from .objectives.pacs import PACS
from .options import LossOptions
from .token_selection import match_head_dtype


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


@dataclass(frozen=True)
class GatheredLogprobs:
    """The piece's log-probs gathered into the rows the objective sees (see the module docstring).

    gather: maps the piece's log-probs (one per ``mask`` token, in order; differentiable) to the whole
    batch's (B, T) rows, differentiably. old_logp, mask: (B, T) of the whole batch; rewards: (B,)."""

    gather: Callable[[torch.Tensor], torch.Tensor]
    old_logp: torch.Tensor
    mask: torch.Tensor
    rewards: torch.Tensor


PIECES = (KnownGradient, GatheredLogprobs)


def group_loss_on_rows(objective, logp, old_logp, rewards, mask, *, group_size: int, valid=None):
    """The objective's loss on (B, T) log-prob rows -> ``(loss, stats dict)``: PACS through ``pacs_loss``
    (which takes ``valid``), GRPO through ``grpo_loss`` (their statistics, as the fused entries report
    them), any other objective as it is."""
    if isinstance(objective, PACS):
        loss, stats = pacs_loss(logp, old_logp, rewards, mask, group_size=group_size, **objective.group_settings(),
                                return_stats=True, backend="torch", valid=valid)
        return loss, stats.as_dict()
    if valid is not None:
        raise ValueError(f"valid= is a PACS input; {type(objective).__name__} takes no validity mask")
    if isinstance(objective, GRPO) and objective.entropy_coef == 0:
        loss, stats = grpo_loss(logp, old_logp, rewards, mask, group_size=group_size, clip_eps=objective.clip_eps,
                                clip_eps_high=objective.clip_eps_high, aggregation=objective.aggregation,
                                kl_coef=objective.kl_coef, return_stats=True)
        return loss, stats.as_dict()
    return objective(logp, old_logp, rewards, mask, group_size=group_size)


def refuse_with_piece(given: dict) -> None:
    """The fused entries' inputs that a piece has no use for, refused by name (a piece is selected by its mask
    and its loss is completed on the whole batch)."""
    for name in ("cu_seqlens", "group_ids", "old_lse", "ref_logp"):
        if given.get(name) is not None:
            raise ValueError(f"{name}= cannot go with piece=: a piece is selected by its mask and its loss is "
                             "completed on the whole batch")
    if given.get("with_entropy"):
        raise ValueError("with_entropy=True cannot go with piece=")


def run_piece(hidden, weight, targets, mask, piece, objective, options: LossOptions, *, group_size: int, bias=None,
              valid=None):
    """The loss of a piece of a batch (``piece``: a :class:`KnownGradient` or :class:`GatheredLogprobs`) ->
    ``(loss, stats dict)``; ``hidden`` in any layout (padded rows, packed tokens), ``mask`` selecting its
    response tokens; ``group_size``, ``valid``: of the whole batch's rows (the gathered route)."""
    if not isinstance(piece, PIECES):
        raise TypeError(f"piece must be a KnownGradient or a GatheredLogprobs, got {type(piece).__name__}")
    if not isinstance(options, LossOptions):
        raise TypeError(f"options must be a LossOptions, got {type(options).__name__}")
    check_tensor("mask", mask, dtypes=MASK_DTYPES)
    hidden = match_head_dtype(hidden, weight)
    if tuple(mask.shape) != tuple(hidden.shape[:-1]) or tuple(targets.shape) != tuple(mask.shape):
        raise ValueError(f"mask and targets must have shape hidden.shape[:-1] = {tuple(hidden.shape[:-1])}, got "
                         f"{tuple(mask.shape)} and {tuple(targets.shape)}")
    check_same_device(hidden=hidden, targets=targets, mask=mask)
    selected = check_mask_values(mask)  # 0/1 only, as on every other route (0.5 was read as 1)
    tokens_h, tokens_y = hidden[selected], targets[selected]
    check_linear_inputs(tokens_h, weight, tokens_y, bias)
    # no token here: the torch backend's empty call still connects the loss to hidden (its backward runs)
    backend = options.backend if bool(selected.any()) else "torch"
    head = dict(temperature=options.temperature, bias=bias, backend=backend, logit_softcap=options.logit_softcap)
    if isinstance(piece, KnownGradient):
        return _known_gradient(piece, tokens_h, weight, tokens_y, selected, head)
    # the user's budget bounds the torch backend's logits chunk here too (4 bytes a logit)
    chunk_elements = options.chunk_elements
    if chunk_elements is None and options.chunk_budget_mib is not None:
        chunk_elements = max(1, int(options.chunk_budget_mib * 2**20) // 4)
    logp = linear_logprobs(tokens_h, weight, tokens_y, chunk_elements=chunk_elements, **head)
    rows = piece.gather(logp)
    return group_loss_on_rows(objective, rows, piece.old_logp, piece.rewards, piece.mask, group_size=group_size,
                              valid=valid)


def _known_gradient(piece: KnownGradient, hidden, weight, targets, selected, head):
    for name in ("grad_logp", "lse", "expected_logp"):
        value = getattr(piece, name)
        if value is None:
            continue
        check_tensor(f"piece.{name}", value, dtypes=FLOAT_DTYPES)
        if tuple(value.shape) != tuple(selected.shape):
            raise ValueError(f"piece.{name} must be laid out like targets {tuple(selected.shape)}, "
                             f"got {tuple(value.shape)}")
    surrogate, logp = linear_logprobs_known_grad(hidden, weight, targets, piece.grad_logp[selected],
                                                 piece.lse[selected], **head)
    if piece.expected_logp is not None:
        drift = logprob_drift(logp, piece.expected_logp[selected])
        if piece.agree is not None:
            drift = piece.agree(drift)
        if not float(drift) <= stale_lse_tolerance(weight.dtype):
            raise RuntimeError(
                f"the one sweep's log-probs differ from the ones the loss's gradient was computed at by up to "
                f"{float(drift):.3g} x (1 + |logp|), more than rounding: the weights changed since then")
    value = torch.as_tensor(piece.loss, dtype=surrogate.dtype, device=surrogate.device).detach()
    return value + (surrogate - surrogate.detach()), dict(piece.stats)
