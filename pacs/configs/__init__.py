"""The configs shipped inside the package (package data, so that an installed ``pacs`` finds them by name
outside a source checkout; a checkout's ``configs/models`` and ``configs/presets`` point here).

``models/<name>/config.json``: published models' configs (no weights), read by ``pacs plan --model <name>``
(or the model's Hugging Face hub id, :data:`HUB_IDS`) and by :func:`pacs.model.model_zoo.build_small_model`.
``presets/<name>.yaml``: ``pacs train`` configs for a GPU size, each with a ``<name>.plan.yaml`` beside it
(the planner's model, GPU memory and GPU count), read by ``pacs plan --preset <name>``.

Imports nothing (the planner reads these without torch)."""

from __future__ import annotations

import os
from importlib.resources import files

# the Hugging Face hub id each shipped model config was published under (`pacs plan --model <hub id>`)
HUB_IDS = {
    "gemma-2-2b-it": "google/gemma-2-2b-it",
    "llama-3.2-1b-instruct": "meta-llama/Llama-3.2-1B-Instruct",
    "qwen2.5-0.5b-instruct": "Qwen/Qwen2.5-0.5B-Instruct",
    "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B",
    "qwen3-0.6b": "Qwen/Qwen3-0.6B",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
}


def root() -> str:
    """The directory holding ``models/`` and ``presets/`` (inside the installed package)."""
    return os.fspath(files(__name__))


def model_names() -> list[str]:
    """Names of the shipped model configs."""
    folder = os.path.join(root(), "models")
    if not os.path.isdir(folder):
        return []
    return sorted(n for n in os.listdir(folder) if os.path.isfile(os.path.join(folder, n, "config.json")))


def model_config_path(name: str) -> str | None:
    """The shipped config.json of model ``name`` (a shipped name, or its hub id in any case), or None."""
    name = name.strip().rstrip("/")
    by_hub_id = {hub.lower(): shipped for shipped, hub in HUB_IDS.items()}
    shipped = by_hub_id.get(name.lower(), name.lower() if "/" not in name else None)
    if shipped is None or shipped not in model_names():
        return None
    return os.path.join(root(), "models", shipped, "config.json")


def preset_names() -> list[str]:
    """Names of the shipped presets (``presets/<name>.yaml`` with a ``<name>.plan.yaml`` beside it)."""
    folder = os.path.join(root(), "presets")
    if not os.path.isdir(folder):
        return []
    return sorted(n[:-len(".yaml")] for n in os.listdir(folder)
                  if n.endswith(".yaml") and not n.endswith(".plan.yaml")
                  and os.path.isfile(os.path.join(folder, n[:-len(".yaml")] + ".plan.yaml")))


def preset_path(name: str) -> str | None:
    """The shipped preset ``name`` (with or without ``.yaml``), or None."""
    stem = name[:-len(".yaml")] if name.endswith(".yaml") else name
    return os.path.join(root(), "presets", stem + ".yaml") if stem in preset_names() else None
