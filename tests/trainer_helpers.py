"""Shared settings for the trainer tests: a tiny, fast configuration of the built-in run."""

import os

from pacs.config import Config, load_config

TINY = [
    "task.digits=2", "task.warmup_steps=6", "task.warmup_batch_size=16",
    "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4",
    "optim.mini_batches_per_step=2", "optim.micro_batch_groups=1",
    "eval.num_problems=8", "eval.every=2", "checkpoint_every=2", "plot=false",
]


def tiny_config(output_dir, cache_dir, *extra: str) -> Config:
    cfg = load_config(None, TINY + [f"task.cache_dir={cache_dir}", *extra])
    cfg.output_dir = str(output_dir)
    return cfg


TIMING_KEYS = {"tokens_per_s", "rollout_time", "update_time", "sync_time", "step_time", "elapsed",
               "peak_memory_mib"}


def comparable(rows: list[dict]) -> list[dict]:
    """Metrics rows without the wall-clock fields."""
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in rows]


def repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
