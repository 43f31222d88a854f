"""The choices a config names, each in one registry: objectives (``optim.algo``), rollout engines
(``rollout.engine``), tasks (``task.name``) and reward functions (``advanced.task.reward``).

A registry maps a name to ``"module:attribute"``, imported only when the name is used (this module imports
nothing of pacs), or to an object given to :meth:`Registry.register`. Where a config names a choice it may
also name a user's object as ``module:Name`` (a dotted ``Name`` reaches a nested attribute; the module must be
importable from where the run starts). What each kind of object must be:

    objective       a class built with no arguments, or a callable satisfying pacs_kernels' Objective protocol
                    (docs/objectives.md); the built-in ones are built from the config's optim settings
    rollout engine  ``factory(model_dir, *, max_model_len, seed, dtype)`` returning an engine of
                    pacs.rollout's RolloutEngine protocol (generate, sync_weights, close)
    task            ``factory(cfg)`` (cfg: the run's Config) returning a pacs.tasks.base.Task
    reward          ``reward(response_text, answer) -> float`` (1.0 correct, 0.0 not)
"""

from __future__ import annotations

import importlib
from typing import Any


def is_user_spec(value: Any) -> bool:
    """Whether ``value`` is spelled ``module:Name`` (dotted identifiers on both sides)."""
    if not isinstance(value, str):
        return False
    module, sep, attribute = value.partition(":")
    return bool(sep) and all(part.isidentifier() for part in module.split(".") + attribute.split("."))


def import_spec(spec: str, label: str) -> Any:
    """``module:Name`` -> the object (``Name`` dotted for a nested attribute); a ValueError starting with ``label``
    (what the config said, e.g. ``optim.algo='my_module:MyLoss'``) when the module cannot be imported or has no
    such attribute."""
    module_name, _, attribute = spec.partition(":")
    try:
        found = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{label}: cannot import module {module_name!r} ({exc}); it must be importable from where "
                         "the run starts (on PYTHONPATH)") from exc
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise ValueError(f"{label}: {getattr(found, '__name__', module_name)!r} has no attribute {part!r}")
        found = getattr(found, part)
    return found


class Registry:
    """Names of one kind of choice -> their objects, resolved on use (the module docstring)."""

    def __init__(self, kind: str, key: str, entries: dict[str, str], *, example: str, also: tuple[str, ...] = (),
                 form: str = "module:Name"):
        self.kind, self.key, self.example, self.form = kind, key, example, form
        self.also = also  # choices the factory resolves itself (rollout.engine's "auto"), listed first
        self._entries: dict[str, Any] = dict(entries)
        self.builtin = tuple(entries)

    def names(self) -> tuple[str, ...]:
        """Every choice by name: the factory's own, the built-in entries, then the registered ones."""
        return (*self.also, *self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def register(self, name: str, obj: Any) -> None:
        """Make ``name`` a choice of this registry: ``obj`` itself, or ``"module:attribute"`` imported on use. A
        name already registered is a ValueError (a user's choice never replaces another silently)."""
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"a {self.kind}'s name must be an identifier, got {name!r}")
        if name in self._entries or name in self.also:
            raise ValueError(f"{self.key}: a {self.kind} named {name!r} is registered already")
        if isinstance(obj, str) and not is_user_spec(obj):
            raise ValueError(f"register({name!r}, ...): a string must be 'module:attribute', got {obj!r}")
        self._entries[name] = obj

    def unregister(self, name: str) -> None:
        """Take back a name :meth:`register` added (a built-in one stays)."""
        if name in self.builtin or name not in self._entries:
            raise ValueError(f"{self.key}: {name!r} is no {self.kind} registered by register()")
        del self._entries[name]

    def check(self, value: Any, where: str | None = None) -> None:
        """A ValueError naming the key unless ``value`` is a choice's name or a user's ``module:Name``."""
        if value in self.names() or is_user_spec(value):
            return
        raise ValueError(f"{where or self.key} must be one of {', '.join(self.names())}, or a user's {self.kind} as "
                         f"{self.form} (e.g. {self.example}); got {value!r}")

    def resolve(self, value: str, where: str | None = None) -> Any:
        """The object a name (or ``module:Name``) stands for, imported now."""
        self.check(value, where)
        found = self._entries.get(value, value)
        if isinstance(found, str):
            label = f"{where or self.key}={value!r}" + (f" ({found})" if found != value else "")
            return import_spec(found, label)
        return found

    def describe(self) -> str:
        """The choices as help text writes them: ``a | b | c, or module:Name``."""
        return " | ".join(self.names()) + f", or a user's as {self.form}"


OBJECTIVES = Registry("objective", "optim.algo", {
    "pacs": "pacs_kernels:PACS",
    "grpo": "pacs_kernels:GRPO",
    "dapo": "pacs_kernels:DAPO",
    "dr_grpo": "pacs_kernels:DrGRPO",
    "gspo": "pacs_kernels:GSPO",
    "cispo": "pacs_kernels:CISPO",
}, example="my_objectives:MyLoss", form="module:Class")

# which built-in objectives read optim.eps_low / optim.eps_high (their clip range)
CLIP_RANGE_READERS = {"eps_low": ("dapo", "dr_grpo", "gspo", "cispo"),
                      "eps_high": ("grpo", "dapo", "dr_grpo", "gspo", "cispo")}

ROLLOUT_ENGINES = Registry("rollout engine", "rollout.engine", {
    "vllm": "pacs.rollout.vllm:VLLMRolloutEngine",
    "hf": "pacs.rollout.hf:HFGenerateEngine",
}, example="my_engines:MyEngine", also=("auto",))

TASKS = Registry("task", "task.name", {
    "embedded": "pacs.tasks.arithmetic:AdditionTask.from_config",
    "wordmath": "pacs.tasks.word_problems:WordProblemTask.from_config",
    "math": "pacs.tasks.math_data:MathTask.from_config",
}, example="my_tasks:MyTask")

# the built-in tasks with a tiny model and prompts of a few tokens: they start from their own toy settings
# (pacs/config/load.py's BUILTIN_TASK_SETTINGS) and read no data file
TOY_TASKS = ("embedded", "wordmath")

REWARDS = Registry("reward", "task.reward", {
    "exact_match": "pacs.tasks.rewards:exact_match",
    "math_verify": "pacs.tasks.rewards:math_reward",
}, example="my_rewards:score")
