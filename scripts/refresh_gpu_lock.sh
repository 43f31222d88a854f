#!/usr/bin/env bash
# Re-resolves requirements/lock-gpu.txt (the GPU environment of scripts/setup_gpu_env.sh) from pyproject.toml's
# extras for Linux x86_64 and Python 3.12, reading package metadata only (uv pip compile: no wheel is
# downloaded, seconds). tests/test_gpu_env_lock.py checks on every CI run that the lock still resolves.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
uv="$(command -v uv || true)"
if [ -z "$uv" ]; then
  tools="$(mktemp -d)"
  trap 'rm -rf "$tools"' EXIT
  python3 -m pip install -q --target "$tools" "uv==0.13.9"
  uv="$tools/bin/uv"
fi
cd "$root"
"$uv" pip compile pyproject.toml --extra dev --extra vllm --extra peers --extra math \
  --python-version 3.12 --python-platform x86_64-manylinux_2_28 -o requirements/lock-gpu.txt
