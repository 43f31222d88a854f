"""Importing the project's modules prints no warning that our own pins cause (TRL 1.16 beside the vLLM we pin
warned five times on every import of the TRL integration)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from trainer_helpers import repo_root


@pytest.mark.parametrize("module", ["pacs_kernels", "pacs.cli", "pacs.integrations.trl"])
def test_import_prints_no_warning(module):
    if module == "pacs.integrations.trl":
        pytest.importorskip("trl")
    ran = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=repo_root(),
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "Warning" not in ran.stderr, ran.stderr[-3000:]
