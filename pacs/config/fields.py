"""A setting describes itself: each config field carries its help text, its choices, its bounds and whether
it is advanced (the metadata of its ``dataclasses.field``, made by :func:`setting`). Validation
(:func:`check_section`), ``pacs train --help``, the unknown-key suggestions and docs/config.md read them here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from pacs.registry import Registry


def setting(default: Any, help: str, *, choices: tuple[str, ...] | Registry | None = None,
            at_least: float | None = None, above: float | None = None, at_most: float | None = None,
            below: float | None = None, why: str = "", expect: str = "", flag: str = "",
            advanced: bool = False, training_only: bool = False) -> Any:
    """A config field: its ``default`` and its description.

    ``help``: one line of what it does (docs/config.md, ``--help``). ``choices``: the values it may take (a
    tuple, or a :class:`pacs.registry.Registry`). ``at_least`` / ``above`` / ``at_most`` / ``below``: its bounds
    (a number outside them, NaN or infinite is refused; None passes when the field's type allows it). ``why``:
    the reason of the bounds, said when they are broken; ``expect``: what a value must be, said instead of the
    bounds. ``flag``: the ``pacs`` option that sets it too (named in errors). ``advanced``: written under
    ``advanced:`` (experts, ablations, tests). ``training_only``: read by ``pacs train`` alone, not by ``pacs eval``
    (left out of its ``--help``; a whole section says so with a class attribute ``TRAINING_ONLY = True``)."""
    metadata = dict(help=help, choices=choices, at_least=at_least, above=above, at_most=at_most, below=below,
                    why=why, expect=expect, flag=flag, advanced=advanced, training_only=training_only)
    return dataclasses.field(default=default, metadata=metadata)


def section(factory: type) -> Any:
    """A nested section of settings (a dataclass built with its defaults)."""
    return dataclasses.field(default_factory=factory)


@dataclass(frozen=True)
class Setting:
    """One key of the config tree, read from its field."""

    key: str                       # dotted, as declared (train.preflight)
    type: str                      # the annotation as written (int | None)
    default: Any
    help: str
    choices: tuple[str, ...] | Registry | None
    advanced: bool
    allowed: str                   # its choices or bounds as text ("" when any value of its type goes)
    read_by_eval: bool = True      # False: pacs train's alone (the field's training_only or its section's)

    @property
    def written(self) -> str:
        """The key as a user writes it: ``advanced.train.preflight`` for an advanced one."""
        return f"advanced.{self.key}" if self.advanced else self.key

    def choice_names(self) -> tuple[str, ...]:
        if self.choices is None:
            return ()
        return self.choices.names() if isinstance(self.choices, Registry) else tuple(self.choices)


def settings(cls: type, prefix: str = "", training_only: bool = False) -> list[Setting]:
    """Every setting of dataclass ``cls`` and its nested sections, in declaration order. ``training_only``: the
    enclosing section is ``pacs train``'s alone."""
    found = []
    training_only = training_only or bool(getattr(cls, "TRAINING_ONLY", False))
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory):
            found += settings(f.default_factory, f"{prefix}{f.name}.", training_only)
            continue
        meta = f.metadata
        if "help" not in meta:
            raise TypeError(f"{cls.__name__}.{f.name}: declare it with setting(default, help=...)")
        found.append(Setting(f"{prefix}{f.name}", str(f.type), f.default, meta["help"], meta["choices"],
                             meta["advanced"], allowed_text(meta),
                             read_by_eval=not (training_only or meta.get("training_only", False))))
    return found


def display_name(prefix: str, f: dataclasses.Field) -> str:
    """A field's key in errors: as a user writes it, and the option that sets it too."""
    name = f"{'advanced.' if f.metadata.get('advanced') else ''}{prefix}{f.name}"
    flag = f.metadata.get("flag")
    return f"{name} ({flag})" if flag else name


def bounds_text(meta: dict) -> str:
    """``> 0``, ``>= 2``, ``in (0, 1]`` ...: the bounds of a field as its error says them."""
    low = ("(", meta["above"]) if meta["above"] is not None else ("[", meta["at_least"])
    high = (")", meta["below"]) if meta["below"] is not None else ("]", meta["at_most"])
    if low[1] is not None and high[1] is not None:
        return f"in {low[0]}{low[1]}, {high[1]}{high[0]}"
    if low[1] is not None:
        return f"{'>' if low[0] == '(' else '>='} {low[1]}"
    return f"{'<' if high[0] == ')' else '<='} {high[1]}"


def allowed_text(meta: dict) -> str:
    """A field's choices (``a | b``) or bounds (``> 0``) as the docs write them; "" for neither."""
    choices = meta["choices"]
    if isinstance(choices, Registry):
        return choices.describe()
    if choices is not None:
        return " | ".join(choices)
    if any(meta[k] is not None for k in ("above", "at_least", "below", "at_most")):
        return meta["expect"] or bounds_text(meta)
    return ""


def _within(value: float, meta: dict) -> bool:
    above, at_least, below, at_most = meta["above"], meta["at_least"], meta["below"], meta["at_most"]
    return ((above is None or value > above) and (at_least is None or value >= at_least)
            and (below is None or value < below) and (at_most is None or value <= at_most))


def check_value(name: str, f: dataclasses.Field, value: Any) -> None:
    """The field's choices and bounds (its metadata); a ValueError naming ``name`` and what was expected."""
    meta = f.metadata
    if value is None and "None" in str(f.type):
        return
    choices = meta.get("choices")
    if isinstance(choices, Registry):
        choices.check(value, name)
    elif choices is not None and value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    bounded = any(meta.get(k) is not None for k in ("above", "at_least", "below", "at_most"))
    if not bounded:
        return
    integer = str(f.type).startswith("int")
    kind_ok = not isinstance(value, bool) and isinstance(value, int if integer else (int, float))
    if kind_ok and math.isfinite(value) and _within(value, meta):
        return
    expected = meta["expect"] or (("an integer " if integer and not kind_ok else "") + bounds_text(meta)
                                  + (f" ({meta['why']})" if meta["why"] else ""))
    raise ValueError(f"{name} must be {expected}, got {value!r}")


def check_section(obj: Any, prefix: str) -> None:
    """Every field of section ``obj`` (its nested sections left to their own check) against its metadata."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if not dataclasses.is_dataclass(value):
            check_value(display_name(prefix, f), f, value)
