"""What a plan is asked about: the model (a :class:`pacs.model.profile.ModelProfile` whose parameters can be
counted), the run's shape (:class:`PlanInputs`) and one set of the trainer's memory levers (:class:`Levers`)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from pacs import configs as shipped_configs
from pacs.model.profile import ModelProfile, load_profile

MODELS_DIR = os.path.join(shipped_configs.root(), "models")  # the shipped model configs (package data)


def load_model_shape(model: str) -> ModelProfile:
    """The profile of ``model`` (:func:`pacs.model.profile.load_profile`: a model directory, a config.json, or a
    shipped config by name or hub id), refused in one line naming ``--model`` unless its parameters can be
    counted."""
    profile = load_profile(model)
    profile.check_countable()
    return profile


def shape_from_config(cfg, name: str = "model") -> ModelProfile:
    """The planner's view of a Hugging Face config (a config.json's dict or a ``PretrainedConfig``; a multimodal
    one's text config): its profile, refused in one line naming ``--model`` unless its parameters can be
    counted."""
    profile = ModelProfile.from_config(cfg, name=name)
    profile.check_countable()
    return profile


def check_positions(m: ModelProfile, prompt_len: int, response_len: int) -> None:
    """A prompt and its response within the model's positions (max_position_embeddings), or one line naming
    --response-len (--prompt-len when the prompt alone takes them all)."""
    if m.max_positions is None or prompt_len + response_len <= m.max_positions:
        return
    if prompt_len >= m.max_positions:
        raise ValueError(f"--prompt-len {prompt_len} (rollout.max_prompt_len) leaves no room for a response in "
                         f"{m.name}'s {m.max_positions} positions (max_position_embeddings)")
    raise ValueError(f"--response-len {response_len} (rollout.max_new_tokens) + --prompt-len {prompt_len} exceed "
                     f"{m.name}'s {m.max_positions} positions (max_position_embeddings): at most "
                     f"{m.max_positions - prompt_len}")


@dataclass(frozen=True)
class Levers:
    """One set of the trainer's memory settings (their ``pacs train`` keys: :meth:`config_lines`)."""

    gradient_checkpointing: bool = False
    tiled_mlp: bool = False
    offload_activations: bool = False
    packing: bool = True
    max_tokens_per_micro_batch: int | None = None  # None: one micro-batch = micro_batch_groups whole groups
    loss_chunk_mib: float | None = None  # None: the device's default
    fsdp_cpu_offload: bool = False
    old_policy_max_tokens: int | None = None  # advanced.train.old_policy_max_tokens; None: the training micro-batches

    def describe(self) -> str:
        """A short name of the lever set, e.g. 'checkpointing + tiled MLP + loss chunk 256 MiB'."""
        names = [name for name, on in (("checkpointing", self.gradient_checkpointing), ("tiled MLP", self.tiled_mlp),
                                       ("activation offload", self.offload_activations),
                                       ("padded rows", not self.packing), ("FSDP CPU offload", self.fsdp_cpu_offload))
                 if on]
        if self.max_tokens_per_micro_batch is not None:
            names.append(f"{self.max_tokens_per_micro_batch} tokens a micro-batch")
        if self.loss_chunk_mib is not None:
            names.append(f"loss chunk {self.loss_chunk_mib:g} MiB")
        if self.old_policy_max_tokens is not None:
            names.append(f"old-policy pass in {self.old_policy_max_tokens} tokens")
        return " + ".join(names) or "none"

    def config_lines(self) -> list[str]:
        lines = [f"model.gradient_checkpointing={str(self.gradient_checkpointing).lower()}",
                 f"train.tiled_mlp={str(self.tiled_mlp).lower()}",
                 f"train.offload_activations={str(self.offload_activations).lower()}"]
        if not self.packing:
            lines.append("train.packing=false")
        if self.max_tokens_per_micro_batch is not None:
            lines.append(f"train.max_tokens_per_micro_batch={self.max_tokens_per_micro_batch}")
        if self.loss_chunk_mib is not None:
            lines.append(f"train.loss_chunk_mib={self.loss_chunk_mib:g}")
        if self.fsdp_cpu_offload:
            lines.append("train.fsdp_cpu_offload=true")
        if self.old_policy_max_tokens is not None:
            lines.append(f"advanced.train.old_policy_max_tokens={self.old_policy_max_tokens}")
        return lines


@dataclass(frozen=True)
class PlanInputs:
    model: ModelProfile
    gpu_gib: float
    gpus: int = 1
    prompt_len: int = 1024
    response_len: int = 8192
    group_size: int = 8
    prompts_per_step: int = 32
    micro_batch_groups: int = 1
    lora_rank: int | None = None
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    compute_dtype: str = "bfloat16"  # bfloat16 | float32
    master_dtype: str = "float32"
    gpu_memory_utilization: float = 0.3  # vLLM's share, held during training; 0: no colocated engine
    engine_dtype: str | None = None  # the engine's weights (rollout.dtype); None: the compute dtype
    device: str = "cuda"  # cuda | cpu (the CPU: host memory is device memory; offload moves nothing)

    def check(self) -> None:
        for name in ("gpu_gib", "gpus", "prompt_len", "response_len", "prompts_per_step", "micro_batch_groups"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value!r}")
        if not math.isfinite(self.gpu_gib):
            raise ValueError(f"--gpu-gib must be a finite number of GiB, got {self.gpu_gib!r}")
        if self.group_size < 2:
            raise ValueError(f"--group-size must be >= 2, got {self.group_size}")
        m = self.model
        check_positions(m, self.prompt_len, self.response_len)
        if self.lora_rank is not None:
            if self.lora_rank < 1:
                raise ValueError(f"--lora-rank must be a positive integer, got {self.lora_rank}")
            m.lora_params(self.lora_rank, self.lora_targets)  # unknown names: one line naming --lora-targets
            narrowest = m.narrowest_projection(self.lora_targets)
            if narrowest is None:
                raise ValueError(f"--lora-targets: {m.name} has none of {','.join(self.lora_targets)} as a linear "
                                 f"layer (expected some of {', '.join(m.projections())})")
            name, fan_in, fan_out = narrowest
            if self.lora_rank > min(fan_in, fan_out):
                raise ValueError(f"--lora-rank {self.lora_rank} is wider than {m.name}'s {name} ({fan_in} -> "
                                 f"{fan_out}): at most {min(fan_in, fan_out)} (or leave {name} out of --lora-targets)")
        if not 0 <= self.gpu_memory_utilization < 1:
            raise ValueError(f"--gpu-memory-utilization must be in [0, 1), got {self.gpu_memory_utilization}")
        if self.engine_dtype not in (None, "bfloat16", "float16", "float32"):
            raise ValueError(f"engine_dtype must be None, bfloat16, float16 or float32, got {self.engine_dtype!r}")
        for name in ("compute_dtype", "master_dtype"):
            if getattr(self, name) not in ("bfloat16", "float32"):
                raise ValueError(f"--{name.replace('_', '-')} must be bfloat16 or float32, got {getattr(self, name)!r}")

    @property
    def row_tokens(self) -> int:
        return self.prompt_len + self.response_len
