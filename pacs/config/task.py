"""The ``task`` section: the problems trained on (a registered task, pacs/registry.py) and the built-in
tasks' toy model and warm-up."""

from __future__ import annotations

from dataclasses import dataclass

from pacs.config.fields import check_section, setting
from pacs.registry import REWARDS, TASKS, TOY_TASKS

BUILTIN_TASKS = TOY_TASKS  # the built-in tasks with a tiny model: their own toy settings, no data file


@dataclass
class TaskConfig:
    name: str = setting("embedded", "embedded | wordmath (generated word problems) | math (jsonl/parquet), or a "
                        "user's task as module:Name (pacs/registry.py)", choices=TASKS)
    data_path: str | None = setting(None, "math: training file")
    eval_path: str | None = setting(None, "math: held-out file (default: the last eval_size rows of data_path)")
    eval_size: int = setting(200, "held-out problems", above=0)
    prompt_template: str = setting("{prompt}", "each problem's prompt text; {prompt}: the problem (braces doubled)")
    use_chat_template: bool = setting(False, "wrap the prompt in the tokenizer's chat template (a user turn)")
    reward: str | None = setting(None, "the reward function scoring responses: None: the task's own; "
                                 "exact_match | math_verify, or a user's as module:Name (pacs/registry.py)",
                                 choices=REWARDS, advanced=True)
    digits: int = setting(3, 'embedded task: multi-digit addition "a+b=" -> "c"', above=0, advanced=True)
    reverse: bool = setting(True, "numbers written least-significant digit first", advanced=True)
    word_steps: int = setting(2, "wordmath task: changes to the starting count per problem", above=0, advanced=True)
    cache_dir: str | None = setting(None, "warm-up cache; default $PACS_CACHE_DIR or ~/.cache/pacs", advanced=True)
    hidden_size: int = setting(64, "the built-in tasks' tiny model: its hidden size", above=0, advanced=True)
    num_layers: int = setting(2, "... its decoder layers", at_least=1, advanced=True)
    num_heads: int = setting(2, "head_dim = hidden_size / num_heads (>= 32 for vLLM CPU)", above=0, advanced=True)
    intermediate_size: int = setting(256, "its MLP width", above=0, advanced=True)
    warmup_steps: int = setting(3000, "at most this many supervised steps (the warm-up is cached)", at_least=0,
                                advanced=True)
    warmup_target_accuracy: float = setting(0.1, "... stopping once validation accuracy reaches this", at_least=0,
                                            at_most=1, advanced=True)
    warmup_batch_size: int = setting(64, "the supervised warm-up's batch size", above=0, advanced=True)
    warmup_lr: float = setting(1e-3, "... and learning rate", above=0, advanced=True)

    def check(self) -> None:
        check_section(self, "task.")
        if self.name == "math" and not self.data_path:
            raise ValueError("task.name='math' needs task.data_path (a .jsonl or .parquet file)")
        for key in ("data_path", "eval_path"):  # else the file would be silently ignored
            if getattr(self, key) and self.name in BUILTIN_TASKS:
                raise ValueError(f"task.{key} is read by task.name=math only (task.name is {self.name!r}): add "
                                 "task.name=math")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"advanced.task.hidden_size ({self.hidden_size}) must be divisible by "
                             f"advanced.task.num_heads ({self.num_heads})")
