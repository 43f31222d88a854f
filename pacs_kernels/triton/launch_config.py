"""Launch settings shared by the log-prob kernels: autotune candidates, vocabulary split, dz chunk.

On CUDA each kernel is wrapped in ``triton.autotune`` over a small set of tile configurations,
keyed on the model width and vocabulary size (Triton adds the tensor dtypes to the key), so the
first call at a new (d, V, dtype) benchmarks the candidates and later calls reuse the winner.
Under ``TRITON_INTERPRET=1`` every kernel gets exactly one small configuration: autotuning in the
interpreter would only be slow, and small tiles make the CPU tests cover many tiles, ragged
edges and several vocabulary splits on tiny shapes.

Which candidate wins on a given GPU is only known after a run there; the candidates below are
the usual tensor-core tile shapes (bf16 inputs, fp32 accumulation), not measured picks, kept to
those that compile for sm_90 without spilling inside their tensor-core loop, as the GPU compiles
them: with the specializations a launch applies (aligned pointers, sizes divisible by 16, unit
strides constant; ``python -m pacs_kernels.triton.compile_check --all-configs --explore``,
benchmarks/results/triton_compile_sm90.txt). Compiled that way every matmul kernel's loads are
pipelined as deep as its config asks (3 or 4 stages; compiled without them, as the check did
before, they got one stage and about 250 registers, and tiles were dropped as "spilling" that do
not spill): 256-column logits tiles with 32-wide width steps and 4-stage variants are back, and
128 x 256 output tiles for the gradient matmuls; 4-warp tiles still spill (the logits tiles by
hundreds of bytes per thread in their loop) and 128 x 256 logits tiles too, so they stay out.
The first candidate of each kernel compiles clean with every optional input present (the
check's default run asks that). Few: every candidate is compiled on first use (a second or two
each on the host CPU), and the GPU run has minutes, not hours. float32 inputs get one small tile
(FLOAT32_CONFIGS).
"""

from __future__ import annotations

import math

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def _probe():
    pass


# True when TRITON_INTERPRET=1 was set before triton decorated our kernels (CPU tensors then work).
INTERPRETED = isinstance(_probe, InterpretedFunction)

# The dz kernel's tile is fixed (not tuned): it is also the granularity of the gradient-filter
# flags, which the two gradient matmuls read with their own (smaller or equal) tiles.
DZ_TILE_GPU = (128, 128)
DZ_TILE_INTERPRETER = (16, 32)
DZ_BLOCK_N, DZ_BLOCK_V = DZ_TILE_INTERPRETER if INTERPRETED else DZ_TILE_GPU

# Every vocabulary split of the forward is a multiple of this many columns (a multiple of every
# BLOCK_V candidate), so the split can be chosen on the host before the autotuner picks BLOCK_V.
SPLIT_ALIGN = 256

# Tokens per dz chunk in the backward: the staged dz buffer (chunk x V, input dtype) stays under
# this many bytes unless one token block alone is larger.
DZ_CHUNK_BYTES = 1 << 30


def describe_config(config: triton.Config) -> str:
    """A config in one short token: [BLOCK_N=128,BLOCK_V=128 w8 s3]."""
    tiles = ",".join(f"{k}={v}" for k, v in config.kwargs.items())
    return f"[{tiles or '-'} w{config.num_warps} s{config.num_stages}]"


def _configs(tiles, warps_stages):
    return [triton.Config(dict(tile), num_warps=w, num_stages=s) for tile in tiles for (w, s) in warps_stages]


def forward_configs() -> list[triton.Config]:
    """Candidates for the forward (online log-sum-exp) kernel: BLOCK_N x BLOCK_V logits tiles."""
    if INTERPRETED:
        return [triton.Config({"BLOCK_N": 16, "BLOCK_V": 32, "BLOCK_D": 16}, num_warps=4, num_stages=1)]
    # first: 64 x 256 (the H200 run's pick at both widths it timed; clean with bias and entropy too, where the
    # 128 x 128 tile spills two instructions in its loop), then 4 stages, and the 32-wide width step that stays
    # clean at widths that are not multiples of 16
    return [triton.Config({"BLOCK_N": 64, "BLOCK_V": 256, "BLOCK_D": 64}, num_warps=8, num_stages=3),
            triton.Config({"BLOCK_N": 128, "BLOCK_V": 128, "BLOCK_D": 64}, num_warps=8, num_stages=3),
            triton.Config({"BLOCK_N": 64, "BLOCK_V": 256, "BLOCK_D": 64}, num_warps=8, num_stages=4),
            triton.Config({"BLOCK_N": 64, "BLOCK_V": 256, "BLOCK_D": 32}, num_warps=8, num_stages=4)]


def dz_configs() -> list[triton.Config]:
    """Candidates for the dz kernel: the tile is fixed (DZ_BLOCK_N x DZ_BLOCK_V), the inner
    width step and pipeline stages are tuned."""
    if INTERPRETED:
        return [triton.Config({"BLOCK_D": 16}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_D": 64}, num_warps=8, num_stages=3),
            triton.Config({"BLOCK_D": 32}, num_warps=8, num_stages=4),
            triton.Config({"BLOCK_D": 64}, num_warps=8, num_stages=4)]


def grad_matmul_configs() -> list[triton.Config]:
    """Candidates for the two gradient matmuls (dh = dz @ W, dW = dz.T @ h): output tile
    BLOCK_M x BLOCK_D, reduction step BLOCK_K. BLOCK_M and BLOCK_K divide the dz tile, so a
    reduction step never straddles two filter flags."""
    if INTERPRETED:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_D": 16, "BLOCK_K": 16}, num_warps=4, num_stages=1)]
    return _configs([{"BLOCK_M": 128, "BLOCK_D": 128, "BLOCK_K": 64}, {"BLOCK_M": 64, "BLOCK_D": 128, "BLOCK_K": 64},
                     {"BLOCK_M": 128, "BLOCK_D": 128, "BLOCK_K": 32}], [(8, 3)]) + [
        triton.Config({"BLOCK_M": 128, "BLOCK_D": 128, "BLOCK_K": 64}, num_warps=8, num_stages=4),
        triton.Config({"BLOCK_M": 128, "BLOCK_D": 256, "BLOCK_K": 64}, num_warps=8, num_stages=3)]


# The gradient matmuls walk their output tiles in bands of this many tile rows (grad_matmuls.grouped_tile):
# dW's programs that share a dz strip, and dh's that share a dz row block, run together. 8 bands the way
# Triton's matmul tutorial groups its tiles (a wave of 132 programs then covers 8 x ~16 tiles); in the
# interpreter 3, so that small test shapes have several bands and a narrower last one.
GRAD_GROUP_ROWS = 3 if INTERPRETED else 8


# float32 inputs multiply exactly on CUDA cores (no TF32; reached only with an explicit
# backend="triton", auto sends them to cuBLAS): one small tile per kernel, no autotuning. The
# tensor-core tiles above spill hundreds of bytes per thread in float32 and take seconds each to
# compile; these compile for sm_90 without spilling in their loops.
FLOAT32_CONFIGS = {
    "forward": triton.Config({"BLOCK_N": 64, "BLOCK_V": 64, "BLOCK_D": 32}, num_warps=8, num_stages=2),
    "dz": triton.Config({"BLOCK_D": 16}, num_warps=8, num_stages=2),
    "grad_matmul": triton.Config({"BLOCK_M": 64, "BLOCK_D": 64, "BLOCK_K": 32}, num_warps=8, num_stages=2),
}


def float32_gets_one_tile(kind: str, pointer: str):
    """``early_config_prune`` for ``triton.autotune``: when the tensor named ``pointer`` is float32,
    the kernel runs FLOAT32_CONFIGS[kind] alone; 16-bit inputs race the tensor-core candidates
    (the autotuner keys on the argument dtypes, so each dtype keeps its own pick)."""
    def prune(configs, named_args, **kwargs):
        if not INTERPRETED and named_args[pointer].dtype == torch.float32:
            return [FLOAT32_CONFIGS[kind]]
        return configs
    return prune


def vocab_split(n_tokens: int, vocab: int, device: torch.device, splits: int | None) -> tuple[int, int]:
    """Split the vocabulary across forward programs when too few token blocks fill the GPU.

    Args:
        n_tokens, vocab: the problem size.
        device: where the kernel runs (the SM count sets the default number of splits).
        splits: requested number of splits, or None for the default.

    Returns:
        (split_size, n_splits): columns per split (a multiple of SPLIT_ALIGN) and the number of
        splits; every split starts inside the vocabulary and n_splits <= 65535 (grid limit).
    """
    n_blocks = math.ceil(n_tokens / 128)  # the largest BLOCK_N candidate: a conservative count
    if splits is None:
        if device.type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            target_programs = 2 * sms
        else:
            target_programs = 1
        splits = max(1, math.ceil(target_programs / max(n_blocks, 1)))
    n_aligned = math.ceil(vocab / SPLIT_ALIGN)
    splits = max(1, min(int(splits), n_aligned, 65535))
    split_size = math.ceil(n_aligned / splits) * SPLIT_ALIGN
    return split_size, math.ceil(vocab / split_size)


def dz_chunk_tokens(n_tokens: int, vocab: int, itemsize: int, chunk_tokens: int | None = None) -> int:
    """Tokens per backward chunk: the (chunk, V) dz buffer of ``itemsize``-byte elements fits
    DZ_CHUNK_BYTES; a multiple of DZ_BLOCK_N, at least one block, at most all tokens."""
    if chunk_tokens is None:
        chunk_tokens = DZ_CHUNK_BYTES // max(vocab * itemsize, 1)
    if chunk_tokens >= n_tokens:
        return max(n_tokens, 1)
    blocks = max(1, int(chunk_tokens) // DZ_BLOCK_N)
    return min(blocks * DZ_BLOCK_N, n_tokens)


# Offsets inside a tile are int32 (64-bit ones cost registers the tensor-core loops need): every
# (row, column) offset of a tile, at most (MAX_BLOCK - 1) * (stride_0 + stride_1), must fit.
MAX_BLOCK = 256
_INT32_LIMIT = 2**31


def with_int32_tile_offsets(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (2-D), or a contiguous copy when a view's strides are too large for int32 offsets
    inside a tile (a slice of a much wider buffer); a clear error if even the copy's are."""
    def fits(t):
        return (MAX_BLOCK - 1) * (abs(t.stride(0)) + abs(t.stride(1))) < _INT32_LIMIT
    if fits(tensor):
        return tensor
    tensor = tensor.contiguous()
    if not fits(tensor):
        raise ValueError(f"{name} of shape {tuple(tensor.shape)} is too wide for the Triton kernels' int32 offsets "
                         f"inside a tile (width x {MAX_BLOCK} must stay below 2**31); use backend='torch'")
    return tensor


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs get exact fp32 products (no TF32): a log-prob kernel must not be approximate."""
    return "ieee" if dtype == torch.float32 else "tf32"


def upcast_dots(dtype: torch.dtype) -> bool:
    """Triton 3.9's interpreter returns garbage for tl.dot on bfloat16 tiles; there (and only
    there) the kernels round through bfloat16 exactly as on the GPU and multiply in float32."""
    return INTERPRETED and dtype == torch.bfloat16


class RestoreOutputs:
    """Autotuner hooks for a kernel that adds into its outputs (dW, db under ACCUMULATE): each benchmarked
    launch runs on copies' worth of state, the outputs copied before and put back after, so timing the
    candidates leaves no trace in the gradients. An output that is absent in a call (None: no bias, or dW
    not wanted) is skipped; Triton's own ``restore_value`` clones every named argument in Triton 3.6 (the
    GPU machine's) and would fail on ``None`` at the first autotuned backward. Only the autotuner's
    benchmark calls these hooks, never the launch that computes the result.
    """

    SAVED = "_pacs_restore_copies"  # the copies ride in the launch's own argument dict, not on this object:
                                    # two threads racing at once (one process, several GPUs) keep theirs apart

    def __init__(self, *names: str):
        self.names = names

    def pre_hook(self, kwargs: dict, reset_only: bool = False) -> None:
        if not reset_only:  # reset_only: after the race, before the winner's launch (nothing to reset here)
            kwargs[self.SAVED] = {name: kwargs[name].clone() for name in self.names if kwargs.get(name) is not None}

    def post_hook(self, kwargs: dict, exception) -> None:
        for name, copy in kwargs.pop(self.SAVED, {}).items():
            kwargs[name].copy_(copy)
