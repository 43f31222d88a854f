"""Training checkpoints that are complete or absent: model, optimizer, scheduler, RNG states, step.

Layout::

    OUTPUT_DIR/checkpoints/step_000010/{model.pt, optimizer.pt, scheduler.pt, state.json,
                                        rng_rank0.pt, ..., manifest.json}
    OUTPUT_DIR/checkpoints/latest        the newest checkpoint's name (for people; resume scans)

How a checkpoint is written (:func:`save_checkpoint`): every file goes into ``step_X.tmp`` and is
fsynced; then ``manifest.json`` (each file's size and SHA-256, and the step) is written and
fsynced last; then the directory is renamed to ``step_X`` and its parent fsynced. A process killed
at any moment therefore leaves either no ``step_X`` or one whose manifest verifies. A ``step_X`` that
exists already (a resumed run writing the same step again) is first renamed to ``step_X.replaced.tmp``
and deleted once the new one is in place (pacs/run/durable.py ``replace_dir``); a process killed
between those two renames leaves no ``step_X``, and every scan (:func:`checkpoint_steps`) and the next
write first put one back (:func:`recover_checkpoints`): the new ``step_X.tmp`` when its manifest
verifies, else the old one. Only then are other ``*.tmp`` directories (unfinished writes) deleted.

How one is chosen (:func:`find_checkpoint`): the ``step_*`` directories are ordered by step number
(never by name) and the newest one whose manifest verifies wins; each newer one that failed is
reported with the reason. Rotation deletes only checkpoints older than the one just written and
verified, keeping the newest ``keep``; a newer checkpoint (which could only be one a resume
skipped as unverified) is left alone until a verified checkpoint of the same step replaces it.

Model and optimizer states are saved "full" (unsharded) by rank 0, so a run may resume with a
different number of processes.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import shutil
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from pacs.model.policy import DistInfo
from pacs.run.disk_space import NoSpaceLeft, is_disk_full, no_space_message, tensor_bytes
from pacs.run.durable import REPLACED_SUFFIX, fsync_dir, recover_replaced, replace_dir
from pacs.run.resume_check import check_model_matches, resume_command
from pacs.run.run_dir import CHECKPOINT_DIR, RunDir, checkpoint_name

MANIFEST = "manifest.json"
_CHUNK = 1 << 22


def _barrier(dist_info: DistInfo) -> None:
    if dist_info.world_size > 1:
        dist.barrier()


def rng_state() -> dict:
    """Every generator's state as plain data (ints, tuples, tensors): what ``torch.load(weights_only=True)`` reads
    back. numpy's state is a tuple holding an ndarray, so its key array travels as a tensor."""
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {"python": random.getstate(),
             "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached_gaussian)),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    if isinstance(keys, torch.Tensor):
        keys = keys.numpy()
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ---------------------------------------------------------------------------------------------
# durable writes


def _write_durably(path: str, write) -> None:
    """``write(fh)`` into a new binary file at ``path``, flushed and fsynced before returning."""
    with open(path, "wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())


def save_torch(obj, path: str) -> None:
    """``torch.save`` that returns only once the bytes are on disk."""
    _write_durably(path, lambda fh: torch.save(obj, fh))


def save_json(obj, path: str) -> None:
    _write_durably(path, lambda fh: fh.write(json.dumps(obj, indent=1).encode()))


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(directory: str, step: int) -> dict:
    """Describe every file of ``directory`` (size, SHA-256) and the step in ``manifest.json``, last."""
    files = {}
    for name in sorted(os.listdir(directory)):
        if name == MANIFEST:
            continue
        path = os.path.join(directory, name)
        files[name] = {"size": os.path.getsize(path), "sha256": file_sha256(path)}
    manifest = {"format": 1, "step": step, "files": files}
    save_json(manifest, os.path.join(directory, MANIFEST))
    fsync_dir(directory)
    return manifest


def verify_checkpoint(path: str, checksums: bool = True) -> str | None:
    """None when the checkpoint at ``path`` is complete; else why not (one short phrase).

    Complete: ``manifest.json`` parses, names the step of the directory, and every file it lists
    exists with the listed size and SHA-256 (``state.json`` and ``model.pt`` must be among them).
    ``checksums=False`` skips the SHA-256 (reading every byte: a minute for a 7B model's optimizer
    state): for messages that only name the checkpoint, never for the one a resume loads.
    """
    match = CHECKPOINT_DIR.fullmatch(os.path.basename(os.path.normpath(path)))
    return _verify(path, None if match is None else int(match.group(1)), checksums)


def _verify(path: str, dir_step: int | None, checksums: bool) -> str | None:
    """:func:`verify_checkpoint` of a directory that holds step ``dir_step`` (None: not a checkpoint's name)."""
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        return "no manifest.json (an unfinished or pre-manifest checkpoint)"
    try:
        with open(manifest_path) as fh:
            manifest = json.load(fh)
        files, step = manifest["files"], int(manifest["step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"manifest.json is unreadable ({type(exc).__name__}: {exc})"
    if dir_step != step:
        return f"manifest.json names step {step}, not this directory's"
    for required in ("state.json", "model.pt"):
        if required not in files:
            return f"manifest.json does not list {required}"
    for name, entry in files.items():
        file_path = os.path.join(path, name)
        if not os.path.isfile(file_path):
            return f"{name} is missing"
        size = os.path.getsize(file_path)
        if size != entry.get("size"):
            return f"{name} has {size} bytes, the manifest says {entry.get('size')}"
        if checksums and file_sha256(file_path) != entry.get("sha256"):
            return f"{name} does not match its checksum"
    return None


# ---------------------------------------------------------------------------------------------
# finding checkpoints


def recover_checkpoints(root: str) -> list[str]:
    """Put back each ``step_X`` under ``root`` (a checkpoints directory) that a write killed between its two
    renames left missing (module docstring): ``step_X.tmp`` when its manifest verifies (checksums too), else the
    old ``step_X.replaced.tmp``. Returns the checkpoints put back. Any process may call it, several at once
    (pacs/run/durable.py ``recover_replaced``: the first rename stands)."""
    if not os.path.isdir(root):
        return []
    recovered = []
    for name in sorted(os.listdir(root)):
        base = name.removesuffix(REPLACED_SUFFIX)
        match = CHECKPOINT_DIR.fullmatch(base) if base != name else None
        if match is None:
            continue
        step, final = int(match.group(1)), os.path.join(root, base)
        if recover_replaced(final, lambda tmp, step=step: _verify(tmp, step, checksums=True) is None):
            recovered.append(final)
    return recovered


def checkpoint_steps(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every ``step_N`` directory under ``OUTPUT_DIR/checkpoints``, by step number (after
    :func:`recover_checkpoints`: a step whose replacement was killed between its renames is there)."""
    root = RunDir(output_dir).checkpoints
    if not os.path.isdir(root):
        return []
    recover_checkpoints(root)
    found = []
    for name in os.listdir(root):
        match = CHECKPOINT_DIR.fullmatch(name)
        if match and os.path.isdir(os.path.join(root, name)):
            found.append((int(match.group(1)), os.path.join(root, name)))
    return sorted(found)


@dataclass
class CheckpointChoice:
    """What :func:`find_checkpoint` found: the checkpoint to resume from (None: none verifies) and
    each newer checkpoint that was skipped, with the reason."""

    path: str | None
    step: int
    skipped: list[tuple[str, str]]

    def describe(self) -> list[str]:
        """Lines for the console: which checkpoint, and why each newer one was skipped."""
        lines = [f"[resume] skipping {path}: {reason}" for path, reason in self.skipped]
        if self.path is not None:
            lines.append(f"[resume] continuing from {self.path} (step {self.step})")
        return lines


def find_checkpoint(output_dir: str, checksums: bool = True) -> CheckpointChoice:
    """The newest checkpoint under ``output_dir`` whose manifest verifies (see module docstring;
    ``checksums``: :func:`verify_checkpoint`'s)."""
    skipped = []
    for step, path in reversed(checkpoint_steps(output_dir)):
        reason = verify_checkpoint(path, checksums)
        if reason is None:
            return CheckpointChoice(path, step, skipped)
        skipped.append((path, reason))
    return CheckpointChoice(None, 0, skipped)


def latest_checkpoint(output_dir: str) -> str | None:
    """Path of the newest verified checkpoint, or None."""
    return find_checkpoint(output_dir).path


def resume_hint(output_dir: str) -> str:
    """Where the run's last checkpoint is and the command that continues the run. (Manifests and sizes checked,
    not checksums: said within a scheduler's grace period or as a crashed run ends; --resume verifies all.)"""
    last = find_checkpoint(output_dir, checksums=False)
    command = resume_command(output_dir)
    if last.path is None:
        return f"no checkpoint was written yet; start again with {command.replace('--resume', '--overwrite')}"
    return f"the last checkpoint is {last.path} (step {last.step}); resume with: {command}"


# ---------------------------------------------------------------------------------------------
# writing, rotating, loading


KEEP = 2  # checkpoints a training run keeps (rotation deletes older ones)


def write_checkpoint_files(root: str, step: int, write_files, dist_info: DistInfo | None = None,
                           keep: int = KEEP, expected_bytes: int | None = None) -> str:
    """Write checkpoint ``step`` under ``root`` so that it is complete or absent; returns its path.

    ``write_files(tmp_dir)`` writes this rank's files (with :func:`save_torch` / :func:`save_json`).
    Every rank calls this; rank 0 creates the temporary directory, writes the manifest, renames,
    points ``latest`` at the new checkpoint and rotates old ones. A full disk (ENOSPC, EDQUOT) on this
    rank removes the unfinished ``step_X.tmp`` and raises :class:`~pacs.run.disk_space.NoSpaceLeft` naming
    the checkpoint, ``expected_bytes`` (what it needs) and the bytes free; older checkpoints are kept.
    """
    try:
        return _write_checkpoint_files(root, step, write_files, dist_info or DistInfo(), keep)
    except Exception as exc:
        if not is_disk_full(exc):
            raise
        final = os.path.join(root, checkpoint_name(step))
        shutil.rmtree(final + ".tmp", ignore_errors=True)
        if os.path.exists(os.path.join(root, "latest.tmp")):
            os.remove(os.path.join(root, "latest.tmp"))
        raise NoSpaceLeft(no_space_message("checkpoint", final, expected_bytes)
                          + f"; the unfinished {final}.tmp was removed") from exc


def _write_checkpoint_files(root: str, step: int, write_files, dist_info: DistInfo, keep: int) -> str:
    name = checkpoint_name(step)
    final, tmp = os.path.join(root, name), os.path.join(root, name + ".tmp")
    if dist_info.is_main:
        os.makedirs(root, exist_ok=True)
        recover_checkpoints(root)  # a step whose replacement was killed between its renames: put back first
        for leftover in os.listdir(root):  # unfinished writes of killed runs, replaced checkpoints: never needed
            if leftover.endswith(".tmp") and os.path.isdir(os.path.join(root, leftover)):
                shutil.rmtree(os.path.join(root, leftover), ignore_errors=True)
        os.makedirs(tmp)
    _barrier(dist_info)
    write_files(tmp)
    _barrier(dist_info)
    if dist_info.is_main:
        write_manifest(tmp, step)
        replace_dir(tmp, final)  # an existing step_X (a resumed run writing it again) moved aside first; fsynced
        pointer = os.path.join(root, "latest")
        try:
            _write_durably(pointer + ".tmp", lambda fh: fh.write(name.encode()))
            os.replace(pointer + ".tmp", pointer)
        except Exception as exc:  # the checkpoint is published (resume scans the step directories): only
            if not is_disk_full(exc):  # the pointer for people failed; a stale one would name an older step
                raise
            for stale in (pointer + ".tmp", pointer):
                if os.path.exists(stale):
                    os.remove(stale)
        fsync_dir(root)
        rotate(root, step, keep)  # on a full disk too: what it deletes makes room
    _barrier(dist_info)
    return final


def rotate(root: str, newest_step: int, keep: int) -> list[str]:
    """Delete checkpoints older than ``newest_step`` (just written and verified) beyond the newest
    ``keep``, ordered by step number. Newer checkpoints are never touched. Returns what went."""
    if keep <= 0:
        return []
    older = [path for step, path in checkpoint_steps(os.path.dirname(root)) if step < newest_step]
    doomed = older[:max(0, len(older) - (keep - 1))]
    for path in doomed:  # renamed first: a kill during the delete leaves a *.tmp, not half a step_N
        os.rename(path, path + ".deleting.tmp")
        shutil.rmtree(path + ".deleting.tmp", ignore_errors=True)
    return doomed


REFERENCE_FILE = "reference.pt"  # PACS's reference weights, when kept across rollout steps


def save_checkpoint(output_dir: str, step: int, policy, optimizer, scheduler, state: dict,
                    dist_info: DistInfo, keep: int = KEEP, reference_state: dict | None = None) -> str:
    """Write checkpoint ``step`` of a training run (every rank must call this). ``reference_state``:
    the reference snapshot's full tensors (pacs/model/reference_policy.py), when the run keeps one."""
    # frozen parameters (a LoRA run's base model) are the model directory's: not written again
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    model_state, optim_state = get_state_dict(policy, optimizer, options=options)
    frozen = {name for name, p in policy.named_parameters(remove_duplicate=False) if not p.requires_grad}
    model_state = {name: tensor for name, tensor in model_state.items() if name not in frozen}  # (tied ones too)

    def write_files(tmp: str) -> None:
        save_torch(rng_state(), os.path.join(tmp, f"rng_rank{dist_info.rank}.pt"))
        if dist_info.is_main:
            if reference_state is not None:
                save_torch(reference_state, os.path.join(tmp, REFERENCE_FILE))
            save_torch(model_state, os.path.join(tmp, "model.pt"))
            save_torch(optim_state, os.path.join(tmp, "optimizer.pt"))
            save_torch(scheduler.state_dict(), os.path.join(tmp, "scheduler.pt"))
            save_json({**state, "step": step, "world_size": dist_info.world_size}, os.path.join(tmp, "state.json"))

    expected = tensor_bytes([model_state, optim_state, reference_state or {}])
    return write_checkpoint_files(RunDir(output_dir).checkpoints, step, write_files, dist_info, keep,
                                  expected_bytes=expected)


# What an RNG file written before the states were plain data holds beside tensors: numpy's state array. These
# build an ndarray from bytes and run nothing else; they are allowed for rng_rank*.pt files only.
_NUMPY_ARRAY_GLOBALS = [np.zeros(1).__reduce__()[0], np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def _load(path: str, name: str):
    """One checkpoint file's object, read as data only: ``torch.load(weights_only=True)`` rebuilds tensors,
    numbers, strings and containers and refuses any other pickled object before it runs, so a checkpoint
    someone shares (or one on a shared filesystem) cannot run code as the user who resumes it.

    Memory-mapped (copy-on-write): under FSDP2 every rank loads the full state and keeps its shard, and the
    ranks of a machine then share the file's pages instead of each holding a full copy (about 12 bytes a
    parameter: 84 GB for a 7B model, on every rank)."""
    file = os.path.join(path, name)
    allowed = _NUMPY_ARRAY_GLOBALS if name.startswith("rng_rank") else []
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:  # an object that is not data: refused before it ran
        raise ValueError(f"checkpoint file {file} holds something other than tensors and plain data, so it was not "
                         f"loaded (nothing in it ran): a checkpoint written by pacs holds data only, so this one "
                         f"was changed by someone; move the checkpoint aside to resume from the previous one "
                         f"({str(exc).splitlines()[0]})") from exc
    except Exception as exc:  # a file changed after verification: name it instead of a pickle traceback
        raise ValueError(f"checkpoint file {os.path.join(path, name)} cannot be read ({type(exc).__name__}: "
                         f"{exc}); move the checkpoint aside and resume again to use the previous one") from exc


def load_reference_state(path: str) -> dict | None:
    """The reference snapshot a checkpoint keeps (``save_checkpoint(reference_state=...)``), or None."""
    return _load(path, REFERENCE_FILE) if os.path.isfile(os.path.join(path, REFERENCE_FILE)) else None


def load_checkpoint(path: str, policy, optimizer, scheduler, dist_info: DistInfo) -> dict:
    """Restore everything saved by :func:`save_checkpoint`; returns the trainer state dict."""
    model_state = _load(path, "model.pt")
    check_model_matches(model_state, policy.state_dict(), path)  # another model: one line, not a size traceback
    optim_state = _load(path, "optimizer.pt")
    frozen = {name for name, p in policy.named_parameters() if not p.requires_grad}
    # a LoRA run's checkpoint holds the adapters only; every trainable parameter must be in it
    set_state_dict(policy, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                   options=StateDictOptions(full_state_dict=True, strict=not frozen))
    missing = sorted(name for name, p in policy.named_parameters() if p.requires_grad and name not in model_state)
    if missing:
        raise ValueError(f"checkpoint {path} does not hold {len(missing)} trainable parameters of the model "
                         f"(e.g. {missing[0]}): written for another model or another model.lora setting")
    scheduler.load_state_dict(_load(path, "scheduler.pt"))
    with open(os.path.join(path, "state.json")) as fh:
        state = json.load(fh)
    if os.path.isfile(os.path.join(path, f"rng_rank{dist_info.rank}.pt")):  # absent with more ranks than saved
        set_rng_state(_load(path, f"rng_rank{dist_info.rank}.pt"))
    return state
