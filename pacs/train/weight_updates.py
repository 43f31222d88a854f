"""``update_nonzero_frac``: the share of the weights an optimizer step actually changed.

Among a fixed sample of each trainable tensor's elements (drawn from a fixed seed), those with a
nonzero gradient before the step: the share whose value differs after it, each tensor's sample weighted by
the tensor's size (so the share is of elements, not of tensors). A weight with a nonzero gradient
that does not move is an update that rounded away (pacs/model/mixed_precision.py): 16-bit weights stepped at a
small learning rate read near 0, float32 master weights near 1. Sampled so that it costs two small gathers
per tensor and step; under FSDP2 each rank samples its own shards and the counts are summed over ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class UpdateMonitor:
    """``before()`` just before ``optimizer.step()``, ``after()`` just after: the share of the sampled
    elements with a nonzero gradient that the step changed (NaN when none had one)."""

    def __init__(self, parameters, *, per_tensor: int = 64, seed: int = 0, distributed: bool = False):
        self.parameters = [p for p in parameters if p.requires_grad]
        self.per_tensor = per_tensor
        self.distributed = distributed
        self._generator = torch.Generator().manual_seed(seed)
        self._index: dict[int, torch.Tensor] = {}
        self._before: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def _sample(self, position: int, flat: torch.Tensor) -> torch.Tensor:
        index = self._index.get(position)
        if index is None or index.device != flat.device:
            count = min(self.per_tensor, flat.numel())
            index = torch.randint(flat.numel(), (count,), generator=self._generator).to(flat.device)
            self._index[position] = index
        return index

    @torch.no_grad()
    def before(self) -> None:
        self._before = []
        for position, p in enumerate(self.parameters):
            if p.grad is None:
                continue
            flat, grad = _local(p).reshape(-1), _local(p.grad).reshape(-1)
            if flat.numel() == 0:
                continue
            index = self._sample(position, flat)
            weight = flat.numel() / index.numel()  # elements each sampled one stands for
            self._before.append((position, index, flat[index].clone(), (grad[index] != 0).double() * weight))

    @torch.no_grad()
    def after(self) -> float:
        changed = torch.zeros((), dtype=torch.float64)
        with_gradient = torch.zeros((), dtype=torch.float64)
        for position, index, old, with_gradient_weight in self._before:
            new = _local(self.parameters[position]).reshape(-1)[index]
            changed += ((new != old).double() * with_gradient_weight).sum().cpu()
            with_gradient += with_gradient_weight.sum().cpu()
        self._before = []
        if self.distributed and dist.is_initialized():
            counts = torch.stack([changed, with_gradient])
            if dist.get_backend() == "nccl":
                counts = counts.cuda()
            dist.all_reduce(counts)
            changed, with_gradient = counts.cpu()
        return float(changed / with_gradient) if with_gradient > 0 else float("nan")
