"""The PACS loss computed inside a causal LM's own forward, so that wrappers see the call.

A trainer that wants hidden states must not call the unwrapped backbone: DDP would not sync the
gradients of that call and FSDP2 would not gather the parameters. ``add_pacs_forward(model, ...)``
therefore teaches the model's forward one more keyword: ``model(input_ids, attention_mask,
pacs_batch=PACSBatch(...))`` (called through whatever wraps the model) runs the backbone, hands the
final hidden states of the completion positions to the LM head, and returns the fused PACS loss
without materialising logits. Without ``pacs_batch`` the forward is the one the model had before
(generation and any other patch keep working).

The loss is computed inside the LM head module's own forward (``head(hidden, pacs_batch=...)``: the
head is taught the same keyword), not by reading ``head.weight`` from outside. Where FSDP2 made the
head a unit of its own (alone, or together with the final norm as accelerate does), only a call of
that module runs FSDP's hooks, which gather the weight and reduce-scatter (average) its gradient
over the ranks. Read from outside, such a weight is still the local shard (a DTensor); gathered
with ``full_tensor()`` it gives the right loss, but the backward of ``full_tensor()`` only slices
each rank's own gradient (no average over the ranks): each rank's shard of the head would be
trained on that rank's data alone (tests/test_model_forward_fsdp.py, layout "head_alone").

Shapes: input_ids / attention_mask (B, P + C): prompt then completion; completion tensors (B, C):
``hidden[:, -C-1:-1]`` predicts ``input_ids[:, -C:]``.

Padding-free (``add_pacs_forward(..., padding_free=True/None)``): the backbone runs on the rows' real tokens
packed into one row (each row's real tokens one run: a left-padded prompt, a right-padded completion), and the
hidden states that predict the completion tokens are gathered back into the (B, C) layout, so the loss is
unchanged; only models for which that is exact are packed (``pacs.model.packing.packing_obstacle``).
``pacs_batch=LogprobRequest(targets)`` asks the same forward for the completion tokens' log-probs instead of
the loss (old log-probs, with the fused kernels).
"""

from __future__ import annotations

import functools
import math
import types
from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput

from pacs.model.packed_attention import PACKED_ATTENTION, packed_call
from pacs.model.packing import pack_real_tokens, packed_backbone_kwargs, packing_obstacle, switch_attention
from pacs.model.profile import ModelProfile
from pacs_kernels import PACSLoss, linear_logprobs

# Batch entries of multimodal models (images): the PACS forwards pass only token ids (refused where they would be
# dropped silently).
MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "token_type_ids",
                   "mm_token_type_ids", "image_position_ids", "num_images")


class PACSBatch:
    """One micro-batch of whole groups, as the loss needs it (B = n_groups * group_size rows).

    targets: (B, C) int, the sampled completion tokens.
    mask: (B, C) 0/1, 1 on the completion tokens that enter the loss.
    rewards: (B,) float 0/1 labels (any value where ``valid`` is False).
    valid: (B,) bool; False: the response has no label (its reward function returned None) and
        contributes no loss term (its score still enters its group's baseline).
    old_logp: (B, C) float32 rollout-policy log-probs, or None for on-policy (the weights are
        still those that sampled: old = current, detached).
    group_ids: optional (B,) int, checked to hold whole groups contiguously.
    token_weights: optional (B, C) float >= 0, each completion token's weight in the loss (the rollout
        correction's importance weights: the loss's ``token_weights=``, docs/rollout-correction.md).
    return_stats: also compute the PACS stats (with the policy's mean token entropy) for logging.

    A plain class, not a dataclass: FSDP2's mixed precision (``cast_forward_inputs``, on in
    accelerate's bf16 policy) casts the float tensors of a forward's dataclass, dict and tuple
    arguments to the parameter dtype, and ``old_logp`` in bf16 would bias psi by up to 2^-8 of each
    log-prob. Tensors inside a plain object reach the loss as the caller made them.
    """
    __slots__ = ("targets", "mask", "rewards", "valid", "old_logp", "group_ids", "token_weights", "return_stats")

    def __init__(self, targets: torch.Tensor, mask: torch.Tensor, rewards: torch.Tensor, valid: torch.Tensor,
                 old_logp: torch.Tensor | None = None, group_ids: torch.Tensor | None = None,
                 return_stats: bool = True, token_weights: torch.Tensor | None = None):
        self.targets, self.mask, self.rewards, self.valid = targets, mask, rewards, valid
        self.old_logp, self.group_ids, self.return_stats = old_logp, group_ids, return_stats
        self.token_weights = token_weights

    def __repr__(self) -> str:
        shapes = ", ".join(f"{name}={None if getattr(self, name) is None else tuple(getattr(self, name).shape)}"
                           for name in self.__slots__[:-1])
        return f"PACSBatch({shapes}, return_stats={self.return_stats})"


class LogprobRequest:
    """``pacs_batch=LogprobRequest(targets)``: the forward returns the per-token log-probs of ``targets`` (B, C),
    the sampled completion tokens, at the loss's temperature (``PACSModelOutput.logp``, (B, C) float32), from
    the same backbone call as the loss (padded or padding-free) and the fused kernels (no (B, C, V) logits).
    Positions whose token is padding get a value that means nothing."""
    __slots__ = ("targets",)

    def __init__(self, targets: torch.Tensor):
        self.targets = targets


@dataclass
class PACSModelOutput(ModelOutput):
    """loss: 0-d float32; stats: dict of floats (``PACSStats.as_dict()``) or None; logp: (B, C) float32 (for a
    :class:`LogprobRequest`, which has no loss)."""
    loss: torch.Tensor | None = None
    stats: dict | None = None
    logp: torch.Tensor | None = None


def check_supported_head(config) -> ModelProfile:
    """The profile of a model's ``config`` (a transformers config); refuses LM heads whose logits the fused
    kernels cannot reproduce (ValueError)."""
    profile = ModelProfile.from_config(config)
    scale, softcap = profile.logit_scale, profile.logit_softcap
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"the model's logit scale must be a finite number > 0, got {scale}")
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"the model's final_logit_softcapping must be a finite number > 0, got {softcap}")
    if softcap is not None and scale != 1.0:
        raise ValueError(
            f"the model both scales (x{scale}) and soft-caps (final_logit_softcapping={softcap}) its logits; the "
            "kernels apply the cap to the head's output and fold the scale into the temperature, which is exact "
            "for one of the two only. Expected a logit scale of 1 with a soft-cap.")
    return profile


def pacs_head_loss(loss_fn: PACSLoss, hidden, weight, bias, batch: PACSBatch):
    """The fused loss on (B, C, d) hidden states -> (loss, stats dict or None).

    On-policy (``old_logp`` None) the kernel serves the single pass with old = current. Dtypes
    follow the kernel's policy whatever autocast region this runs in: hidden is cast to the head's
    dtype (bf16 hidden with a float32 head under ``cast_lm_head_to_fp32`` works), the GEMMs run in
    that dtype, softmax and accumulation in float32.
    """
    result = loss_fn(hidden, weight, batch.targets, batch.mask, batch.old_logp, batch.rewards, bias=bias,
                     return_stats=batch.return_stats, with_entropy=batch.return_stats,
                     group_ids=batch.group_ids, valid=batch.valid, token_weights=batch.token_weights)
    loss, stats = result if batch.return_stats else (result, None)
    return loss, None if stats is None else stats.as_dict()


def add_pacs_forward(model, loss_fn: PACSLoss, *, temperature: float, padding_free: bool | None = False,
                     setting: str = "padding_free") -> bool:
    """Patch ``model.forward`` (a transformers causal LM) and its LM head's forward
    (``model.get_output_embeddings()``) to serve ``pacs_batch=`` (see the module doc). Patch after
    any change to the head (a PEFT model built afterwards must not wrap ``lm_head``).

    ``temperature``: the sampling temperature; the model's own logit scale (``ModelProfile.logit_scale``) is
    folded into it. ``loss_fn.temperature`` is overwritten with the effective value, and
    ``loss_fn.logit_softcap`` with the model's soft-cap (``final_logit_softcapping``, or None).

    ``padding_free``: the ``pacs_batch`` forward runs the backbone on the rows' real tokens packed into
    one row (:func:`packed_completion_hidden`) instead of the padded (B, P + C) batch; the loss and its
    gradients are the padded forward's (up to float rounding), its cost is the real tokens'. The model's
    attention then becomes ``pacs_packed_sdpa`` (plain ``sdpa`` for every call that is not a packed row:
    generation, logits), unless it is a flash-attention one, which takes packed rows as they are.
    None: padding-free wherever that is exact for the model (:func:`pacs.model.packing.packing_obstacle`);
    True for a model where it is not: a ValueError naming ``setting``. Returns whether it is on.
    """
    profile = check_supported_head(model.config)
    attention = padding_free_attention(model, padding_free, setting)  # None: padded rows (nothing changed yet)
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__}.get_output_embeddings() returned None: the fused PACS loss needs "
                         "the model's LM head (a module with a (V, d) weight)")
    loss_fn.temperature = float(temperature) / profile.logit_scale
    loss_fn.logit_softcap = profile.logit_softcap  # Gemma-style soft-cap, inside the kernels
    add_pacs_head_forward(head, loss_fn)

    padding_free = attention is not None and switch_attention(
        model, attention, required_by=f"{setting}=True" if padding_free is True else None, off=f"{setting}=False")
    previous_forward = unbound_forward(model)

    @functools.wraps(type(model).forward)  # generate() checks its kwargs against this signature
    def forward(self, *args, pacs_batch: PACSBatch | LogprobRequest | None = None, **kwargs):
        if pacs_batch is None:
            return previous_forward(self, *args, **kwargs)
        head = self.get_output_embeddings()
        if not getattr(head, "serves_pacs_batch", False):
            raise ValueError(f"the LM head ({type(head).__name__}) was replaced after add_pacs_forward: call "
                             "add_pacs_forward again on the model as it is now")
        kwargs["use_cache"] = False
        if padding_free:
            hidden = packed_completion_hidden(self.base_model, args, kwargs, pacs_batch)
        else:
            completion_len = pacs_batch.targets.shape[1]
            hidden = self.base_model(*args, **kwargs).last_hidden_state[:, -completion_len - 1:-1]
        if isinstance(pacs_batch, LogprobRequest):
            return PACSModelOutput(logp=head(hidden, pacs_batch=pacs_batch))
        loss, stats = head(hidden, pacs_batch=pacs_batch)  # a module call: module doc
        return PACSModelOutput(loss=loss, stats=stats)

    model.forward = types.MethodType(forward, model)
    return padding_free


def padding_free_attention(model, requested: bool | None, setting: str) -> str | None:
    """The attention a padding-free ``model`` would run (its own flash attention, else ``pacs_packed_sdpa``), or
    None for padded rows: ``requested`` False, or None where packing cannot be exact for the model
    (:func:`pacs.model.packing.packing_obstacle`, rows left-padded as TRL's prompts are); ``requested`` True there is
    a ValueError naming ``setting`` and saying why. Changes nothing."""
    if requested is False:
        return None
    if requested is not None and requested is not True:
        raise ValueError(f"{setting} must be True, False or None (padding-free wherever exact), got {requested!r}")
    current = model.config._attn_implementation or "sdpa"
    attention = current if "flash" in current else PACKED_ATTENTION
    why = packing_obstacle(model.config, attention, model_class=type(model), left_padded=True)
    if why is not None and requested:
        raise ValueError(f"{setting}=True cannot be exact for this model: {why}; set {setting}=False")
    return None if why is not None else attention


def packed_completion_hidden(backbone, args: tuple, kwargs: dict, batch: PACSBatch | LogprobRequest) -> torch.Tensor:
    """The backbone's final hidden states at the positions that predict the completion tokens, (B, C, d),
    computed on the rows' real tokens packed into one row.

    ``input_ids`` / ``attention_mask`` (B, P + C), positional or keyword: each row's real tokens one
    contiguous run (a left-padded prompt, then a right-padded completion); completion column j of a row
    is predicted by the real token before it. A packed row restarts its positions at 0 where a
    left-padded row's start at its padding: RoPE sees the same distances. Where ``batch.mask`` is 0 the
    hidden state is a stand-in (the packed row's first), which the loss ignores.
    """
    names = ("input_ids", "attention_mask")
    if len(args) > len(names):
        raise TypeError(f"the padding-free PACS forward takes input_ids and attention_mask, got {len(args)} "
                        "positional arguments")
    for name, value in zip(names, args):
        if name in kwargs:
            raise TypeError(f"got {name} both as a positional and a keyword argument")
        kwargs[name] = value
    input_ids, attention_mask = kwargs.pop("input_ids", None), kwargs.pop("attention_mask", None)
    not_packed = ("inputs_embeds", "position_ids", "past_key_values", "cache_position", *MULTIMODAL_KEYS)
    refused = [name for name in not_packed if kwargs.pop(name, None) is not None]
    if input_ids is None or refused:
        raise ValueError(f"the padding-free PACS forward takes input_ids (B, L) and attention_mask (text only), not "
                         f"{refused or 'no input_ids'}; add_pacs_forward(..., padding_free=False) takes any")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)

    layout = pack_real_tokens(input_ids, attention_mask)
    with packed_call(layout.bounds):
        hidden = backbone(input_ids=layout.input_ids, **packed_backbone_kwargs(
            layout.position_ids, layout.cu_seqlens, layout.max_seqlen), **kwargs).last_hidden_state[0]
    width, completion_len = input_ids.shape[1], batch.targets.shape[1]
    columns = torch.arange(width - completion_len, width, device=input_ids.device).expand(input_ids.shape[0], -1)
    predictor, predictor_real = layout.packed_index(columns - 1)
    if isinstance(batch, LogprobRequest):  # every completion position; padding's values mean nothing
        return hidden[predictor]
    _, target_real = layout.packed_index(columns)
    if bool(((batch.mask != 0) & ~(predictor_real & target_real)).any()):
        raise ValueError("pacs_batch.mask selects completion tokens that attention_mask marks as padding (or whose "
                         "previous token it does): the loss may only count real tokens after a real token")
    return hidden[predictor]


def unbound_forward(module):
    """``module.forward`` as a function of (self, ...): a patched forward calls it with the module it
    runs on, so that a deep copy of a patched model runs its own weights, not the original's."""
    bound = module.forward
    return bound.__func__ if getattr(bound, "__self__", None) is module else (lambda self, *a, **k: bound(*a, **k))


def add_pacs_head_forward(head, loss_fn: PACSLoss) -> None:
    """Patch the LM head's forward: ``head(hidden (B, C, d), pacs_batch=...)`` -> (loss, stats dict or None).

    It runs inside the head module's call, so that FSDP2's hooks gather the weight before and
    reduce its gradient after (module doc). Without ``pacs_batch`` the previous forward runs (logits).
    A PEFT adapter on the head (LoRA in ``target_modules``) is refused: the loss reads the head's
    weight, which would leave the adapter out (``modules_to_save=["lm_head"]`` trains the head itself).
    """
    if hasattr(head, "base_layer"):
        raise ValueError(f"the LM head is a PEFT adapter layer ({type(head).__module__}.{type(head).__name__}): the "
                         "fused PACS loss reads the head's (V, d) weight and would leave the adapter out. Leave "
                         "lm_head out of LoRA's target_modules (modules_to_save=['lm_head'] trains the head itself)")
    previous_forward = unbound_forward(head)

    def forward(self, hidden, *args, pacs_batch: PACSBatch | None = None, **kwargs):
        if pacs_batch is None:
            return previous_forward(self, hidden, *args, **kwargs)
        weight, bias = self.weight, getattr(self, "bias", None)
        if hasattr(weight, "full_tensor"):  # FSDP2 would have gathered it: sharded some other way
            raise ValueError(
                f"the LM head's weight is a DTensor ({tuple(weight.placements)}) inside the head's own forward: the "
                "fused loss needs the full (V, d) weight, gathered by FSDP2 (which also reduces its gradient); a "
                "tensor-parallel or otherwise distributed LM head is not supported")
        if isinstance(pacs_batch, LogprobRequest):
            return linear_logprobs(hidden.to(weight.dtype), weight, pacs_batch.targets, temperature=loss_fn.temperature,
                                   bias=bias, logit_softcap=loss_fn.logit_softcap, backend=loss_fn.backend)
        return pacs_head_loss(loss_fn, hidden, weight, bias, pacs_batch)

    head.forward = types.MethodType(forward, head)
    head.serves_pacs_batch = True
