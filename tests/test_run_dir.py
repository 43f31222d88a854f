"""The run directory (pacs/run/run_dir.py): its layout, the refusal of a directory that holds a run, and
that no other module of the trainer builds a path under a run's directory itself."""

import ast
import os

import pytest

from pacs.run.run_dir import RUN_FILES, RunDir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUT_NAMES = {"config.yaml", "config_history.jsonl", "metrics.jsonl", "metrics.png", "checkpoints", "final_model",
                ".lock"}


def test_the_layout():
    run = RunDir("out")
    assert run.config == os.path.join("out", "config.yaml")
    assert run.config_history == os.path.join("out", "config_history.jsonl")
    assert run.metrics == os.path.join("out", "metrics.jsonl")
    assert run.metrics_plot == os.path.join("out", "metrics.png")
    assert run.checkpoint(12) == os.path.join("out", "checkpoints", "step_000012")
    assert run.final_model == os.path.join("out", "final_model")
    assert run.eval == os.path.join("out", "eval")
    assert run.lock == os.path.join("out", ".lock")


def test_a_directory_holding_a_run_is_refused_then_moved_aside(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    run.check_usable()
    assert run.contents() == []
    run.check_free_for_run(resume=False, overwrite=False)
    open(run.metrics, "w").close()
    assert run.contents() == ["metrics.jsonl"] and "metrics.jsonl" in RUN_FILES
    with pytest.raises(ValueError, match="already holds a run \\(metrics.jsonl\\); pass --resume"):
        run.check_free_for_run(resume=False, overwrite=False)
    with pytest.raises(ValueError, match="--resume and --overwrite exclude each other"):
        run.check_free_for_run(resume=True, overwrite=True)
    moved = run.move_aside()
    assert os.path.isfile(os.path.join(moved, "metrics.jsonl")) and run.contents() == []


def test_a_file_in_place_of_the_directory_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        RunDir(str(tmp_path / "file")).check_usable()


def _names_output_dir(node: ast.AST) -> bool:
    """``node`` reads a run's directory (an ``output_dir``) other than through ``RunDir(...)``."""
    if "RunDir(" in ast.unparse(node):
        return False
    return any((isinstance(n, ast.Attribute) and n.attr == "output_dir") or (isinstance(n, ast.Name)
               and n.id == "output_dir") for n in ast.walk(node))


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def paths_built_outside_run_dir() -> list[str]:
    """Each place in pacs/train, pacs/eval and pacs/cli.py (but run_dir.py) that joins a path onto a run's
    directory (``os.path.join(cfg.output_dir, ...)``, ``Path(output_dir)``, ``open(output_dir...)``) or
    spells one of the run directory's file names."""
    files = [os.path.join(ROOT, "pacs", "cli.py")]
    for package in ("train", "eval"):
        folder = os.path.join(ROOT, "pacs", package)
        files += [os.path.join(folder, name) for name in sorted(os.listdir(folder)) if name.endswith(".py")]
    found = []
    for path in files:
        if os.path.basename(path) == "run_dir.py":
            continue
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        docstrings = _docstrings(tree)
        where = os.path.relpath(path, ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and node.args and _names_output_dir(node.args[0]):
                name = ast.unparse(node.func)
                if name in ("os.path.join", "Path", "pathlib.Path", "open", "os.path.realpath"):
                    found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
            if (isinstance(node, ast.Constant) and node.value in LAYOUT_NAMES and id(node) not in docstrings):
                found.append(f"{where}:{node.lineno}: the run directory's file name {node.value!r}")
    return found


def test_every_path_under_a_run_directory_comes_from_run_dir():
    found = paths_built_outside_run_dir()
    assert not found, "paths under a run's directory built outside RunDir (pacs/run/run_dir.py):\n" + "\n".join(found)
