"""The trained policy as a Hugging Face model directory (``OUTPUT_DIR/final_model``): written so that a kill
at any moment leaves a whole export in place, or one that the next export or reader puts back."""

from __future__ import annotations

import json
import os
import shutil

from pacs.model.policy import DistInfo, Policy, full_named_tensors
from pacs.run.disk_space import NoSpaceLeft, is_disk_full, no_space_message, tensor_bytes
from pacs.run.durable import REPLACED_SUFFIX, fsync_tree, recover_replaced, replace_dir


def export_hf(policy: Policy, tokenizer, out_dir: str, dist_info: DistInfo | None = None) -> None:
    """Save the policy in Hugging Face format (config, safetensors, tokenizer); rank 0 writes.

    Written to ``out_dir.tmp``, every file fsynced, then renamed into place
    (:func:`pacs.run.durable.replace_dir`: an existing export is moved aside to ``out_dir.replaced.tmp``
    first and deleted after), so that a reader never sees half an export and a kill at any moment leaves one
    at ``out_dir`` or, killed between the two renames, one that the next export or reader
    (:func:`recover_export`) puts back first. Float32 master weights are written
    in the compute dtype (``model.dtype``), the dtype the model came in and was served in.
    """
    dist_info = dist_info or DistInfo()
    dtype = policy.precision.compute
    state = {name: (t.to(dtype) if t.is_floating_point() else t).cpu() for name, t in full_named_tensors(policy)}
    if not dist_info.is_main:
        return
    out_dir = os.path.normpath(out_dir)
    tmp = out_dir + ".tmp"
    recover_replaced(out_dir, is_complete_export)  # an export killed between its renames: before tmp is removed
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write_export(policy, tokenizer, tmp, state, dtype)
    except Exception as exc:  # a full disk: one line (pacs train: exit 2), nothing half-written left behind
        if not is_disk_full(exc):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise NoSpaceLeft(no_space_message("the final model", out_dir, sum(tensor_bytes(t) for t in state.values()))
                          + f"; the unfinished {tmp} was removed") from exc
    replace_dir(tmp, out_dir)


def _write_export(policy: Policy, tokenizer, tmp: str, state: dict, dtype) -> None:
    """The export's files in ``tmp``, fsynced."""
    policy.causal_lm.save_pretrained(tmp, state_dict=state)
    if policy.precision.mixed:  # save_pretrained records the parameters' (float32) dtype in the config
        config_path = os.path.join(tmp, "config.json")
        with open(config_path) as fh:
            config = json.load(fh)
        config["dtype"] = str(dtype).removeprefix("torch.")
        with open(config_path, "w") as fh:
            json.dump(config, fh, indent=2, sort_keys=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    fsync_tree(tmp)  # save_pretrained does not fsync: a power loss after the rename must not leave empty files


def is_complete_export(path: str) -> bool:
    """Whether directory ``path`` holds a whole :func:`export_hf` export: a ``config.json`` and its weights
    (every shard a ``*.index.json`` names, or one weights file)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        return False
    names = os.listdir(path)
    for index in (name for name in names if name.endswith(".index.json")):
        try:
            with open(os.path.join(path, index)) as fh:
                shards = set(json.load(fh)["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False
        return all(os.path.isfile(os.path.join(path, shard)) for shard in shards)
    return any(name.endswith((".safetensors", ".bin")) for name in names)


def recover_export(path: str) -> bool:
    """Put back the export at ``path`` when one was killed between its two renames (no ``path``, a
    ``path.replaced.tmp`` beside it): the new one if complete, else the previous one. Returns whether it did."""
    path = os.path.normpath(os.path.expanduser(path))
    if os.path.isdir(path) or not os.path.isdir(path + REPLACED_SUFFIX):
        return False
    return recover_replaced(path, is_complete_export)
