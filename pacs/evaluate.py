"""Held-out evaluation: accuracy and pass@k with the unbiased estimator of Chen et al. (2021)."""

from __future__ import annotations

from typing import Sequence

from .tasks.base import Problem, Task


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


def evaluate(engine, task: Task, tokenizer, problems: list[Problem], *, n_samples: int = 1,
             temperature: float = 0.0, top_p: float = 1.0, ks: Sequence[int] = (1,),
             max_new_tokens: int, stop_token_ids: list[int], seed: int = 0,
             template: str = "{prompt}", use_chat_template: bool = False,
             max_prompt_len: int | None = None) -> dict[str, float]:
    """Generate ``n_samples`` answers per problem and score them.

    Prompts longer than ``max_prompt_len`` tokens keep their last ``max_prompt_len`` tokens.
    Returns ``accuracy`` (the mean reward over all samples: greedy accuracy when temperature is 0,
    else mean pass@1) and ``pass@k`` for each k in ``ks``.
    """
    if n_samples > 1 and temperature == 0:
        raise ValueError("n_samples > 1 needs temperature > 0 (greedy samples are identical)")
    prompts, _ = encode_prompts(tokenizer, problems, template=template, use_chat_template=use_chat_template,
                                max_prompt_len=max_prompt_len)
    outputs = engine.generate(prompts, n_samples, temperature=temperature, top_p=top_p,
                              max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, seed=seed)
    counts = []
    for problem, responses in zip(problems, outputs):
        counts.append(int(sum(task.reward(decode_response(tokenizer, r), problem) for r in responses)))
    result = {"accuracy": sum(counts) / (len(counts) * n_samples), "num_problems": float(len(problems))}
    for k in ks:
        result[f"pass@{k}"] = mean_pass_at_k(counts, n_samples, k)
    return result
