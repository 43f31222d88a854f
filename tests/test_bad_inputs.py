"""Bad input that used to end badly (issue 46, item 7): each now ends in one line naming the setting, with
exit code 2 before any work and nothing written to the run directory, or behaves as documented. One test
each; the everyday mistakes before them: tests/test_run_errors.py, tests/test_cli_mistakes.py."""

from __future__ import annotations

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
