"""Plans of ``pacs train`` configs: one exactly as set (:func:`plan_for_config`), a preset with its
``.plan.yaml`` and the flags given beside it (:func:`plan_preset`), and the preflight's planned training peak
(:func:`planned_training_gib`)."""

from __future__ import annotations

import os

from pacs import configs as shipped_configs
from pacs.config import load_config, micro_batch_groups, validate
from pacs.model.profile import ModelProfile
from pacs.train.memory_plan.arithmetic import MemoryPlan, plan_memory
from pacs.train.memory_plan.coefficients import GiB
from pacs.train.memory_plan.inputs import Levers, PlanInputs, check_positions, load_model_shape, shape_from_config


def plan_for_config(cfg, model: ModelProfile, gpu_gib: float, gpus: int = 1, lora_rank: int | None = None,
                    lora_targets: tuple[str, ...] | None = None, device: str = "cuda") -> MemoryPlan:
    """The plan of a ``pacs train`` config (pacs.config.Config) exactly as set: its lengths, group size,
    micro-batches, precision, vLLM share and memory levers (what the trainer's preflight could print)."""
    r, tr = cfg.rollout, cfg.train
    if lora_rank is None and cfg.model.lora.rank > 0:  # model.lora.*: all-linear = every projection
        lora_rank = cfg.model.lora.rank
        names = tuple(name.strip() for name in cfg.model.lora.target_modules.split(",") if name.strip())
        lora_targets = lora_targets or (None if names == ("all-linear",) else names)
    compute = cfg.model.dtype if cfg.model.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    engine_share = 0.0 if r.engine == "hf" else r.gpu_memory_utilization
    inp = PlanInputs(model=model, gpu_gib=gpu_gib, gpus=gpus, prompt_len=r.max_prompt_len,
                     response_len=r.max_new_tokens, group_size=r.group_size, prompts_per_step=r.prompts_per_step,
                     micro_batch_groups=micro_batch_groups(cfg), lora_rank=lora_rank,
                     **({"lora_targets": tuple(lora_targets)} if lora_targets else {}), compute_dtype=compute,
                     master_dtype=cfg.optim.master_dtype, gpu_memory_utilization=engine_share, device=device,
                     engine_dtype=None if r.dtype == "auto" else r.dtype)
    levers = Levers(gradient_checkpointing=cfg.model.gradient_checkpointing, tiled_mlp=tr.tiled_mlp,
                    offload_activations=tr.offload_activations, packing=tr.packing is not False,
                    max_tokens_per_micro_batch=tr.max_tokens_per_micro_batch, loss_chunk_mib=tr.loss_chunk_mib,
                    fsdp_cpu_offload=tr.fsdp_cpu_offload, old_policy_max_tokens=tr.old_policy_max_tokens)
    return plan_memory(inp, levers)


PRESET_PLAN_FLAGS = ("model", "gpu_gib", "gpus")
PRESET_CONFIG_FLAGS = {"prompt_len": "rollout.max_prompt_len", "response_len": "rollout.max_new_tokens",
                       "group_size": "rollout.group_size", "prompts_per_step": "rollout.prompts_per_step",
                       "micro_batch_groups": "optim.micro_batch_groups", "lora_rank": "model.lora.rank",
                       "lora_targets": "model.lora.target_modules", "compute_dtype": "model.dtype",
                       "master_dtype": "optim.master_dtype",
                       "gpu_memory_utilization": "rollout.gpu_memory_utilization"}


def find_preset(preset: str) -> str:
    """The YAML of ``preset``: a path, or the name of one shipped in pacs/configs/presets/ (with or without .yaml)."""
    if os.path.isfile(preset):
        return preset
    shipped = shipped_configs.preset_path(os.path.basename(preset)) if not os.path.dirname(preset) else None
    if shipped is None:
        raise ValueError(f"--preset: no file {preset!r}; expected a preset YAML or a shipped preset's name: "
                         f"{', '.join(shipped_configs.preset_names()) or 'none shipped'}")
    return shipped


def plan_preset(path: str, flags: dict | None = None) -> MemoryPlan:
    """Plan a preset: ``path`` is a ``pacs train`` YAML (or a shipped preset's name); its sibling
    ``<name>.plan.yaml`` holds what the YAML cannot say: ``model`` (a config.json, model directory or shipped
    name), ``gpu_gib``, ``gpus`` (and ``lora_rank`` / ``lora_targets`` to plan LoRA the YAML does not set; the
    YAML's ``model.lora`` is read). ``flags``: pacs plan's flags given beside --preset, by their dest
    (``gpu_gib``, ``response_len``...), applied over the .plan.yaml (:data:`PRESET_PLAN_FLAGS`) and the YAML
    (:data:`PRESET_CONFIG_FLAGS`: each sets the ``pacs train`` key a run would take)."""
    import yaml

    path = find_preset(path)
    flags = dict(flags or {})
    unknown_flags = sorted(set(flags) - set(PRESET_PLAN_FLAGS) - set(PRESET_CONFIG_FLAGS))
    if unknown_flags:
        raise ValueError(f"--preset: cannot apply {', '.join('--' + f.replace('_', '-') for f in unknown_flags)}")
    stem = path[:-len(".yaml")] if path.endswith(".yaml") else path
    sidecar = stem + ".plan.yaml"
    if not os.path.isfile(sidecar):
        raise ValueError(f"--preset: no {sidecar} beside {path} (the planner's inputs: model, gpu_gib, gpus)")
    with open(sidecar) as fh:
        spec = yaml.safe_load(fh) or {}
    known = {"model", "gpu_gib", "gpus", "lora_rank", "lora_targets"}
    unknown = sorted(set(spec) - known)
    if unknown or "model" not in spec or "gpu_gib" not in spec:
        raise ValueError(f"{sidecar}: expected keys model, gpu_gib (and optionally gpus, lora_rank, lora_targets); "
                         f"got {', '.join(sorted(spec)) or 'none'}")
    beside = os.path.join(os.path.dirname(sidecar), str(spec["model"]))  # a model path relative to the preset
    if not os.path.isabs(str(spec["model"])) and os.path.exists(beside):
        spec["model"] = beside
    spec.update({name: flags[name] for name in PRESET_PLAN_FLAGS if name in flags})
    cfg = load_config(path)
    for name, key in PRESET_CONFIG_FLAGS.items():
        if name not in flags:
            continue
        value = flags[name]
        if name == "gpu_memory_utilization":  # 0: no colocated vLLM, i.e. Hugging Face generate on the policy
            if value == 0:
                cfg.rollout.engine = "hf"
                continue
            if cfg.rollout.engine == "hf":
                cfg.rollout.engine = "vllm"
        if name == "micro_batch_groups":
            cfg.optim.micro_batch_responses = None
        if name == "lora_rank":  # the YAML's LoRA replaced: the .plan.yaml's LoRA inputs no longer apply
            spec.pop("lora_rank", None)
        section, _, field_name = key.rpartition(".")
        owner = cfg
        for part in section.split("."):
            owner = getattr(owner, part)
        setattr(owner, field_name, value)
    if "lora_targets" in flags and cfg.model.lora.rank == 0 and not spec.get("lora_rank"):
        raise ValueError("--lora-targets needs LoRA: --lora-rank, or a preset that sets model.lora.rank")
    gpus = spec.get("gpus", 1)
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"--gpus must be a positive integer, got {gpus!r}")
    try:
        gpu_gib = float(spec["gpu_gib"])
    except (TypeError, ValueError):
        raise ValueError(f"--gpu-gib must be a number of GiB, got {spec['gpu_gib']!r}") from None
    model = load_model_shape(str(spec["model"]))
    if cfg.rollout.max_prompt_len is not None:  # before validate's micro-batch checks: the model's limit first
        check_positions(model, cfg.rollout.max_prompt_len, cfg.rollout.max_new_tokens)
    validate(cfg, world_size=gpus)
    return plan_for_config(cfg, model, gpu_gib, gpus, spec.get("lora_rank"), spec.get("lora_targets"))


def planned_training_gib(cfg, model_config, gpu_gib: float, gpus: int) -> float | None:
    """The planned training peak (GiB, :attr:`MemoryPlan.training_peak`) of ``cfg`` for a loaded model's
    Hugging Face config, or None when its config is not one the planner reads (the preflight prints it
    beside the measured peak when it can)."""
    try:
        shape = shape_from_config(model_config, name=ModelProfile.from_config(model_config).model_type or "model")
        return plan_for_config(cfg, shape, gpu_gib, gpus).training_peak / GiB
    except (ValueError, KeyError, TypeError):
        return None
