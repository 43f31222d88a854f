#!/usr/bin/env bash
# The kernels against the GPU machine's Triton (3.6; the project's .venv has a newer one), without a GPU:
# a separate venv (torch CPU + triton==3.6.0) runs the Triton tests in the interpreter and compiles every
# kernel candidate for sm_90. Not part of the test suite (it installs a second Triton); run it after a
# kernel change, before the next GPU run.
# Usage: bash scripts/check_gpu_triton.sh [VENV_DIR]      (default /tmp/pacs-triton36; about 2 minutes)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-/tmp/pacs-triton36}"
triton_version="3.6.0"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  # numpy < 2.3: Triton 3.6's interpreter converts 1-element arrays to scalars, which numpy 2.4 refuses
  # (an interpreter-only failure: the compiled kernels never see numpy)
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0" "triton==$triton_version" \
    "numpy<2.3" pytest pyyaml
fi
cd "$root"
"$venv/bin/python" -c "import triton; print('triton', triton.__version__)"
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_compact_tiles.py tests/test_single_pass.py \
  tests/test_triton_backward.py tests/test_linear_logprobs.py tests/test_linear_logprobs_errors.py \
  tests/test_known_grad.py tests/test_first_step_fast_path.py tests/test_grpo_loss.py tests/test_pacs_loss.py
env -u TRITON_INTERPRET TRITON_DEFAULT_FP_FUSION=1 "$venv/bin/python" -m pacs_kernels.triton.compile_check \
  --all-configs --dtypes bfloat16 float32
