"""The fused entries: hidden states + LM head -> a loss, never holding N x V logits.

Every entry runs the same four steps (:func:`run_loss`), the shape of Liger's fused-linear base class with
the engine as sub-package (pacs_kernels/engine/):

1. the checked batch: ``LossBatch.build`` checks the inputs once and selects the response tokens
   (engine/batch.py);
2. the objective's loss on those tokens: its own ``engine_loss`` (PACS, GRPO) or its ``__call__`` on
   padded rows (any other, objectives/rows.py), with the capabilities it declares;
3. the plan: one pure function of the batch's shape, the capabilities, ``LossOptions`` and the device's
   profile (engine/plan.py, engine/device.py): path, chunks, backend, budget;
4. the path that executes it: engine/single_pass.py, engine/two_pass.py or engine/one_sweep.py (with the
   plan's fallback where old_lse turns out stale, or the rows loss refuses the chunks' sum).

``fused_linear_objective_loss`` runs any objective; ``fused_linear_pacs_loss``, ``fused_linear_grpo_loss`` and
``PACSLoss`` are thin wrappers with their historical argument order and return values. ``old_logp=None``
means on-policy: the old log-probs are the current ones, detached (TRL's ``num_iterations=1``).

Dtype policy, whatever autocast region the caller is in: hidden is cast to the LM head's dtype;
the GEMMs run in that dtype (tensor cores for bf16/fp16 on CUDA), logits, softmax and gradient
accumulation in float32 (float64 for float64 inputs); gradients return in the inputs' dtypes.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import replace

import torch
from torch import nn

from .engine.batch import LossBatch
from .engine.device import device_profile
from .engine.one_sweep import run_one_sweep
from .engine.plan import plan_loss
from .engine.single_pass import run_single_pass
from .engine.two_pass import run_two_pass
from .keywords import moved_keywords
from .loss_inputs import check_group_size
from .objectives import GRPO, PACS
from .objectives.rows import engine_objective
from .options import LossOptions
from .pieces import check_piece

logger = logging.getLogger("pacs_kernels")


def _historical_order(function):
    """``fused_linear_objective_loss`` took ``(hidden, weight, targets, mask, rewards, objective)`` before every
    fused entry shared one order, ``(hidden, weight, targets, mask, old_logp, rewards, *, objective=...)``: a call
    in the old order (a non-tensor objective sixth, or five positional arguments beside ``objective=`` and no
    ``rewards=``) still works, with a DeprecationWarning saying the new order."""
    import functools

    @functools.wraps(function)
    def wrapper(*args, **keywords):
        old = (len(args) == 6 and args[5] is not None and not isinstance(args[5], torch.Tensor)) or (
            len(args) == 5 and "objective" in keywords and "rewards" not in keywords)
        if old:
            warnings.warn("fused_linear_objective_loss(hidden, weight, targets, mask, rewards, objective) is "
                          "deprecated: every fused entry takes (hidden, weight, targets, mask, old_logp, rewards, "
                          "*, objective=...); old_logp=None is on-policy", DeprecationWarning, stacklevel=2)
            keywords.setdefault("objective", args[5] if len(args) == 6 else None)
            args = (*args[:4], keywords.pop("old_logp", None), args[4])
        return function(*args, **keywords)

    return wrapper


@_historical_order
@moved_keywords("fused_linear_objective_loss")
def fused_linear_objective_loss(hidden, weight, targets, mask, old_logp, rewards, *, objective, group_size: int,
                                options: LossOptions | None = None, ref_logp=None, old_lse=None, cu_seqlens=None,
                                bias=None, valid=None, group_ids=None, piece=None, token_weights=None):
    """``objective`` (see :class:`~pacs_kernels.objectives.Objective`) on the log-probs of
    ``softmax((hidden @ weight.T + bias) / temperature)``, straight from hidden states and the LM head. The
    arguments in the order of every fused entry (``fused_linear_pacs_loss``, ``fused_linear_grpo_loss``).

    Args:
        hidden: padded (B, T, d), or packed (N, d) / (1, N, d) with ``cu_seqlens`` (B + 1,); the backbone's
            final hidden states (after the last norm), cast to weight's dtype if it differs.
        weight: (V, d) LM head; targets: like hidden[..., 0], token ids (any valid id where mask is 0).
        mask: like targets, 1 on response tokens.
        old_logp: laid out like targets, the rollout policy's log-probs (constant); None: on-policy.
        rewards: (B,), each group's ``group_size`` contiguous.
        objective: PACS(), GRPO(), DAPO(), ... or your own callable satisfying the Objective protocol.
        options: :class:`LossOptions` (backend, path, chunk budget, temperature, ...; None: ``LossOptions()``).
        ref_logp: laid out like targets, a reference model's log-probs (for a KL term); None: none.
        old_lse: laid out like targets, the log-sum-exp of the old-policy pass (``linear_logprobs(...,
            return_lse=True)``), ONLY while the weights are those that produced old_logp: one sweep then gives
            the loss and its gradients (a stale one: a RuntimeWarning and the usual path).
        cu_seqlens: (B + 1,) offsets of the packed layout. bias: (V,) LM-head bias.
        valid: (B,) bool, PACS only: responses that count (see :func:`pacs_loss`). group_ids: (B,), PACS only:
            checked to be contiguous groups of ``group_size``.
        piece: these tokens are a piece of a batch whose loss is completed elsewhere (:class:`KnownGradient`,
            :class:`GatheredLogprobs`; rewards and old_logp unused then).
        token_weights: laid out like targets, constant weights (finite, >= 0; read on the response tokens only)
            multiplying each token's policy term (rollout correction's truncated importance weights,
            docs/rollout-correction.md); None: every weight 1. The objective must take them
            (``Capabilities(token_weights=True)``: every built-in one); every path honours them.

    Returns:
        ``(loss, stats)``: a 0-d float32 (float64 for float64 inputs) loss, differentiable in hidden, weight and
        bias; stats a dict of floats as the objective reports them.
    """
    loss, stats, engine, _ = run_loss(hidden, weight, targets, mask, old_logp, rewards, objective,
                                      group_size=group_size, options=options, ref_logp=ref_logp, old_lse=old_lse,
                                      cu_seqlens=cu_seqlens, bias=bias, valid=valid, group_ids=group_ids,
                                      piece=piece, token_weights=token_weights)
    return loss, engine.as_objective_stats(loss, stats) if hasattr(engine, "as_objective_stats") else stats


def run_loss(hidden, weight, targets, mask, old_logp, rewards, objective, *, group_size, options, ref_logp=None,
             old_lse=None, cu_seqlens=None, bias=None, valid=None, group_ids=None, piece=None,
             with_entropy: bool = False, token_weights=None):
    """Batch, loss, plan, path (the module docstring) -> (loss, stats, the engine loss, the path that ran)."""
    options = LossOptions() if options is None else options
    if not isinstance(options, LossOptions):
        raise TypeError(f"options must be a LossOptions, got {type(options).__name__}")
    if piece is not None:  # a piece of a batch: its tokens' share, the loss completed elsewhere (pieces.py)
        check_piece(piece, cu_seqlens=cu_seqlens, group_ids=group_ids, old_lse=old_lse, ref_logp=ref_logp,
                    with_entropy=with_entropy)
        source = piece.with_objective(objective)
    else:
        source = engine_objective(objective)
    batch = LossBatch.build(hidden, weight, targets, mask, old_logp, rewards, group_size=group_size,
                            cu_seqlens=cu_seqlens, bias=bias, ref_logp=ref_logp, old_lse=old_lse, valid=valid,
                            group_ids=group_ids, piece=None if piece is None else piece.kind,
                            token_weights=token_weights)
    profile = device_profile(weight.device, weight.dtype, dispatch_table=options.dispatch_table)
    engine = source.engine_loss(batch, options, with_entropy=with_entropy)
    plan = plan_loss(batch.shape, engine.capabilities, options, profile)
    result = None
    if plan.path == "one_sweep":
        result = run_one_sweep(batch, plan, engine, options)
        plan = plan if result is not None else plan.fallback
    if result is None and plan.path == "single_pass":
        result = run_single_pass(batch, plan, engine, options)
        if result is None:  # the objective couples groups through its log-probs (objectives/rows.py)
            plan = plan.fallback
            if plan is None:
                raise ValueError("the objective couples groups through their log-probs and the two passes cannot "
                                 "run with these options (a logit soft-cap on backend='triton'): use backend='torch'")
    if result is None:
        result = run_two_pass(batch, plan, engine, options)
    shape = batch.shape
    bounded = (f", {plan.rebuilt:.0%} of the logits built twice (groups bigger than the budget)" if plan.rebuilt
               else f", logits in chunks of {plan.chunk_elements} (the budget)" if plan.chunk_elements else "")
    logger.debug("fused loss: %s path, B=%d, %d response tokens%s", plan.path, len(shape.counts), shape.n_selected,
                 bounded)
    loss, stats = result
    return loss, stats, engine, plan.path


@moved_keywords("fused_linear_pacs_loss", default_objective=PACS)
def fused_linear_pacs_loss(hidden, weight, targets, mask, old_logp, rewards, *, group_size: int,
                           objective: PACS | None = None, options: LossOptions | None = None, cu_seqlens=None,
                           bias=None, group_ids=None, valid=None, old_lse=None, return_stats: bool = False,
                           with_entropy: bool = False, piece=None, token_weights=None):
    """The PACS loss straight from final hidden states and the LM head (:func:`fused_linear_objective_loss` with
    ``objective=PACS(...)``, the arguments in the order of every fused entry).

    ``hidden``, ``weight``, ``targets``, ``mask``, ``old_logp``, ``cu_seqlens``, ``bias``, ``old_lse``, ``piece`` and
    ``token_weights`` are as in :func:`fused_linear_objective_loss`; ``group_ids`` and ``valid`` as in
    :func:`pacs_loss`. A keyword
    that moved (``beta=``, ``path=``, ...) still works, with a DeprecationWarning naming its new home.

    Args:
        rewards: (B,) 0/1 labels, each group's ``group_size`` responses contiguous.
        objective: ``PACS(beta=, score=, advantage=, weighting=, score_function_term=)`` (None: ``PACS()``);
            its kl_coef / entropy_coef need :func:`fused_linear_objective_loss`.
        options: :class:`LossOptions` (None: ``LossOptions()``).
        return_stats: also return a :class:`PACSStats` (its ``path`` says which ran; with ``piece``, a dict).
        with_entropy: with return_stats, also the policy's mean token entropy.

    Returns:
        0-d float32 loss (or ``(loss, PACSStats)``), differentiable in hidden, weight and bias.
        Its gradients are computed in this call on the single-pass and one-sweep paths; a second
        backward needs ``retain_graph=True`` on the first, as anywhere in autograd.
    """
    objective = PACS() if objective is None else objective
    check_pacs_objective(objective)
    return_stats, with_entropy = _flag("return_stats", return_stats), _flag("with_entropy", with_entropy)
    loss, stats, engine, path = run_loss(hidden, weight, targets, mask, old_logp, rewards, objective,
                                         group_size=group_size, options=options, old_lse=old_lse,
                                         cu_seqlens=cu_seqlens, bias=bias, valid=valid, group_ids=group_ids,
                                         piece=piece, with_entropy=with_entropy and return_stats,
                                         token_weights=token_weights)
    if not return_stats:
        return loss
    return loss, stats if piece is not None else replace(stats, path=path)


@moved_keywords("fused_linear_grpo_loss", default_objective=GRPO)
def fused_linear_grpo_loss(hidden, weight, targets, mask, old_logp, rewards, *, group_size: int,
                           objective: GRPO | None = None, options: LossOptions | None = None, cu_seqlens=None,
                           bias=None, ref_logp=None, return_stats: bool = False, piece=None, token_weights=None):
    """``grpo_loss`` straight from hidden states and the LM head (:func:`fused_linear_objective_loss` with
    ``objective=GRPO(...)``, the arguments in the order of every fused entry; ``old_logp=None`` means on-policy).

    ``objective``: ``GRPO(clip_eps=, clip_eps_high=, aggregation=, kl_coef=)`` (None: ``GRPO()``; an
    entropy_coef needs :func:`fused_linear_objective_loss`). ``ref_logp``: for the KL term, laid out like old_logp;
    ``token_weights``: as in :func:`fused_linear_objective_loss` (each token's clipped surrogate times its weight);
    ``return_stats``: -> ``(loss, GRPOStats)``; the others as in :func:`fused_linear_objective_loss`.
    The GRPO term of a token depends only on its own log-prob once the advantages and the normaliser are
    fixed, so the single pass (the default) cuts the response tokens into chunks of the budget whatever the
    response lengths (3 matmuls); ``LossOptions(path="two_pass")`` runs ``linear_logprobs`` and autograd.
    """
    objective = GRPO() if objective is None else objective
    if not isinstance(objective, GRPO):
        raise TypeError(f"objective must be a GRPO, got {type(objective).__name__}; "
                        "other objectives run through fused_linear_objective_loss")
    if objective.entropy_coef > 0:
        raise ValueError("fused_linear_grpo_loss has no entropy bonus; GRPO(entropy_coef > 0) runs through "
                         "fused_linear_objective_loss")
    return_stats = _flag("return_stats", return_stats)
    loss, stats, _, _ = run_loss(hidden, weight, targets, mask, old_logp, rewards, objective, group_size=group_size,
                                 options=options, ref_logp=ref_logp, cu_seqlens=cu_seqlens, bias=bias, piece=piece,
                                 token_weights=token_weights)
    return (loss, stats) if return_stats else loss


def check_pacs_objective(objective) -> None:
    if not isinstance(objective, PACS):
        raise TypeError(f"objective must be a PACS, got {type(objective).__name__}; "
                        "other objectives run through fused_linear_objective_loss")
    if objective.kl_coef > 0 or objective.entropy_coef > 0:
        raise ValueError("fused_linear_pacs_loss has no KL or entropy term; PACS(kl_coef=, entropy_coef=) runs "
                         "through fused_linear_objective_loss")


def _flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


class PACSLoss(nn.Module):
    """The PACS loss as a module, configured once; forward takes hidden states and the LM head.

    Example::

        loss_fn = PACSLoss(group_size=8, objective=PACS(beta=1.0), options=LossOptions(temperature=1.0))
        loss = loss_fn(hidden, model.lm_head.weight, targets, mask, old_logp, rewards)
        loss = loss_fn(hidden, model.lm_head.weight, targets, mask, None, rewards)   # on-policy
    """

    @moved_keywords("PACSLoss", default_objective=PACS)
    def __init__(self, group_size: int, *, objective: PACS | None = None, options: LossOptions | None = None) -> None:
        super().__init__()
        objective = PACS() if objective is None else objective
        options = LossOptions() if options is None else options
        if not isinstance(options, LossOptions):
            raise TypeError(f"PACSLoss(): options must be a LossOptions, got {type(options).__name__}")
        check_pacs_objective(objective)
        check_group_size(group_size, group_size, objective.advantage)
        self.group_size, self.objective, self.options = group_size, objective, options

    # the model's sampling settings may be set after construction (integrations.model_forward folds a
    # model's logit scale into the temperature and reads its soft-cap); other fields read through
    @property
    def temperature(self) -> float:
        return self.options.temperature

    @temperature.setter
    def temperature(self, value: float) -> None:
        self.options = replace(self.options, temperature=value)

    @property
    def logit_softcap(self) -> float | None:
        return self.options.logit_softcap

    @logit_softcap.setter
    def logit_softcap(self, value: float | None) -> None:
        self.options = replace(self.options, logit_softcap=value)

    @property
    def backend(self) -> str:
        return self.options.backend

    @property
    def path(self) -> str:
        return self.options.path

    @property
    def beta(self) -> float:
        return self.objective.beta

    def forward(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
                old_logp: torch.Tensor | None, rewards: torch.Tensor, *, cu_seqlens=None, bias=None, group_ids=None,
                valid=None, old_lse=None, return_stats: bool = False, with_entropy: bool = False, piece=None,
                token_weights=None):
        """Arguments as in :func:`fused_linear_pacs_loss` (``old_logp=None``: on-policy)."""
        return fused_linear_pacs_loss(hidden, lm_head_weight, targets, mask, old_logp, rewards,
                                      group_size=self.group_size, objective=self.objective, options=self.options,
                                      cu_seqlens=cu_seqlens, bias=bias, group_ids=group_ids, valid=valid,
                                      old_lse=old_lse, return_stats=return_stats, with_entropy=with_entropy,
                                      piece=piece, token_weights=token_weights)

    def extra_repr(self) -> str:
        return f"group_size={self.group_size}, objective={self.objective}, options={self.options}"
