"""Groups whose responses all got one reward: where their gradient is exactly 0 (not run:
``train.skip_zero_gradient_groups``), and PACS's loss without them (``optim.drop_single_label_groups``).

A group whose valid responses carry one label y and one class weight w has, per response, the BCE slope
g_i = w (sigmoid(psi_i) - y) / B, and the gradient with respect to the scores r is J^T g, J the Jacobian of the
group advantage psi(r). Under "rloo" and "grpo" the rows of J sum to 0 over the group, so while every psi_i is
the same (psi = 0: the reference is the current policy, as on the first mini-batch after a reset) g is
constant over the group and J^T g = 0: the group adds nothing. Once the policy has moved from the reference
(later mini-batches; every step between resets with ``optim.ref_reset_every`` > 1) the psi_i differ and the
group pulls each response's log-ratio toward the group's: toward the reference (under "grpo" only weakly:
its standardisation projects out the part of g linear in psi, leaving sigmoid's curvature). Dropping these groups
removes that pull (and only it: the divisor B still counts them, so the other groups' terms are unchanged).
The loss statistic ``single_label_grad_share`` measures the part removed. With skipping on (the default)
dropped groups are not run at all; with it off they run with loss terms that weigh 0.

Exactly 0 needs psi = 0 exactly, which the one-sweep first step guarantees (its loss is taken at
logp = old_logp); a recomputed first mini-batch has psi of rounding size, negligible under "rloo" but
standardised to order 1 by "grpo", so skipping also needs ``optim.one_sweep_first_step``.
TRL's ``PACSTrainer`` skips them on its on-policy steps (``groups_that_must_run``, ``group_losses_at_zero``).
"""

from __future__ import annotations

import math

import torch

from pacs_kernels.objectives.pacs_math import class_weights


def single_label(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(n_groups,) bool: the groups whose rewards are all equal (``rewards`` (B,), groups contiguous)."""
    grouped = rewards.reshape(-1, group_size)
    return (grouped == grouped[:, :1]).all(1)


def loss_valid(rewards: torch.Tensor, group_size: int, drop_single_label_groups: bool) -> torch.Tensor | None:
    """(B,) bool: False for every response of a group whose rewards are all equal; None when not dropping.

    ``rewards`` (B,) holds whole groups of ``group_size`` contiguous responses."""
    if not drop_single_label_groups:
        return None
    if rewards.numel() % group_size:
        raise ValueError(f"optim.drop_single_label_groups needs whole groups of {group_size} responses, "
                         f"got {rewards.numel()} rewards")
    return (~single_label(rewards, group_size)).repeat_interleave(group_size)


# ----------------------------------------------------------------------------- skipping their compute


def zero_gradient_at_psi_zero(score: str, advantage: str, score_function_term: bool) -> bool:
    """Does a single-label group have a gradient of exactly 0 where every psi is 0, under these loss options?
    The log-ratio score (mean_logp's psi is not 0 there), an "rloo"/"grpo" baseline (which cancels the group's
    one slope), no score-function term (it adds w l / B per response, not cancelled)."""
    return score == "log_ratio" and advantage in ("rloo", "grpo") and not score_function_term


def skip_rules(cfg, *, reference_is_current: bool) -> tuple[bool, bool]:
    """(skip on the first mini-batch, skip on every mini-batch): where a single-label group's gradient is
    exactly 0, so ``train.skip_zero_gradient_groups`` may leave out its forward and backward.

    First mini-batch: PACS with the log-ratio score against the policy that sampled (``reference_is_current``:
    the reference reset this step) on the one-sweep first step, where every psi is exactly 0, and under
    "rloo"/"grpo" the group's slope cancels (the module docstring; the score-function term adds w l / B per
    response, not cancelled: not then). mean_logp's psi is not 0 there. Every mini-batch:
    ``optim.drop_single_label_groups`` (weight 0)."""
    o = cfg.optim
    if not cfg.train.skip_zero_gradient_groups or o.algo != "pacs":
        return False, False
    every = o.drop_single_label_groups
    first = every or (reference_is_current and o.one_sweep_first_step
                      and zero_gradient_at_psi_zero(o.score, o.advantage, o.score_function_term))
    return first, every


def plan_group_skips(rewards: torch.Tensor, group_size: int, mini_batches: int, *, skip_first: bool,
                     skip_every: bool) -> tuple[torch.Tensor | None, list[int]]:
    """Which groups each mini-batch runs, the skippable ones moved behind the others.

    ``rewards`` (B,): this rank's rows, groups contiguous, mini-batch m holding groups [m n, (m + 1) n).
    Returns (the row order that puts, within each mini-batch, the groups that must run first, keeping
    their order, and the skippable ones after them; None when nothing moves) and the number of groups
    each mini-batch runs: those that must, and at least one, so that every parameter the loss reaches
    gets its (zero) gradient as when every group runs, and the optimizer steps alike (AdamW counts the
    step; a parameter left without a gradient would not be stepped). Under FSDP the caller takes every
    rank's largest count, so a rank may run some skippable groups too (their gradient is 0: exact)."""
    single = single_label(rewards, group_size).tolist()
    per_mini = len(single) // mini_batches
    order, run = [], []
    for mini in range(mini_batches):
        ids = range(mini * per_mini, (mini + 1) * per_mini)
        skippable = skip_every or (skip_first and mini == 0)
        must = [g for g in ids if not (skippable and single[g])]
        order += must + [g for g in ids if skippable and single[g]]
        run.append(max(len(must), 1))
    if order == list(range(len(single))):
        return None, run
    rows = torch.tensor(order, dtype=torch.long).repeat_interleave(group_size) * group_size
    rows += torch.arange(group_size).repeat(len(order))
    return rows.to(rewards.device), run


def group_losses_at_zero(rewards: torch.Tensor, valid: torch.Tensor | None, group_size: int,
                         weighting: str) -> torch.Tensor:
    """(n_groups,) float64: each group's loss value (the mean of its responses' terms) at psi = 0, the
    value a group skipped for a zero gradient would have had: each term is w ln 2 (softplus(0) - y * 0),
    0 for an invalid or dropped response (weight 0)."""
    weights = class_weights(rewards.double(), group_size, weighting, valid)
    return weights.reshape(-1, group_size).mean(1) * math.log(2.0)


def groups_that_must_run(rewards: torch.Tensor, valid: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """(n_groups,) bool: False for a group whose gradient is exactly 0 at psi = 0: every response valid and
    one reward (the slopes are equal and the baseline cancels them), or no valid response (no term)."""
    single = single_label(rewards, group_size)
    if valid is None:
        return ~single
    ok = valid.reshape(-1, group_size)
    return ~((ok.all(1) & single) | ~ok.any(1))
