"""The policy: any Hugging Face causal LM, optionally sharded with FSDP2, whose forward returns
the backbone's final hidden states together with the LM-head weight.

Handing the LM-head weight out of ``forward`` (instead of reading ``lm_head.weight`` outside) is
what makes the fused loss work under FSDP2: the root module's parameters (embeddings, final norm,
LM head) are gathered by FSDP's pre-forward hook, so the tensor returned here is the full,
unsharded weight, and its gradient flows back into FSDP's reduce-scatter. Tied embeddings are the
same tensor as the input embedding, which lives in the same (root) FSDP unit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from pacs.model.layers import decoder_layers
from pacs.model.lora import add_lora, has_lora, merged_named_tensors
from pacs.model.memory import apply_liger_patches, fsdp_kwargs
from pacs.model.mixed_precision import Precision, resolve_precision
from pacs.model.model_dir import check_model_dir
from pacs.model.model_forward import check_supported_head
from pacs.model.packing import enable_packed_attention
from pacs.model.profile import ModelProfile
from pacs.model.sequence_parallel import enable_sequence_parallel_attention, new_sequence_parallel
from pacs.model.tiled_mlp import tile_mlp


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    mesh: object | None = None
    sp: object | None = None  # this rank's sequence-parallel group (pacs.model.sequence_parallel.SequenceParallel)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sp_size(self) -> int:
        """Ranks that share one micro-batch's tokens (train.sequence_parallel_size)."""
        return 1 if self.sp is None else self.sp.size

    @property
    def dp_size(self) -> int:
        """Ranks with their own data: the world over the sequence-parallel size."""
        return self.world_size // self.sp_size

    @property
    def dp_rank(self) -> int:
        """This rank's share of the data (ranks of one sequence-parallel group share it)."""
        return self.rank // self.sp_size


def setup_distributed(sequence_parallel_size: int = 1, timeout_minutes: float | None = None) -> DistInfo:
    """Join the process group that ``torchrun`` describes (NCCL on GPU, gloo on CPU; collectives wait
    ``timeout_minutes`` for every rank, torch's default when None), and with ``sequence_parallel_size`` > 1
    its sequence-parallel groups (pacs/model/sequence_parallel.py).

    A single process (no ``WORLD_SIZE`` > 1 in the environment) gets a DistInfo without any group.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world_size <= 1:
        return DistInfo(device=device)
    import datetime

    from torch.distributed.device_mesh import init_device_mesh

    timeout = None if timeout_minutes is None else datetime.timedelta(minutes=timeout_minutes)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", timeout=timeout)

    mesh = init_device_mesh(device.type, (world_size,))
    rank = dist.get_rank()
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device, mesh=mesh,
                    sp=new_sequence_parallel(sequence_parallel_size, rank, world_size, timeout))


def close_distributed() -> None:
    """Leave the process group in step: a barrier (every rank is done with its collectives), then
    ``destroy_process_group``. A rank that simply exits can close its gloo connections while a
    slower rank still holds them, and gloo then aborts that rank (SIGABRT, "Connection closed by
    peer") after the work is done. No-op without a process group."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | torch.dtype, device: torch.device | str) -> torch.dtype:
    """The one place ``model.dtype`` "auto" is decided, for the policy and both rollout engines:
    bfloat16 on GPU, float32 on CPU. Other names ("float32", "bfloat16", "float16") map directly."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"model.dtype must be 'auto', {', '.join(map(repr, DTYPES))}; got {name!r}")
    return DTYPES[name]


def check_model_path(path: str, trust_remote_code: bool = False):
    """Load the model's config (no weights) or raise a ValueError naming the path.

    Runs before any work starts: an unknown local path, or a hub id that cannot be fetched, fails
    here instead of after a warm-up or an engine start.
    """
    from transformers import AutoConfig

    check_model_dir(path)
    looks_local = path.startswith((".", "/", "~")) or os.path.exists(path) or path.count("/") != 1
    if looks_local and not os.path.isdir(os.path.expanduser(path)):
        raise ValueError(f"--model: {path!r} is not a model directory (no such directory) and not a hub id")
    try:
        config = AutoConfig.from_pretrained(os.path.expanduser(path), trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises OSError/ValueError/HTTP errors here
        raise ValueError(f"--model: cannot load a model config from {path!r}: {exc}") from exc
    local = os.path.expanduser(path)
    if os.path.isdir(local) and not any(_is_weight_file(name) for name in os.listdir(local)):
        raise ValueError(
            f"--model: {path!r} has a config.json but no weights (expected model.safetensors, "
            "model-*.safetensors with its index, or pytorch_model.bin)")
    return config


def _is_weight_file(name: str) -> bool:
    return name.endswith(".safetensors") or name in ("pytorch_model.bin", "pytorch_model.bin.index.json",
                                                     "model.safetensors.index.json")


def max_positions(model_config) -> int | None:
    """The longest sequence a model with this (transformers) config takes (:attr:`ModelProfile.max_positions`)."""
    return ModelProfile.from_config(model_config).max_positions


class Policy(nn.Module):
    """Wraps a causal LM; ``forward`` returns ``(hidden, lm_head_weight, lm_head_bias)``.

    hidden: (B, T, d) final hidden states after the backbone's last norm, in the compute dtype;
    lm_head_weight: (V, d); lm_head_bias: (V,) or None.

    ``precision`` (pacs/model/mixed_precision.py): the compute and master dtypes; None: both the model's own.
    ``autocast``: float32 master parameters on one process: the backbone runs under autocast to the
    16-bit compute dtype, and the hidden states and the head are cast to it, so the fused loss runs in
    16 bits while the gradients reach the float32 parameters. (FSDP2's mixed precision casts the
    parameters itself: no autocast there.)
    """

    def __init__(self, causal_lm: nn.Module, precision: Precision | None = None, autocast: bool = False):
        super().__init__()
        self.causal_lm = causal_lm
        dtype = getattr(causal_lm, "dtype", torch.float32)
        self.precision = precision or Precision(compute=dtype, master=dtype)
        self.autocast_dtype = self.precision.compute if autocast and self.precision.mixed else None
        profile = check_supported_head(causal_lm.config)
        self.logit_scale = profile.logit_scale
        self.logit_softcap = profile.logit_softcap

    def head_options(self, temperature: float) -> dict:
        """Keyword arguments that make the pacs_kernels functions compute this model's logits at sampling
        temperature ``temperature`` from (hidden, lm_head_weight): its logit soft-cap (Gemma 2's
        ``final_logit_softcapping``) and its logit scale, folded into the temperature."""
        return dict(temperature=temperature / self.logit_scale, logit_softcap=self.logit_softcap)

    @property
    def backbone(self) -> nn.Module:
        return self.causal_lm.get_decoder()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, **backbone_kwargs):
        """``backbone_kwargs``: e.g. ``position_ids`` and ``cu_seq_lens_q`` for a packed row
        (:func:`pacs.model.packing.packed_forward`)."""
        head = self.causal_lm.get_output_embeddings()
        bias = getattr(head, "bias", None)
        if self.autocast_dtype is None:
            out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **backbone_kwargs)
            return out.last_hidden_state, head.weight, bias
        dtype = self.autocast_dtype
        with torch.autocast(input_ids.device.type, dtype=dtype):
            out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **backbone_kwargs)
        return (out.last_hidden_state.to(dtype), head.weight.to(dtype),
                None if bias is None else bias.to(dtype))


def load_policy(path: str, *, dtype: str = "auto", gradient_checkpointing: bool = False,
                dist_info: DistInfo | None = None, trust_remote_code: bool = False, packed_attention: bool = False,
                liger_patches: bool = False, fsdp_cpu_offload: bool = False, tiled_mlp: bool = False,
                mlp_tile_tokens: int | None = None, master_dtype: str = "float32", lora=None) -> Policy:
    """Load ``path`` as a :class:`Policy` on this rank's device, FSDP2-sharded when world_size > 1.

    Dropout is switched off: the old-policy log-probs and the training forward must agree.
    Long-context options (pacs/model/packing.py, pacs/model/memory.py): ``packed_attention`` switches to an
    attention that keeps packed sequences apart (under sequence parallelism, ``dist_info.sp``: one that
    also trades the ranks' token split for a head split, pacs/model/sequence_parallel.py); ``liger_patches``
    (CUDA) puts Liger-Kernel's RMSNorm/SwiGLU/RoPE in the model; ``tiled_mlp`` runs each decoder MLP over tiles of
    ``mlp_tile_tokens`` tokens (pacs/model/tiled_mlp.py); ``fsdp_cpu_offload`` keeps parameters, gradients and
    optimizer state on the host (FSDP2 CPUOffloadPolicy).

    ``dtype`` is the compute dtype, ``master_dtype`` the dtype of the parameters the optimizer steps
    (pacs/model/mixed_precision.py): float32 parameters under a 16-bit ``dtype`` compute in 16 bits through
    autocast on one process and FSDP2's MixedPrecisionPolicy on several.

    ``lora`` (``model.lora``: rank, alpha, target_modules; rank 0 or None: full fine-tuning): LoRA adapters
    (pacs/model/lora.py) in the master dtype over a frozen base kept in the compute dtype.
    """
    from transformers import AutoModelForCausalLM


    dist_info = dist_info or DistInfo()
    precision = resolve_precision(resolve_dtype(dtype, dist_info.device), master_dtype)
    with_lora = lora is not None and lora.rank > 0
    # the frozen base of a LoRA run needs no master copy: it stays in the compute dtype
    causal_lm = AutoModelForCausalLM.from_pretrained(
        os.path.expanduser(path), dtype=precision.compute if with_lora else precision.master,
        trust_remote_code=trust_remote_code)
    causal_lm.config.use_cache = False
    # no dropout anywhere: the old-log-prob pass and the loss's pass must compute the same function (psi = 0
    # before an update); attention layers read their dropout from the config into a float of their own
    if isinstance(getattr(causal_lm.config, "attention_dropout", None), float):
        causal_lm.config.attention_dropout = 0.0
    for module in causal_lm.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    if with_lora:
        add_lora(causal_lm, lora.rank, lora.alpha, lora.target_modules, precision.master)
    if gradient_checkpointing:
        causal_lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if dist_info.sp_size > 1:  # attention trades the token split for a head split (pacs/model/sequence_parallel.py)
        enable_sequence_parallel_attention(causal_lm, dist_info.sp_size)
    elif packed_attention:
        enable_packed_attention(causal_lm, dist_info.device)
    sharded = dist_info.world_size > 1
    policy = Policy(causal_lm, precision, autocast=not sharded).to(dist_info.device)
    if liger_patches:
        apply_liger_patches(causal_lm, dist_info.device)
    if tiled_mlp:  # after Liger: the tiles run whichever MLP forward the model has now
        tile_mlp(causal_lm, mlp_tile_tokens)
    policy.train()
    if sharded:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        options = fsdp_kwargs(fsdp_cpu_offload)
        if precision.mixed:  # FSDP all-gathers 16-bit copies, reduce-scatters float32 gradients
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=precision.compute, reduce_dtype=torch.float32)
        for layer in decoder_layers(causal_lm):
            fully_shard(layer, mesh=dist_info.mesh, **options)
        fully_shard(policy, mesh=dist_info.mesh, **options)
    return policy


def full_named_tensors(policy: Policy) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) pairs of the policy, one tensor gathered at a time under FSDP; LoRA adapters
    merged into the weights they adapt.

    Every rank must consume the iterator completely (each DTensor is an all-gather).
    """
    from torch.distributed.tensor import DTensor

    def full(tensor: torch.Tensor) -> torch.Tensor:
        return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()

    state = policy.causal_lm.state_dict()
    if has_lora(policy.causal_lm):  # the adapters merged into plain Hugging Face weights (pacs/model/lora.py)
        yield from merged_named_tensors(policy.causal_lm, state, full)
        return
    for name, tensor in state.items():
        yield name, full(tensor)
