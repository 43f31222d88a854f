"""The kernels compile for an H100/H200 (sm_90) on this CPU: Triton -> PTX -> cubin with the bundled
ptxas, in a subprocess without TRITON_INTERPRET (the test session runs the interpreter). Two small
kernels (a gradient matmul, the soft-capped row kernel of the single pass) keep it quick;
``python -m pacs_kernels.triton.compile_check --all-configs`` does them all."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-m", "pacs_kernels.triton.compile_check", "--kernels", "dh", "row_grad",
                           "--dtypes", "bfloat16", "--arch", "90"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith(("ok", "FAIL", "OVER"))]
    assert lines and all(line.startswith("ok") for line in lines), done.stdout
    assert "0 failure(s)" in done.stdout


def test_refuses_interpreted_kernels():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "pacs_kernels.triton.compile_check", "--kernels", "dh"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "TRITON_INTERPRET is set" in done.stderr
