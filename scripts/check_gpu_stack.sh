#!/usr/bin/env bash
# Everything the GPU run will execute, against the GPU machine's package versions, without a GPU.
# The GPU machine (benchmarks/gpu.sh) has Triton 3.6.0, transformers 5.17.0 and accelerate 1.15.0; the
# project's .venv has newer ones (and vLLM, math-verify and TRL, which that machine lacks). A separate
# venv with those versions (torch stays the 2.13.0 CPU build: the GPU's 2.11 exists on PyPI only with
# CUDA) then
#   1. runs the Triton tests in the interpreter (the autotuner's race too: tests/test_autotune_race.py),
#   2. compiles every kernel candidate for sm_90 (spills, tensor cores: pacs_kernels/triton/compile_check.py),
#   3. runs the trainer's tests that the GPU run's `pacs train` relies on (model loading, the tiled MLP,
#      the preflight, packing, split groups, checkpoints and resume),
#   4. dry-runs both parts of benchmarks/gpu.sh on the CPU (tiny shapes; the output goes to a temp dir).
# Not part of the test suite (it installs a second stack); run it after a kernel, trainer or benchmark
# change, before the next GPU run.
# Usage: bash scripts/check_gpu_stack.sh [VENV_DIR]   (default /tmp/pacs-gpustack; about 6 minutes, +1 to
#        build the venv)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-/tmp/pacs-gpustack}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  # numpy < 2.3: Triton 3.6's interpreter converts 1-element arrays to scalars, which numpy 2.4 refuses
  # (an interpreter-only failure: the compiled kernels never see numpy). matplotlib, psutil, pandas,
  # tqdm, pyyaml, peft: also on the GPU machine.
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0" "triton==3.6.0" \
    "transformers==5.17.0" "accelerate==1.15.0" "numpy<2.3" peft safetensors pyyaml tqdm matplotlib psutil \
    pandas pytest
fi
cd "$root"
export PYTHONPATH="$root"
"$venv/bin/python" -c "import torch, triton, transformers, accelerate
print('torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__,
      '| accelerate', accelerate.__version__)"
echo "== 1/4 Triton tests in the interpreter"
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_autotune_race.py tests/test_compact_tiles.py \
  tests/test_single_pass.py tests/test_triton_backward.py tests/test_linear_logprobs.py tests/test_linear_logprobs_errors.py \
  tests/test_known_grad.py tests/test_first_step_fast_path.py tests/test_grpo_loss.py tests/test_pacs_loss.py
echo "== 2/4 every kernel candidate compiled for sm_90"
env -u TRITON_INTERPRET TRITON_DEFAULT_FP_FUSION=1 "$venv/bin/python" -m pacs_kernels.triton.compile_check \
  --all-configs --dtypes bfloat16 float32
echo "== 3/4 the trainer's tests (what gpu.sh's pacs train uses)"
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_model_forward.py tests/test_tiled_mlp.py \
  tests/test_preflight.py tests/test_trainer_e2e.py tests/test_memory_levers.py tests/test_packing.py \
  tests/test_split_groups.py tests/test_trainer_components.py tests/test_run_setup.py tests/test_sequence_parallel.py \
  tests/test_padding_free.py tests/test_varlen_attention.py
echo "== 4/4 benchmarks/gpu.sh, both parts, dry run"
dry="$(mktemp -d)"
PACS_GPU_DRY_RUN=1 PACS_GPU_PART=all PYTHON="$venv/bin/python" bash benchmarks/gpu.sh "$dry/out" > "$dry/log.txt" 2>&1 \
  || { tail -40 "$dry/log.txt"; echo "gpu.sh dry run failed: $dry/log.txt" >&2; exit 1; }
if grep -n '!!!' "$dry/log.txt"; then echo "gpu.sh dry run reported a failure: $dry/log.txt" >&2; exit 1; fi
echo "gpu.sh dry run: exit 0, no failure reported ($dry/log.txt)"
echo "GPU stack check passed"
