"""The ``Objective`` protocol: what a group loss on per-token log-probs must look like.

An objective is only the group loss. It never sees hidden states or the LM head: it gets the
per-token log-probs of whole groups of responses (each group's ``group_size`` responses contiguous)
and returns a scalar loss and a small dict of plain-float statistics. Anything that satisfies this
protocol, a class or a plain function, runs on the fused paths of
:func:`pacs_kernels.fused_linear_objective_loss` unchanged (the loss engine, pacs_kernels/engine/):
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

and, only where the caller gives per-token weights (``token_weights=`` of the fused entries; rollout
correction's truncated importance weights), ``token_weights=`` (B, T) >= 0, constant: each token's policy term
multiplied by its weight (the regularizers' terms are not). An objective that takes them declares
``Capabilities(token_weights=True)``; the engine refuses weights for one that does not.

Optional attribute ``uses_entropy`` (bool, default False): when True the fused entry computes the
token entropy alongside the log-probs and passes it as ``entropy``.

Optional, for objectives that know more about themselves (the built-in ones):

* ``capabilities``: a :class:`Capabilities` (token-separable terms, group coupling, the one sweep), which the
  engine's planner reads (pacs_kernels/engine/plan.py);
* ``engine_loss(batch, options, *, with_entropy=False)``: the loss on the engine's selected tokens (a
  ``LossBatch``: whole responses back to back, in order) as an object with ``capabilities``, ``with_entropy``,
  ``chunk_loss(logp, chunk) -> (share, extra)``, ``single_pass_result(loss, extras, logp, entropy)``,
  ``two_pass_result(logp, entropy)``, ``first_step(at_old) -> (loss, stats_of(total))`` and
  ``as_objective_stats(loss, stats)``; or None. Without one the engine runs ``__call__`` on padded rows
  (objectives/rows.py), which any objective satisfying the protocol gets.
"""

from __future__ import annotations

from dataclasses import dataclass
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


CHUNKINGS = ("tokens", "groups", "batch")


@dataclass(frozen=True)
class Capabilities:
    """What an objective lets the engine do; the planner reads it (pacs_kernels/engine/plan.py).

    chunking: "tokens" (token-separable once per-response constants are known: any run of tokens is a chunk,
    responses may be cut; the GRPO family's clipped surrogate), "groups" (groups couple their responses through
    the log-probs: chunks of whole groups; PACS's scores) or "batch" (nothing declared: chunks of whole groups,
    the engine checking that the chunks' shares add up to the loss on the whole batch).
    uses_entropy: a term in the policy's entropy (the single pass's entropy carries no gradient: two passes).
    one_sweep: the loss is a function of the log-probs alone, so on the first step after a rollout
    (logp == old_logp) its gradient is known before any logits are built, and one vocabulary sweep from the
    rollout's log-sum-exp (``old_lse``) gives the loss and its gradients.
    token_weights: the objective takes ``token_weights=`` (a constant weight on each token's policy term); every
    path honours them (they are an input of the engine loss, whichever path runs it).
    response_validity: the objective takes ``valid=`` (a per-response mask of the responses that count; PACS's,
    which leaves a response out of its group's class counts but keeps it as the others' baseline).
    """

    chunking: str = "batch"
    uses_entropy: bool = False
    one_sweep: bool = True
    token_weights: bool = False
    response_validity: bool = False

    def __post_init__(self) -> None:
        if self.chunking not in CHUNKINGS:
            raise ValueError(f"chunking must be one of {CHUNKINGS}, got {self.chunking!r}")
