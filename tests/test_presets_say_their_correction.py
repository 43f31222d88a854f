"""Issue 48: each shipped preset and the paper's configs say which rollout correction they use (a mode written
out, not left to the default), and that mode is one the config accepts."""

from __future__ import annotations

import glob
import os

import pytest
import yaml

from pacs.config import load_config, validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(p for p in glob.glob(os.path.join(ROOT, "pacs", "configs", "presets", "*.yaml"))
                 if not p.endswith(".plan.yaml")) + [os.path.join(ROOT, "configs", "qwen2.5-math.yaml")]


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_the_config_names_its_rollout_correction_mode(path):
    with open(path) as f:
        data = yaml.safe_load(f)
    mode = data.get("advanced", {}).get("rollout_correction", {}).get("mode")
    assert mode is not None, f"{path}: no advanced.rollout_correction.mode"
    cfg = load_config(path, ["task.data_path=train.jsonl"])
    assert cfg.rollout_correction.mode == mode
    validate(cfg)


def test_the_verl_config_says_its_rollout_correction():
    with open(os.path.join(ROOT, "configs", "verl_pacs_qwen2.5_7b.yaml")) as f:
        text = f.read()
    assert "rollout correction: none" in text and "rollout_correction" in text
