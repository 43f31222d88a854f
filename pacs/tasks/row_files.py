"""Rows of a data file (``.jsonl``/``.json`` or ``.parquet``) as dicts: what a math task's file
(pacs/tasks/math_data.py) and a local copy of a named dataset (pacs/tasks/datasets.py) are read with."""

from __future__ import annotations

import json
import os


def read_rows(path: str) -> list[dict]:
    """All rows of a ``.jsonl``/``.json`` or ``.parquet`` file as dicts: a ``.jsonl`` holds one JSON object per
    line; a ``.json`` file one JSON array of objects (as ``pandas``' ``to_json(orient="records")`` writes it) or,
    like a ``.jsonl``, one object per line."""
    if not os.path.isfile(path):
        raise ValueError(f"task.data_path: no such file {path!r}")
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise ValueError(f"reading {path!r} needs pyarrow (pip install pyarrow)") from exc
        # plain Python values, as a .jsonl row's: a chat-style list stays a list (pandas gives a numpy array,
        # whose text became the prompt) and a missing value is None (pandas: NaN, read as the answer "nan")
        return pq.read_table(path).to_pylist()
    if path.endswith((".jsonl", ".json")):
        rows = []
        with open(path, "rb") as fh:
            data = fh.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = data[:exc.start].count(b"\n") + 1
            raise ValueError(f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
                             "save the file as UTF-8") from None
        if path.endswith(".json") and text.lstrip().startswith("["):  # one JSON array of rows (pandas, datasets)
            try:
                rows = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
            return _objects(rows, lambda i: f"{path} row {i}")
        lines = []
        for n, line in enumerate(text.split("\n"), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{n}: not valid JSON ({exc.msg})") from exc
                lines.append(n)
        return _objects(rows, lambda i: f"{path}:{lines[i]}")
    raise ValueError(f"task.data_path must end in .jsonl, .json or .parquet, got {path!r}")


def _objects(rows: list, where) -> list[dict]:
    """``rows`` when each is a JSON object; else a ValueError naming the first that is not (``where(i)``)."""
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{where(i)}: a row must be a JSON object such as {{\"problem\": ..., \"answer\": ...}}, "
                             f"got {type(row).__name__} {json.dumps(row)[:60]}")
    return rows
