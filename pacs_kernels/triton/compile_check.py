"""Compile every Triton kernel (log-probs, single-pass rows, group loss) for a GPU architecture
without a GPU (Triton -> PTX -> cubin), as a launch on that GPU would compile it.

    python -m pacs_kernels.triton.compile_check                 # first autotune candidate of each kernel
    python -m pacs_kernels.triton.compile_check --all-configs   # every candidate x pointer set x shape
    python -m pacs_kernels.triton.compile_check --all-configs --explore   # and tiles launch_config lacks

GPU time is scarce: this finds, on the CPU, what the interpreter cannot (code that only fails in
the compiler: loop-carried types, control flow around ``tl.dot``, shared memory beyond the
device's limit) and what decides the speed of a tensor-core kernel: whether its loads were
software-pipelined (``stages``: the shared-memory buffers the pipeliner gave the loop's operands;
1 means each step waits for its own load), its registers per thread, the bytes it spills to local
memory (a spill in the inner loop costs more than the matmul), and whether its dots became Hopper
warpgroup MMAs (HGMMA) or older tensor-core MMAs (HMMA).

What the GPU runs depends on the arguments, not only on the source: at launch Triton specializes
each kernel on its arguments (pointers 16-byte aligned and ints divisible by 16 are marked so,
ints equal to 1, the unit strides, become constants) and compiles it with the config's warps and
stages. Without those marks the loads cannot be vectorized or made asynchronous, and the same
kernels compile to one stage and more registers. So each kernel is bound here by Triton's own
argument binder (``compile_kernel``) to the values its launches pass for contiguous tensors
(``scalar_arguments``: Qwen2.5-7B's head, and with ``--all-configs`` sizes that are multiples of
16 but not of the tiles, and odd sizes), its constexprs from its ``triton.heuristics``, with the
optional pointers present and absent (absent: the loss's usual launch, no bias, no entropy
gradient, no filter). A kernel launched without autotuning gets the backend's default warps and
stages, as its launch does.

Needs TRITON_INTERPRET unset (the kernels must be ``JITFunction``s) and Triton's bundled ptxas and
cuobjdump. Prints a header (Triton version, date), then one line per compile (SPILL marks a
candidate that spills inside its hot loop; a few spilled registers in the epilogue run once per
tile and pass). Exits non-zero if a compile fails or exceeds shared memory, or if no candidate of
a kernel compiles without loop spills for some dtype, pointer set and shape (the default run
compiles only the first candidate, so that one must be clean; ``--explore`` candidates do not
count). float32 inputs have their own single small tile (``launch_config.FLOAT32_CONFIGS``).
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import re
import subprocess
import sys
import tempfile
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import MockTensor, create_function_from_signature

from . import launch_config
from .kernel_report import our_kernels, pipeline_stages

SHARED_MEMORY_LIMIT = {90: 232448, 80: 166912}  # bytes per block (H100/H200, A100)
_F32 = torch.float32


# (width, vocabulary, tokens) of the shapes the check compiles for: see scalar_arguments
SHAPES = {"even": (3584, 152064, 32768), "ragged16": (3600, 151952, 32752), "ragged": (3580, 151655, 32767)}


def scalar_arguments(shape: str, sms: int = 132) -> dict:
    """The value of every scalar argument our kernels take, as the launches pass them for contiguous
    tensors at the given shape (SHAPES): "even", Qwen2.5-7B's head (d=3584, V=152064, 32,768 tokens:
    every tile full, every size and row stride a multiple of 16); "ragged16" (d=3600, V=151952, 32,752
    tokens: multiples of 16 but not of the tiles, so the masked loops, with strides Triton knows to be
    16-aligned); or "ragged" (d=3580, V=151655, 32,767 tokens: the masked loops with sizes and strides
    Triton cannot assume divisible by 16, as no released model's head has them). Triton specializes
    a kernel on these values at launch (an int equal to 1, the unit strides, becomes a constant; one
    divisible by 16 is marked so), and that decides whether its loads vectorize and its loops pipeline:
    the compile must see the same values. ``sms``: multiprocessors of the GPU the forward's vocabulary
    split is sized for (132: H100/H200 SXM)."""
    even = shape == "even"
    width, vocab, n_tokens = SHAPES[shape]
    chunk = launch_config.dz_chunk_tokens(n_tokens, vocab, 2)  # the backward's dz chunk in bf16
    last_start = (n_tokens - 1) // chunk * chunk
    blocks = math.ceil(n_tokens / 128)
    splits = max(1, min(math.ceil(2 * sms / blocks), math.ceil(vocab / launch_config.SPLIT_ALIGN)))
    split_size = math.ceil(math.ceil(vocab / launch_config.SPLIT_ALIGN) / splits) * launch_config.SPLIT_ALIGN
    row_block = importlib.import_module("pacs_kernels.triton.softmax_rows").BLOCK_V
    return {
        "n_tokens": n_tokens, "vocab": vocab, "width": width, "V": vocab, "split_size": split_size,
        # the backward's dz chunks: the second (full) one in the even shape, the last (shorter) one else
        "row0": chunk if even else last_start, "chunk_len": chunk if even else n_tokens - last_start,
        "stride_hn": width, "stride_hd": 1, "stride_wv": width, "stride_wd": 1,
        "n_flag_cols": math.ceil(vocab / launch_config.DZ_BLOCK_V),
        # the single pass's row kernels: row-contiguous (C, V) strips
        "stride_z": vocab, "stride_p": vocab, "stride_dz": vocab, "n_slices": math.ceil(vocab / row_block),
        "inv_tau": 1.0, "filter_eps": 0.0, "softcap": 30.0,
        # the group loss: 64 responses in groups of 8, 4,096 tokens at most
        "n_responses": 64, "group_size": 8, "g_size": 8.0, "max_len": 4096, "beta": 0.04, "inv_batch": 1 / 64,
    }


def _kernels(dtype: torch.dtype):
    """(name, kernel (autotuned, heuristics only, or plain), pointer dtypes, optional pointers, fixed
    constexprs) per kernel whose model-dtype inputs are ``dtype``; the PACS group-loss kernels
    (float32 log-probs for every model) come with float32. Scalar arguments: ``scalar_arguments``."""
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
         ("bias_ptr", "negent_part_ptr"), {}),
        ("dz", kernel["dz"],
         {"hidden_ptr": dtype, "weight_ptr": dtype, "bias_ptr": dtype, "targets_ptr": torch.int64,
          "lse_ptr": _F32, "entropy_ptr": _F32, "grad_logp_ptr": _F32, "grad_entropy_ptr": _F32,
          "dz_ptr": dtype, "flags_ptr": torch.int8, "logp_out_ptr": _F32},
         ("bias_ptr", "entropy_ptr", "grad_entropy_ptr", "flags_ptr", "logp_out_ptr"),
         {"BLOCK_N": launch_config.DZ_BLOCK_N, "BLOCK_V": launch_config.DZ_BLOCK_V}),
        ("dh", kernel["dh"],
         {"dz_ptr": dtype, "weight_ptr": dtype, "dh_ptr": dtype, "flags_ptr": torch.int8},
         ("flags_ptr",), flags),
        ("dw", kernel["dw"],
         {"dz_ptr": dtype, "hidden_ptr": dtype, "dw_ptr": _F32, "db_ptr": _F32, "flags_ptr": torch.int8},
         ("db_ptr", "flags_ptr"), {**flags, "ACCUMULATE": True}),
        # the single pass's row kernels, soft-capped (Gemma) as the harder case
        # (row_lse writes the 16-bit tile when probs_ptr is given; absent: the statistics alone)
        ("row_lse", kernel["row_lse"],
         {"z_ptr": _F32, "y_ptr": torch.int64, "bias_ptr": dtype, "lse_ptr": _F32, "target_ptr": _F32,
          "entropy_ptr": _F32, "probs_ptr": dtype, "slice_max_ptr": _F32, "coef_ptr": _F32},
         ("bias_ptr", "entropy_ptr", "probs_ptr", "slice_max_ptr", "coef_ptr"), {"BLOCK_V": rows.BLOCK_V}),
        ("row_grad", kernel["row_grad"],
         {"z_ptr": _F32, "dz_ptr": dtype, "y_ptr": torch.int64, "bias_ptr": dtype, "lse_ptr": _F32, "g_ptr": _F32},
         ("bias_ptr",), {"BLOCK_V": rows.BLOCK_V}),
        ("row_grad_probs", kernel["row_grad_probs"],
         {"probs_ptr": dtype, "dz_ptr": dtype, "y_ptr": torch.int64, "slice_max_ptr": _F32, "lse_ptr": _F32,
          "coef_ptr": _F32, "g_ptr": _F32}, (), {"BLOCK_V": rows.BLOCK_V}),
    ]
    if dtype != torch.float32:  # the group loss reads float32 log-probs whatever the model's dtype
        return kernels
    return kernels + [
        ("group_fwd", kernel["group_fwd"],
         {"logp_ptr": _F32, "old_ptr": _F32, "mask_ptr": torch.uint8, "offsets_ptr": torch.int64,
          "rewards_ptr": _F32, "loss_part_ptr": _F32, "per_response_ptr": _F32}, (), group_flags),
        ("group_bwd", kernel["group_bwd"],
         {"grad_loss_ptr": _F32, "coef_ptr": _F32, "mask_ptr": torch.uint8, "offsets_ptr": torch.int64,
          "grad_ptr": _F32}, (), {"HAS_MASK": True, "BLOCK_T": 4096}),
    ]


def launch_defaults(arch: int = 90) -> triton.Config:
    """What a kernel launched without a config gets: the backend's default warps and stages."""
    options = make_backend(GPUTarget("cuda", arch, 32)).parse_options({})
    return triton.Config({}, num_warps=options.num_warps, num_stages=options.num_stages)


def configs_of(kernel, pointers: dict | None = None, arch: int = 90) -> list:
    """An autotuned kernel's candidate configs for arguments of the given pointer dtypes (after its
    ``early_config_prune``: float32 inputs get one small tile), or, for a kernel launched without
    autotuning, the backend's defaults (``launch_defaults``: 4 warps, 3 stages)."""
    if not hasattr(kernel, "configs"):
        return [launch_defaults(arch)]
    prune = getattr(kernel, "early_config_prune", None)
    if prune is not None and pointers:
        return prune(kernel.configs, {name: torch.empty(0, dtype=dt) for name, dt in pointers.items()})
    return kernel.configs


def compile_kernel(kernel, pointers: dict, absent: set, fixed: dict, config: triton.Config, arch: int,
                   shape: str = "even"):
    """Compile one (kernel, config, absent pointers, shape) combination as a launch on the GPU would:
    Triton's own argument binder specializes the arguments (16-byte aligned pointers and ints divisible
    by 16 marked so, ints equal to 1 made constants, absent pointers constants), the heuristics and the
    config give the constexprs, the config the warps and stages. Returns the compiled kernel."""
    jit, rules = kernel, {}  # [Autotuner ->] [Heuristics ->] JITFunction
    while not isinstance(jit, triton.runtime.jit.JITFunction):
        rules = getattr(jit, "values", rules)
        if not hasattr(jit, "fn"):
            raise ValueError(f"kernel must be a JITFunction, got {type(jit).__name__}: unset TRITON_INTERPRET")
        jit = jit.fn
    scalars = scalar_arguments(shape)
    # pointers stand in as MockTensors (a dtype; data_ptr 0, aligned as the caching allocator's blocks are)
    args = {name: (None if name in absent else MockTensor(dt)) for name, dt in pointers.items()}
    args.update({name: scalars[name] for name in jit.arg_names if name not in args and name in scalars})
    args.update(fixed)
    args.update(config.kwargs)
    args.update({name: rule(args) for name, rule in rules.items()})
    missing = [name for name in jit.arg_names if name not in args]
    if missing:
        raise ValueError(f"no value for arguments {missing} of {jit.__name__}: add them to scalar_arguments")
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    launch = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    bound, specialization, options = binder(**{name: args[name] for name in jit.arg_names}, **launch)
    options, signature, constexprs, attrs = jit._pack_args(backend, launch, bound, specialization, options)
    return triton.compile(ASTSource(jit, signature, constexprs, attrs), target=target, options=options.__dict__)


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


def _explored(name: str) -> list:
    """Tile candidates beyond launch_config's, for a matmul kernel in 16-bit (``--explore``)."""
    tiles = {"forward": [{"BLOCK_N": n, "BLOCK_V": v, "BLOCK_D": k} for n, v in ((128, 128), (64, 256), (128, 256))
                         for k in (32, 64)],
             "dz": [{"BLOCK_D": k} for k in (32, 64, 128)],
             "dh": [{"BLOCK_M": m, "BLOCK_D": d, "BLOCK_K": k} for m, d in ((128, 128), (64, 128), (128, 256))
                    for k in (32, 64)],
             "dw": [{"BLOCK_M": m, "BLOCK_D": d, "BLOCK_K": k} for m, d in ((128, 128), (64, 128), (128, 256))
                    for k in (32, 64)]}
    return [triton.Config(dict(tile), num_warps=w, num_stages=st) for tile in tiles.get(name, [])
            for w, st in ((4, 3), (8, 3), (8, 4))]


def header(argv) -> str:
    """The report's first line: command, target, Triton version, conditions, date."""
    import datetime
    return (f"# python -m pacs_kernels.triton.compile_check {' '.join(argv)} (sm_{{arch}}, Triton {triton.__version__}, "
            "compiled on the CPU (no GPU) with the specializations a launch applies: 16-byte aligned pointers, "
            "sizes and strides as the launches pass them (scalar_arguments), unit strides constant; "
            f"TRITON_DEFAULT_FP_FUSION={os.environ.get('TRITON_DEFAULT_FP_FUSION', 'unset')}; "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%MZ})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"],
                        choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--all-configs", action="store_true", help="every autotune candidate and flag combination")
    parser.add_argument("--explore", action="store_true",
                        help="16-bit matmul kernels: also tiles, warps and stages launch_config does not list "
                             "(marked 'explore'; they do not count towards the verdict)")
    parser.add_argument("--kernels", nargs="+", default=None,
                        help="forward dz dh dw row_lse row_grad row_grad_probs group_fwd group_bwd (default: all)")
    args = parser.parse_args(argv)
    if launch_config.INTERPRETED:
        print("TRITON_INTERPRET is set: the kernels are interpreted functions; unset it", file=sys.stderr)
        return 2
    print(header(sys.argv[1:] if argv is None else argv).replace("{arch}", str(args.arch)))
    limit = SHARED_MEMORY_LIMIT.get(args.arch)
    failures = 0
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for name, kernel, pointers, optional, fixed in _kernels(dtype):
            if args.kernels and name not in args.kernels:
                continue
            configs = configs_of(kernel, pointers, args.arch)
            configs = configs if args.all_configs else configs[:1]
            listed = {launch_config.describe_config(config) for config in configs}
            if args.explore and dtype != torch.float32:
                configs = configs + [c for c in _explored(name) if launch_config.describe_config(c) not in listed]
            # every optional pointer present, then absent (the loss's usual launch: no bias, no entropy
            # gradient, no filter); with --all-configs also the filter's flags alone absent
            absents = [set(), set(optional)] if optional else [set()]
            if args.all_configs and "flags_ptr" in optional and len(optional) > 1:
                absents.insert(1, {"flags_ptr"})
            shapes = list(SHAPES) if args.all_configs else ["even"]
            for absent, shape in ((a, sh) for a in absents for sh in shapes):
                spill_free = 0
                for config in configs:
                    candidate = launch_config.describe_config(config) in listed
                    label = (f"{name:8s} {dtype_name:9s} {launch_config.describe_config(config)} {shape:6s} "
                             f"absent={sorted(absent) or '-'}{'' if candidate else ' explore'}")
                    start = time.perf_counter()
                    try:
                        compiled = compile_kernel(kernel, pointers, absent, fixed, config, args.arch, shape)
                    except Exception as exc:  # report every failure, then exit non-zero
                        failures += candidate
                        print(f"FAIL {label}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
                        continue
                    shared = compiled.metadata.shared
                    usage = resource_usage(compiled)
                    verdict = "ok  "
                    if limit is not None and shared > limit:
                        verdict = "OVER"
                        failures += candidate
                    elif usage.get("loop_spills", 0) > 0:
                        verdict = "SPILL"
                    else:
                        spill_free += candidate
                    regs = (f"regs={usage['registers']} stack={usage['stack']}B loop_spills={usage['loop_spills']} "
                            f"hgmma={usage['hgmma']} hmma={usage['hmma']} ") if usage else "regs=? "
                    print(f"{verdict} {label} stages={pipeline_stages(compiled)} {regs}shared={shared}B "
                          f"({time.perf_counter() - start:.1f}s)", flush=True)
                if spill_free == 0:  # the autotuner needs one candidate that keeps up
                    failures += 1
                    print(f"FAIL {name} {dtype_name} {shape} absent={sorted(absent) or '-'}: no candidate "
                          "compiled without spilling in its tensor-core loop")
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
