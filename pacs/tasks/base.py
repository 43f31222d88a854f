"""What the trainer needs from a task: a prompt stream, a held-out set and a verifiable reward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Problem:
    prompt: str   # text given to the model (before the tokenizer's BOS / chat template)
    answer: str   # reference answer the reward checks against


class Task:
    """A deterministic, indexable prompt stream plus a reward.

    ``train_problem(i)`` is a pure function of the task's seed and ``i``: the trainer's data
    position is just the next index, so a resumed run sees exactly the prompts it would have seen.
    """

    name: str = "task"
    reward_fn: Callable[[str, str], float]

    def train_problem(self, index: int) -> Problem:
        raise NotImplementedError

    def eval_problems(self, limit: int | None = None) -> list[Problem]:
        raise NotImplementedError

    def labeled_problems(self, sample: int) -> list[tuple[str, Problem]]:
        """The problems a run may see, each with where it is, for the prompt-length check
        (pacs/run/prompt_lengths.py). A generated stream: its held-out problems and its first ``sample``
        training problems (one format)."""
        held = [(f"held-out problem {i}", p) for i, p in enumerate(self.eval_problems())]
        return held + [(f"training problem {i}", self.train_problem(i)) for i in range(sample)]

    def target_text(self, problem: Problem) -> str:
        """The reply a supervised warm-up teaches for ``problem`` (the bare answer by default)."""
        return problem.answer

    def reward(self, response_text: str, problem: Problem) -> float:
        return float(self.reward_fn(response_text, problem.answer))

    def reward_metrics(self) -> dict[str, float]:
        """Counts of rewards that timed out or failed since the last call (math-verify rewards),
        e.g. ``{"reward_timeouts": 0.0, "reward_errors": 1.0}``; empty for rewards without them."""
        pop = getattr(getattr(self, "reward_fn", None), "pop_counts", None)
        if pop is None:
            return {}
        counts = pop()
        return {"reward_timeouts": float(counts["timeouts"]), "reward_errors": float(counts["errors"])}

    def train_batch(self, start: int, count: int) -> list[Problem]:
        return [self.train_problem(start + i) for i in range(count)]
