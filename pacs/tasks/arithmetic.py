"""Multi-digit addition with an exact-match 0/1 reward: the built-in task's problems."""

from __future__ import annotations

import random

from pacs.tasks.base import Problem, Task
from pacs.tasks.rewards import exact_match


def _digits(value: int, width: int, little_endian: bool) -> str:
    text = f"{value:0{width}d}"
    return text[::-1] if little_endian else text


def addition_problem(rng: random.Random, digits: int, reverse: bool = True) -> Problem:
    """``a+b=`` with a, b drawn uniformly from [0, 10**digits): operands zero-padded to ``digits``
    digits, the answer to ``digits + 1``.

    With ``reverse`` (the default) every number is written least-significant digit first, so the
    i-th answer digit sits at a fixed distance from the i-th digits of both operands and a
    left-to-right decoder meets the carries in the order it needs them (Lee et al. 2023, "Teaching
    arithmetic to small transformers"). Example, 3 digits: 7 + 95 = 102 reads ``700+590=`` ->
    ``2010``.
    """
    a, b = rng.randrange(10 ** digits), rng.randrange(10 ** digits)
    return Problem(prompt=f"{_digits(a, digits, reverse)}+{_digits(b, digits, reverse)}=",
                   answer=_digits(a + b, digits + 1, reverse))


class AdditionTask(Task):
    """Training stream and a disjoint held-out set of additions of up to ``digits`` digits."""

    name = "embedded"

    @classmethod
    def from_config(cls, cfg) -> AdditionTask:
        """The task of a run's config (a pacs.config.Config): ``task.name=embedded`` (pacs/registry.py)."""
        return cls(cfg.task.digits, seed=cfg.seed, eval_size=cfg.task.eval_size, reverse=cfg.task.reverse)

    def __init__(self, digits: int = 3, seed: int = 0, eval_size: int = 200, reverse: bool = True):
        if digits < 1:
            raise ValueError(f"digits must be >= 1, got {digits}")
        self.digits, self.seed, self.reverse = digits, seed, reverse
        self.reward_fn = exact_match
        rng = random.Random(f"addition-eval-{digits}-{seed}")
        held_out: dict[str, Problem] = {}
        # the held-out set is fixed by (digits, seed); never more than a quarter of all problems
        size = min(eval_size, (10 ** digits) ** 2 // 4)
        while len(held_out) < size:
            p = addition_problem(rng, digits, reverse)
            held_out.setdefault(p.prompt, p)
        self._eval = list(held_out.values())
        self._eval_prompts = set(held_out)

    def train_problem(self, index: int) -> Problem:
        rng = random.Random(f"addition-train-{self.digits}-{self.seed}-{index}")
        while True:  # training never shows a held-out problem
            p = addition_problem(rng, self.digits, self.reverse)
            if p.prompt not in self._eval_prompts:
                return p

    def eval_problems(self, limit: int | None = None) -> list[Problem]:
        return self._eval[:limit] if limit is not None else list(self._eval)
