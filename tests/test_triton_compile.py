"""The kernels compile for an H100/H200 (sm_90) on this CPU: Triton -> PTX -> cubin with the bundled
ptxas, in a subprocess without TRITON_INTERPRET (the test session runs the interpreter). Every
kernel's first autotune candidate in bfloat16 and its float32 tile (and the PACS group-loss
kernels, float32), with every optional pointer present, at Qwen2.5-7B shapes: each must compile,
fit shared memory and keep its hot loop free of register spills, and the four matmul kernels must
run their bfloat16 dots as Hopper warpgroup MMAs (HGMMA).
``python -m pacs_kernels.triton.compile_check --all-configs`` checks every candidate and flag set."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pacs_kernels.triton.compile_check import sass_summary

ROOT = Path(__file__).resolve().parent.parent
MATMUL_KERNELS = ("forward", "dz", "dh", "dw")


def test_kernels_compile_for_sm90_on_tensor_cores_without_loop_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-m", "pacs_kernels.triton.compile_check", "--dtypes", "bfloat16",
                           "float32", "--arch", "90"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith(("ok", "FAIL", "OVER", "SPILL"))]
    assert len(lines) == 16 and all(line.startswith("ok") for line in lines), done.stdout  # 7 + 7 + group loss
    assert "0 failure(s)" in done.stdout
    float32_forward = next(line for line in lines if line.split()[1:3] == ["forward", "float32"])
    assert "BLOCK_N=64,BLOCK_V=64,BLOCK_D=32" in float32_forward, "float32 must get its own small tile"
    for line in lines:
        name, dtype = line.split()[1:3]
        found = re.search(r"loop_spills=(\d+) hgmma=(\d+)", line)
        assert found, f"no resource usage reported (cuobjdump missing?): {line}"
        assert int(found.group(1)) == 0, line
        if name in MATMUL_KERNELS and dtype == "bfloat16":
            assert int(found.group(2)) > 0, f"{name} does not use Hopper tensor cores: {line}"


SASS_LOOP = """
        /*0100*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0110*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ ;
        /*0120*/              @P0  STL [R1+0x8], R2 ;
        /*0130*/              @P1  BRA 0x100 ;
        /*0140*/                   STL [R1+0x10], R3 ;
        /*0150*/                   LDL R3, [R1+0x10] ;
        /*0160*/                   EXIT ;
"""


@pytest.mark.parametrize("listing,expected", [
    (SASS_LOOP, {"hgmma": 1, "hmma": 0, "loop_spills": 1}),  # the epilogue's STL/LDL do not count
    (SASS_LOOP.replace("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ", "FFMA R24, R2, R3, R24"),
     {"hgmma": 0, "hmma": 0, "loop_spills": 1}),  # no tensor cores: every loop is hot
    (SASS_LOOP.replace("@P0  STL [R1+0x8], R2", "MOV R2, R3"), {"hgmma": 1, "hmma": 0, "loop_spills": 0}),
])
def test_sass_summary_counts_spills_inside_hot_loops_only(listing, expected):
    assert sass_summary(listing) == expected


def test_refuses_interpreted_kernels():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "pacs_kernels.triton.compile_check", "--kernels", "dh"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "TRITON_INTERPRET is set" in done.stderr
