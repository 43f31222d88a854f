"""Memory levers for long responses, each behind one ``train.*`` config switch.

  * activation checkpointing: ``model.gradient_checkpointing`` (pacs/model/policy.py): each decoder
    layer keeps only its input and recomputes the rest in the backward;
  * ``train.offload_activations``: :func:`activation_offload` moves every tensor the forward saves
    for the backward to host memory (``torch.autograd.graph.save_on_cpu``) and brings it back when
    the backward needs it. With checkpointing on, what the forward saves is the layer inputs only
    (the recomputation runs in the backward, outside the context), so this is offloaded
    checkpointing: device memory for activations no longer grows with the number of layers;
  * ``train.fsdp_cpu_offload``: :func:`fsdp_kwargs` gives FSDP2's ``CPUOffloadPolicy``: parameters,
    gradients and the optimizer state live in host memory, each layer's parameters are copied to
    the device for its forward and backward only (the optimizer steps on the CPU);
  * the old-policy pass in no-grad chunks: ``train.old_policy_max_tokens`` (pacs/model/packing.py plans
    the chunks, pacs/train/update.py runs them);
  * ``train.liger_patches``: :func:`apply_liger_patches`, Liger-Kernel's Triton RMSNorm, SwiGLU and
    RoPE in the model (CUDA only; never its loss: the loss is ours);
  * ``train.tiled_mlp``: each decoder layer's MLP over tiles of ``train.mlp_tile_tokens`` tokens,
    keeping only its input for the backward (pacs/model/tiled_mlp.py).
"""

from __future__ import annotations

import contextlib

import torch

from pacs.model.profile import ModelProfile


def activation_offload(enabled: bool, device: torch.device):
    """Context manager for a micro-batch's forward: tensors saved for the backward go to host
    memory (pinned on CUDA) when ``enabled``; a no-op context otherwise. Gradients are unchanged:
    the saved tensors come back bit for bit."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")


def fsdp_kwargs(cpu_offload: bool) -> dict:
    """Extra keyword arguments for every ``fully_shard`` call: ``offload_policy=CPUOffloadPolicy()``
    when ``cpu_offload`` (parameters, gradients and optimizer state in host memory), else none."""
    if not cpu_offload:
        return {}
    from torch.distributed.fsdp import CPUOffloadPolicy

    return {"offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())}


LIGER_KERNELS = dict(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False)


def apply_liger_patches(causal_lm: torch.nn.Module, device: torch.device) -> None:
    """Swap ``causal_lm``'s RMSNorm, SwiGLU MLP and rotary embedding for Liger-Kernel's Triton
    kernels, in place (the loss stays ours: Liger's cross-entropy patches are never applied).

    Raises ValueError when the device is not CUDA, when liger-kernel is not installed, or when
    Liger has no patch for the model type.
    """
    if device.type != "cuda":
        raise ValueError(f"train.liger_patches needs a CUDA device (Liger-Kernel's kernels are Triton on GPU), "
                         f"got device {device.type!r}; set train.liger_patches=false")
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError as exc:
        raise ValueError("train.liger_patches=true needs liger-kernel: pip install liger-kernel "
                         f"(import failed: {exc})") from exc
    model_type = ModelProfile.from_config(causal_lm.config).model_type or None
    try:
        _apply_liger_kernel_to_instance(model=causal_lm, **LIGER_KERNELS)
    except Exception as exc:  # Liger raises or logs differently per version for unknown model types
        raise ValueError(f"train.liger_patches: Liger-Kernel cannot patch model type {model_type!r}: {exc}") from exc
