"""The GPU run's kernel report (autotune winners, registers, spills) reads Triton's runtime caches."""

from __future__ import annotations

from types import SimpleNamespace

import triton

from pacs_kernels.triton.kernel_report import report_lines


class _Compiled:
    def __init__(self, regs, spills):
        self.metadata = SimpleNamespace(num_warps=8, num_stages=3, shared=32768)
        self.asm = {"ttgir": "%0 = ttg.local_alloc : () -> !ttg.memdesc<3x128x64xbf16, #shared, #smem, mutable>"}
        self.loaded = False
        self._regs, self._spills = regs, spills

    def _init_handles(self):  # the driver fills n_regs / n_spills when it loads the binary
        self.loaded = True
        self.n_regs, self.n_spills = self._regs, self._spills


def test_report_names_the_winner_and_each_loaded_variant():
    compiled = _Compiled(190, 0)
    # a JITFunction has an ``fn`` of its own (its Python function): the report must stop at the JITFunction
    jit = SimpleNamespace(device_caches={0: ({"spec": compiled}, {}, None, None, None)}, fn=lambda: None)
    autotuner = SimpleNamespace(
        cache={(3584, 152064, "torch.bfloat16"): triton.Config({"BLOCK_N": 128, "BLOCK_V": 128}, num_warps=8,
                                                                 num_stages=3)},
        fn=SimpleNamespace(fn=jit))  # Autotuner -> Heuristics -> JITFunction
    lines = report_lines([("forward", autotuner)])
    assert lines[0] == "forward  autotune winner for (3584, 152064, torch.bfloat16): [BLOCK_N=128,BLOCK_V=128 w8 s3]"
    assert lines[1] == "forward  compiled: warps=8 stages=3 pipelined=3 registers=190 spills=0 shared=32768B"
    assert compiled.loaded


def test_interpreted_kernels_report_that_nothing_was_compiled():
    assert report_lines() == [
        "no Triton kernel of ours was compiled in this process (CPU or interpreter, or none ran)"]
