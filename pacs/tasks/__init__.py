"""Tasks: the built-in addition task ("embedded"), generated word problems ("wordmath") and math
datasets (jsonl / parquet)."""

from __future__ import annotations

from pacs.config import Config
from pacs.tasks.arithmetic import AdditionTask
from pacs.tasks.base import Problem, Task
from pacs.tasks.math_data import MathTask, load_problems
from pacs.tasks.word_problems import WordProblemTask


def make_task(cfg: Config) -> Task:
    """The task named by ``cfg.task.name``."""
    t = cfg.task
    if t.name == "embedded":
        return AdditionTask(t.digits, seed=cfg.seed, eval_size=t.eval_size,
                            reverse=t.reverse)
    if t.name == "wordmath":
        return WordProblemTask(t.word_steps, seed=cfg.seed, eval_size=t.eval_size)
    if t.name == "math":
        return MathTask(t.data_path, eval_path=t.eval_path, eval_size=t.eval_size, seed=cfg.seed)
    raise ValueError(f"task.name must be 'embedded', 'wordmath' or 'math', got {t.name!r}")


__all__ = ["AdditionTask", "MathTask", "Problem", "Task", "WordProblemTask", "load_problems", "make_task"]
