"""``update_nonzero_frac``: the share of the weights an optimizer step actually changed.

Among every element of the trainable tensors with a nonzero gradient before the step: the share whose
value differs after it (counted, not sampled: a sample of 64 elements a tensor read 1e-4 where 0.5% of the
weights moved). A weight with a nonzero gradient that does not move is an update that rounded away
(pacs/model/mixed_precision.py): 16-bit weights stepped at a small learning rate read near 0, float32 master
weights near 1. The weights before the step are copied to the CPU (a GPU holds one tensor's copy at a time,
while it is compared); under FSDP2 each rank counts its own shards and the counts are summed over ranks.
``per_tensor=N`` counts a fixed random sample of N elements a tensor instead, each weighted by its tensor's
size (cheaper, but blind to a few weights moving).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class UpdateMonitor:
    """``before()`` just before ``optimizer.step()``, ``after()`` just after (the gradients still in place):
    the share of the elements with a nonzero gradient that the step changed (NaN when none had one)."""

    def __init__(self, parameters, *, per_tensor: int | None = None, seed: int = 0, distributed: bool = False):
        self.parameters = [p for p in parameters if p.requires_grad]
        self.per_tensor = per_tensor
        self.distributed = distributed
        self._generator = torch.Generator().manual_seed(seed)
        self._index: dict[int, torch.Tensor] = {}
        self._before: list[tuple[int, torch.Tensor | None, torch.Tensor, float]] = []

    def _sample(self, position: int, flat: torch.Tensor) -> torch.Tensor | None:
        """The elements counted: all (None), or ``per_tensor`` fixed random ones."""
        if self.per_tensor is None or self.per_tensor >= flat.numel():
            return None
        index = self._index.get(position)
        if index is None or index.device != flat.device:
            index = torch.randint(flat.numel(), (self.per_tensor,), generator=self._generator).to(flat.device)
            self._index[position] = index
        return index

    @torch.no_grad()
    def before(self) -> None:
        self._before = []
        for position, p in enumerate(self.parameters):
            if p.grad is None:
                continue
            flat = _local(p).reshape(-1)
            if flat.numel() == 0:
                continue
            index = self._sample(position, flat)
            old = flat if index is None else flat[index]
            weight = 1.0 if index is None else flat.numel() / index.numel()  # elements each counted one stands for
            self._before.append((position, index, old.to("cpu", copy=True), weight))

    @torch.no_grad()
    def after(self) -> float:
        changed = torch.zeros((), dtype=torch.float64)
        with_gradient = torch.zeros((), dtype=torch.float64)
        for position, index, old, weight in self._before:
            p = self.parameters[position]
            new, grad = _local(p).reshape(-1), _local(p.grad).reshape(-1)  # (the step leaves the gradient as it was)
            if index is not None:
                new, grad = new[index], grad[index]
            moved = grad != 0
            changed += ((new != old.to(new.device)) & moved).sum().cpu().double() * weight
            with_gradient += moved.sum().cpu().double() * weight
        self._before = []
        if self.distributed and dist.is_initialized():
            counts = torch.stack([changed, with_gradient])
            if dist.get_backend() == "nccl":
                counts = counts.cuda()
            dist.all_reduce(counts)
            changed, with_gradient = counts.cpu()
        return float(changed / with_gradient) if with_gradient > 0 else float("nan")
