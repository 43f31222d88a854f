#!/usr/bin/env bash
# Creates (once) a GPU environment in .venv-gpu beside the CPU one (.venv): the CUDA build of torch, vLLM for
# GPUs, TRL and peft (LoRA), the benchmarks' peers (Liger-Kernel, Cut Cross-Entropy), every version pinned by
# requirements/lock-gpu.txt (Linux x86_64, Python 3.12; refreshed by scripts/refresh_gpu_lock.sh), then pacs
# itself (editable, no dependency resolution). No flash-attn (it builds from source): the trainer's attention
# is PyTorch's SDPA and its flash varlen kernel, vLLM brings its own. Several GB of downloads; the CPU
# commands (scripts/train.sh, scripts/test.sh) never run this.
#   bash scripts/setup_gpu_env.sh            # then: .venv-gpu/bin/torchrun --nproc-per-node=8 -m pacs train ...
#   PYTHON=python3.12 VENV=/path/to/venv bash scripts/setup_gpu_env.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3.12}"
venv="${VENV:-$root/.venv-gpu}"
lock="$root/requirements/lock-gpu.txt"
if ! command -v "$python" >/dev/null; then
  echo "[gpu setup] $python not found: the GPU lock is resolved for Python 3.12 (set PYTHON=... to another 3.12)" >&2
  exit 2
fi
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$lock"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e "$root"
"$venv/bin/python" -c "import torch, vllm, pacs; print('[gpu setup] torch', torch.__version__, '| CUDA available:', \
torch.cuda.is_available(), '| vllm', vllm.__version__)"
