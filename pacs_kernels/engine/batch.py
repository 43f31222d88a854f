"""The checked batch: a micro-batch's inputs checked once and its response tokens selected.

Every fused entry builds one :class:`LossBatch` (``LossBatch.build``): the layout (padded or packed), the
response tokens (mask == 1, in order: their hidden rows are gathered and only they reach the LM head),
the LM head (weight, bias) and every optional input a batch can carry (old_logp, ref_logp, old_lse,
token_weights, valid, group_ids), each checked here and nowhere after. What the batch IS for the planner (shapes,
dtypes, response lengths: no tensor data) is :meth:`LossBatch.shape`.

Layouts of the fused losses' inputs:
    padded: hidden (B, T, d); targets, mask, old_logp, ref_logp, old_lse, token_weights (B, T).
    packed: hidden (N, d) or (1, N, d); targets, mask, ... (N,) or (1, N);
            cu_seqlens (B + 1,) int: response i owns tokens cu_seqlens[i]:cu_seqlens[i+1].
    piece:  any (..., d) with a mask selecting tokens; no responses (``LossBatch.build(..., piece=kind)``).
The backward of the gather scatters the hidden-state gradient back to the selected rows (zeros elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import (
    FLOAT_DTYPES,
    INT_DTYPES,
    check_no_inf_where,
    check_not_sharded,
    check_same_device,
    check_targets_in_range,
    check_tensor,
)
from ..loss_inputs import MASK_DTYPES, ResponseLayout, check_cu_seqlens, check_mask_values


@dataclass(frozen=True)
class BatchShape:
    """What the planner knows of a batch: numbers, never tensor data. ``counts``: response lengths in order
    (selected tokens); ``n_tokens``: the input's tokens, selected or not; ``d``, ``vocab``: the LM head's
    width and vocabulary; ``dtype``: the head's (the GEMMs' input) dtype; ``device_type``: "cpu", "cuda", ...;
    ``group_size``; ``has_old_lse``: the rollout's log-sum-exp came with the batch; ``piece``: the kind of
    piece (None: whole groups; "known_gradient" / "gathered_logprobs"); ``has_token_weights``: per-token weights
    came with the batch (the objective must declare ``Capabilities(token_weights=True)``); ``has_valid``: a
    per-response validity mask came with it (``Capabilities(response_validity=True)``)."""

    counts: tuple[int, ...]
    n_tokens: int
    d: int
    vocab: int
    dtype: torch.dtype
    device_type: str
    group_size: int
    has_old_lse: bool = False
    piece: str | None = None
    has_token_weights: bool = False
    has_valid: bool = False

    @property
    def n_selected(self) -> int:
        return sum(self.counts)


@dataclass(frozen=True)
class LossBatch:
    """A micro-batch checked once, its response tokens selected (mask == 1, in order).

    hidden (N_sel, d) in the head's dtype, targets (N_sel,); old_logp, ref_logp, old_lse (N_sel,) or None
    (on-policy / no KL reference / no one sweep); token_weights (N_sel,) or None: a constant weight >= 0 on each
    token's term (rollout correction's truncated importance weights; None: 1); counts (B,) int64 response lengths (a
    piece: one entry, its
    selected tokens); layout: the packed layout of the selected tokens; weight (V, d), bias (V,) or None;
    rewards (B,), valid (B,) and group_ids (B,) as given (the objective checks them its way); group_size;
    index: the selected positions of the flattened input (None: all); token_shape: the input's per-token shape;
    shape: what the planner reads (:class:`BatchShape`).
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    targets: torch.Tensor
    old_logp: torch.Tensor | None
    ref_logp: torch.Tensor | None
    old_lse: torch.Tensor | None
    token_weights: torch.Tensor | None
    counts: torch.Tensor
    layout: ResponseLayout
    rewards: torch.Tensor | None
    valid: torch.Tensor | None
    group_ids: torch.Tensor | None
    group_size: int
    index: torch.Tensor | None
    token_shape: tuple
    shape: BatchShape

    @classmethod
    def build(cls, hidden, weight, targets, mask, old_logp, rewards, *, group_size, cu_seqlens=None, bias=None,
              ref_logp=None, old_lse=None, valid=None, group_ids=None, piece: str | None = None,
              token_weights=None) -> "LossBatch":
        """Check a batch and select its tokens: whole responses, padded (B, T, d) or packed (N, d) with
        ``cu_seqlens``; or, with ``piece`` ("known_gradient" / "gathered_logprobs"), a piece of a batch in any
        (..., d) layout whose mask selects its tokens (no responses; old_logp and rewards unused)."""
        check_head(hidden, weight, bias)
        hidden = match_head_dtype(hidden, weight)
        check_tensor("targets", targets, dtypes=INT_DTYPES)
        check_tensor("mask", mask, dtypes=MASK_DTYPES)
        if piece is not None:
            old_logp = rewards = None
            token_shape, width = tuple(hidden.shape[:-1]), hidden.shape[-1]
        else:
            token_shape, width = _check_layout(hidden, cu_seqlens)
        for name, value in (("targets", targets), ("mask", mask), ("old_logp", old_logp), ("ref_logp", ref_logp),
                            ("old_lse", old_lse), ("token_weights", token_weights)):
            _check_per_token(name, value, token_shape, hidden.device, floating=name not in ("targets", "mask"))
        if old_lse is not None and old_logp is None:
            raise ValueError("old_lse goes with the old_logp it was computed with; got old_lse with old_logp=None")
        check_same_device(targets=targets, mask=mask, cu_seqlens=cu_seqlens)
        bool_mask = check_mask_values(mask)  # 0/1 only, on every route
        flat_mask = bool_mask.reshape(-1)
        if old_logp is not None:
            check_no_inf_where("old_logp", old_logp, bool_mask)
        if ref_logp is not None:
            check_no_inf_where("ref_logp", ref_logp, bool_mask)
        if token_weights is not None and piece is not None:
            raise ValueError("token_weights= cannot go with piece=: a piece's loss is completed on the whole batch, "
                             "pass the weights there")
        if piece is not None:  # a piece may select nothing: always an index (its gradient still reaches hidden)
            counts, index = flat_mask.sum().reshape(1), flat_mask.nonzero().squeeze(1)
        elif cu_seqlens is None:
            counts, index = bool_mask.sum(-1), selected_index(flat_mask)
        else:
            cu, _ = check_cu_seqlens(cu_seqlens, flat_mask.shape[0])
            segment = ResponseLayout(cu.shape[0] - 1, None, cu, 0).segment_ids()
            counts = torch.zeros(cu.shape[0] - 1, dtype=torch.int64, device=flat_mask.device)
            counts.index_add_(0, segment, flat_mask.to(torch.int64))
            index = selected_index(flat_mask)
        flat_targets = pick(targets.reshape(-1), index)
        check_targets_in_range(flat_targets, weight.shape[0])
        flat_weights = check_token_weights(_picked(token_weights, index))
        vocab, d = weight.shape
        shape = BatchShape(tuple(counts.tolist()), int(torch.Size(token_shape).numel()), d, vocab, weight.dtype,
                           weight.device.type, group_size, old_lse is not None, piece, token_weights is not None,
                           valid is not None)
        return cls(pick(hidden.reshape(-1, width), index), weight, bias, flat_targets, _picked(old_logp, index),
                   _picked(ref_logp, index), _picked(old_lse, index), flat_weights, counts,
                   ResponseLayout.from_counts(counts), rewards, valid, group_ids, group_size, index, token_shape, shape)

    @property
    def n_responses(self) -> int:
        return self.counts.shape[0]

    @property
    def n_tokens(self) -> int:
        """Tokens of the input, selected or not."""
        return self.shape.n_tokens

    @property
    def n_selected(self) -> int:
        return self.hidden.shape[0]

    def per_token(self, values: torch.Tensor) -> torch.Tensor:
        """(N_sel,) selected values of a per-token input laid out like targets (e.g. a piece's grad_logp)."""
        return pick(values.reshape(-1), self.index)


def check_head(hidden, weight, bias) -> None:
    """The LM head (weight (V, d), bias (V,) or None) and hidden (..., d) on its device."""
    check_not_sharded(weight=weight, bias=bias)
    if type(hidden).__name__ == "DTensor":
        raise TypeError("hidden is a DTensor (sharded, e.g. by FSDP2's fully_shard): the kernels need the full "
                        "tensor. Read it inside the forward of the module FSDP wraps, or pass hidden.full_tensor()")
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(f"hidden must be a torch.Tensor, got {type(hidden).__name__}")
    if hidden.dtype not in FLOAT_DTYPES:
        raise TypeError(f"hidden must have a floating dtype (float16, bfloat16, float32, float64), got {hidden.dtype}")
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, ndim=2)
    vocab, d = weight.shape
    if vocab == 0 or d == 0:
        raise ValueError(f"weight must be non-empty (V, d), got shape {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != d:
        raise ValueError(f"hidden's last dimension must equal weight.shape[1] = {d} (the model width), "
                         f"got hidden of shape {tuple(hidden.shape)}")
    if hidden.device != weight.device:
        raise ValueError(f"all tensors must be on one device: weight is on {weight.device}, but hidden is on "
                         f"{hidden.device}")
    if bias is not None:
        check_tensor("bias", bias, dtypes=FLOAT_DTYPES, ndim=1)
        if bias.shape[0] != vocab:
            raise ValueError(f"bias must have shape (V,) = ({vocab},), got {tuple(bias.shape)}")
        check_same_device(weight=weight, bias=bias)


def _check_layout(hidden: torch.Tensor, cu_seqlens) -> tuple[tuple, int]:
    if cu_seqlens is None:
        if hidden.dim() != 3:
            raise ValueError(
                "hidden must be (B, T, d) in the padded layout (or pass cu_seqlens for the packed "
                f"layout with hidden (N, d)), got shape {tuple(hidden.shape)}")
    elif not (hidden.dim() == 2 or (hidden.dim() == 3 and hidden.shape[0] == 1)):
        raise ValueError(
            f"with cu_seqlens (packed layout) hidden must be (N, d) or (1, N, d), got shape {tuple(hidden.shape)}")
    return tuple(hidden.shape[:-1]), hidden.shape[-1]


def _check_per_token(name: str, value, token_shape: tuple, device: torch.device, *, floating: bool) -> None:
    if value is None:
        return
    if name == "old_lse" and (not isinstance(value, torch.Tensor) or tuple(value.shape) != token_shape):
        raise ValueError(f"old_lse must have the shape of old_logp {token_shape}, got "
                         + (f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__))
    if floating:
        check_tensor(name, value, dtypes=FLOAT_DTYPES)
    if tuple(value.shape) != token_shape:
        raise ValueError(f"{name} must have shape hidden.shape[:-1] = {token_shape}, got {tuple(value.shape)}")
    if value.device != device:
        raise ValueError(f"all tensors must be on one device: hidden is on {device}, but {name} is on {value.device}")


def check_token_weights(selected: torch.Tensor | None) -> torch.Tensor | None:
    """The response tokens' weights (N_sel,): finite and >= 0 (the tokens outside the mask are never read);
    returned detached (a weight is a constant of the loss)."""
    if selected is None:
        return None
    if not bool(torch.isfinite(selected).all()):
        raise ValueError("token_weights must be finite on the response tokens (mask == 1); got a NaN or an inf")
    if bool((selected < 0).any()):
        raise ValueError(f"token_weights must be >= 0 on the response tokens (mask == 1); got "
                         f"{float(selected.min()):.6g}")
    return selected.detach()


def _picked(values: torch.Tensor | None, index: torch.Tensor | None) -> torch.Tensor | None:
    return None if values is None else pick(values.reshape(-1), index)


def match_head_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden cast to the LM head's dtype (e.g. bf16 hidden states with a float32 head, as TRL's
    ``cast_lm_head_to_fp32`` makes them); differentiable: the gradient comes back in hidden's dtype."""
    if hidden.dtype != weight.dtype:
        return hidden.to(weight.dtype)
    return hidden


def selected_index(mask: torch.Tensor) -> torch.Tensor | None:
    """Indices of the mask == 1 tokens of a bool (N,) mask, or None when every token is selected."""
    return None if bool(mask.all()) else mask.nonzero().squeeze(1)


def pick(values: torch.Tensor | None, index: torch.Tensor | None) -> torch.Tensor | None:
    """values[index] along dim 0 (values itself when index is None: every token selected)."""
    if values is None or index is None:
        return values
    return values.index_select(0, index)


def scatter_selected(selected: torch.Tensor, index: torch.Tensor | None, n_tokens: int) -> torch.Tensor:
    """(N_sel,) values back into an (N,) tensor with zeros at the unselected tokens."""
    if index is None:
        return selected
    return selected.new_zeros(n_tokens).index_put((index,), selected)
