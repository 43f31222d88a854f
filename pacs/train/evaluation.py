"""The held-out evaluation during training, and the sampling seeds of rollouts and evaluations."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from pacs.config import Config
from pacs.eval.evaluate import evaluate
from pacs.model.policy import DistInfo
from pacs.run import Run


def step_seed(seed: int, step: int, first_row: int = 0) -> int:
    """Sampling seed of rollout ``step`` for a call whose first response is global row ``first_row``.

    A function of (seed, step, row) only: a resumed run samples exactly what the uninterrupted run
    did, and engines that seed row j with ``seed + j`` sample the same rows on any number of ranks.
    """
    return (seed * 1_000_003 + step * 7_919_993) % (2**31 - 1) + first_row


def evaluate_policy(cfg: Config, engine, run: Run, dist_info: DistInfo, step: int) -> dict:
    """Held-out accuracy (and pass@k) with the rollout engine; each rank scores its share with
    :func:`pacs.eval.evaluate.evaluate` (the evaluator of ``pacs eval``) and the shares are averaged."""
    e = cfg.eval
    every = run.task.eval_problems(e.num_problems)
    share = math.ceil(len(every) / dist_info.world_size)
    first = dist_info.rank * share
    problems = every[first:first + share]
    sums = [0.0] * (2 + len(e.ks))
    if problems:
        result = evaluate(engine, run.task, run.tokenizer, problems, n_samples=e.n_samples, temperature=e.temperature,
                          top_p=e.top_p, ks=e.ks, max_new_tokens=cfg.rollout.max_new_tokens,
                          stop_token_ids=run.stop_ids,
                          seed=step_seed(cfg.seed + 1, step, first * e.n_samples),
                          template=cfg.task.prompt_template, use_chat_template=cfg.task.use_chat_template,
                          max_prompt_len=cfg.rollout.max_prompt_len)
        n = len(problems)
        sums = [result["accuracy"] * n * e.n_samples, float(n)] + [result[f"pass@{k}"] * n for k in e.ks]
    if dist_info.world_size > 1:
        t = torch.tensor(sums, dtype=torch.float64, device=dist_info.device)
        dist.all_reduce(t)
        sums = t.tolist()
    out = {"eval_accuracy": sums[0] / (sums[1] * e.n_samples)}
    for k, total in zip(e.ks, sums[2:]):
        out[f"eval_pass@{k}"] = total / sums[1]
    return out
