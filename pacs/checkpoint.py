"""Training checkpoints: model, optimizer, scheduler, RNG states, data position and step.

Layout: ``OUTPUT_DIR/checkpoints/step_000010/{model.pt, optimizer.pt, scheduler.pt, state.json,
rng_rank0.pt, ...}`` plus ``OUTPUT_DIR/checkpoints/latest`` naming the newest complete one. A
checkpoint is written into ``step_X.tmp`` and renamed when complete, and ``latest`` is replaced
atomically, so a run killed at any moment leaves the previous checkpoint usable.

Model and optimizer states are saved "full" (unsharded) by rank 0, so a run may resume with a
different number of processes.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from .policy import DistInfo


def _barrier(dist_info: DistInfo) -> None:
    if dist_info.world_size > 1:
        dist.barrier()


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def latest_checkpoint(output_dir: str) -> str | None:
    """Path of the newest complete checkpoint, or None."""
    pointer = os.path.join(output_dir, "checkpoints", "latest")
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as fh:
        name = fh.read().strip()
    path = os.path.join(output_dir, "checkpoints", name)
    return path if os.path.isfile(os.path.join(path, "state.json")) else None


def save_checkpoint(output_dir: str, step: int, policy, optimizer, scheduler, state: dict,
                    dist_info: DistInfo, keep: int = 2) -> str:
    """Write checkpoint ``step`` (every rank must call this; rank 0 writes the shared files)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(policy, optimizer, options=options)
    root = os.path.join(output_dir, "checkpoints")
    name = f"step_{step:06d}"
    final, tmp = os.path.join(root, name), os.path.join(root, name + ".tmp")
    if dist_info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier(dist_info)
    torch.save(rng_state(), os.path.join(tmp, f"rng_rank{dist_info.rank}.pt"))
    if dist_info.is_main:
        torch.save(model_state, os.path.join(tmp, "model.pt"))
        torch.save(optim_state, os.path.join(tmp, "optimizer.pt"))
        torch.save(scheduler.state_dict(), os.path.join(tmp, "scheduler.pt"))
        with open(os.path.join(tmp, "state.json"), "w") as fh:
            json.dump({**state, "step": step, "world_size": dist_info.world_size}, fh)
    _barrier(dist_info)
    if dist_info.is_main:
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        pointer = os.path.join(root, "latest")
        with open(pointer + ".tmp", "w") as fh:
            fh.write(name)
        os.replace(pointer + ".tmp", pointer)
        old = sorted(d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".tmp"))
        for stale in old[:-keep] if keep > 0 else []:
            shutil.rmtree(os.path.join(root, stale), ignore_errors=True)
    _barrier(dist_info)
    return final


def load_checkpoint(path: str, policy, optimizer, scheduler, dist_info: DistInfo) -> dict:
    """Restore everything saved by :func:`save_checkpoint`; returns the trainer state dict."""
    model_state = torch.load(os.path.join(path, "model.pt"), map_location="cpu", weights_only=False)
    optim_state = torch.load(os.path.join(path, "optimizer.pt"), map_location="cpu", weights_only=False)
    set_state_dict(policy, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                   options=StateDictOptions(full_state_dict=True))
    scheduler.load_state_dict(torch.load(os.path.join(path, "scheduler.pt"), weights_only=False))
    with open(os.path.join(path, "state.json")) as fh:
        state = json.load(fh)
    rng_file = os.path.join(path, f"rng_rank{dist_info.rank}.pt")
    if os.path.isfile(rng_file):  # absent when resuming with more processes than were saved
        set_rng_state(torch.load(rng_file, weights_only=False))
    return state
