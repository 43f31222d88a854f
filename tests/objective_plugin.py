"""A user's objective, outside pacs_kernels, for the tests that train it by ``optim.algo=objective_plugin:...``
(tests/test_every_objective.py): REINFORCE with a leave-one-out baseline and the clipped ratio of PPO, one token
mean over the batch (declared: ``aggregation = "token_mean"``), written only against the ``Objective`` protocol."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LeaveOneOutPG:
    """A[i] = R[i] - mean_{j in group, j != i} R[j];  loss = token mean of max(-A rho, -A clip(rho, 1 - eps, 1 + eps))."""

    eps: float = 0.2
    aggregation: str = "token_mean"  # what the trainer reads: one token mean over the mini-batch

    def __call__(self, logp, old_logp, rewards, mask, *, group_size, ref_logp=None, entropy=None):
        mask = mask.bool()
        old = logp.detach() if old_logp is None else old_logp
        r = rewards.to(logp.dtype).reshape(-1, group_size)
        advantage = (r - (r.sum(1, keepdim=True) - r) / (group_size - 1)).reshape(-1, 1)
        # the log-ratio zeroed outside the mask before exp: nothing there reaches the loss
        ratio = torch.exp(torch.where(mask, logp - old, torch.zeros_like(logp)))
        terms = torch.maximum(-advantage * ratio, -advantage * ratio.clamp(1 - self.eps, 1 + self.eps))
        loss = torch.where(mask, terms, torch.zeros_like(terms)).sum() / mask.sum().clamp_min(1)
        return loss, {"advantage_abs_mean": float(advantage.abs().mean())}
