"""``pacs_packed_sdpa``: the attention a packed row runs through a Hugging Face model, registered with transformers.

A packed row (pacs/model/packing.py) holds several sequences back to back. While it runs through a backbone
(:func:`packed_call`), this attention keeps each sequence causal and to itself: one flash varlen call for the
whole row where it can (CUDA, 16-bit: pacs/model/varlen_attention.py), else ``scaled_dot_product_attention``
once per sequence; its mask function builds no mask. Every other call (padded rows, generation) is exactly
Hugging Face's ``sdpa``. Sequence parallelism's attention (pacs/model/sequence_parallel.py) falls back to
this one outside a sequence-parallel forward and shares its checks (:func:`sequence_bounds`,
:func:`require_causal`).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from pacs.model.varlen_attention import varlen_causal_attention

PACKED_ATTENTION = "pacs_packed_sdpa"
SEQUENCE_PARALLEL_KWARG = "pacs_sequence_parallel"  # the backbone keyword that reaches every attention call
                                                    # of a sequence-parallel forward (pacs/model/sequence_parallel.py)
# inside a packed row's forward: the row's sequence offsets, on the host (None outside one)
_PACKED_CALL: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("pacs_packed_call",
                                                                                default=None)


@contextlib.contextmanager
def packed_call(bounds: list[int]):
    """While a packed row runs through a backbone: ``pacs_packed_sdpa``'s mask function builds no mask
    (the attention keeps each sequence to itself), and its attention reads the sequence offsets ``bounds``
    (the row's ``cu_seqlens`` as a list) from here instead of from the device in every layer."""
    token = _PACKED_CALL.set(list(bounds))
    try:
        yield
    finally:
        _PACKED_CALL.reset(token)


def sequence_bounds(cu_seqlens: torch.Tensor, window: int | None, what: str, instead: str) -> list[int]:
    """The packed sequences' offsets as a list (those :func:`packed_call` holds on the host, else read from
    ``cu_seqlens``: a device sync, e.g. in a checkpointed layer's recompute); a ValueError when one is longer
    than the layer's sliding window, which ``what`` (an attention that runs whole sequences) does not implement
    (``instead``: the setting to use)."""
    held = _PACKED_CALL.get()
    bounds = held if held is not None and len(held) == cu_seqlens.numel() else cu_seqlens.tolist()
    longest = max(e - s for s, e in zip(bounds[:-1], bounds[1:]))
    if window is not None and longest > window:
        raise ValueError(
            f"{what} does not implement sliding-window attention: a packed sequence of {longest} tokens exceeds "
            f"this layer's window of {window}; set {instead} for this model")
    return bounds


def require_causal(module, kwargs: dict, what: str) -> None:
    """A packed row's attention keeps each sequence causal: a ValueError for a layer that is not (the module's
    ``is_causal``, or the call's); the call's ``is_causal`` is taken out of ``kwargs`` (the attention sets it)."""
    if kwargs.pop("is_causal", None) is False or getattr(module, "is_causal", True) is False:
        raise ValueError(f"{type(module).__name__} is not a causal attention layer, and {what} keeps every packed "
                         "sequence causal: this model cannot be packed")


def packed_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                           scaling: float | None = None, **kwargs):
    """Hugging Face attention function: query (1, H, N, D), key/value (1, H_kv, N, D).

    With ``cu_seq_lens_q`` (a packed call from :func:`packed_forward`): causal attention over each
    sequence on its own -> (1, N, H, D), as one flash varlen call where it runs
    (pacs/model/varlen_attention.py), else SDPA per sequence, outputs concatenated. Otherwise (padded rows, generation,
    a single sequence): exactly Hugging Face's ``sdpa`` attention.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.pop("cu_seq_lens_q", None)
    for name in ("cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(name, None)
    if cu is not None and attention_mask is not None and _PACKED_CALL.get() is not None:
        raise ValueError(f"{type(module).__name__}: the model built an attention mask for a packed row, which "
                         "pacs_packed_sdpa cannot combine with the row's sequence bounds; this model cannot be packed")
    if cu is None and _PACKED_CALL.get() is not None:  # plain SDPA here would attend across the row's sequences
        raise ValueError(f"{type(module).__name__}: a packed row's sequence bounds (cu_seq_lens_q) did not reach "
                         "this attention layer (its decoder layer does not pass its keyword arguments on, as "
                         "Nemotron's): this model cannot be packed; set train.packing=false (PACSTrainer: "
                         "pacs_padding_free=False)")
    if cu is None or attention_mask is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    kwargs.pop("position_ids", None)
    require_causal(module, kwargs, "pacs_packed_sdpa")
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects one packed row, got batch size {query.shape[0]}")
    bounds = sequence_bounds(cu, kwargs.get("sliding_window"), "pacs_packed_sdpa", "train.packing=false")
    fused = varlen_causal_attention(query, key, value, cu, bounds, scaling=scaling, dropout=dropout, extras=kwargs)
    if fused is not None:  # one flash varlen call for the whole row (CUDA, 16-bit: pacs/model/varlen_attention.py)
        return fused.transpose(1, 2), None
    outputs = [
        sdpa_attention_forward(module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], None, dropout=dropout,
                               scaling=scaling, is_causal=True, **kwargs)[0]
        for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
    return torch.cat(outputs, dim=1), None


def packed_sdpa_mask(*args, **kwargs):
    """Mask function paired with ``pacs_packed_sdpa``: none for a packed call (the attention keeps
    each sequence to itself), Hugging Face's sdpa mask otherwise."""
    if _PACKED_CALL.get() is not None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def register_packed_attention() -> str:
    """Register ``pacs_packed_sdpa`` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_sdpa_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, packed_sdpa_mask)
    return PACKED_ATTENTION


def packed_attention_implementation(device: torch.device) -> str:
    """``flash_attention_2`` on CUDA when ``flash_attn`` is importable, else ``pacs_packed_sdpa``."""
    if device.type == "cuda":
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    return register_packed_attention()
