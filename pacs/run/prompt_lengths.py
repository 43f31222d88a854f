"""Prompt length follows the data: checked with the run's tokenizer before the model loads.

``rollout.max_prompt_len`` unset (None, a real model's default) becomes the longest prompt the task holds,
tokenized as the run will tokenize it (template, chat template, the tokenizer's special tokens). A number set
there is a limit: a prompt longer than it is refused in one line naming the longest prompt (where it is,
its token count) and the limit, unless ``rollout.truncate_prompts`` asks for prompts to be cut to their last
``max_prompt_len`` tokens. A data file's every row is measured; a generated task (the built-in ones) its
held-out problems and its first :data:`GENERATED_SAMPLE` training problems, which share one format.
"""

from __future__ import annotations

from pacs.config import Config
from pacs.tasks import Problem, Task

GENERATED_SAMPLE = 1000
CHUNK = 1024  # prompts per tokenizer call


def prompt_lengths(cfg: Config, problems: list[Problem], tokenizer, chunk: int = CHUNK) -> list[int]:
    """Token counts of the problems' prompts, encoded as :func:`pacs.eval.evaluate.encode_prompt` encodes them (the
    same tokenizer calls, batched: about 0.5 ms per 300-token prompt on a CPU core, not 5)."""
    counts = []
    for start in range(0, len(problems), chunk):
        texts = [cfg.task.prompt_template.format(prompt=p.prompt) for p in problems[start:start + chunk]]
        if cfg.task.use_chat_template:
            ids = tokenizer.apply_chat_template([[{"role": "user", "content": text}] for text in texts],
                                                add_generation_prompt=True, tokenize=True, return_dict=True)
        else:
            ids = tokenizer(texts)
        counts += [len(row) for row in ids["input_ids"]]
    return counts


def longest_prompt(cfg: Config, task: Task, tokenizer) -> tuple[str, int]:
    """(where, token count) of the longest prompt of ``task``'s problems, encoded as the run encodes them."""
    labeled = task.labeled_problems(GENERATED_SAMPLE)
    counts = prompt_lengths(cfg, [problem for _, problem in labeled], tokenizer)
    if not counts:
        return "no prompt", 0
    i = max(range(len(counts)), key=counts.__getitem__)  # the first of the longest
    return labeled[i][0], counts[i]


def fit_prompt_length(cfg: Config, task: Task, tokenizer, log=print) -> None:
    """Set an unset ``cfg.rollout.max_prompt_len`` to the longest prompt; refuse (ValueError) a set one that a
    prompt exceeds, unless ``cfg.rollout.truncate_prompts``."""
    r = cfg.rollout
    where, longest = longest_prompt(cfg, task, tokenizer)
    if r.max_prompt_len is None:
        r.max_prompt_len = max(longest, 1)
        log(f"[data] rollout.max_prompt_len: {r.max_prompt_len} tokens, the longest prompt ({where})")
    elif longest > r.max_prompt_len:
        if not r.truncate_prompts:
            raise ValueError(
                f"rollout.max_prompt_len={r.max_prompt_len} is shorter than the longest prompt ({where}: {longest} "
                f"tokens); raise it to at least {longest}, leave it unset to follow the data, or set "
                "rollout.truncate_prompts=true to cut prompts to their last max_prompt_len tokens")
        log(f"[warning] rollout.truncate_prompts: prompts longer than rollout.max_prompt_len={r.max_prompt_len} "
            f"tokens are cut to their last max_prompt_len tokens (the longest: {where}, {longest} tokens)")
