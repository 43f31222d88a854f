"""Math datasets: ``.jsonl`` or ``.parquet`` rows holding a question ("prompt" or "problem") and an
"answer" (or "solution" with a \\boxed{} answer). Scored with :func:`pacs.tasks.rewards.math_reward`."""

from __future__ import annotations

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
    return Problem(prompt=str(question), answer=answer)


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

    def __init__(self, data_path: str, *, eval_path: str | None = None, eval_size: int = 200, seed: int = 0):
        problems = load_problems(data_path)
        labels = [f"task.data_path row {i}" for i in range(len(problems))]
        if eval_path:
            self._eval = load_problems(eval_path)
            self._train = problems
            self._labels = labels + [f"task.eval_path row {i}" for i in range(len(self._eval))]
        else:  # hold out the last eval_size rows (at most half of the file)
            held = min(eval_size, len(problems) // 2)
            self._train, self._eval = problems[:len(problems) - held], problems[len(problems) - held:]
            self._labels = labels
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
