"""What tells a healthy run from a broken one (pacs/train/health.py): the progress bar's numbers, the
end-of-run verdict, and the metrics row's share of groups with mixed rewards."""

from __future__ import annotations

import math

import torch

from pacs.train.health import health_lines, mixed_reward_group_frac, progress_fields


def test_mixed_reward_groups_are_counted_per_group():
    rewards = torch.tensor([1., 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0.5, 0.5, 0.5, 0.2])
    assert mixed_reward_group_frac(rewards, 4) == 0.5
    assert mixed_reward_group_frac(torch.zeros(8), 2) == 0.0


def test_the_progress_bar_shows_what_moves_not_the_loss():
    row = {"reward_mean": 0.4, "loss": math.log(2), "mixed_reward_group_frac": 0.625, "update_nonzero_frac": 0.97,
           "eval_accuracy": 0.31}
    assert progress_fields(row) == {"reward": "0.40", "acc": "0.31", "mixed": "0.62", "moved": "0.97"}
    row.pop("eval_accuracy")
    row["update_nonzero_frac"] = float("nan")  # a step whose updates had no gradient: left out, never "nan"
    assert progress_fields(row) == {"reward": "0.40", "mixed": "0.62"}


def _rows(rewards, mixed, moved, evals=None):
    rows = [{"step": i, "reward_mean": r, "mixed_reward_group_frac": mixed, "update_nonzero_frac": moved}
            for i, r in enumerate(rewards)]
    for step, accuracy in (evals or {}).items():
        rows[step]["eval_accuracy"] = accuracy
    return rows


def test_a_healthy_run_gets_one_line_and_no_warning():
    rows = _rows([0.1 + 0.01 * i for i in range(40)], 0.6, 0.98, {0: 0.2, 39: 0.6})
    lines = health_lines(rows)
    assert lines == ["[health] reward 0.115 -> 0.475, held-out accuracy 0.200 -> 0.600, groups with mixed rewards "
                     "60%, weights moved by each step 98%"]
    # the evaluation before the first step has a row of its own, without a rollout: it is where accuracy starts
    assert health_lines([{"step": 0, "eval_accuracy": 0.125}] + rows)[0].startswith(
        "[health] reward 0.115 -> 0.475, held-out accuracy 0.125 -> 0.600")


def test_a_broken_run_is_named():
    lines = health_lines(_rows([0.0] * 40, 0.02, 0.001, {0: 0.1, 39: 0.1}))
    assert len(lines) == 4
    assert "only 2% of the groups had mixed rewards" in lines[1]
    assert "changed 0.1% of the weights" in lines[2] and "round away" in lines[2]
    assert lines[3] == "[health] warning: neither the reward nor the held-out accuracy rose"
    assert health_lines([]) == []
