"""What the GPU actually ran: each Triton kernel's autotune winners and, for every variant the
driver loaded, its registers, spills and shared memory.

``compile_check`` predicts these on the CPU; the first GPU run records them
(``benchmarks/check_gpu_correctness.py`` prints this report after its cases), so a tile that won
the race but spilled, or a winner nobody expected, shows up in the run's log. Reads Triton's
runtime caches (``Autotuner.cache``, ``JITFunction.device_caches``): on the CPU, or before any
launch, there is nothing to report and the report says so.
"""

from __future__ import annotations

import importlib
import re

from .launch_config import describe_config

_KERNELS = (
    ("forward", "pacs_kernels.triton.logprob_forward", "_logprob_forward_kernel"),
    ("dz", "pacs_kernels.triton.logprob_backward", "_dz_kernel"),
    ("dh", "pacs_kernels.triton.grad_matmuls", "dh_kernel"),
    ("dw", "pacs_kernels.triton.grad_matmuls", "dw_kernel"),
    ("row_lse", "pacs_kernels.triton.softmax_rows", "_row_lse_kernel"),
    ("row_grad", "pacs_kernels.triton.softmax_rows", "_row_grad_kernel"),
    ("row_grad_probs", "pacs_kernels.triton.softmax_rows", "_row_grad_probs_kernel"),
    ("group_fwd", "pacs_kernels.triton.group_loss", "_group_loss_forward_kernel"),
    ("group_bwd", "pacs_kernels.triton.group_loss", "_group_loss_backward_kernel"),
)


def _innermost(kernel):
    """The JITFunction under any Autotuner / Heuristics wrappers (a JITFunction has an ``fn`` too, its Python
    function: the walk stops at the object that holds the compiled variants, ``device_caches``)."""
    while hasattr(kernel, "fn") and not hasattr(kernel, "device_caches"):
        kernel = kernel.fn
    return kernel


def pipeline_stages(compiled) -> int | str:
    """How many shared-memory buffers the software pipeliner gave a compiled kernel's loop operands: the
    leading size of its multi-buffered (3-D) shared allocations in the TTGIR; 1 when there are none (loads not
    pipelined: each step waits for its own load); "?" without the TTGIR. ``num_stages`` is what a config asks
    for, this is what the compiler did."""
    asm = getattr(compiled, "asm", None) or {}
    if "ttgir" not in asm:
        return "?"
    return max((int(depth) for depth in re.findall(r"memdesc<(\d+)x\d+x\d+x", asm["ttgir"])), default=1)


def _compiled_variants(jit):
    """Every compiled kernel in a JITFunction's per-device caches (Triton 3.x layout)."""
    for entry in getattr(jit, "device_caches", {}).values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        if isinstance(cache, dict):
            yield from cache.values()


def our_kernels() -> list[tuple[str, object]]:
    """(name, decorated kernel) of every Triton kernel of ours."""
    return [(name, getattr(importlib.import_module(module), attribute)) for name, module, attribute in _KERNELS]


def report_lines(kernels=None) -> list[str]:
    """One line per autotune winner and per loaded kernel variant of ``kernels`` (default: ours); a
    single line when none ran."""
    lines = []
    for name, kernel in (our_kernels() if kernels is None else kernels):
        for key, config in getattr(kernel, "cache", {}).items():
            shown = ", ".join(str(part) for part in key)
            lines.append(f"{name:8s} autotune winner for ({shown}): {describe_config(config)}")
        for compiled in _compiled_variants(_innermost(kernel)):
            try:
                compiled._init_handles()  # loads the binary if this variant has not run yet
            except Exception:  # a variant that cannot load here: report what metadata says
                pass
            meta = compiled.metadata
            lines.append(f"{name:8s} compiled: warps={meta.num_warps} stages={meta.num_stages} "
                         f"pipelined={pipeline_stages(compiled)} "
                         f"registers={getattr(compiled, 'n_regs', '?')} spills={getattr(compiled, 'n_spills', '?')} "
                         f"shared={meta.shared}B")
    return lines or ["no Triton kernel of ours was compiled in this process (CPU or interpreter, or none ran)"]


def print_report() -> None:
    print("[kernels] what the GPU compiled and loaded (registers and spills from the driver):")
    for line in report_lines():
        print(f"[kernels] {line}")
