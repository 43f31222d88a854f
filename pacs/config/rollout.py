"""The ``rollout`` section: the engine that samples the training responses (a registered one, pacs/registry.py),
how many and how long."""

from __future__ import annotations

from dataclasses import dataclass

from pacs.config.fields import check_section, setting
from pacs.config.model import DTYPES
from pacs.registry import ROLLOUT_ENGINES


@dataclass
class RolloutConfig:
    engine: str = setting("auto", "auto (vLLM if importable, else HF generate) | vllm | hf, or a user's engine as "
                          "module:Name (pacs/registry.py)", choices=ROLLOUT_ENGINES, flag="--rollout")
    group_size: int = setting(8, "responses per prompt (G >= 2)", at_least=2,
                              why="PACS and GRPO compare responses within a group", training_only=True)
    prompts_per_step: int = setting(32, "prompts per rollout step (all ranks together)", above=0, training_only=True)
    temperature: float = setting(1.0, "sampling temperature of the training rollouts (> 0)", above=0,
                                 why="training rollouts sample", training_only=True)
    top_p: float = setting(1.0, "nucleus sampling of the training rollouts; 1: off", above=0, at_most=1,
                           advanced=True, training_only=True)
    max_new_tokens: int = setting(4096, "the paper's response budget (the built-in tasks: 6)", above=0)
    max_prompt_len: int | None = setting(
        None, "None: the longest prompt of the task's data, tokenized as the run will (pacs/run/prompt_lengths.py; "
        "the built-in tasks: 32); a prompt longer than a number set here is refused before any work, unless "
        "truncate_prompts", above=0)
    truncate_prompts: bool = setting(False, "cut prompts longer than max_prompt_len to their last max_prompt_len "
                                     "tokens")
    gpu_memory_utilization: float = setting(0.5, "vLLM's share of the GPU (the built-in tasks: 0.3)", above=0,
                                            at_most=1)
    kv_cache_gib: float = setting(1.0, "vLLM on a CPU: the KV cache it reserves up front", above=0, advanced=True)
    enforce_eager: bool = setting(True, "vLLM without CUDA graphs / torch.compile (faster start, slower decode)",
                                  advanced=True)
    dtype: str = setting(
        "auto", "the engine's weights: auto (model.dtype's) | float32 | bfloat16 | float16. float32 under LoRA over a "
        "16-bit base: the merged weights unrounded, so small adapter changes reach the rollouts (twice the engine's "
        "weights)", choices=DTYPES, advanced=True)

    def check(self) -> None:
        check_section(self, "rollout.")
