"""A generated math word-problem task: multi-step arithmetic told in words, answered in
``\\boxed{}`` and checked by math-verify.

Example (3 steps)::

    prompt: "ann has 7 apples . ann buys 5 more . ann gives away 3 . then ann finds 9 more .
             how many apples now ?"
    answer: "18"             (the model is taught to reply "\\boxed{18}")

Every problem starts with a count in [2, 20] and applies ``steps`` changes of 1..9 (more, or
fewer while the count stays >= 0), so answers are integers in [0, 20 + 9 * steps]. The problems
are built from a small word vocabulary, so the built-in tiny model can read them with a
word-level tokenizer (:func:`build_word_tokenizer`). :func:`write_jsonl` writes a file in the
``{"problem", "answer"}`` schema that ``task.name=math`` reads (``tests/data/wordmath_eval.jsonl`` is
``write_jsonl(path, 50)``: held-out problems of seed 0).
"""

from __future__ import annotations

import json
import random

from pacs.tasks.base import Problem, Task
from pacs.tasks.rewards import math_reward

NAMES = ("ann", "bob", "cal", "dee", "eve", "fay", "gus", "hal")
ITEMS = ("apples", "pens", "cards", "coins", "books", "shells")
MORE = ("buys {n} more", "finds {n} more", "gets {n} more")
FEWER = ("gives away {n}", "loses {n}", "sells {n}")
# every token a prompt or a boxed answer can hold, besides the digits
WORDS = sorted({*NAMES, *ITEMS, "has", "then", "how", "many", "now", "more", "away", "boxed",
                *(w for phrase in MORE + FEWER for w in phrase.split() if w != "{n}")})
PUNCTUATION = [".", "?", "\\", "{", "}"]


def boxed(answer: str) -> str:
    """The response format the model is taught: ``\\boxed{answer}``."""
    return "\\boxed{" + answer + "}"


def word_problem(rng: random.Random, steps: int) -> Problem:
    """One problem with ``steps`` changes after the starting count (see the module docstring)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    count = rng.randint(2, 20)
    sentences = [f"{name} has {count} {item} ."]
    for i in range(steps):
        n = rng.randint(1, 9)
        if n <= count and rng.random() < 0.5:
            phrase, count = rng.choice(FEWER), count - n
        else:
            phrase, count = rng.choice(MORE), count + n
        sentences.append(("then " if i == steps - 1 and steps > 1 else "") + f"{name} {phrase.format(n=n)} .")
    sentences.append(f"how many {item} now ?")
    return Problem(prompt=" ".join(sentences), answer=str(count))


class WordProblemTask(Task):
    """Training stream and a disjoint held-out set of ``steps``-step word problems, rewarded by
    :func:`pacs.tasks.rewards.math_reward` (math-verify) on the response's ``\\boxed{}`` answer."""

    name = "wordmath"

    @classmethod
    def from_config(cls, cfg) -> WordProblemTask:
        """The task of a run's config (a pacs.config.Config): ``task.name=wordmath`` (pacs/registry.py)."""
        return cls(cfg.task.word_steps, seed=cfg.seed, eval_size=cfg.task.eval_size)

    def __init__(self, steps: int = 2, seed: int = 0, eval_size: int = 200):
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self.steps, self.seed = steps, seed
        self.reward_fn = math_reward
        rng = random.Random(f"wordmath-eval-{steps}-{seed}")
        held_out: dict[str, Problem] = {}
        while len(held_out) < eval_size:
            p = word_problem(rng, steps)
            held_out.setdefault(p.prompt, p)
        self._eval = list(held_out.values())
        self._eval_prompts = set(held_out)

    def target_text(self, problem: Problem) -> str:
        return boxed(problem.answer)

    def train_problem(self, index: int) -> Problem:
        rng = random.Random(f"wordmath-train-{self.steps}-{self.seed}-{index}")
        while True:  # training never shows a held-out problem
            p = word_problem(rng, self.steps)
            if p.prompt not in self._eval_prompts:
                return p

    def eval_problems(self, limit: int | None = None) -> list[Problem]:
        return self._eval[:limit] if limit is not None else list(self._eval)


def build_word_tokenizer():
    """Word-level PreTrainedTokenizerFast for the word problems (pad 0, bos 1, eos 2, unk 3):
    lower-cased, split on whitespace, each punctuation mark and each digit its own token; decoding
    joins tokens without spaces, so a reply decodes to e.g. ``\\boxed{18}``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab_list = ["<pad>", "<bos>", "<eos>", "<unk>", *"0123456789", *PUNCTUATION, *WORDS]
    vocab = {token: i for i, token in enumerate(vocab_list)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(behavior="isolated"),
        pre_tokenizers.Digits(individual_digits=True)])
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        padding_side="left")


def write_jsonl(path: str, count: int, *, steps: int = 2, seed: int = 0) -> None:
    """Write the first ``count`` held-out problems of ``WordProblemTask(steps, seed)`` as
    ``{"problem": ..., "answer": ...}`` lines: problems the training stream of that seed never shows."""
    task = WordProblemTask(steps, seed=seed, eval_size=count)
    with open(path, "w") as fh:
        for p in task.eval_problems():
            fh.write(json.dumps({"problem": p.prompt, "answer": p.answer}) + "\n")
