"""Compile every Triton kernel (log-probs, single-pass rows, group loss) for a GPU architecture
without a GPU (Triton -> PTX -> cubin).

    python -m pacs_kernels.triton.compile_check                 # first autotune candidate of each kernel
    python -m pacs_kernels.triton.compile_check --all-configs   # every candidate x flag combination

GPU time is scarce: this finds, on the CPU, what the interpreter cannot (code that only fails in
the compiler: loop-carried types, control flow around ``tl.dot``, shared memory beyond the
device's limit) and what decides the speed of a tensor-core kernel: its registers per thread,
the bytes it spills to local memory (a spill in the inner loop costs more than the matmul), and
whether its dots became Hopper warpgroup MMAs (HGMMA) or older tensor-core MMAs (HMMA). Needs
TRITON_INTERPRET unset (the kernels must be ``JITFunction``s) and Triton's bundled ptxas and
cuobjdump. Each kernel is compiled with the constexprs its ``triton.heuristics`` derive from
arguments of the given dtypes at Qwen2.5-7B shapes (d=3584, V=152064: every tile full), with
optional pointers present or absent; ``--all-configs`` adds a ragged shape (the masked loops).
Prints one line per compile (SPILL marks a candidate that spills inside its hot loop; a few
spilled registers in the epilogue run once per tile and pass). Exits non-zero if a compile fails
or exceeds shared memory, or if no candidate of a kernel compiles without loop spills for some
dtype, pointer set and shape (the default run compiles only the first candidate, so that one must
be clean). float32 inputs have their own single small tile (``launch_config.FLOAT32_CONFIGS``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import launch_config
from .kernel_report import our_kernels

SHARED_MEMORY_LIMIT = {90: 232448, 80: 166912}  # bytes per block (H100/H200, A100)
_TRITON_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
                 torch.int8: "i8", torch.uint8: "u8"}
_FLOAT_SCALARS = ("inv_tau", "filter_eps", "softcap", "beta", "inv_batch", "g_size")
_F32 = torch.float32
# integer arguments the heuristics read: a real model's shape (every tile full), and a ragged one
SHAPES = {"even": {"width": 3584, "vocab": 152064, "n_tokens": 32768, "chunk_len": 2048},
          "ragged": {"width": 3580, "vocab": 151655, "n_tokens": 32767, "chunk_len": 2047}}


def _kernels(dtype: torch.dtype):
    """(name, kernel (autotuned, heuristics only, or plain), pointer dtypes, optional pointers, fixed
    constexprs, scalar values its heuristics read) per kernel whose model-dtype inputs are ``dtype``;
    the PACS group-loss kernels (float32 log-probs for every model) come with float32."""
    kernel = dict(our_kernels())
    rows = importlib.import_module("pacs_kernels.triton.softmax_rows")
    # the PACS group loss (float32 log-probs whatever the model dtype): log-ratio score, RLOO
    # advantage, balanced weighting (the defaults) plus the score-function term (the longer code
    # path), with a mask; groups of 8, 512-token tiles
    group_flags = {"SCORE": 0, "ADVANTAGE": 0, "WEIGHTING": 0, "HAS_MASK": True, "SCORE_FUNCTION_TERM": True,
                   "BLOCK_G": 8, "BLOCK_T": 512}
    flags = {"FLAG_N": launch_config.DZ_BLOCK_N, "FLAG_V": launch_config.DZ_BLOCK_V}
    kernels = [
        ("forward", kernel["forward"],
         {"hidden_ptr": dtype, "weight_ptr": dtype, "bias_ptr": dtype, "targets_ptr": torch.int64,
          "lse_part_ptr": _F32, "negent_part_ptr": _F32, "target_logit_part_ptr": _F32},
         ("bias_ptr", "negent_part_ptr"), {}, {}),
        ("dz", kernel["dz"],
         {"hidden_ptr": dtype, "weight_ptr": dtype, "bias_ptr": dtype, "targets_ptr": torch.int64,
          "lse_ptr": _F32, "entropy_ptr": _F32, "grad_logp_ptr": _F32, "grad_entropy_ptr": _F32,
          "dz_ptr": dtype, "flags_ptr": torch.int8, "logp_out_ptr": _F32},
         ("bias_ptr", "entropy_ptr", "grad_entropy_ptr", "flags_ptr", "logp_out_ptr"),
         {"BLOCK_N": launch_config.DZ_BLOCK_N, "BLOCK_V": launch_config.DZ_BLOCK_V}, {}),
        ("dh", kernel["dh"],
         {"dz_ptr": dtype, "weight_ptr": dtype, "dh_ptr": dtype, "flags_ptr": torch.int8},
         ("flags_ptr",), flags, {}),
        ("dw", kernel["dw"],
         {"dz_ptr": dtype, "hidden_ptr": dtype, "dw_ptr": _F32, "db_ptr": _F32, "flags_ptr": torch.int8},
         ("db_ptr", "flags_ptr"), {**flags, "ACCUMULATE": True}, {}),
        # the single pass's row kernels, soft-capped (Gemma) as the harder case
        # (row_lse writes the 16-bit tile when probs_ptr is given; absent: the statistics alone)
        ("row_lse", kernel["row_lse"],
         {"z_ptr": _F32, "y_ptr": torch.int64, "bias_ptr": dtype, "lse_ptr": _F32, "target_ptr": _F32,
          "entropy_ptr": _F32, "probs_ptr": dtype, "slice_max_ptr": _F32, "coef_ptr": _F32},
         ("bias_ptr", "entropy_ptr", "probs_ptr", "slice_max_ptr", "coef_ptr"), {"BLOCK_V": rows.BLOCK_V},
         {"softcap": 30.0}),
        ("row_grad", kernel["row_grad"],
         {"z_ptr": _F32, "dz_ptr": dtype, "y_ptr": torch.int64, "bias_ptr": dtype, "lse_ptr": _F32, "g_ptr": _F32},
         ("bias_ptr",), {"BLOCK_V": rows.BLOCK_V}, {"softcap": 30.0}),
        ("row_grad_probs", kernel["row_grad_probs"],
         {"probs_ptr": dtype, "dz_ptr": dtype, "y_ptr": torch.int64, "slice_max_ptr": _F32, "lse_ptr": _F32,
          "coef_ptr": _F32, "g_ptr": _F32}, (), {"BLOCK_V": rows.BLOCK_V}, {}),
    ]
    if dtype != torch.float32:  # the group loss reads float32 log-probs whatever the model's dtype
        return kernels
    return kernels + [
        ("group_fwd", kernel["group_fwd"],
         {"logp_ptr": _F32, "old_ptr": _F32, "mask_ptr": torch.uint8, "offsets_ptr": torch.int64,
          "rewards_ptr": _F32, "loss_part_ptr": _F32, "per_response_ptr": _F32}, (), group_flags, {}),
        ("group_bwd", kernel["group_bwd"],
         {"grad_loss_ptr": _F32, "coef_ptr": _F32, "mask_ptr": torch.uint8, "offsets_ptr": torch.int64,
          "grad_ptr": _F32}, (), {"HAS_MASK": True, "BLOCK_T": 4096}, {}),
    ]


def configs_of(kernel, pointers: dict | None = None) -> list:
    """An autotuned kernel's candidate configs for arguments of the given pointer dtypes (after its
    ``early_config_prune``: float32 inputs get one small tile), or one default config for a
    heuristics-only kernel."""
    if not hasattr(kernel, "configs"):
        return [triton.Config({}, num_warps=4, num_stages=2)]
    prune = getattr(kernel, "early_config_prune", None)
    if prune is not None and pointers:
        return prune(kernel.configs, {name: torch.empty(0, dtype=dt) for name, dt in pointers.items()})
    return kernel.configs


def compile_kernel(kernel, pointers: dict, absent: set, fixed: dict, config: triton.Config, arch: int,
                   scalars: dict | None = None, shape: str = "even"):
    """Compile one (kernel, config, absent pointers, shape) combination; returns the compiled kernel."""
    jit, rules = kernel, {}  # [Autotuner ->] [Heuristics ->] JITFunction
    while not isinstance(jit, triton.runtime.jit.JITFunction):
        rules = getattr(jit, "values", rules)
        if not hasattr(jit, "fn"):
            raise ValueError(f"kernel must be a JITFunction, got {type(jit).__name__}: unset TRITON_INTERPRET")
        jit = jit.fn
    args = {name: (None if name in absent else torch.empty(0, dtype=dt)) for name, dt in pointers.items()}
    constexprs = {name: args[name] for name in absent}
    constexprs.update(fixed)
    constexprs.update(config.kwargs)
    seen = {**args, **SHAPES[shape], **(scalars or {}), **constexprs}
    constexprs.update({name: rule(seen) for name, rule in rules.items()})
    signature = {}
    for index, name in enumerate(jit.arg_names):
        if name in constexprs or index in jit.constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + _TRITON_DTYPE[pointers[name]]
        else:
            signature[name] = "fp32" if name in _FLOAT_SCALARS else "i32"
    missing = [n for i, n in enumerate(jit.arg_names) if signature[n] == "constexpr" and n not in constexprs]
    if missing:
        raise ValueError(f"no value for constexpr arguments {missing} of {jit.__name__}")
    source = ASTSource(jit, signature, constexprs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": config.num_warps, "num_stages": config.num_stages})


def _tool(name: str) -> str | None:
    """Path of a CUDA binary Triton bundles (cuobjdump), or None."""
    import triton.backends.nvidia as nvidia
    path = os.path.join(os.path.dirname(nvidia.__file__), "bin", name)
    return path if os.path.isfile(path) else None


def resource_usage(compiled) -> dict:
    """What a compiled kernel costs per thread, read from its cubin with cuobjdump ({} without it):
    registers; stack bytes (local memory: spills, wherever they are); HGMMA / HMMA tensor-core
    instruction counts; and ``loop_spills``, the local loads and stores inside its hot loops (the
    loops that hold a tensor-core instruction, or every loop of a kernel without one): a spill in
    the epilogue runs once per tile, one in the loop once per step."""
    tool = _tool("cuobjdump")
    if tool is None:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as handle:
            handle.write(compiled.asm["cubin"])
        usage = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    if found is None:
        return {}
    return {"registers": int(found.group(1)), "stack": int(found.group(2)), **sass_summary(sass)}


def sass_summary(sass: str) -> dict:
    """Tensor-core instruction counts and local-memory accesses inside hot loops of a SASS listing.
    A loop is a backward branch (``BRA`` to a lower address); it is hot if it holds an HGMMA/HMMA,
    or, in a kernel without any, always."""
    program = []  # (address, opcode text without predicate)
    for line in sass.splitlines():
        found = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", line)
        if found:
            program.append((int(found.group(1), 16), found.group(2), found.group(3)))
    mma = {"hgmma": sum(op.startswith("HGMMA") for _, op, _ in program),
           "hmma": sum(op.startswith("HMMA") for _, op, _ in program)}
    has_mma = mma["hgmma"] + mma["hmma"] > 0
    hot = set()
    for address, op, operands in program:
        target = re.search(r"0x([0-9a-f]+)", operands)
        if op.startswith("BRA") and target and int(target.group(1), 16) < address:
            body = [(a, o) for a, o, _ in program if int(target.group(1), 16) <= a <= address]
            if not has_mma or any(o.startswith(("HGMMA", "HMMA")) for _, o in body):
                hot.update(a for a, o in body if o.startswith(("LDL", "STL")))
    return {**mma, "loop_spills": len(hot)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"],
                        choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--all-configs", action="store_true", help="every autotune candidate and flag combination")
    parser.add_argument("--kernels", nargs="+", default=None,
                        help="forward dz dh dw row_lse row_grad row_grad_probs group_fwd group_bwd (default: all)")
    args = parser.parse_args(argv)
    if launch_config.INTERPRETED:
        print("TRITON_INTERPRET is set: the kernels are interpreted functions; unset it", file=sys.stderr)
        return 2
    limit = SHARED_MEMORY_LIMIT.get(args.arch)
    failures = 0
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for name, kernel, pointers, optional, fixed, scalars in _kernels(dtype):
            if args.kernels and name not in args.kernels:
                continue
            configs = configs_of(kernel, pointers)
            configs = configs if args.all_configs else configs[:1]
            absents = [set(), set(optional)] if args.all_configs else [set()]
            shapes = list(SHAPES) if args.all_configs else ["even"]
            for absent, shape in ((a, sh) for a in absents for sh in shapes):
                spill_free = 0
                for config in configs:
                    label = (f"{name:8s} {dtype_name:9s} {launch_config.describe_config(config)} {shape:6s} "
                             f"absent={sorted(absent) or '-'}")
                    start = time.perf_counter()
                    try:
                        compiled = compile_kernel(kernel, pointers, absent, fixed, config, args.arch, scalars, shape)
                    except Exception as exc:  # report every failure, then exit non-zero
                        failures += 1
                        print(f"FAIL {label}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
                        continue
                    shared = compiled.metadata.shared
                    usage = resource_usage(compiled)
                    verdict = "ok  "
                    if limit is not None and shared > limit:
                        verdict = "OVER"
                        failures += 1
                    elif usage.get("loop_spills", 0) > 0:
                        verdict = "SPILL"
                    else:
                        spill_free += 1
                    regs = (f"regs={usage['registers']} stack={usage['stack']}B loop_spills={usage['loop_spills']} "
                            f"hgmma={usage['hgmma']} hmma={usage['hmma']} ") if usage else "regs=? "
                    print(f"{verdict} {label} {regs}shared={shared}B ({time.perf_counter() - start:.1f}s)")
                if spill_free == 0:  # the autotuner needs one candidate that keeps up
                    failures += 1
                    print(f"FAIL {name} {dtype_name} {shape} absent={sorted(absent) or '-'}: no candidate "
                          "compiled without spilling in its tensor-core loop")
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
