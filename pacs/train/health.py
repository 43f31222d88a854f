"""Is the run healthy? What to watch while it trains, and a verdict at its end.

The PACS loss cannot say it: on-policy, the first mini-batch of every step scores psi = 0 for every response, so
its loss is ln 2 = 0.693 whatever the policy has learned (docs/pacs-algorithm.md), and the GRPO family's
on-policy loss is 0 in expectation. What moves in a run that learns:

- ``reward_mean``: the share of sampled responses scored right; it rises.
- ``eval_accuracy``: held-out accuracy (greedy), every ``eval.every`` steps; it rises.
- ``mixed_reward_group_frac``: the share of groups whose responses did not all get the same reward. Those carry
  the learning signal: a group all right or all wrong has GRPO advantage 0 for every response, and its PACS
  gradient is exactly 0 while psi = 0 (docs/trainer.md) and small after; near 0 the task is too hard or too easy
  for the model and little trains.
- ``update_nonzero_frac``: the share of the weights with a gradient that the optimizer step changed; near 0 the
  updates round away (16-bit weights at a small learning rate: docs/mixed-precision.md).
"""

from __future__ import annotations

import math

import torch

# below these the end-of-run verdict names the problem
LOW_MIXED_GROUPS = 0.1
LOW_UPDATE_FRACTION = 0.01


def mixed_reward_group_frac(rewards: torch.Tensor, group_size: int) -> float:
    """The share of groups (``group_size`` consecutive rewards) whose rewards are not all equal."""
    groups = rewards.reshape(-1, group_size)
    return float((groups != groups[:, :1]).any(dim=1).double().mean())


def progress_fields(row: dict) -> dict[str, str]:
    """What the progress bar shows of a step's metrics row: the numbers that move when the run learns."""
    fields = {"reward": f"{row['reward_mean']:.2f}"}
    if row.get("eval_accuracy") is not None:
        fields["acc"] = f"{row['eval_accuracy']:.2f}"
    fields["mixed"] = f"{row['mixed_reward_group_frac']:.2f}"
    if _finite(row.get("update_nonzero_frac")):
        fields["moved"] = f"{row['update_nonzero_frac']:.2f}"
    return fields


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _mean(values: list[float]) -> float:
    values = [v for v in values if _finite(v)]
    return sum(values) / len(values) if values else float("nan")


def _ends(rows: list[dict], key: str) -> tuple[float, float]:
    """The mean of ``key`` over the first and over the last tenth of the rows (at least one row each)."""
    values = [row[key] for row in rows if _finite(row.get(key))]
    if not values:
        return float("nan"), float("nan")
    span = max(1, len(values) // 10)
    return _mean(values[:span]), _mean(values[-span:])


def health_lines(rows: list[dict]) -> list[str]:
    """The end-of-run verdict from the metrics rows of ``metrics.jsonl``: reward and held-out accuracy first ->
    last, the share of groups that carried a gradient, the share of the weights that moved, then what looks
    wrong (nothing when the run looks healthy)."""
    steps = [row for row in rows if "reward_mean" in row]
    if not steps:
        return []
    first_reward, last_reward = _ends(steps, "reward_mean")
    evals = [row["eval_accuracy"] for row in rows if _finite(row.get("eval_accuracy"))]  # step 0's row: no rollout
    mixed = _mean([row.get("mixed_reward_group_frac") for row in steps])
    moved = _mean([row.get("update_nonzero_frac") for row in steps])
    parts = [f"reward {first_reward:.3f} -> {last_reward:.3f}"]
    if evals:
        parts.append(f"held-out accuracy {evals[0]:.3f} -> {evals[-1]:.3f}")
    if _finite(mixed):
        parts.append(f"groups with mixed rewards {mixed:.0%}")
    if _finite(moved):
        parts.append(f"weights moved by each step {moved:.0%}")
    lines = ["[health] " + ", ".join(parts)]
    problems = []
    if _finite(mixed) and mixed < LOW_MIXED_GROUPS:
        problems.append(f"only {mixed:.0%} of the groups had mixed rewards, which carry the learning signal: the "
                        "task is too hard or too easy for this model (more responses per prompt, other problems)")
    if _finite(moved) and moved < LOW_UPDATE_FRACTION:
        problems.append(f"the optimizer steps changed {moved:.1%} of the weights that had a gradient: the updates "
                        "round away (float32 master weights, optim.master_dtype, or a larger learning rate)")
    if len(steps) >= 20 and last_reward <= first_reward and (len(evals) < 2 or evals[-1] <= evals[0]):
        problems.append("neither the reward nor the held-out accuracy rose")
    lines += [f"[health] warning: {problem}" for problem in problems]
    return lines
