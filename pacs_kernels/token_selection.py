"""The response tokens of a micro-batch, checked and selected: the input stage of both fused losses.

Only the response tokens (mask == 1) matter to PACS and GRPO, so only their rows of ``hidden``
are gathered and sent to the log-prob computation; prompt and padding tokens cost nothing. The
selected tokens stay in order, so they form a packed layout whose response offsets are the running
sum of each response's token count. The backward of the gather scatters the hidden-state gradient
back to the selected rows (zeros elsewhere).

Layouts of the fused losses' inputs:
    padded: hidden (B, T, d); targets, mask, old_logp (B, T).
    packed: hidden (N, d) or (1, N, d); targets, mask, old_logp (N,) or (1, N);
            cu_seqlens (B + 1,) int: response i owns tokens cu_seqlens[i]:cu_seqlens[i+1].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .checks import FLOAT_DTYPES, INT_DTYPES, check_no_inf_where, check_same_device, check_tensor
from .loss_inputs import MASK_DTYPES, ResponseLayout, check_cu_seqlens, check_mask_values


@dataclass(frozen=True)
class ResponseTokens:
    """A micro-batch's tokens, flattened: hidden (N, d), targets (N,), mask bool (N,), old_logp (N,) or
    None, counts (B,) int64 masked tokens per response, n_responses B, and the input's token shape."""

    hidden: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    old_logp: torch.Tensor | None
    counts: torch.Tensor
    n_responses: int
    token_shape: tuple

    def selected(self, index: torch.Tensor | None) -> tuple:
        """(hidden, targets, old_logp) of the tokens at ``index`` (:func:`selected_index`; None: all of them)."""
        if index is None:
            return self.hidden, self.targets, self.old_logp
        old_logp = None if self.old_logp is None else self.old_logp.index_select(0, index)
        return self.hidden.index_select(0, index), self.targets.index_select(0, index), old_logp

    def selected_layout(self) -> ResponseLayout:
        """The packed layout of the selected (mask == 1) tokens: offsets = running sum of counts."""
        return ResponseLayout.from_counts(self.counts)


def match_head_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden cast to the LM head's dtype (e.g. bf16 hidden states with a float32 head, as TRL's
    ``cast_lm_head_to_fp32`` makes them); differentiable: the gradient comes back in hidden's dtype."""
    if isinstance(hidden, torch.Tensor) and isinstance(weight, torch.Tensor) and hidden.dtype != weight.dtype \
            and hidden.dtype in FLOAT_DTYPES and weight.dtype in FLOAT_DTYPES:
        return hidden.to(weight.dtype)
    return hidden


def check_response_tokens(hidden, targets, mask, old_logp, cu_seqlens) -> ResponseTokens:
    """Check the per-token inputs of a fused loss (either layout); ``old_logp`` may be None."""
    check_tensor("hidden", hidden, dtypes=FLOAT_DTYPES)
    check_tensor("targets", targets, dtypes=INT_DTYPES)
    check_tensor("mask", mask, dtypes=MASK_DTYPES)
    if old_logp is not None:
        check_tensor("old_logp", old_logp, dtypes=FLOAT_DTYPES)
    if cu_seqlens is None:
        if hidden.dim() != 3:
            raise ValueError(
                "hidden must be (B, T, d) in the padded layout (or pass cu_seqlens for the packed "
                f"layout with hidden (N, d)), got shape {tuple(hidden.shape)}")
    elif not (hidden.dim() == 2 or (hidden.dim() == 3 and hidden.shape[0] == 1)):
        raise ValueError(
            f"with cu_seqlens (packed layout) hidden must be (N, d) or (1, N, d), got shape {tuple(hidden.shape)}")
    token_shape = tuple(hidden.shape[:-1])
    for name, value in (("targets", targets), ("mask", mask), ("old_logp", old_logp)):
        if value is not None and tuple(value.shape) != token_shape:
            raise ValueError(f"{name} must have shape hidden.shape[:-1] = {token_shape}, got {tuple(value.shape)}")
    check_same_device(hidden=hidden, targets=targets, mask=mask, old_logp=old_logp, cu_seqlens=cu_seqlens)
    mask = check_mask_values(mask)
    if old_logp is not None:
        check_no_inf_where("old_logp", old_logp, mask)
    width = hidden.shape[-1]
    if cu_seqlens is None:
        counts = mask.sum(-1)
        n_responses = hidden.shape[0]
    else:
        cu, _ = check_cu_seqlens(cu_seqlens, hidden.numel() // max(width, 1))
        n_responses = cu.shape[0] - 1
        segment = ResponseLayout(n_responses, None, cu, 0).segment_ids()
        counts = torch.zeros(n_responses, dtype=torch.int64, device=hidden.device)
        counts.index_add_(0, segment, mask.reshape(-1).to(torch.int64))
    return ResponseTokens(hidden.reshape(-1, width), targets.reshape(-1), mask.reshape(-1),
                          None if old_logp is None else old_logp.reshape(-1), counts, n_responses, token_shape)


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
