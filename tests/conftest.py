"""Test set-up. Triton kernels run on the CPU through Triton's interpreter, which must be
switched on before triton (and our kernels) are first imported."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# path="auto"'s device calibration stays in memory, in worker processes too (no cache under the home directory)
os.environ.setdefault("PACS_KERNELS_NO_DISK_CACHE", "1")

