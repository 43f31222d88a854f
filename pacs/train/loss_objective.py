"""The configured loss as an objective: ``optim.algo`` and its settings -> ``PACS(...)`` or ``GRPO(...)``.

Built in one place for every route a micro-batch's loss takes (pacs/train/trainer.py's ``micro_batch_loss``):
the fused loss straight from hidden states, and the group loss on log-probs known or gathered first (groups
run in parts, pacs/train/split_groups.py; sequence parallelism)."""

from __future__ import annotations

from pacs.config import Config
from pacs_kernels import GRPO, PACS


def loss_objective(cfg: Config) -> PACS | GRPO:
    """``PACS`` (optim.beta, score, advantage, weighting, score_function_term) for ``optim.algo=pacs``, else
    ``GRPO`` (optim.clip_eps, aggregation)."""
    o = cfg.optim
    if o.algo == "pacs":
        return PACS(beta=o.beta, score=o.score, advantage=o.advantage, weighting=o.weighting,
                    score_function_term=o.score_function_term)
    return GRPO(clip_eps=o.clip_eps, aggregation=o.aggregation)
