"""The ``Objective`` protocol: what a group loss on per-token log-probs must look like.

An objective is only the group loss. It never sees hidden states or the LM head: it gets the
per-token log-probs of whole groups of responses (each group's ``group_size`` responses contiguous)
and returns a scalar loss and a small dict of plain-float statistics. Anything that satisfies this
protocol, a class or a plain function, runs on the fused paths of
:func:`pacs_kernels.objectives.fused_linear_objective_loss` unchanged (the loss engine, engine.py):
the single pass (chunks of whole groups, each chunk's logits built once, dloss/dlogp by autograd on
the chunk's log-probs) needs only that groups interact through constants (rewards, mask), never through
each other's log-probs, which the engine checks; two passes need nothing more.

Call::

    loss, stats = objective(logp, old_logp, rewards, mask, group_size=G, ref_logp=None, entropy=None)

    logp      (B, T) float, differentiable: the policy's log-prob of each sampled token (padded rows)
    old_logp  (B, T) float or None: the rollout policy's log-probs (a constant); None is on-policy
              (old_logp = logp.detach(), every ratio is 1)
    rewards   (B,) float rewards (the GRPO family takes any finite value; PACS 0/1 labels)
    mask      (B, T) bool, True on response tokens; nothing outside it may reach the loss
    group_size  G >= 2, dividing B
    ref_logp  (B, T) or None: a reference model's log-probs, for a k3 KL penalty
    entropy   (B, T) or None, differentiable: the policy's token entropy, for an entropy bonus

Optional attribute ``uses_entropy`` (bool, default False): when True the fused entry computes the
token entropy alongside the log-probs and passes it as ``entropy``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Objective(Protocol):
    """A group loss on per-token log-probs (see the module docstring for the exact contract)."""

    def __call__(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor | None,
        rewards: torch.Tensor,
        mask: torch.Tensor,
        *,
        group_size: int,
        ref_logp: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        ...
