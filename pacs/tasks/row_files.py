"""Rows of a data file (``.jsonl``/``.json`` or ``.parquet``) as dicts: what a math task's file
(pacs/tasks/math_data.py) and a local copy of a named dataset (pacs/tasks/datasets.py) are read with."""

from __future__ import annotations

import json
import os


def read_rows(path: str) -> list[dict]:
    """All rows of a ``.jsonl``/``.json`` or ``.parquet`` file as dicts."""
    if not os.path.isfile(path):
        raise ValueError(f"task.data_path: no such file {path!r}")
    if path.endswith(".parquet"):
        try:
            import pandas as pd
        except ImportError as exc:
            raise ValueError(f"reading {path!r} needs pandas and pyarrow (pip install pandas pyarrow)") from exc
        return pd.read_parquet(path).to_dict("records")
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
        for n, line in enumerate(text.split("\n"), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{n}: not valid JSON ({exc.msg})") from exc
        return rows
    raise ValueError(f"task.data_path must end in .jsonl, .json or .parquet, got {path!r}")
