"""The kernels compile for an H100/H200 (sm_90) on this CPU as a launch there compiles them: Triton -> PTX ->
cubin with the bundled ptxas, in a subprocess without TRITON_INTERPRET (the test session runs the interpreter),
the arguments specialized by Triton's own binder (aligned pointers, sizes divisible by 16, unit strides
constant) at Qwen2.5-7B shapes. Every kernel's first autotune candidate in bfloat16 and its float32 tile (and the
PACS group-loss kernels, float32), with every optional pointer present and with them absent (the loss's usual
launch): each must compile, fit shared memory and keep its hot loop free of register spills; the four matmul
kernels must run their bfloat16 dots as Hopper warpgroup MMAs (HGMMA) and, in the usual launch, have their
loads software-pipelined as deep as their config asks (without the launch's specializations they got one stage).
``python -m pacs_kernels.triton.compile_check --all-configs`` checks every candidate, pointer set and shape."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pacs_kernels.triton.compile_check import sass_summary, scalar_arguments
from pacs_kernels.triton.kernel_report import pipeline_stages

ROOT = Path(__file__).resolve().parent.parent
MATMUL_KERNELS = ("forward", "dz", "dh", "dw")
LINE = re.compile(r"^(ok|FAIL|OVER|SPILL)\s+(\S+)\s+(\S+)\s+\[(.*?) w(\d+) s(\d+)\] (\S+)\s+absent=(.*?) stages=(\d+) "
                  r"regs=(\d+) stack=(\d+)B loop_spills=(\d+) hgmma=(\d+) hmma=(\d+) shared=(\d+)B")


def test_kernels_compile_for_sm90_pipelined_on_tensor_cores_without_loop_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-m", "pacs_kernels.triton.compile_check", "--dtypes", "bfloat16",
                           "float32", "--arch", "90"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("# python -m pacs_kernels.triton.compile_check") and "Triton " in done.stdout
    lines = [line for line in done.stdout.splitlines() if line.startswith(("ok", "FAIL", "OVER", "SPILL"))]
    # bf16: 6 kernels x 2 pointer sets + row_grad_probs (no optional pointer); float32 the same + the group loss
    assert len(lines) == 13 + 15 and all(line.startswith("ok") for line in lines), done.stdout
    assert "0 failure(s)" in done.stdout
    parsed = []
    for line in lines:
        found = LINE.match(line)
        assert found, f"no resource usage reported (cuobjdump missing?): {line}"
        parsed.append(found)
    float32_forward = next(f for f in parsed if f.group(2, 3) == ("forward", "float32"))
    assert float32_forward.group(4) == "BLOCK_N=64,BLOCK_V=64,BLOCK_D=32", "float32 must get its own small tile"
    for found in parsed:
        name, dtype, absent = found.group(2), found.group(3), found.group(8)
        assert int(found.group(12)) == 0, found.group(0)  # no spill in a hot loop
        if name in MATMUL_KERNELS and dtype == "bfloat16":
            assert int(found.group(13)) > 0, f"{name} does not use Hopper tensor cores: {found.group(0)}"
            if absent != "-":  # the usual launch: loads pipelined as deep as the config asks
                assert int(found.group(9)) == int(found.group(6)) >= 3, f"{name} is not pipelined: {found.group(0)}"


def test_the_scalar_arguments_are_what_the_launches_specialize_on():
    """Unit strides (constants at launch), the even shape's sizes and strides divisible by 16, the odd shape's not."""
    even, ragged16, ragged = (scalar_arguments(shape) for shape in ("even", "ragged16", "ragged"))
    assert even["stride_hd"] == even["stride_wd"] == ragged["stride_hd"] == 1
    for name in ("width", "vocab", "stride_hn", "stride_wv", "chunk_len", "row0", "split_size", "stride_dz"):
        assert even[name] % 16 == 0 and ragged16[name] % 16 == 0, name
    assert ragged["width"] % 16 and ragged["vocab"] % 16 and ragged["chunk_len"] % 16
    assert ragged16["width"] % 64 and ragged16["vocab"] % 128  # not multiples of the tiles: the masked loops


def test_pipeline_stages_reads_the_multi_buffered_operands():
    class Compiled:
        def __init__(self, ttgir):
            self.asm = {"ttgir": ttgir}

    assert pipeline_stages(Compiled("%1 = ttg.local_alloc : () -> !ttg.memdesc<3x128x64xbf16, #shared, #smem, mutable>\n"
                                    "%2 = ttg.local_alloc : () -> !ttg.memdesc<3x64x128xbf16, #shared1, #smem, mutable>")) == 3
    assert pipeline_stages(Compiled("%1 = ttg.local_alloc %0 : () -> !ttg.memdesc<128x64xbf16, #shared, #smem>")) == 1
    assert pipeline_stages(Compiled("")) == 1


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
