"""``optim.drop_single_label_groups``: PACS's loss without the groups whose responses all got one reward.

A group whose valid responses carry one label y and one class weight w has, per response, the BCE slope
g_i = w (sigmoid(psi_i) - y) / B, and the gradient with respect to the scores r is J^T g, J the Jacobian of the
group advantage psi(r). Under "rloo" and "grpo" the rows of J sum to 0 over the group, so while every psi_i is
the same (psi = 0: the reference is the current policy, as on the first mini-batch after a reset) g is
constant over the group and J^T g = 0: the group adds nothing. Once the policy has moved from the reference
(later mini-batches; every step between resets with ``optim.ref_reset_every`` > 1) the psi_i differ and the
group pulls each response's log-ratio toward the group's: toward the reference (under "grpo" only weakly:
its standardisation projects out the part of g linear in psi, leaving sigmoid's curvature). Dropping these groups
removes that pull (and only it: the divisor B still counts them, so the other groups' terms are unchanged).
The rows still run forward and backward (their loss terms weigh 0), so nothing is saved in compute.
The loss statistic ``single_label_grad_share`` measures the part removed.
"""

from __future__ import annotations

import torch


def loss_valid(rewards: torch.Tensor, group_size: int, drop_single_label_groups: bool) -> torch.Tensor | None:
    """(B,) bool: False for every response of a group whose rewards are all equal; None when not dropping.

    ``rewards`` (B,) holds whole groups of ``group_size`` contiguous responses."""
    if not drop_single_label_groups:
        return None
    if rewards.numel() % group_size:
        raise ValueError(f"optim.drop_single_label_groups needs whole groups of {group_size} responses, "
                         f"got {rewards.numel()} rewards")
    grouped = rewards.reshape(-1, group_size)
    mixed = (grouped != grouped[:, :1]).any(1)
    return mixed.repeat_interleave(group_size)
