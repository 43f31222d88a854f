"""Held-out evaluation: accuracy, mean@n, response length and pass@k with the unbiased estimator of
Chen et al. (2021), per problem and overall."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pacs.tasks.base import Problem, Task


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct: 1 - C(n-c, k) / C(n, k).

    Computed as a running product (no huge binomials): 1 - prod_{i=n-c+1}^{n} (1 - k / i).
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if n < 1 or not 0 <= c <= n:
        raise ValueError(f"need n >= 1 and 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}], got {k}")
    if n - c < k:
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def mean_pass_at_k(correct_counts: Sequence[int], n: int, k: int) -> float:
    """pass@k averaged over problems, each with ``n`` samples and ``correct_counts[i]`` correct."""
    if not correct_counts:
        raise ValueError("correct_counts is empty")
    return sum(pass_at_k(n, c, k) for c in correct_counts) / len(correct_counts)


def encode_prompt(tokenizer, problem: Problem, *, template: str = "{prompt}",
                  use_chat_template: bool = False) -> list[int]:
    """Token ids of a problem's prompt (the tokenizer's special tokens or chat template included)."""
    text = template.format(prompt=problem.prompt)
    if use_chat_template:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return list(tokenizer(text)["input_ids"])


def encode_prompts(tokenizer, problems: Sequence[Problem], *, template: str = "{prompt}",
                   use_chat_template: bool = False, max_prompt_len: int | None = None) -> tuple[list[list[int]], int]:
    """Token ids of each prompt cut to its last ``max_prompt_len`` tokens (None: uncut), and how many
    were cut. Training rollouts, the trainer's evaluation and ``pacs eval`` all use this one rule."""
    encoded = [encode_prompt(tokenizer, p, template=template, use_chat_template=use_chat_template)
               for p in problems]
    if max_prompt_len is None:
        return encoded, 0
    return [ids[-max_prompt_len:] for ids in encoded], sum(len(ids) > max_prompt_len for ids in encoded)


def decode_response(tokenizer, tokens: Sequence[int]) -> str:
    return tokenizer.decode(list(tokens), skip_special_tokens=True)


@dataclass
class EvalReport:
    """What :func:`run_eval` measured.

    metrics: ``accuracy`` and ``mean@n`` (the mean reward over all samples: greedy accuracy at
    temperature 0, else mean pass@1), ``pass@k`` for each requested k, ``response_length`` (mean
    generated tokens per sample, EOS included), ``num_problems``, ``n_samples``.
    records: one dict per problem: ``index``, ``prompt``, ``answer``, ``n``, ``correct`` (count),
    ``pass@k`` per k, ``rewards`` and ``lengths`` (per sample) and ``responses`` (decoded texts).
    """

    metrics: dict[str, float]
    records: list[dict]


def run_eval(engine, task: Task, tokenizer, problems: list[Problem], *, n_samples: int = 1,
             temperature: float = 0.0, top_p: float = 1.0, ks: Sequence[int] = (1,),
             max_new_tokens: int, stop_token_ids: list[int], seed: int = 0,
             template: str = "{prompt}", use_chat_template: bool = False,
             max_prompt_len: int | None = None, chunk_problems: int | None = None,
             journal=None, progress: bool = False) -> EvalReport:
    """Generate ``n_samples`` answers per problem with ``engine`` and score them with the task's
    reward (prompts longer than ``max_prompt_len`` tokens keep their last ``max_prompt_len``).

    ``chunk_problems``: generate that many problems at a time (default: all in one call); chunk c
    starts at problem i and samples with seed ``seed + i * n_samples``, which is what the one call
    gives each row with the HF engine (row j: seed + j) and a reproducible choice with vLLM's.
    ``journal`` (:class:`pacs.eval.journal.EvalJournal`): problems it holds are not generated again,
    and each finished chunk is appended to it. ``progress``: a progress bar over the problems.
    """
    if n_samples > 1 and temperature == 0:
        raise ValueError("n_samples > 1 needs temperature > 0 (greedy samples are identical)")
    for k in ks:
        if not 1 <= k <= n_samples:
            raise ValueError(f"ks entries must be in [1, n_samples={n_samples}], got {k}")
    if not problems:
        raise ValueError("problems is empty")
    if chunk_problems is not None and (isinstance(chunk_problems, bool) or not isinstance(chunk_problems, int)
                                       or chunk_problems < 1):
        raise ValueError(f"chunk_problems must be an int >= 1 or None, got {chunk_problems!r}")
    prompts, _ = encode_prompts(tokenizer, problems, template=template, use_chat_template=use_chat_template,
                                max_prompt_len=max_prompt_len)
    chunk = chunk_problems or len(problems)
    done = dict(journal.done) if journal is not None else {}
    from tqdm import tqdm

    bar = tqdm(total=len(problems), initial=len(done), desc="eval problems", unit="problem", disable=not progress,
               dynamic_ncols=True)
    try:
        for first in range(0, len(problems), chunk):
            last = min(first + chunk, len(problems))
            if all(i in done for i in range(first, last)):
                continue
            # the whole chunk again, with its own seed, even if a torn journal kept part of it: the same samples
            outputs = engine.generate(prompts[first:last], n_samples, temperature=temperature, top_p=top_p,
                                      max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids,
                                      seed=seed + first * n_samples)  # one chunk: seed itself
            finished = [_score(task, tokenizer, index, problems[index], responses, n_samples, ks)
                        for index, responses in zip(range(first, last), outputs) if index not in done]
            if journal is not None:
                journal.append(finished)
            done.update((r["index"], r) for r in finished)
            bar.update(len(finished))
    finally:
        bar.close()
    records = [done[i] for i in range(len(problems))]
    counts = [r["correct"] for r in records]
    mean = sum(counts) / (len(counts) * n_samples)
    metrics = {"accuracy": mean, f"mean@{n_samples}": mean, "num_problems": float(len(problems)),
               "n_samples": float(n_samples),
               "response_length": sum(sum(r["lengths"]) for r in records) / (len(records) * n_samples)}
    for k in ks:
        metrics[f"pass@{k}"] = mean_pass_at_k(counts, n_samples, k)
    for key in ("reward_timeouts", "reward_errors"):  # scored 0 without a verdict (math-verify rewards)
        if any(key in r for r in records):
            metrics[key] = float(sum(r.get(key, 0) for r in records))
    return EvalReport(metrics=metrics, records=records)


def _score(task: Task, tokenizer, index: int, problem: Problem, responses, n_samples: int, ks) -> dict:
    """The record of one problem: its responses decoded, each rewarded, pass@k."""
    texts = [decode_response(tokenizer, r) for r in responses]
    counts = getattr(task, "reward_metrics", dict)  # a task without them (not a pacs.tasks.Task): none
    counts()  # the reward's timeout and error counts start from here: these samples' own
    rewards = [float(task.reward(t, problem)) for t in texts]
    failed = {key: int(value) for key, value in counts().items()}
    correct = int(sum(rewards))
    return {"index": index, "prompt": problem.prompt, "answer": problem.answer, "n": n_samples, "correct": correct,
            **{f"pass@{k}": pass_at_k(n_samples, correct, k) for k in ks}, "rewards": rewards, **failed,
            "lengths": [len(r) for r in responses], "responses": texts}


def evaluate(engine, task: Task, tokenizer, problems: list[Problem], **kwargs) -> dict[str, float]:
    """The metrics of :func:`run_eval` (same arguments)."""
    return run_eval(engine, task, tokenizer, problems, **kwargs).metrics
