#!/usr/bin/env bash
# One prepared GPU run (one GPU, no network): about 4.5 minutes expected, hard limits add up to 5m45s:
#   1. correctness of the Triton kernels at real shapes against a float32 chunked reference
#   2. the GPU benchmark set, with the peers (Cut Cross-Entropy, Liger-Kernel) when importable
#   3. the long-context sweep (largest N within 40 GiB, naive vs Triton)
# Usage: bash benchmarks/gpu.sh OUT_DIR        (run from anywhere; writes CSV, PNG, Markdown, log)
# Peers: wheels in .whl/ (see benchmarks/README.md) are installed into /tmp/site when present.
# Environment knobs: PACS_BENCH_SET (gpu | gpu-quick | gpu-full, default gpu), PYTHON (default python3),
# PACS_GPU_DRY_RUN=1: the same three steps on the CPU at tiny shapes (checks this script's plumbing).
set -uo pipefail

if [ $# -ne 1 ]; then
    echo "usage: bash benchmarks/gpu.sh OUT_DIR" >&2
    exit 2
fi
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$1"
out="$(cd "$1" && pwd)"
log="$out/log.txt"
py="${PYTHON:-python3}"
bench_set="${PACS_BENCH_SET:-gpu}"
site="${PACS_PEER_SITE:-/tmp/site}"
cd "$root"
exec > >(tee -a "$log") 2>&1

started=$(date +%s)
stamp() { echo "=== [$(( $(date +%s) - started ))s] $*"; }
status=0

stamp "pacs GPU run, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>/dev/null || true

if compgen -G ".whl/*.whl" > /dev/null; then
    stamp "installing peer wheels from .whl/ into $site"
    wheels=(.whl/*.whl)
    # packaging (needed by liger-kernel) only when the machine lacks it: never shadow its own copy
    if "$py" -c "import packaging" 2>/dev/null; then
        wheels=($(printf '%s\n' "${wheels[@]}" | grep -v '/packaging-'))
    fi
    # pure-Python wheels: unzipping them is an install too, for a machine without pip
    "$py" -m pip install -q --no-index --no-deps --target "$site" "${wheels[@]}" \
        || "$py" -c "import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]" \
            "$site" "${wheels[@]}" \
        || echo "wheel install failed; peers will be skipped"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
"$py" - <<'EOF'
import importlib, torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
for name in ("triton", "cut_cross_entropy", "liger_kernel"):
    try:
        module = importlib.import_module(name)
        print(f"{name}: {getattr(module, '__version__', 'importable')}")
    except Exception as exc:
        print(f"{name}: not importable ({type(exc).__name__}: {exc})")
EOF

# the CPU dry run swaps in tiny shapes; everything else is the same
if [ "${PACS_GPU_DRY_RUN:-0}" = "1" ]; then
    check_args=(--device cpu --small)
    bench_args=(--set cpu --device cpu --d 32 --v 512 --n 64 128)
    long_args=(--device cpu --d 32 --v 512 --budget-mib 24 --n-start 256 --n-max 4096)
else
    check_args=(--device cuda)
    bench_args=(--set "$bench_set" --device cuda)
    long_args=(--device cuda --budget-gib 40 --n-start 8192 --n-max 1048576)
fi

stamp "1/3 correctness at real shapes (limit 70s)"
timeout 70 "$py" benchmarks/check_gpu_correctness.py "${check_args[@]}" --peers without
rc=$?
if [ $rc -ne 0 ]; then
    echo "!!! CORRECTNESS CHECK FAILED OR TIMED OUT (exit $rc): the benchmark numbers below are not trustworthy"
    status=1
fi
stamp "1b/3 peers' log-probs against the same reference, informational (limit 40s; compiles their kernels)"
timeout 40 "$py" benchmarks/check_gpu_correctness.py "${check_args[@]}" --peers only \
    || echo "(peer check exited with $?; the benchmark records each peer's own status)"

stamp "2/3 benchmark set '$bench_set' with peers (budget 140s, limit 175s)"
timeout 175 "$py" benchmarks/run.py "${bench_args[@]}" --out "$out" --name gpu \
    --warmup 1 --repeats 3 --max-seconds 1.5 --time-budget 140 \
    --note "one GPU lent for a single prepared run; peers installed from wheels without network"
rc=$?
if [ $rc -ne 0 ]; then
    echo "!!! benchmark exited with $rc; rebuilding the table and plots from the rows it wrote"
    "$py" benchmarks/run.py "${bench_args[@]}" --out "$out" --name gpu --report-only
    status=1
fi

stamp "3/3 long-context sweep, 40 GiB budget (30s of trials, limit 60s)"
timeout 60 "$py" benchmarks/long_context.py "${long_args[@]}" --time-budget 30 --out "$out" \
    || { echo "!!! long-context sweep exited with $?"; status=1; }

stamp "done (exit $status); files in $out:"
ls -la "$out" "$out"/plots_gpu 2>/dev/null
exit $status
