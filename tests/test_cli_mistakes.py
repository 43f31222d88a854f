"""A newcomer's first mistakes with ``pacs train`` / ``pacs eval`` end in one line naming the argument and
what was expected (exit code 2, nothing written): a typo'd config key gets the key it most likely meant, a
data file the task would ignore is refused, a ``--model`` directory without config.json says what it is,
``--k`` above ``--n-samples`` and ``--data`` / ``--preset`` mistakes name the flags the user typed.
(More everyday mistakes: tests/test_run_errors.py.)"""

from __future__ import annotations

import pytest

from pacs.cli import main


def error_line(capsys, *argv: str) -> str:
    code = main(list(argv))
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("override, meant", [
    ("optim.lrr=1e-4", "optim.lr"),
    ("optm.lr=1e-4", "optim.lr"),
    ("rollout.group_sise=4", "rollout.group_size"),
    ("advanced.optim.weighing=none", "advanced.optim.weighting"),
])
def test_a_typo_in_a_key_suggests_the_key_meant(tmp_path, capsys, override, meant):
    line = error_line(capsys, "train", "--output-dir", str(tmp_path / "o"), override)
    key = override.split("=")[0]
    assert line == (f"pacs train: error: unknown config key {key!r}; did you mean {meant}? "
                    "(every key: pacs train --help)")
    assert not (tmp_path / "o").exists()


def test_a_typo_in_a_config_file_suggests_the_key_meant(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("optim:\n  lrr: 1.0e-4\n")
    line = error_line(capsys, "train", "--config", str(config), "--output-dir", str(tmp_path / "o"))
    assert line.startswith("pacs train: error: unknown config key 'optim.lrr'; did you mean optim.lr? known: ")
    config.write_text("optm:\n  lr: 1.0e-4\n")
    line = error_line(capsys, "train", "--config", str(config), "--output-dir", str(tmp_path / "o"))
    assert line.startswith("pacs train: error: unknown config key 'optm'; did you mean optim? known: ")


def test_an_unknown_key_far_from_any_still_lists_the_known_ones(tmp_path, capsys):
    line = error_line(capsys, "train", "--output-dir", str(tmp_path / "o"), "zzz=1")
    assert line.startswith("pacs train: error: unknown config key 'zzz'; known: ") and "did you mean" not in line
    # each key as it is written: an expert's under advanced.
    line = error_line(capsys, "train", "--output-dir", str(tmp_path / "o"), "optim.zzzzzzzzz=1")
    known = line.partition("known: ")[2].split(", ")
    assert "optim.lr" in known and "advanced.optim.weighting" in known and "weighting" not in known


def test_a_data_file_without_the_math_task_is_refused_not_ignored(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    line = error_line(capsys, "train", "--output-dir", str(tmp_path / "o"), f"task.data_path={data}")
    assert line == ("pacs train: error: task.data_path is read by task.name=math only (task.name is 'embedded'): "
                    "add task.name=math")
    assert not (tmp_path / "o").exists()


def test_a_model_directory_without_config_json(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    for command in ("train", "eval"):
        line = error_line(capsys, command, "--model", str(empty), "--output-dir", str(tmp_path / "o"))
        assert line == (f"pacs {command}: error: --model: {str(empty)!r} has no config.json (a Hugging Face model "
                        "directory holds config.json and the weights)")
    run = tmp_path / "run"
    (run / "final_model").mkdir(parents=True)
    (run / "final_model" / "config.json").write_text("{}")
    line = error_line(capsys, "eval", "--model", str(run), "--output-dir", str(tmp_path / "o"))
    assert line == (f"pacs eval: error: --model: {str(run)!r} is not a model directory (no config.json); the model "
                    f"in it is {str(run / 'final_model')!r}")
    assert not (tmp_path / "o").exists()


def test_eval_k_above_n_samples_names_the_flags(tmp_path, capsys):
    line = error_line(capsys, "eval", "--output-dir", str(tmp_path / "o"), "--n-samples", "2", "--temperature",
                      "1", "--k", "4")
    assert line == ("pacs eval: error: --k 4 is more than the samples per problem (2): pass@k needs "
                    "k <= --n-samples (e.g. --n-samples 4)")


def test_eval_data_and_preset_mistakes_name_the_flags(tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    line = error_line(capsys, "eval", "--output-dir", str(tmp_path / "o"), "--data", str(missing))
    assert line == f"pacs eval: error: --data: no such file {str(missing)!r}"
    line = error_line(capsys, "eval", "--output-dir", str(tmp_path / "o"), "--preset", "math")
    assert line == "pacs eval: error: --preset math evaluates a data file: add --data FILE (.jsonl or .parquet)"
    assert not (tmp_path / "o").exists()


def test_a_missing_data_file_is_named_before_any_check_of_lengths(tmp_path, capsys):
    """The built-in model's 64 positions are too few for a math run's default lengths: the missing file is
    what the user has to mend first, and it is what the error names."""
    line = error_line(capsys, "train", "--output-dir", str(tmp_path / "o"), "task.name=math",
                      f"task.data_path={tmp_path / 'missing.jsonl'}")
    assert line == f"pacs train: error: task.data_path: no such file {str(tmp_path / 'missing.jsonl')!r}"
