"""Writes the key tables of docs/config.md from the config fields (pacs/config/): each key as a user writes it,
its type, its default (and the built-in tasks' where theirs differs), what it allows (its choices or bounds)
and its help, by section; the user's keys first, then the advanced ones. Only the text between the page's
markers is generated; the prose around it is written by hand. tests/test_docs_site.py fails when the page is
stale.

    python -m pacs.config.docs            # rewrite the tables of docs/config.md
    python -m pacs.config.docs --check    # exit 1 if they are out of date
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import sys

from pacs.config.fields import settings
from pacs.config.keys import ADVANCED_KEYS, config_keys
from pacs.config.load import BUILTIN_TASK_SETTINGS, apply_dict
from pacs.config.root import Config

REGENERATE = "python -m pacs.config.docs"
BEGIN = f"<!-- config-tables: generated from the fields of pacs/config/ by `{REGENERATE}`; do not edit below -->"
END = "<!-- end of config-tables -->"


def yaml_value(value) -> str:
    """A value as a YAML config would spell it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    return str(value)


def cell(text: str) -> str:
    """Text for a table cell: a pipe outside a code span would end the cell (inside one it does not)."""
    return text if text.startswith("`") else text.replace("|", "\\|")


def sections(cls: type = Config, prefix: str = "") -> list[tuple[str, type]]:
    """(section key, dataclass) of the tree, each nested section right after its parent."""
    found = [(prefix.rstrip("."), cls)]
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory):
            found += sections(f.default_factory, f"{prefix}{f.name}.")
    return found


def key_tables() -> str:
    """The generated part of docs/config.md: the counts, then a table per section of the user's keys, then of
    the advanced ones."""
    every = {s.key: s for s in settings(Config)}
    builtin = dict(config_keys(apply_dict(Config(), BUILTIN_TASK_SETTINGS)))
    out = [f"The {len(every) - len(ADVANCED_KEYS)} keys a user sets come first, by section; then the "
           f"{len(ADVANCED_KEYS)} [advanced keys](#advanced-settings).", ""]
    for advanced in (False, True):
        if advanced:
            out += ["## Advanced settings", "",
                    "Written under `advanced:` in a YAML file, `advanced.` before the key on the command line.", ""]
        for key, cls in sections():
            rows = []
            for f in dataclasses.fields(cls):
                s = every.get(f"{key}.{f.name}" if key else f.name)
                if s is None or s.advanced != advanced:
                    continue
                shown = f"`{yaml_value(s.default)}`"
                if builtin[s.key] != (list(s.default) if isinstance(s.default, tuple) else s.default):
                    shown += f" (built-in tasks: `{yaml_value(builtin[s.key])}`)"
                allowed = f"`{s.allowed}`" if s.allowed else ""
                rows.append((f"`{s.written}`", f"`{s.type}`", shown, allowed, s.help))
            if not rows:
                continue
            if advanced:
                out += [f"### `advanced.{key}`" if key else "### `advanced` (top level)", ""]
            else:
                out += [f"## `{key}`" if key else "## Top level", ""]
            doc = inspect.getdoc(cls)
            if not advanced and doc and not doc.startswith(f"{cls.__name__}("):  # (no docstring: the signature)
                out += [doc, ""]
            out += ["| key | type | default | allowed | description |", "|---|---|---|---|---|"]
            out += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
            out.append("")
    return "\n".join(out)


def with_tables(page: str) -> str:
    """``page`` (docs/config.md's text) with the text between its markers generated anew."""
    if BEGIN not in page or END not in page:
        raise ValueError(f"docs/config.md must hold the markers {BEGIN!r} and {END!r}")
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n\n{key_tables()}\n{END}{tail}"


def page_path() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs",
                        "config.md")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pacs.config.docs", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/config.md's tables are out of date")
    parser.add_argument("--page", default=page_path(), help="the page to write (default: docs/config.md)")
    args = parser.parse_args(argv)
    with open(args.page) as f:
        page = f.read()
    text = with_tables(page)
    if args.check:
        if text != page:
            print(f"{args.page} is out of date: run {REGENERATE}", file=sys.stderr)
            return 1
        return 0
    with open(args.page, "w") as f:
        f.write(text)
    print(f"wrote {args.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
