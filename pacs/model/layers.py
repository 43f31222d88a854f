"""Where a Hugging Face causal LM keeps its repeated decoder blocks: what FSDP wraps one by one
(pacs/model/policy.py) and whose MLPs tiled MLP patches (pacs/model/tiled_mlp.py)."""

from __future__ import annotations

from torch import nn


def decoder_layers(causal_lm: nn.Module) -> list[nn.Module]:
    """The repeated decoder blocks (FSDP units), found as the backbone's largest ModuleList."""
    lists = [m for m in causal_lm.get_decoder().modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ValueError(f"cannot find the decoder layers of {type(causal_lm).__name__} for FSDP")
    return list(max(lists, key=len))
