"""Filling the tree: YAML files and ``key.path=value`` overrides (in the layout a user writes, pacs/config/keys.py)
coerced to each field's type, over the dataclass defaults or, for a built-in task, its toy settings."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from typing import Any

import yaml

from pacs.config.keys import ADVANCED, ADVANCED_KEYS, did_you_mean, from_user_layout, to_dict, to_user_dict
from pacs.config.root import Config
from pacs.config.task import BUILTIN_TASKS

_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")

# The built-in tasks (embedded, wordmath: tiny models, prompts of a few tokens) start from these toy settings
# instead of the dataclass defaults, which are a real model's (the paper's); configs/default.yaml
# lists the built-in run's every value. Applied by load_config under the YAML file and the overrides.
BUILTIN_TASK_SETTINGS = {"optim": {"lr": 2e-4},
                         "rollout": {"max_prompt_len": 32, "max_new_tokens": 6, "gpu_memory_utilization": 0.3}}


def config_hash(obj: Any, length: int = 12) -> str:
    data = obj if isinstance(obj, dict) else to_dict(obj)
    return hashlib.sha1(json.dumps(data, sort_keys=True).encode()).hexdigest()[:length]


def _coerce(name: str, value: Any, current: Any, type_hint: Any) -> Any:
    """Turn a YAML/CLI value into the type of the field it sets."""
    hint = str(type_hint)
    if isinstance(value, str) and not hint.startswith("str"):
        text = value.strip()
        if text.lower() in ("none", "null", "~"):
            value = None
        elif hint.startswith("float") and _FLOAT.fullmatch(text):
            value = float(text)  # YAML 1.1 reads "2e-4" as a string
        else:
            try:
                value = yaml.safe_load(text)
            except yaml.YAMLError as exc:
                raise ValueError(f"{name}: cannot parse {value!r} ({exc})") from exc
    if value is None:
        if "None" in hint:
            return None
        raise ValueError(f"{name} cannot be None (expected {hint})")
    if hint.startswith("tuple"):
        if isinstance(value, (int, float)):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{name} must be a list, got {value!r}")
        return tuple(value)
    if hint == "bool" or isinstance(current, bool) and "bool" in hint:
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be true or false, got {value!r}")
        return value
    if hint.startswith("int"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an integer, got {value!r}")
        return value
    if hint.startswith("float"):
        if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, got {value!r}")
        return float(value)
    if hint.startswith("str"):
        return str(value)
    return value


def apply_dict(cfg: Any, data: dict, prefix: str = "") -> Any:
    """Set fields of the dataclass ``cfg`` from a nested dict; unknown keys are errors."""
    if not isinstance(data, dict):
        raise TypeError(f"{prefix or 'config'} must be a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if key not in fields:  # a user's keys by their spelling: an advanced one under advanced.
            full = [f"{prefix}{k}" for k in sorted(fields)]
            known = ([k for k in full if k not in ADVANCED_KEYS]
                     + [f"{ADVANCED}.{k}" for k in full if k in ADVANCED_KEYS])
            raise ValueError(f"unknown config key {name!r}; {did_you_mean(name)}known: {', '.join(known)}")
        current = getattr(cfg, key)
        if dataclasses.is_dataclass(current):
            apply_dict(current, value, prefix=f"{name}.")
        else:
            setattr(cfg, key, _coerce(name, value, current, fields[key].type))
    return cfg


def apply_override(cfg: Config, assignment: str) -> Config:
    """Apply one ``a.b.c=value`` override (an advanced key spelled ``advanced.a.b=value``)."""
    if "=" not in assignment:
        raise ValueError(f"override must look like key.path=value, got {assignment!r}")
    path, value = assignment.split("=", 1)
    keys = path.strip().split(".")
    nested: Any = value
    for key in reversed(keys):
        nested = {key: nested}
    return apply_dict(cfg, from_user_layout(nested))


def load_config(path: str | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the YAML file at ``path``, then ``key=value`` overrides (both in the layout a user writes,
    :func:`pacs.config.keys.from_user_layout`). The defaults are the dataclasses' (a real model's) or, when the
    resulting ``task.name`` is a built-in task, those plus :data:`BUILTIN_TASK_SETTINGS`."""
    data = from_user_layout(read_yaml(path))
    cfg = _layered(Config(), data, overrides)
    if cfg.task.name in BUILTIN_TASKS:
        cfg = _layered(apply_dict(Config(), BUILTIN_TASK_SETTINGS), data, overrides)
    return cfg


def _layered(cfg: Config, data: dict, overrides: list[str] | None) -> Config:
    apply_dict(cfg, data)
    for assignment in overrides or []:
        apply_override(cfg, assignment)
    return cfg


def read_yaml(path: str | None) -> dict:
    """The mapping in the YAML file at ``path`` ({} for None), or in the shipped preset of that name
    (pacs/configs/presets/, e.g. ``qwen2.5-1.5b_lora_24gb``) when no such file exists."""
    data: dict = {}
    if path is not None:
        if not os.path.isfile(path):
            from pacs import configs as shipped_configs

            shipped = None if os.path.dirname(path) else shipped_configs.preset_path(path)
            if shipped is None:
                raise ValueError(f"--config: no such file {path!r} (nor a shipped preset: "
                                 f"{', '.join(shipped_configs.preset_names())})")
            path = shipped
        with open(path) as fh:
            try:
                data = yaml.safe_load(fh) or {}
            except yaml.YAMLError as exc:
                raise ValueError(f"--config: {path!r} is not valid YAML ({exc})") from exc
    return data


def save_config(cfg: Config, path: str) -> None:
    """``cfg`` as a YAML file in the layout a user writes (advanced keys under ``advanced:``): ``load_config``
    reads it back equal."""
    with open(path, "w") as fh:
        yaml.safe_dump(to_user_dict(cfg), fh, sort_keys=False)
