"""The fused entries: hidden states + LM head -> a loss, never holding N x V logits.

``fused_linear_pacs_loss``, ``fused_linear_grpo_loss`` and the ``PACSLoss`` module are short wrappers over
the engine (engine.py): they build the checked batch once, take what the loss is from the objective
(``PACS(beta=...)``, ``GRPO(clip_eps=...)``) and how to compute it from a :class:`LossOptions`, and run
it. The engine picks the path (single pass, two passes, or PACS's one sweep given ``old_lse``) and the
backend.

``old_logp=None`` means on-policy: the old log-probs are the current ones, detached (what TRL's
GRPOTrainer does with ``num_iterations=1``); every path handles it.

Dtype policy, whatever autocast region the caller is in: hidden is cast to the LM head's dtype;
the GEMMs run in that dtype (tensor cores for bf16/fp16 on CUDA), logits, softmax and gradient
accumulation in float32 (float64 for float64 inputs); gradients return in the inputs' dtypes.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from . import engine, pieces
from .keywords import sort_keywords
from .loss_inputs import check_group_size
from .objectives import GRPO, PACS
from .options import LossOptions

PACS_INPUTS = ("cu_seqlens", "bias", "group_ids", "valid", "old_lse", "return_stats", "with_entropy", "piece")
GRPO_INPUTS = ("cu_seqlens", "bias", "ref_logp", "return_stats", "piece")


def fused_linear_pacs_loss(hidden, weight, targets, mask, old_logp, rewards, *, group_size: int,
                           objective: PACS | None = None, options: LossOptions | None = None, **inputs):
    """The PACS loss straight from final hidden states and the LM head.

    Args:
        hidden: (B, T, d) padded, or (N, d) / (1, N, d) packed with ``cu_seqlens``; the backbone's
            final hidden states (after the last norm). Cast to weight's dtype if it differs.
        weight: (V, d) LM-head weight (may be the tied input embedding).
        targets: (B, T) / (N,) int: the sampled token at each position (any valid id where mask == 0).
        mask: (B, T) / (N,) 0/1 (bool/int/float): 1 on response tokens; log-probs are computed only there.
        old_logp: (B, T) / (N,) the rollout policy's log-probs (constant), or None: on-policy.
        rewards: (B,) 0/1 labels, each group's ``group_size`` responses contiguous.
        group_size: G, responses per prompt.
        objective: ``PACS(beta=, score=, advantage=, weighting=, score_function_term=)`` (None: ``PACS()``);
            its kl_coef / entropy_coef need :func:`fused_linear_objective_loss`.
        options: :class:`LossOptions` (backend, path, chunk budget, temperature, logit_softcap, with_entropy,
            ...; None: ``LossOptions()``).
        inputs: the batch's optional inputs: ``cu_seqlens`` (B + 1,) offsets of the packed layout;
            ``bias`` (V,); ``group_ids``, ``valid`` as in :func:`pacs_loss`; ``old_lse``: the log-sum-exp
            from the old-policy pass (``linear_logprobs(..., return_lse=True)``), ONLY while the weights
            are still those that produced old_logp: then one sweep gives the loss and its gradients (a
            stale one gives a RuntimeWarning and the usual path); ``return_stats``: also return a
            :class:`PACSStats` (its ``path`` says which ran); ``with_entropy``: with return_stats, also
            the policy's mean token entropy; ``piece``: these tokens are a piece of a batch whose loss is
            completed elsewhere (:class:`KnownGradient`, :class:`GatheredLogprobs`; old_logp and rewards
            are then unused, the stats a dict). A keyword that moved (``beta=``,
            ``path=``, ...) still works, with a DeprecationWarning naming its new home.

    Returns:
        0-d float32 loss (or ``(loss, PACSStats)``), differentiable in hidden, weight and bias.
        Its gradients are computed in this call on the single-pass and one-sweep paths; a second
        backward needs ``retain_graph=True`` on the first, as anywhere in autograd.
    """
    objective, options, given = sort_keywords("fused_linear_pacs_loss", inputs, inputs=PACS_INPUTS,
                                              objective=PACS() if objective is None else objective, options=options)
    check_pacs_objective(objective)
    if given.get("piece") is not None:
        return piece_loss(hidden, weight, targets, mask, objective, options, given, group_size=group_size)
    batch = engine.LossBatch.build(hidden, weight, targets, mask, old_logp, rewards, group_size=group_size,
                                   cu_seqlens=given.get("cu_seqlens"), bias=given.get("bias"))
    return engine.run_pacs(batch, objective.group_settings(), options, valid=given.get("valid"),
                           group_ids=given.get("group_ids"), old_lse=given.get("old_lse"),
                           return_stats=_flag("return_stats", given.get("return_stats", False)),
                           with_entropy=_flag("with_entropy", given.get("with_entropy", False)))


def fused_linear_grpo_loss(hidden, weight, targets, mask, old_logp, rewards, *, group_size: int,
                           objective: GRPO | None = None, options: LossOptions | None = None, **inputs):
    """``grpo_loss`` straight from hidden states and the LM head, padded (B, T, d) or packed (N, d) with
    ``cu_seqlens`` (layouts as in :func:`fused_linear_pacs_loss`); ``old_logp=None`` means on-policy.

    ``objective``: ``GRPO(clip_eps=, clip_eps_high=, aggregation=, kl_coef=)`` (None: ``GRPO()``; an
    entropy_coef needs :func:`fused_linear_objective_loss`). ``inputs``: ``cu_seqlens``, ``bias``,
    ``ref_logp`` (for the KL term, laid out like old_logp), ``return_stats`` (-> ``(loss, GRPOStats)``), ``piece``
    (as in :func:`fused_linear_pacs_loss`).
    The GRPO term of a token depends only on its own log-prob once the advantages and the normaliser are
    fixed, so the single pass (the default) cuts the response tokens into chunks of the budget whatever the
    response lengths (3 matmuls); ``LossOptions(path="two_pass")`` runs ``linear_logprobs`` and autograd.
    """
    objective, options, given = sort_keywords("fused_linear_grpo_loss", inputs, inputs=GRPO_INPUTS,
                                              objective=GRPO() if objective is None else objective, options=options)
    if not isinstance(objective, GRPO):
        raise TypeError(f"objective must be a GRPO, got {type(objective).__name__}; "
                        "other objectives run through fused_linear_objective_loss")
    if objective.entropy_coef > 0:
        raise ValueError("fused_linear_grpo_loss has no entropy bonus; GRPO(entropy_coef > 0) runs through "
                         "fused_linear_objective_loss")
    if given.get("piece") is not None:
        return piece_loss(hidden, weight, targets, mask, objective, options, given, group_size=group_size)
    batch = engine.LossBatch.build(hidden, weight, targets, mask, old_logp, rewards, group_size=group_size,
                                   cu_seqlens=given.get("cu_seqlens"), bias=given.get("bias"))
    settings = dict(clip_eps=objective.clip_eps, clip_eps_high=objective.clip_eps_high,
                    aggregation=objective.aggregation, kl_coef=objective.kl_coef)
    return engine.run_grpo(batch, settings, options, ref_logp=given.get("ref_logp"),
                           return_stats=_flag("return_stats", given.get("return_stats", False)))


def piece_loss(hidden, weight, targets, mask, objective, options, given: dict, *, group_size: int):
    """A piece of a batch (``piece=``, pieces.py): ``(loss, stats dict)`` with return_stats, else the loss."""
    pieces.refuse_with_piece(given)
    loss, stats = pieces.run_piece(hidden, weight, targets, mask, given["piece"], objective, options,
                                   group_size=group_size, bias=given.get("bias"), valid=given.get("valid"))
    return (loss, stats) if _flag("return_stats", given.get("return_stats", False)) else loss


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

    def __init__(self, group_size: int, *, objective: PACS | None = None, options: LossOptions | None = None,
                 **deprecated) -> None:
        super().__init__()
        objective, options, _ = sort_keywords("PACSLoss", deprecated, inputs=(),
                                              objective=PACS() if objective is None else objective, options=options)
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
                old_logp: torch.Tensor | None, rewards: torch.Tensor, **inputs):
        """Arguments as in :func:`fused_linear_pacs_loss` (``old_logp=None``: on-policy; ``inputs``: cu_seqlens,
        bias, group_ids, valid, old_lse, return_stats, with_entropy)."""
        return fused_linear_pacs_loss(hidden, lm_head_weight, targets, mask, old_logp, rewards,
                                      group_size=self.group_size, objective=self.objective, options=self.options,
                                      **inputs)

    def extra_repr(self) -> str:
        return f"group_size={self.group_size}, objective={self.objective}, options={self.options}"
