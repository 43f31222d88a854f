"""Settings as data (issue 49 item 2): each config key is one field carrying its help, choices, bounds and
whether it is advanced; the advanced keys, the checks of each value, ``pacs train --help``, docs/config.md's
tables and the "did you mean" of an unknown key are read from the fields, and the config imports nothing heavy."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys

import pytest

from pacs.config import ADVANCED_KEYS, Config, load_config, settings, validate
from pacs.config.fields import setting
from pacs.registry import OBJECTIVES, ROLLOUT_ENGINES, TASKS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(args: list[str], pythonpath: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def test_importing_the_config_imports_no_model_rollout_task_trainer_or_kernels():
    code = ("import sys, pacs.config\n"
            "heavy = ('pacs.model', 'pacs.rollout', 'pacs.tasks', 'pacs.train', 'pacs_kernels', 'torch')\n"
            "print([m for m in sys.modules if m.split('.')[0] in heavy or m.startswith(heavy)])\n")
    done = run_python(["-c", code], ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_every_key_describes_itself_and_the_advanced_keys_are_the_fields_marked_so():
    every = settings(Config)
    assert all(s.help.strip() for s in every)
    assert ADVANCED_KEYS == tuple(s.key for s in every if s.advanced)
    named = {s.key: s.choice_names() for s in every}
    # the choices that name code are the registries' names (one spelling, pacs/registry.py)
    assert named["optim.algo"] == OBJECTIVES.names() == ("pacs", "grpo", "dapo", "dr_grpo", "gspo", "cispo")
    assert named["rollout.engine"] == ROLLOUT_ENGINES.names() == ("auto", "vllm", "hf")
    assert named["task.name"] == TASKS.names() == ("embedded", "wordmath", "math")


@dataclasses.dataclass
class Section:
    size: int = setting(4, "a size", above=0)
    share: float = setting(0.5, "a share", above=0, at_most=1, why="of the memory")
    mode: str = setting("a", "a mode", choices=("a", "b"), advanced=True)
    budget: int | None = setting(None, "a budget", at_least=1, expect="a positive number of tokens or None")


@pytest.mark.parametrize("change, message", [
    ({"size": 0}, "sec.size must be > 0, got 0"),
    ({"size": True}, "sec.size must be an integer > 0, got True"),
    ({"share": 1.5}, "sec.share must be in (0, 1] (of the memory), got 1.5"),
    ({"share": float("nan")}, "sec.share must be in (0, 1] (of the memory), got nan"),
    ({"share": "x"}, "sec.share must be in (0, 1] (of the memory), got 'x'"),
    ({"mode": "c"}, "advanced.sec.mode must be one of a, b; got 'c'"),
    ({"budget": 0}, "sec.budget must be a positive number of tokens or None, got 0"),
])
def test_a_section_is_checked_from_its_fields_metadata(change, message):
    from pacs.config.fields import check_section

    check_section(Section(budget=None), "sec.")
    with pytest.raises(ValueError) as refused:
        check_section(Section(**change), "sec.")
    assert str(refused.value) == message


def test_the_few_rules_across_sections_still_refuse():
    with pytest.raises(ValueError, match="must divide the prompts per rank and step"):
        validate(load_config(None, ["optim.mini_batches_per_step=5"]))
    with pytest.raises(ValueError, match=r"eval.num_problems \(300\) must be <= task.eval_size \(200\)"):
        validate(load_config(None, ["eval.num_problems=300"]))
    with pytest.raises(ValueError, match="needs model.dtype='bfloat16'"):
        validate(load_config(None, ["optim.master_dtype=bfloat16", "model.dtype=float32"]))


HELP = "a knob added in one file by tests/test_config_fields.py"
NEW_FIELD = f'    my_new_knob: int = setting(7, "{HELP}", at_least=1, advanced=True)\n'


def test_a_key_added_in_one_file_shows_in_help_docs_validation_and_suggestions(tmp_path):
    """One field line in pacs/config/train.py: ``pacs train --help`` lists it with its help, the docs generator
    writes its row, the CLI refuses a value out of its bounds naming it, and a typo of it gets it suggested."""
    for part in ("pacs", "pacs_kernels"):
        shutil.copytree(os.path.join(ROOT, part), tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "docs").mkdir()
    shutil.copy(os.path.join(ROOT, "docs", "config.md"), tmp_path / "docs" / "config.md")
    section = tmp_path / "pacs" / "config" / "train.py"
    text = section.read_text()
    anchor = "    sequence_parallel_size: int = setting("
    assert anchor in text
    section.write_text(text.replace(anchor, NEW_FIELD + anchor, 1))
    copy = str(tmp_path)

    shown = run_python(["-m", "pacs", "train", "--help"], copy, cwd=copy)
    assert shown.returncode == 0, shown.stderr
    assert f"advanced.train.my_new_knob = 7\n      {HELP}" in shown.stdout

    written = run_python(["-m", "pacs.config.docs"], copy, cwd=copy)
    assert written.returncode == 0, written.stderr
    page = (tmp_path / "docs" / "config.md").read_text()
    assert f"| `advanced.train.my_new_knob` | `int` | `7` | `>= 1` | {HELP} |" in page

    refused = run_python(["-m", "pacs", "train", "--output-dir", str(tmp_path / "run"),
                          "advanced.train.my_new_knob=0"], copy, cwd=copy)
    assert refused.returncode == 2
    assert "pacs train: error: advanced.train.my_new_knob must be >= 1, got 0" in refused.stderr
    assert not (tmp_path / "run").exists()

    typo = run_python(["-m", "pacs", "train", "advanced.train.my_new_knb=3"], copy, cwd=copy)
    assert typo.returncode == 2 and "did you mean advanced.train.my_new_knob?" in typo.stderr


def test_what_pacs_eval_reads_is_declared_by_the_fields():
    """A field says it is pacs train's alone (training_only=True), or its section does (TRAINING_ONLY); pacs eval's
    --help lists the rest, and nothing in pacs/cli.py keeps its own list."""
    from pacs.cli import _key_list
    from pacs.config import Config, settings

    read = {s.key: s.read_by_eval for s in settings(Config)}
    assert not read["optim.lr"] and not read["train.packing"] and not read["model.lora.rank"]
    assert not read["rollout_correction.mode"] and not read["eval.every"] and not read["max_steps"]
    assert read["task.name"] and read["eval.n_samples"] and read["model.path"] and read["rollout.max_new_tokens"]
    eval_help, train_help = _key_list("eval"), _key_list("train")
    assert "optim.lr =" in train_help and "optim.lr =" not in eval_help
    assert "eval.n_samples =" in eval_help and "eval.every =" not in eval_help
