"""Bad input that used to end badly (issue 46, item 7): each now ends in one line naming the setting, with
exit code 2 before any work and nothing written to the run directory, or behaves as documented. One test
each; the everyday mistakes before them: tests/test_run_errors.py, tests/test_cli_mistakes.py."""

from __future__ import annotations

import json

import pytest

from pacs.tasks.math_data import load_problems
from test_run_errors import TINY_RUN, one_error_line, run_cli, tiny_model  # noqa: F401  (a fixture)


def test_a_learning_rate_above_one_is_refused_before_any_work(tmp_path, capsys, tiny_model):
    """optim.lr=1e300 passed validation, then AdamW's update overflowed in a traceback."""
    out = tmp_path / "run"
    code, _, err = run_cli(capsys, "train", "--model", tiny_model, "--output-dir", str(out), "--max-steps", "1",
                           *TINY_RUN, "optim.lr=1e300")
    assert code == 2
    assert one_error_line(err) == ("pacs train: error: optim.lr must be in (0, 1] (AdamW moves each weight by "
                                   "about lr per step), got 1e+300")
    assert not out.exists()


def test_a_json_file_holding_an_array_of_rows_loads(tmp_path):
    """A .json file holding one JSON array (pandas' to_json(orient="records"), json.dump of a list) failed with
    "'<' not supported between instances of 'dict'"; a row that is no JSON object is named in one line."""
    rows = [{"problem": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(4)]
    for name, text in (("one_line.json", json.dumps(rows)), ("indented.json", json.dumps(rows, indent=2)),
                       ("lines.json", "\n".join(json.dumps(row) for row in rows))):
        path = tmp_path / name
        path.write_text(text)
        assert [(p.prompt, p.answer) for p in load_problems(str(path))] == [(r["problem"], r["answer"]) for r in rows]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([rows[0], ["What is 1 + 1?", "2"]]))
    with pytest.raises(ValueError) as raised:
        load_problems(str(bad))
    assert str(raised.value) == (f"{bad} row 1: a row must be a JSON object such as {{\"problem\": ..., \"answer\": "
                                 "...}, got list [\"What is 1 + 1?\", \"2\"]")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:3: a row must be a JSON object"):
        load_problems(str(bad))
