"""A full disk ends a run in one line, never half a checkpoint: free space checked before training, and a
write that fails with ENOSPC (or a quota's EDQUOT) named with the bytes it needed and the bytes free.

:func:`check_checkpoint_space` runs before the first rollout: the checkpoints a run keeps (their number,
plus the one being written before rotation deletes the oldest) and the final model must fit; it says how
much that is and refuses (ValueError, exit 2) when they do not. :class:`NoSpaceLeft` is what a checkpoint
or metrics write raises when the disk fills anyway (another process wrote there): the unfinished
``step_X.tmp`` is removed first, and the run resumes from its last good checkpoint once space is freed.
"""

from __future__ import annotations

import errno
import os
import shutil

import torch

from pacs.model.lora import is_adapter_weight

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class NoSpaceLeft(RuntimeError):
    """A write ran out of disk space; the message names the path, the bytes needed and the bytes free."""


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or the error it wraps: torch.save reports ENOSPC as a RuntimeError from its C++
    writer) is a full disk or an exceeded quota."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in DISK_FULL:
            return True
        if isinstance(exc, RuntimeError) and "unexpected pos" in str(exc):  # torch's zip writer on ENOSPC
            return True
        if "No space left on device" in str(exc) or "Disk quota exceeded" in str(exc):  # safetensors' (Rust) error
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def free_bytes(path: str) -> int:
    """Bytes free for this user on the file system of ``path`` (its nearest existing parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def tensor_bytes(obj) -> int:
    """Bytes of every tensor in a nested dict / list of tensors (a state dict, an optimizer's)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def no_space_message(what: str, path: str, needed: int | None) -> str:
    need = f"it needs about {human(needed)}, " if needed else ""
    return f"no space left on the device writing {what} {path}: {need}{human(free_bytes(path))} free there"


def checkpoint_bytes(policy: torch.nn.Module, reference_kept: bool) -> int:
    """About what one checkpoint of ``policy`` takes: the trainable weights (a LoRA run's adapters alone: the
    frozen base stays the model directory's), AdamW's two moments of them (their dtype), and the reference's
    copy of them when the run keeps one (a few KiB of RNG and scheduler state aside)."""
    weights = sum(p.numel() * p.element_size() for p in policy.parameters() if p.requires_grad)
    return weights * (4 if reference_kept else 3)


def final_model_bytes(policy: torch.nn.Module) -> int:
    """About what the exported model takes: every weight but LoRA's adapters (merged into the weights they
    adapt), floating-point ones in the compute dtype (``policy.precision.compute``, where the policy has one)."""
    precision = getattr(policy, "precision", None)
    total = 0
    for name, p in policy.named_parameters():
        if is_adapter_weight(name):
            continue
        size = precision.compute.itemsize if precision is not None and p.is_floating_point() else p.element_size()
        total += p.numel() * size
    return total


def check_checkpoint_space(output_dir: str, policy: torch.nn.Module, *, keep: int, existing: int,
                           reference_kept: bool, say=print) -> None:
    """Say how much disk the run's checkpoints (``keep`` of them, one more while the next is written;
    ``existing`` already there) and its final model take, and refuse (ValueError) when that is more than
    is free under ``output_dir``."""
    each = checkpoint_bytes(policy, reference_kept)
    model = final_model_bytes(policy)
    count = keep + 1
    needed = max(0, count - existing) * each + model
    free = free_bytes(output_dir)
    say(f"[train] disk: {count} checkpoints of about {human(each)} ({keep} kept, one more while the next is "
        f"written) and the final model need about {human(needed)} more; {human(free)} free in {output_dir}")
    if needed > free:
        raise ValueError(f"--output-dir {output_dir!r} has {human(free)} free, but the checkpoints this run keeps "
                         f"and its final model need about {human(needed)} ({count} checkpoints of {human(each)}); "
                         "free space there or choose another --output-dir")
