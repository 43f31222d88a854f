"""Mixed precision: what the optimizer steps (the master weights) and what the model computes in.

``model.dtype`` is the compute dtype (bfloat16 on a GPU by default); ``optim.master_dtype`` (float32 by
default) is the dtype of the parameters AdamW steps. Why it matters: AdamW's update of an element is about
``lr`` in size (``m / sqrt(v)`` is about 1), and an update smaller than half the spacing between
neighbouring numbers (half an ulp) of the weight rounds away. In bfloat16 (8 significant bits) half an ulp
of a weight of 0.02 is 6e-5, so at lr 1e-6, the PACS paper's rate for 7B models, almost no weight of a
bfloat16 model moves: measured on a 1024 x 1024 ``nn.Linear``, 10 AdamW steps at lr 1e-6 changed 1.5% of
the bfloat16 weights and 99.99% of the float32 ones.

So the policy keeps float32 parameters and computes in 16 bits:

- one process: the backbone runs under ``torch.autocast(compute dtype)`` and the LM head's weight and the
  final hidden states are cast to the compute dtype, so the fused loss runs its 16-bit path; gradients
  reach the float32 parameters in float32 (``Policy.forward``);
- FSDP2: ``MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=float32)`` over float32 shards (FSDP
  all-gathers the 16-bit copies, reduce-scatters float32 gradients).

Stepping 16-bit weights directly (``optim.master_dtype`` equal to a 16-bit ``model.dtype``) stays
possible when asked for by name, and warns with the share of weights that would not move
(:func:`share_frozen_by_rounding`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch

DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Precision:
    """``compute``: the dtype the forward and backward run in; ``master``: the dtype of the parameters the
    optimizer steps."""

    compute: torch.dtype
    master: torch.dtype

    @property
    def mixed(self) -> bool:
        """Float32 master weights under a 16-bit compute dtype."""
        return self.master != self.compute

    @property
    def steps_16_bit_weights(self) -> bool:
        """The optimizer steps 16-bit weights directly (asked for by name)."""
        return self.master.itemsize < 4


def resolve_precision(compute: torch.dtype, master_dtype: str) -> Precision:
    """The run's precision from the resolved compute dtype and ``optim.master_dtype``'s name.

    The master weights are float32, or the compute dtype itself (16-bit stepping); anything else (16-bit
    master weights under float32 compute) is refused, and so is float16 compute (no loss scaling here)."""
    if master_dtype not in DTYPE_NAMES:
        raise ValueError(f"optim.master_dtype must be one of {', '.join(map(repr, DTYPE_NAMES))}; "
                         f"got {master_dtype!r}")
    if compute == torch.float16:  # its 5 exponent bits: small gradients flush to 0 without a loss scale
        raise ValueError("model.dtype='float16': training in float16 needs loss scaling, which pacs train does "
                         "not do (gradients below float16's range would become 0, silently); use bfloat16 (GPUs "
                         "from Ampere on) or float32. pacs eval runs a float16 model as it is")
    master = DTYPE_NAMES[master_dtype]
    if master != torch.float32 and master != compute:
        raise ValueError(f"optim.master_dtype={master_dtype!r} needs model.dtype={master_dtype!r} (16-bit weights "
                         f"stepped directly); model.dtype resolves to {str(compute).removeprefix('torch.')} here. "
                         "Use optim.master_dtype=float32 (float32 master weights, the default)")
    return Precision(compute=compute, master=master)


def half_ulp(weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half the spacing of ``dtype``'s numbers at each weight's magnitude (float32): an update below it
    rounds away when the weight is stored in ``dtype``. 0 for a weight of 0 (it always moves)."""
    info = torch.finfo(dtype)
    digits = 1 - math.log2(info.eps)  # significant bits: 8 in bfloat16, 11 in float16, 24 in float32
    _, exponent = torch.frexp(weights.detach().float())  # |w| = m * 2**exponent, m in [0.5, 1)
    half = torch.ldexp(torch.ones_like(weights, dtype=torch.float32), exponent - int(digits) - 1)
    half = half.clamp(min=info.tiny * info.eps / 2)  # subnormals: the spacing stops shrinking
    return torch.where(weights == 0, torch.zeros_like(half), half)


def share_frozen_by_rounding(parameters: Iterable[torch.Tensor], lr: float, *, sample: int = 4096,
                             seed: int = 0) -> float:
    """The share of the trainable weights that an AdamW step of size ``lr`` cannot move, in their own
    dtype: those whose half ulp exceeds ``lr`` (AdamW's step of an element is about ``lr``; a sample of up
    to ``sample`` elements per tensor, from a fixed seed). 0.0 for float32 weights at any usual rate."""
    generator = torch.Generator().manual_seed(seed)
    frozen = total = 0
    for p in parameters:
        if not p.requires_grad or not p.is_floating_point() or p.numel() == 0:
            continue
        local = p.to_local() if hasattr(p, "to_local") else p
        flat = local.detach().reshape(-1)
        if flat.numel() == 0:
            continue
        if flat.numel() > sample:
            flat = flat[torch.randint(flat.numel(), (sample,), generator=generator).to(flat.device)]
        frozen += int((half_ulp(flat, p.dtype) > lr).sum())
        total += flat.numel()
    return frozen / total if total else 0.0


def rounding_warning(share_frozen: float, lr: float, dtype: torch.dtype, what: str) -> str:
    """One line saying how much of a 16-bit model an AdamW step at ``lr`` leaves where it is."""
    name = str(dtype).removeprefix("torch.")
    return (f"[warning] {what}: AdamW steps {name} weights directly; at lr {lr:g}, {100 * share_frozen:.1f}% of them "
            f"have a half ulp larger than the update, which rounds away (they do not train). Float32 master "
            f"weights avoid this (measured on a 1024 x 1024 layer, 10 steps at lr 1e-6: 1.5% of bfloat16 weights "
            f"changed, 99.99% of float32 ones)")
