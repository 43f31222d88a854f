"""Test set-up. Triton kernels run on the CPU through Triton's interpreter, which must be
switched on before triton (and our kernels) are first imported."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    """path="auto"'s device calibration (pacs_kernels/path_choice.py) stays in memory: tests write no cache
    under the home directory."""
    from pacs_kernels import path_choice

    path_choice.set_disk_cache(False)
