#!/usr/bin/env bash
# The README's main command: set up .venv on first use, then train. With no arguments this is the
# built-in "embedded" run (tiny model + addition task, CPU-friendly); arguments go to `pacs train`,
# e.g. `bash scripts/train.sh --config configs/grpo.yaml` or `--model /path/to/hf_model ...`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
cd "$root"
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"
exec "$root/.venv/bin/python" -m pacs train "$@"
