"""Tasks: the built-in addition task ("embedded"), generated word problems ("wordmath") and math
datasets (jsonl / parquet); a user's task by name (pacs/registry.py's TASKS) or as ``module:Name``."""

from __future__ import annotations

from pacs.config import Config
from pacs.registry import REWARDS, TASKS
from pacs.tasks.arithmetic import AdditionTask
from pacs.tasks.base import Problem, Task
from pacs.tasks.math_data import MathTask, load_problems
from pacs.tasks.word_problems import WordProblemTask


def make_task(cfg: Config) -> Task:
    """The task named by ``cfg.task.name``: its factory (pacs/registry.py) called with the config. With
    ``advanced.task.reward`` set, that reward function scores its responses instead of the task's own."""
    task = TASKS.resolve(cfg.task.name, "task.name")(cfg)
    if not isinstance(task, Task):
        raise ValueError(f"task.name={cfg.task.name!r} built a {type(task).__name__}, not a pacs.tasks.base.Task "
                         "(train_problem, eval_problems, reward_fn)")
    if cfg.task.reward is not None:
        reward = REWARDS.resolve(cfg.task.reward, "advanced.task.reward")
        if not callable(reward):
            raise ValueError(f"advanced.task.reward={cfg.task.reward!r} is a {type(reward).__name__}, not a function "
                             "reward(response_text, answer) -> float")
        task.reward_fn = reward
    return task


__all__ = ["AdditionTask", "MathTask", "Problem", "Task", "WordProblemTask", "load_problems", "make_task"]
