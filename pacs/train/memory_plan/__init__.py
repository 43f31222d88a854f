"""``pacs plan``: the peak memory per GPU of a ``pacs train`` run, by component, before any download.

Only the model's ``config.json`` is read (a local Hugging Face model directory, the file itself, or the
name or Hugging Face hub id of one shipped in ``pacs/configs/models/``). :func:`plan_memory` gives one lever set's
:class:`MemoryPlan`; :func:`cheapest_fitting_plan` tries the lever sets from cheapest to dearest and
returns the first that fits, or, when none does, the one with the lowest peak; :func:`what_would_fit`
says what would make one fit.

One concept a module: ``inputs`` (the model's profile, the run, the levers), ``coefficients`` (the measured
bytes), ``arithmetic`` (:func:`plan_memory`), ``advice`` (the lever ladder, what blocks, what would fit),
``report`` (what ``pacs plan`` prints), ``presets`` (plans of ``pacs train`` configs and presets). This package's
names below are the planner's public surface.

The formula (docs/plan.md derives it): parameters, gradients and AdamW state from the parameter count
(FSDP2 shards them over the GPUs), the activations a decoder layer saves for the backward per token from
the architecture (coefficients counted on Hugging Face's Qwen2 decoder layer, bytes per token per
element of the hidden size, the query/key-value projections and the MLP), the fused loss's chunk
(``train.loss_chunk_mib``), and the vLLM engine's share of the GPU (``rollout.gpu_memory_utilization``),
which stays allocated while the policy trains.
"""

from pacs.train.memory_plan.advice import blocker, cheapest_fitting_plan, lever_ladder, what_would_fit
from pacs.train.memory_plan.arithmetic import (
    MemoryPlan,
    kv_cache_tokens,
    layer_forward_bytes,
    layer_saved_bytes_per_token,
    loss_chunk_budget,
    old_policy_pass_bytes,
    old_policy_tokens,
    plan_memory,
)
from pacs.train.memory_plan.coefficients import (
    CUDA_FREE_LOSS_CHUNK_SHARE,
    CUDA_RESERVE_GIB,
    DEFAULT_LOSS_CHUNK_MIB,
    FORWARD_COPIES,
    LOGPROB_CHUNK_BYTES,
    OLD_POLICY_PASS,
    RAISED_LOSS_CHUNK_SHARE,
    GiB,
    MiB,
)
from pacs.train.memory_plan.inputs import (
    MODELS_DIR,
    Levers,
    PlanInputs,
    check_positions,
    load_model_shape,
    shape_from_config,
)
from pacs.train.memory_plan.presets import find_preset, plan_for_config, plan_preset, planned_training_gib
from pacs.train.memory_plan.report import config_lines, preset_header, preset_verdict, report

__all__ = [
    "CUDA_FREE_LOSS_CHUNK_SHARE", "CUDA_RESERVE_GIB", "DEFAULT_LOSS_CHUNK_MIB", "FORWARD_COPIES", "LOGPROB_CHUNK_BYTES", "MODELS_DIR",
    "OLD_POLICY_PASS", "RAISED_LOSS_CHUNK_SHARE", "GiB", "Levers", "MemoryPlan", "MiB", "PlanInputs", "blocker",
    "check_positions", "cheapest_fitting_plan", "config_lines", "find_preset", "kv_cache_tokens",
    "layer_forward_bytes", "layer_saved_bytes_per_token", "lever_ladder", "load_model_shape", "loss_chunk_budget",
    "old_policy_pass_bytes", "old_policy_tokens", "plan_for_config", "plan_memory", "plan_preset",
    "planned_training_gib", "preset_header", "preset_verdict", "report", "shape_from_config", "what_would_fit",
]
