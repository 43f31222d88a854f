"""Math datasets: ``.jsonl`` or ``.parquet`` rows holding a question ("prompt" or "problem") and an
"answer" (or "solution" with a \\boxed{} answer). Scored with :func:`pacs.tasks.rewards.math_reward`."""

from __future__ import annotations

import os
import random

from pacs.tasks.base import Problem, Task
from pacs.tasks.datasets import HF_PREFIX, load_hf
from pacs.tasks.rewards import extract_boxed, math_reward
from pacs.tasks.row_files import read_rows

QUESTION_KEYS = ("prompt", "problem", "question", "Problem")  # "Problem": AIME 2024's column
ANSWER_KEYS = ("answer", "final_answer", "Answer", "solution")


def _row_to_problem(row: dict, where: str) -> Problem:
    question = next((row[k] for k in QUESTION_KEYS if k in row and row[k] is not None), None)
    answer_key = next((k for k in ANSWER_KEYS if k in row and row[k] is not None), None)
    if question is None or answer_key is None:
        raise ValueError(
            f"{where}: each row needs a question ({'/'.join(QUESTION_KEYS)}) and an answer "
            f"({'/'.join(ANSWER_KEYS)}); got keys {sorted(row)}")
    answer = str(row[answer_key])
    if answer_key == "solution":
        answer = extract_boxed(answer) or answer
    if isinstance(question, list):  # chat-style [{"role": ..., "content": ...}]
        question = "\n".join(m.get("content", "") for m in question if isinstance(m, dict))
    if not str(question).strip():
        raise ValueError(f"{where}: the question is empty; each row needs a problem to solve")
    return Problem(prompt=str(question), answer=answer)


def drop_repeats(problems: list[Problem], where: str, rows: list[int] | None = None, seen: set[str] = frozenset(),
                 repeat: str = "an earlier row's") -> list[int]:
    """Which of ``rows`` (indices of ``problems``; default all) to keep: each question once (its first row), none
    of ``seen``; the rows dropped are said in one line (``where``: the file's setting and path)."""
    rows = list(range(len(problems))) if rows is None else rows
    kept, dropped, own = [], [], set()
    for i in rows:
        key = problems[i].prompt.strip()
        if key in seen or key in own:
            dropped.append(i)
        else:
            own.add(key)
            kept.append(i)
    if dropped and os.environ.get("RANK", "0") == "0":
        print(f"[data] {where}: {len(dropped)} of {len(rows)} rows repeat {repeat} question (rows "
              f"{', '.join(map(str, dropped[:5]))}{', ...' if len(dropped) > 5 else ''}): dropped, {len(kept)} "
              "problems left", flush=True)
    return kept


def load_problems(path: str) -> list[Problem]:
    """All rows of a ``.jsonl``/``.json`` or ``.parquet`` file as problems; ``hf:NAME`` loads a
    dataset of :data:`pacs.tasks.datasets.DATASETS` from the Hugging Face Hub (online only)."""
    if path.startswith(HF_PREFIX):
        return load_hf(path[len(HF_PREFIX):])
    rows = read_rows(path)
    problems = [_row_to_problem(row, f"{path} row {i}") for i, row in enumerate(rows)]
    if not problems:
        raise ValueError(f"task.data_path: {path!r} holds no rows")
    return problems


class MathTask(Task):
    """Problems from a file, reshuffled every epoch (deterministic in seed and epoch)."""

    name = "math"

    @classmethod
    def from_config(cls, cfg) -> MathTask:
        """The task of a run's config (a pacs.config.Config): ``task.name=math`` (pacs/registry.py)."""
        t = cfg.task
        return cls(t.data_path, eval_path=t.eval_path, eval_size=t.eval_size, seed=cfg.seed)

    def __init__(self, data_path: str, *, eval_path: str | None = None, eval_size: int = 200, seed: int = 0):
        # a question asked twice is one problem: repeated rows are dropped (and said), so that no held-out problem
        # is a training one too
        problems = load_problems(data_path)
        keep = drop_repeats(problems, f"task.data_path {data_path!r}")
        if eval_path:
            same = os.path.abspath(eval_path) == os.path.abspath(data_path)  # (pacs eval --data FILE)
            held_out = problems if same else load_problems(eval_path)
            held_keep = keep if same else drop_repeats(held_out, f"task.eval_path {eval_path!r}")
            self._eval = [held_out[i] for i in held_keep]
            if not same:
                seen = {p.prompt.strip() for p in self._eval}
                keep = drop_repeats(problems, f"task.data_path {data_path!r}", keep, seen=seen,
                                    repeat="a task.eval_path row's")
                if not keep:
                    raise ValueError(f"task.data_path {data_path!r}: every question is also in task.eval_path "
                                     f"{eval_path!r}; nothing is left to train on")
            self._train = [problems[i] for i in keep]
            self._labels = [f"task.data_path row {i}" for i in keep] + [f"task.eval_path row {i}" for i in held_keep]
        else:  # hold out the last eval_size problems (at most half of them)
            held = min(eval_size, len(keep) // 2)
            self._train = [problems[i] for i in keep[:len(keep) - held]]
            self._eval = [problems[i] for i in keep[len(keep) - held:]]
            self._labels = [f"task.data_path row {i}" for i in keep]
        self.seed = seed
        self.reward_fn = math_reward
        self._orders: dict[int, list[int]] = {}

    def train_problem(self, index: int) -> Problem:
        epoch, offset = divmod(index, len(self._train))
        if epoch not in self._orders:
            order = list(range(len(self._train)))
            random.Random(f"math-{self.seed}-{epoch}").shuffle(order)
            self._orders = {epoch: order}
        return self._train[self._orders[epoch][offset]]

    def labeled_problems(self, sample: int) -> list[tuple[str, Problem]]:
        """Every row of the training file (and of the held-out file), numbered from 0 in its file."""
        return list(zip(self._labels, self._train + self._eval))

    def eval_problems(self, limit: int | None = None) -> list[Problem]:
        return self._eval[:limit] if limit is not None else list(self._eval)
