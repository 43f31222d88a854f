"""LoRA adapters in ``pacs train`` (``model.lora.*``), through peft.

Only the adapters train: each adapted linear layer computes ``W x + (alpha / r) B A x`` with ``W`` frozen
(in the compute dtype: a 7B base in bfloat16 is 14 GB where full fine-tuning's float32 master weights,
gradients and AdamW state take 16 bytes a parameter) and ``A`` (r x in), ``B`` (out x r, zero at the start)
trained in the master dtype (float32). vLLM (and Hugging Face generate under FSDP), ``pacs eval`` and the final
export see plain Hugging Face weights with the adapters merged, ``W + (alpha / r) B A``
(:func:`merged_named_tensors`); Hugging Face generate on one process samples the policy itself;
checkpoints hold the adapters and their optimizer state only (the frozen base is the model directory's).

Targets: ``all-linear`` (peft's: every linear layer but the LM head) or comma-separated module names (e.g.
``q_proj,v_proj``); only linear layers (an adapter on the embeddings or the LM head is refused).
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

ADAPTER = "default"  # peft's adapter name


def lora_targets(target_modules: str) -> str | list[str]:
    """peft's ``target_modules`` from ``model.lora.target_modules``."""
    names = [name.strip() for name in target_modules.split(",") if name.strip()]
    if not names:
        raise ValueError("model.lora.target_modules must name modules (e.g. 'all-linear' or 'q_proj,v_proj'), "
                         f"got {target_modules!r}")
    return "all-linear" if names == ["all-linear"] else names


def check_lora_targets(model_config, rank: int, target_modules: str, trust_remote_code: bool = False) -> None:
    """Before any work (the model built on the meta device from its config, no weights): every name in
    ``target_modules`` names a layer of the model, and ``rank`` is at most the narrower side of every layer it
    adapts (a wider rank adds parameters and time, not capacity). A ValueError naming the setting otherwise."""
    if rank <= 0:
        return
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_config, trust_remote_code=trust_remote_code)
    except Exception:  # a model transformers cannot build from its config alone: add_lora checks the loaded one
        return
    head = model.get_output_embeddings()
    names = [name for name, _ in model.named_modules()]
    linear = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head}
    targets = lora_targets(target_modules)

    def matches(name: str, target: str) -> bool:  # peft's rule for a list of names: the name or its last parts
        return name == target or name.endswith("." + target)

    if targets != "all-linear":
        unknown = [t for t in targets if not any(matches(name, t) for name in names)]
        if unknown:
            kinds = sorted({name.rsplit(".", 1)[-1] for name in linear})
            raise ValueError(f"model.lora.target_modules={target_modules!r}: {', '.join(map(repr, unknown))} names no "
                             f"layer of the model (its linear layers: {', '.join(kinds)}; or all-linear)")
        linear = {name: m for name, m in linear.items() if any(matches(name, t) for t in targets)}
    if linear:
        name, layer = min(linear.items(), key=lambda item: min(item[1].in_features, item[1].out_features))
        width = min(layer.in_features, layer.out_features)
        if rank > width:
            raise ValueError(f"model.lora.rank={rank} is wider than a layer it adapts: {name} maps "
                             f"{layer.in_features} -> {layer.out_features} features, so a rank above {width} adds "
                             f"parameters, not capacity; choose model.lora.rank <= {width}")


def add_lora(causal_lm: nn.Module, rank: int, alpha: float, target_modules: str, adapter_dtype: torch.dtype) -> None:
    """Put LoRA adapters of rank ``rank`` into ``causal_lm`` in place (the base weights frozen, the adapters
    in ``adapter_dtype``); raises a ValueError naming the setting when a target is no linear layer or
    nothing matched."""
    try:
        import peft
    except ImportError as exc:
        raise ValueError("model.lora.rank > 0 needs peft: pip install peft (or the trl extra)") from exc
    from peft.tuners.lora import Linear as LoraLinear

    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=lora_targets(target_modules),
                             lora_dropout=0.0, bias="none")
    try:
        peft.inject_adapter_in_model(config, causal_lm, adapter_name=ADAPTER)
    except ValueError as exc:  # peft: "Target modules ... not found in the base model"
        raise ValueError(f"model.lora.target_modules={target_modules!r}: {exc}") from exc
    adapted = [name for name, module in causal_lm.named_modules() if hasattr(module, "lora_A")]
    others = [name for name in adapted if not isinstance(causal_lm.get_submodule(name), LoraLinear)]
    if others:
        raise ValueError(f"model.lora.target_modules={target_modules!r} matched layers that are not linear: "
                         f"{others[:4]}; name linear layers only (e.g. q_proj,k_proj,v_proj,o_proj)")
    if not adapted:
        raise ValueError(f"model.lora.target_modules={target_modules!r} matched no layer of the model")
    if hasattr(causal_lm.get_output_embeddings(), "lora_A"):  # the fused loss reads the head's weight alone
        raise ValueError(f"model.lora.target_modules={target_modules!r} adapts the LM head, whose adapter the "
                         "fused loss would never train (it reads the head's weight); leave the head out "
                         "(all-linear does)")
    for name, param in causal_lm.named_parameters():
        param.requires_grad = is_adapter_weight(name)
        if param.requires_grad:
            param.data = param.data.to(adapter_dtype)


def is_adapter_weight(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def has_lora(causal_lm: nn.Module) -> bool:
    return any(hasattr(module, "lora_A") for module in causal_lm.modules())


def merged_named_tensors(causal_lm: nn.Module, state: dict[str, torch.Tensor], full) -> Iterator[
        tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of the model with its adapters merged, from its ``state`` (a state dict);
    ``full`` turns one state tensor into a full local tensor (an all-gather under FSDP2), called one tensor
    at a time and by every rank in the same order. Each merged weight is at least float32 (a bfloat16 base
    would round small adapter changes away): the engine converts it to the dtype it serves
    (``rollout.dtype``), the export to the compute dtype; every other tensor keeps its dtype."""
    scaling = {name: module.scaling[ADAPTER] for name, module in causal_lm.named_modules()
               if hasattr(module, "lora_A")}
    for key, tensor in state.items():
        if is_adapter_weight(key):
            continue
        if ".base_layer." not in key:
            yield key, full(tensor)
            continue
        layer, _, leaf = key.partition(".base_layer.")
        base = full(tensor)
        if leaf == "weight":
            a = full(state[f"{layer}.lora_A.{ADAPTER}.weight"])
            b = full(state[f"{layer}.lora_B.{ADAPTER}.weight"])
            dtype = torch.promote_types(base.dtype, torch.float32)
            base = base.to(dtype) + scaling[layer] * (b.to(dtype) @ a.to(dtype))
        yield f"{layer}.{leaf}", base
