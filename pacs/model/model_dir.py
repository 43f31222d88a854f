"""What a local ``--model`` directory must hold, checked before anything is loaded (no torch, no transformers)."""

from __future__ import annotations

import os


def check_model_dir(path: str) -> None:
    """A local directory without a config.json: a ValueError saying so, and naming the model inside it where a
    subfolder holds one (a run directory's trained model is its ``final_model/``). Anything else (a model
    directory, a hub id, a path that does not exist) passes: :func:`pacs.model.policy.check_model_path` says
    more once it loads the config."""
    local = os.path.expanduser(path)
    if not os.path.isdir(local) or os.path.isfile(os.path.join(local, "config.json")):
        return
    inside = sorted(name for name in os.listdir(local)
                    if os.path.isfile(os.path.join(local, name, "config.json")))
    if inside:
        models = " or ".join(repr(os.path.join(path, name)) for name in inside)
        raise ValueError(f"--model: {path!r} is not a model directory (no config.json); the model in it is {models}")
    raise ValueError(f"--model: {path!r} has no config.json (a Hugging Face model directory holds config.json "
                     "and the weights)")
