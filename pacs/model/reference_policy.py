"""PACS's reference policy, reset every ``optim.ref_reset_every`` rollout steps.

PACS scores a response by ``r = beta * sum_t (logp - ref_logp)``. The public code takes the
reference to be the policy that generated the rollouts, so it is reset at every rollout step (the
paper's "periodic hard reset" of pi_ref, period 1: ``ref_reset_every = 1``, the default, which needs
nothing from this module). With a period ``k > 1`` the reference is the policy as it was at the
last reset: rollout steps 1, 1 + k, 1 + 2k, ... take a snapshot of the weights, and the steps in
between score their responses against it, so the log-ratio accumulates the policy's change over up
to k rollout steps.

The snapshot is a copy of each parameter's local data (this rank's shard under FSDP2) in host
memory. The reference log-probs are computed by copying the snapshot into the parameters for one
no-grad pass and copying the current weights back (:meth:`ReferenceSnapshot.weights_in`): the
policy's modules, hooks and FSDP collectives stay what they are, at the cost of two host copies of
the weights during that pass. Under FSDP2 the gathered parameters are freed before each copy, so that
the pass, and the training forward after it, gather the shards as they now are. A checkpoint keeps
the snapshot as full tensors (:meth:`ReferenceSnapshot.full_state` /
:meth:`ReferenceSnapshot.load_full_state`), so a resumed run scores against the same reference, with
any number of ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def _local(param: torch.Tensor) -> torch.Tensor:
    """The tensor that holds this rank's values of ``param`` (its shard under FSDP2)."""
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param


def _reshard(policy: torch.nn.Module) -> None:
    """Free FSDP2's gathered copies of the parameters, so that the next forward gathers the shards again.

    FSDP2 keeps the root unit's parameters gathered after a forward (they are usually needed again in
    the backward): a forward right after the shards changed would still run on the old gathered values.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in policy.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def is_reset_step(step: int, every: int) -> bool:
    """True at the rollout steps that reset the reference to the current policy: 1, 1 + k, 1 + 2k, ..."""
    return (step - 1) % every == 0


class ReferenceSnapshot:
    """The reference weights between resets (host copies of each parameter's local data)."""

    def __init__(self, policy: torch.nn.Module) -> None:
        self.policy = policy
        # the trainable ones: frozen parameters (a LoRA run's base) never differ from the reference's
        self.params = {name: p for name, p in policy.named_parameters() if p.requires_grad}
        self.weights: dict[str, torch.Tensor] | None = None
        self.step: int | None = None  # the rollout step whose weights these are

    @torch.no_grad()
    def take(self, step: int) -> None:
        """The current weights become the reference (at rollout step ``step``)."""
        self.weights = {name: _local(p).detach().to("cpu", copy=True) for name, p in self.params.items()}
        self.step = step

    @contextlib.contextmanager
    def weights_in(self) -> Iterator[None]:
        """Within the block the policy holds the reference weights; the current ones afterwards (also
        when the block raises)."""
        if self.weights is None:
            raise RuntimeError("no reference snapshot taken yet")
        with torch.no_grad():
            current = {name: _local(p).detach().to("cpu", copy=True) for name, p in self.params.items()}
        try:
            with torch.no_grad():
                _reshard(self.policy)  # (under FSDP2 a forward reads gathered copies, not the shards written here)
                for name, p in self.params.items():
                    _local(p).copy_(self.weights[name])
            yield
        finally:
            with torch.no_grad():
                _reshard(self.policy)  # or the next forward would run the root unit on the reference's values
                for name, p in self.params.items():
                    _local(p).copy_(current[name])

    @torch.no_grad()
    def full_state(self) -> dict:
        """{"step": ..., "weights": {name: full tensor on the CPU}} for a checkpoint, which rank 0 writes.
        Every rank must call this (a sharded parameter's snapshot is gathered, one tensor at a time); the
        other ranks get no weights back (a whole model per rank would be that many copies in host memory)."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        if self.weights is None:
            raise RuntimeError("no reference snapshot taken yet")
        keep = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        full = {}
        for name, p in self.params.items():
            local = self.weights[name]
            if isinstance(p, DTensor):
                local = DTensor.from_local(local.to(p.device), p.device_mesh, p.placements, shape=p.shape,
                                           stride=p.stride()).full_tensor()
            if keep:
                full[name] = local.cpu()
        return {"step": self.step, "weights": full}

    @torch.no_grad()
    def load_full_state(self, state: dict) -> None:
        """Restore a snapshot written by :meth:`full_state` (this rank keeps its shard of each tensor)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        weights = state["weights"]
        missing = sorted(set(self.params) - set(weights))
        if missing:
            raise ValueError(f"the checkpoint's reference weights lack {missing[:3]} (of {len(missing)}): "
                             "it was written for another model")
        restored = {}
        for name, p in self.params.items():
            full = weights[name]
            if tuple(full.shape) != tuple(p.shape):
                raise ValueError(f"the checkpoint's reference weight {name} has shape {tuple(full.shape)}, "
                                 f"the model's {tuple(p.shape)}: it was written for another model")
            if isinstance(p, DTensor):
                full = distribute_tensor(full.to(device=p.device, dtype=p.dtype), p.device_mesh,
                                         p.placements).to_local()
            restored[name] = full.to(device="cpu", dtype=p.dtype, copy=True)
        self.weights, self.step = restored, state["step"]
