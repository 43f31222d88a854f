"""Tile sizes and the vocabulary split, shared by the log-prob kernels."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def _probe():
    pass


# True when TRITON_INTERPRET=1 was set before triton decorated our kernels (CPU tensors then work).
INTERPRETED = isinstance(_probe, InterpretedFunction)


@dataclass(frozen=True)
class TileConfig:
    block_n: int
    block_v: int
    block_d: int
    num_warps: int
    num_stages: int


# GPU tiles (bf16/fp16 tensor cores, fp32 accumulation). Interpreter tiles are small so that
# the tests exercise many tiles, ragged edges and several vocabulary splits on tiny shapes.
FORWARD_GPU = TileConfig(block_n=128, block_v=128, block_d=64, num_warps=8, num_stages=3)
BACKWARD_GPU = TileConfig(block_n=64, block_v=128, block_d=64, num_warps=8, num_stages=3)
INTERPRETER = TileConfig(block_n=16, block_v=32, block_d=16, num_warps=4, num_stages=1)


def tile_config(pass_name: str) -> TileConfig:
    if INTERPRETED:
        return INTERPRETER
    return FORWARD_GPU if pass_name == "forward" else BACKWARD_GPU


def vocab_split(n_tokens: int, vocab: int, cfg: TileConfig, device: torch.device, splits: int | None):
    """Split the vocabulary across programs when there are too few token blocks to fill the GPU.

    Returns (tiles_per_split, n_splits). Every split starts inside the vocabulary.
    """
    n_blocks = math.ceil(n_tokens / cfg.block_n)
    n_tiles = math.ceil(vocab / cfg.block_v)
    if splits is None:
        if device.type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            target_programs = 2 * sms
        else:
            target_programs = 1
        splits = max(1, math.ceil(target_programs / max(n_blocks, 1)))
    splits = max(1, min(int(splits), n_tiles, 65535))
    tiles_per_split = math.ceil(n_tiles / splits)
    n_splits = math.ceil(n_tiles / tiles_per_split)
    return tiles_per_split, n_splits


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs get exact fp32 products (no TF32): a log-prob kernel must not be approximate."""
    return "ieee" if dtype == torch.float32 else "tf32"


def upcast_dots(dtype: torch.dtype) -> bool:
    """Triton 3.9's interpreter returns garbage for tl.dot on bfloat16 tiles; there (and only
    there) the kernels round through bfloat16 exactly as on the GPU and multiply in float32."""
    return INTERPRETED and dtype == torch.bfloat16
