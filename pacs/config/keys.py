"""Keys as a user writes them: the advanced ones under ``advanced:`` (derived from the fields' ``advanced``
flag), the layout conversions of YAML files and saved configs, and the "did you mean" of an unknown key.

YAML files and KEY=VALUE overrides write the advanced keys under ``advanced:``, in their section
(``advanced: {train: {preflight: false}}``, ``advanced.train.preflight=false``); the code reads each where it is
declared (``cfg.train.preflight``), and the same key at that spot in a YAML file or an override is refused.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
from typing import Any

from pacs.config.fields import settings
from pacs.config.root import Config

ADVANCED = "advanced"  # the section of a YAML file (and the first part of an override's key) that holds them

# keys only an expert, an ablation or a test should set: those declared advanced=True (pacs/config/fields.py)
ADVANCED_KEYS = tuple(s.key for s in settings(Config) if s.advanced)


def to_dict(cfg: Any) -> dict:
    """Plain nested dict (tuples become lists) for YAML/JSON."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def config_keys(cfg: Any = None, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every setting, in declaration order (defaults when ``cfg`` is None)."""
    cfg = Config() if cfg is None else cfg
    keys = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            keys.extend(config_keys(value, f"{prefix}{f.name}."))
        else:
            keys.append((f"{prefix}{f.name}", list(value) if isinstance(value, tuple) else value))
    return keys


def user_key(key: str) -> str:
    """The dotted key ``key`` (as declared: ``train.preflight``) as a user writes it (``advanced.train.preflight``)."""
    return f"{ADVANCED}.{key}" if key in ADVANCED_KEYS else key


def declared_key(key: str) -> str:
    """The inverse of :func:`user_key`: ``advanced.train.preflight`` -> ``train.preflight``."""
    return key[len(ADVANCED) + 1:] if key.startswith(f"{ADVANCED}.") else key


def to_user_dict(cfg: Config) -> dict:
    """:func:`to_dict` in the layout a user writes: the advanced keys moved under ``advanced:``, in their sections."""
    data, advanced = to_dict(cfg), {}
    for key in ADVANCED_KEYS:
        *sections, name = key.split(".")
        holder = data
        for section in sections:
            holder = holder[section]
        put(advanced, key, holder.pop(name))
    data[ADVANCED] = advanced
    return data


def from_user_layout(data: dict) -> dict:
    """A config mapping as a user writes it (a YAML file, an override) in the layout of the dataclasses: each key
    under ``advanced:`` moved to its section. An advanced key outside ``advanced:``, or a user's key inside it, is a
    ValueError naming the spelling to use. A mapping saved by a run before the ``advanced:`` section existed
    (:func:`saved_before_advanced`) is that layout already: returned as it is, so an old run directory resumes."""
    if not isinstance(data, dict):
        raise TypeError(f"config must be a mapping, got {type(data).__name__}")
    if saved_before_advanced(data):
        return data
    declared = {key: value for key, value in data.items() if key != ADVANCED}
    for key, _ in leaves(declared):
        if key in ADVANCED_KEYS:
            raise ValueError(f"{key} is an advanced key now: write {ADVANCED}.{key}")
    advanced = data.get(ADVANCED) or {}
    if not isinstance(advanced, dict):
        raise TypeError(f"{ADVANCED} must be a mapping of sections, got {type(advanced).__name__}")
    declared = copy.deepcopy(declared)  # the caller's mapping stays as it was
    for key, value in leaves(advanced):
        if key in dict(config_keys()) and key not in ADVANCED_KEYS:
            raise ValueError(f"{ADVANCED}.{key} is not an advanced key: write {key}")
        if key not in ADVANCED_KEYS:
            written = f"{ADVANCED}.{key}"
            raise ValueError(f"unknown config key {written!r}; {did_you_mean(written)}{advanced_keys_near(key)}")
        put(declared, key, value)
    return declared


def known_keys() -> set[str]:
    """Every dotted key and section a user may write, in both spellings (as declared and as written)."""
    known = set()
    for key, _ in config_keys():
        for spelling in (key, user_key(key)):
            parts = spelling.split(".")
            known.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return known


def closest_key(name: str) -> str | None:
    """The key a typo'd ``name`` most likely meant, as a user writes it (None when nothing is close): a section
    for a name without a dot; in a known section, its key whose name is closest (else the key of that name in
    another section); in an unknown one, the closest whole key."""
    written = [user_key(key) for key, _ in config_keys()]
    if "." not in name:
        return _closest(name, sorted(known_keys()))
    section, _, leaf = name.rpartition(".")
    if section not in known_keys():
        return _closest(name, written)
    near = _closest(leaf, [key[len(section) + 1:] for key in written if key.startswith(f"{section}.")])
    if near is not None:
        return f"{section}.{near}"
    elsewhere = [key for key in written if key.rpartition(".")[2] == leaf]  # the right name in the wrong section
    return elsewhere[0] if len(elsewhere) == 1 else None


def _closest(name: str, candidates: list[str]) -> str | None:
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return close[0] if close else None


def did_you_mean(name: str) -> str:
    """``"did you mean KEY? "`` for an unknown key ``name`` close to a known one, else ``""``."""
    close = closest_key(name)
    return "" if close is None else f"did you mean {close}? "


def advanced_keys_near(key: str) -> str:
    """The advanced keys in the section of dotted ``key`` (or in ``key``, a section), else the top level's."""
    for section in (key, key.rpartition(".")[0]):
        names = [k[len(section) + 1:] for k in ADVANCED_KEYS if section and k.startswith(f"{section}.")]
        if names:
            return f"known under {ADVANCED}.{section}: {', '.join(names)}"
    top = dict.fromkeys(k.split(".")[0] for k in ADVANCED_KEYS)
    return f"known under {ADVANCED}: {', '.join(top)}"


# what only a run's saved config holds at its top level: where and how the run started (written as false)
SAVED_ONLY = ("resume", "overwrite")


def saved_before_advanced(data: dict) -> bool:
    """Whether ``data`` is a run's config.yaml (or config_history.jsonl entry) written before the ``advanced:``
    section: every section, and ``resume`` and ``overwrite`` at the top level, which only such a saved config
    held there, and no ``advanced:``."""
    sections = [f.name for f in dataclasses.fields(Config) if dataclasses.is_dataclass(getattr(Config(), f.name))]
    return ADVANCED not in data and all(key in data for key in (*SAVED_ONLY, *sections))


def leaves(data: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of each value of nested mapping ``data`` that is not itself a mapping."""
    found = []
    for key, value in data.items():
        if isinstance(value, dict):
            found += leaves(value, f"{prefix}{key}.")
        else:
            found.append((f"{prefix}{key}", value))
    return found


def put(data: dict, key: str, value: Any) -> None:
    """Set dotted ``key`` of nested mapping ``data`` to ``value``, making the mappings on its way."""
    *sections, name = key.split(".")
    for section in sections:
        data = data.setdefault(section, {})
        if not isinstance(data, dict):
            raise TypeError(f"{section} must be a mapping, got {type(data).__name__}")
    data[name] = value
