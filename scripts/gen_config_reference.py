"""Writes docs/config.md, the reference of every `pacs train` setting, from the config dataclasses.

Every key of ``pacs.config.Config`` with its type (the annotation as written), its default (and the
built-in tasks' value where theirs differs) and its description: the comments next to the field in
pacs/config.py (the comment lines right above it, the one on its line and the lines continuing it),
grouped by section as in a YAML config: first the keys a user sets, then the advanced ones
(``pacs.config.ADVANCED_KEYS``, spelled as written: ``advanced.train.preflight``). tests/test_docs_site.py
checks that docs/config.md equals this script's output.

    python scripts/gen_config_reference.py            # rewrite docs/config.md
    python scripts/gen_config_reference.py --check    # exit 1 if docs/config.md is out of date
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import os
import re
import sys
import textwrap
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "config.md")
REGENERATE = "python scripts/gen_config_reference.py"


def field_comments(cls: type) -> dict[str, str]:
    """Each field of dataclass ``cls`` -> the comments that describe it in the source, joined.

    A comment line at the field's indentation belongs to the next field; a comment on a field's last line
    and the comment lines indented further right below it continue that field's description."""
    source = textwrap.dedent(inspect.getsource(cls))
    body = ast.parse(source).body[0].body
    fields = {node.target.id: node for node in body if isinstance(node, ast.AnnAssign)}
    indent = min(node.col_offset for node in fields.values())
    comments = {}  # line number -> (column, text)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = (token.start[1], token.string.lstrip("#").strip())
    lines = source.split("\n")
    comment_only = {n for n in comments if not lines[n - 1][:comments[n][0]].strip()}
    described = {}
    for name, node in fields.items():
        above = []
        line = node.lineno - 1
        while line in comment_only and comments[line][0] == indent:
            above.insert(0, comments[line][1])
            line -= 1
        below = []
        line = node.end_lineno
        if line in comments and line not in comment_only:
            below.append(comments[line][1])
            line += 1
            while line in comment_only and comments[line][0] > indent:
                below.append(comments[line][1])
                line += 1
        described[name] = "; ".join(part for part in (" ".join(above), " ".join(below)) if part)
    return described


def annotation(cls: type, name: str) -> str:
    source = textwrap.dedent(inspect.getsource(cls))
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and node.target.id == name:
            return ast.get_source_segment(source, node.annotation)
    raise KeyError(f"{cls.__name__} has no annotated field {name!r}")


def yaml_value(value) -> str:
    """A value as a YAML config would spell it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    return str(value)


def cell(text: str) -> str:
    """Text for a table cell: a pipe outside a code span would end the cell (inside one it does not)."""
    return text if text.startswith("`") else text.replace("|", "\\|")


def sections(default, builtin, advanced: bool, prefix: str = "") -> list[tuple[str, type, list[tuple[str, ...]]]]:
    """(section key, dataclass, rows (key as written, type, default, description)) of the user's keys or, with
    ``advanced``, the advanced ones; nested dataclasses follow their parent; sections without such keys left out."""
    from pacs.config import ADVANCED_KEYS, user_key

    cls = type(default)
    comments = field_comments(cls)
    rows, nested = [], []
    for f in dataclasses.fields(cls):
        value, builtin_value = getattr(default, f.name), getattr(builtin, f.name)
        if dataclasses.is_dataclass(value):
            nested += sections(value, builtin_value, advanced, f"{prefix}{f.name}.")
            continue
        key = f"{prefix}{f.name}"
        if (key in ADVANCED_KEYS) != advanced:
            continue
        shown = f"`{yaml_value(value)}`"
        if builtin_value != value:
            shown += f" (built-in tasks: `{yaml_value(builtin_value)}`)"
        rows.append((f"`{user_key(key)}`", f"`{annotation(cls, f.name)}`", shown, comments[f.name]))
    return ([(prefix.rstrip("."), cls, rows)] if rows else []) + nested


def config_reference() -> str:
    """The text of docs/config.md."""
    sys.path.insert(0, ROOT)
    from pacs import config

    default = config.Config()
    builtin = config.apply_dict(config.Config(), config.BUILTIN_TASK_SETTINGS)
    precedence = re.sub(r":\w+:`", "`", inspect.getdoc(config).split("\n\n", 1)[1])
    out = [
        "# Config reference",
        "",
        f"<!-- Generated from pacs/config.py by `{REGENERATE}`; do not edit by hand. -->",
        "",
        "Every setting of `pacs train` and `pacs eval`: a key of a `--config` YAML file (nested as the sections",
        "below), or `KEY=VALUE` on the command line (`optim.lr=1e-6`). The defaults are a real model's (the",
        "paper's); where the built-in tasks `embedded` and `wordmath` start from another value, it follows in",
        "parentheses (`configs/default.yaml` lists the built-in run's every value). Descriptions are the",
        "comments of `pacs/config.py`; a key without one is described on the page of its feature.",
        "",
        f"The {len(config.config_keys()) - len(config.ADVANCED_KEYS)} keys a user sets come first, by section. The "
        f"{len(config.ADVANCED_KEYS)} [advanced keys](#advanced-settings)",
        "(kernel knobs, the algorithm's ablation switches, thresholds, timeouts, the built-in tasks' toy model) are",
        "for experts, ablations and tests: they are written under `advanced:`, in their section",
        "(`advanced: {train: {preflight: false}}` in YAML, `advanced.train.preflight=false` on the command line);",
        "the same key outside `advanced:` is refused with the spelling to use.",
        "",
        precedence,
        "",
    ]
    for advanced in (False, True):
        if advanced:
            out += ["## Advanced settings", "",
                    "Written under `advanced:` in a YAML file, `advanced.` before the key on the command line.", ""]
        for key, cls, rows in sections(default, builtin, advanced):
            if advanced:
                out += [f"### `advanced.{key}`" if key else "### `advanced` (top level)", ""]
            else:
                out += [f"## `{key}`" if key else "## Top level", ""]
            doc = inspect.getdoc(cls)
            if not advanced and doc and not doc.startswith(f"{cls.__name__}("):  # (no docstring: the signature)
                out += [doc, ""]
            out += ["| key | type | default | description |", "|---|---|---|---|"]
            out += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
            out.append("")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/config.md differs from the output")
    args = parser.parse_args()
    text = config_reference()
    if args.check:
        with open(PAGE) as f:
            if f.read() != text:
                print(f"docs/config.md is out of date: run {REGENERATE}", file=sys.stderr)
                return 1
        return 0
    with open(PAGE, "w") as f:
        f.write(text)
    print(f"wrote {os.path.relpath(PAGE, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
