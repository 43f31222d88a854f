#!/usr/bin/env bash
# One prepared GPU run (one GPU, no network): about 5 minutes expected, hard limits add up to 6m00s:
#   1. correctness at real shapes against a float32 chunked reference: the Triton kernels (the backward
#      with both GEMM engines), and every path of the fused loss (two passes, single pass with Triton row
#      kernels and with eager torch); on the first 4096-token case also GRPO, DAPO, Dr. GRPO, GSPO and CISPO
#      through fused_linear_objective_loss (single pass, two passes, packed) against each objective on the
#      reference log-probs
#   2a. the Triton backward's two gradient GEMMs on its staged dz chunks: our Triton kernels against
#      torch.mm (cuBLAS); the faster one is what the race below and "auto" afterwards use
#   2. the race at Qwen2.5-7B's head (d=3584, V=152064, N 8k-64k, bf16): naive, torch (two passes),
#      single_pass, single_pass_lowmem (groups larger than the budget, rebuilt in part), triton, and
#      the peers (Cut Cross-Entropy, Liger-Kernel) when importable; each
#      time over the 3-matmul floor at the matmul rate measured in the same run
#   3. dispatch.json (what backend/path "auto" should pick, by measurement) and the cost model's
#      predictions next to the measured times (roofline_measured.csv)
#   4. the long-context sweep (largest N within 40 GiB, naive vs Triton)
# PACS_GPU_PART=long runs instead, in a second call (hard limits add up to 6m45s), "how long can I train
# here", the most needed first (the session's 15 device minutes may cut the end of this call):
#   5. the trainer itself (pacs train on the built-in task: preflight, tiled MLP, split groups), resumed;
#      5b. pacs plan's predicted peak against one measured training step at Qwen2.5-1.5B's shape
#   6. the packed row's attention, forward + backward, at Qwen2.5-1.5B's and 7B's heads on N = 16384: one
#      flash varlen call (its first run on a GPU, checked against float32) vs SDPA per sequence vs padded rows
#   7. the tiled MLP's cost in step time (with and without checkpointing, L = 4096)
#   8. the longest response whose full training step (Qwen2.5-1.5B-shaped model, random weights)
#      fits 24 GiB, padded naive vs packed fused, the memory levers (tiled MLP included); 80 GiB
#      would share the same 100 s (every search cut short): run it by hand when there is time
# PACS_GPU_PART=grid runs instead, in a call of its own (limit 150s): the loss grid (benchmarks/loss_grid.py) at
# GPU shapes, naive, every path, auto, the peers and naive's 3 GEMMs alone (naive_gemms), first for PACS (budget
# 60s, limit 75s), then for DAPO (--objective dapo: naive, single_pass, two_pass, auto, CCE + the objective, Liger's
# fused linear GRPO loss with loss_type="dapo", naive_gemms; budget 60s, limit 75s); cases not started within a
# budget are listed as "budget". PACS_GRID
# picks the grid (gpu-quick | gpu, default gpu-quick: 3 points; the full gpu grid, 27 points, needs up to 10 minutes
# per objective: run loss_grid.py by hand for it). Files: log.txt, loss_grid_<grid>{,_dapo}.{csv,md,png} (7 of 8).
# (PACS_GPU_PART=all runs all three, for the CPU dry run.)
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
    gemm_args=(--set cpu --device cpu --d 32 --v 512 --n 64 128)
    long_args=(--device cpu --d 32 --v 512 --budget-mib 24 --n-start 256 --n-max 4096)
    long_train_args=(--dry-run)
    tiled_cost_args=(--dry-run)
    packed_attention_args=(--dry-run)
    plan_accuracy_args=(--dry-run)
    grid_args=(--grid dry --columns naive single_pass two_pass auto)
    smoke_steps=(2 3)
else
    check_args=(--device cuda)
    bench_args=(--set "$bench_set" --device cuda)
    gemm_args=(--set gpu --device cuda --n 8192 32768)  # Qwen2.5-7B's head; 1 GiB dz chunks, as the backward stages
    long_args=(--device cuda --budget-gib 40 --n-start 8192 --n-max 1048576)
    long_train_args=(--device cuda --budget-gib 24 --time-budget 100)  # 7 searches of ~14 s; 80 GiB: by hand
    tiled_cost_args=(--device cuda --repeats 5)
    packed_attention_args=(--device cuda --repeats 5)
    plan_accuracy_args=()
    grid_args=(--grid "${PACS_GRID:-gpu-quick}" --device cuda)
    smoke_steps=(4 6)
fi
part="${PACS_GPU_PART:-race}"
case "$part" in race|long|grid|all) ;; *) echo "PACS_GPU_PART must be race, long, grid or all, got '$part'" >&2; exit 2;; esac

if [ "$part" = "grid" ] || [ "$part" = "all" ]; then
    # two halves of the part's 150 s: each grid stops starting cases after its budget, its timeout is the backstop
    stamp "grid 1/2: the PACS loss at GPU shapes, naive / paths / auto / peers (budget 60s, limit 75s)"
    timeout 75 "$py" benchmarks/loss_grid.py "${grid_args[@]}" --time-budget 60 --out "$out" \
        || { echo "!!! PACS loss grid exited with $?"; status=1; }
    stamp "grid 2/2: the DAPO loss at the same shapes, naive / paths / auto / CCE / Liger's fused loss (budget 60s, limit 75s)"
    timeout 75 "$py" benchmarks/loss_grid.py "${grid_args[@]}" --objective dapo --time-budget 60 --out "$out" \
        || { echo "!!! DAPO loss grid exited with $?"; status=1; }
fi

if [ "$part" = "race" ] || [ "$part" = "all" ]; then

# the limit leaves room for compiling every kernel variant the cases need (about 40, a second or two
# each on the host CPU): the race below then finds them in Triton's on-disk cache
stamp "1/4 correctness at real shapes (limit 110s)"
timeout 110 "$py" benchmarks/check_gpu_correctness.py "${check_args[@]}" --peers without
rc=$?
if [ $rc -ne 0 ]; then
    echo "!!! CORRECTNESS CHECK FAILED OR TIMED OUT (exit $rc): the benchmark numbers below are not trustworthy"
    status=1
fi
stamp "1b/4 peers' log-probs against the same reference, informational (limit 15s; compiles their kernels)"
timeout 15 "$py" benchmarks/check_gpu_correctness.py "${check_args[@]}" --peers only \
    || echo "(peer check exited with $?; the benchmark records each peer's own status)"

stamp "2a/4 the Triton backward's gradient GEMMs: our kernels vs torch.mm / cuBLAS (budget 10s, limit 35s)"
timeout 25 "$py" benchmarks/run.py "${gemm_args[@]}" --out "$out" --name gpu_grad_gemms --ops grad_gemms \
    --impls torch triton --warmup 1 --repeats 3 --max-seconds 1.5 --time-budget 10 \
    || { echo "!!! grad-GEMM race exited with $?"; status=1; }
# the race below runs the Triton backward with the engine measured faster just now
if timeout 10 "$py" benchmarks/dispatch_table.py "$out/gpu_grad_gemms.csv" --out "$out/grad_gemms"; then
    export PACS_BENCH_DISPATCH_TABLE="$out/grad_gemms/dispatch.json"  # read by benchmarks/ops.py
else
    echo "!!! the grad-GEMM table exited with $?: the race runs the default engine (cuBLAS)"; status=1
fi

stamp "2/4 the race, benchmark set '$bench_set' with peers (budget 115s, limit 145s)"
timeout 145 "$py" benchmarks/run.py "${bench_args[@]}" --out "$out" --name gpu \
    --ops pacs_loss_fwd_bwd pacs_loss_first_step logprobs_fwd_bwd \
    --impls naive torch single_pass single_pass_lowmem triton cce cce_exact liger_flce liger_chunked \
    --warmup 1 --repeats 3 --max-seconds 1.5 --time-budget 115 \
    --note "one GPU lent for a single prepared run; peers installed from wheels without network"
rc=$?
if [ $rc -ne 0 ]; then
    echo "!!! benchmark exited with $rc; rebuilding the table and plots from the rows it wrote"
    "$py" benchmarks/run.py "${bench_args[@]}" --out "$out" --name gpu --report-only
    status=1
fi

stamp "3/4 dispatch table and the cost model, measured vs predicted (limit 20s)"
rate=$("$py" -c "import csv,sys; r=[x['matmul_tflops'] for x in csv.DictReader(open(sys.argv[1])) if x.get('matmul_tflops')]; print(r[0] if r else '')" "$out/gpu.csv" 2>/dev/null)
gemm_csv=(); [ -f "$out/gpu_grad_gemms.csv" ] && gemm_csv=("$out/gpu_grad_gemms.csv")
timeout 10 "$py" benchmarks/dispatch_table.py "$out/gpu.csv" ${gemm_csv[@]+"${gemm_csv[@]}"} --out "$out" \
    || { echo "!!! dispatch table exited with $?"; status=1; }
timeout 10 "$py" benchmarks/roofline.py ${rate:+--matmul-tflops "$rate"} --measured "$out/measured_for_roofline.csv" \
    --out "$out" > /dev/null || { echo "!!! roofline exited with $?"; status=1; }
[ -f "$out/roofline_measured.csv" ] && cat "$out/roofline_measured.csv"

stamp "4/4 long-context sweep, 40 GiB budget (15s of trials, limit 35s)"
timeout 35 "$py" benchmarks/long_context.py "${long_args[@]}" --time-budget 15 --out "$out" \
    || { echo "!!! long-context sweep exited with $?"; status=1; }

fi

if [ "$part" = "long" ] || [ "$part" = "all" ]; then
    # the trainer itself on this device, first: the built-in task, HF generation (no vLLM here), the
    # preflight, the tiled MLP, checkpointing and a token budget that splits groups; then a resume
    rm -rf /tmp/pacs-train-smoke  # a rerun on a warm machine starts afresh (a used output dir is refused)
    smoke=(--output-dir /tmp/pacs-train-smoke advanced.task.cache_dir=/tmp/pacs-smoke-cache advanced.task.warmup_steps=200
           rollout.engine=hf eval.every=0 eval.num_problems=16 checkpoint_every=2 advanced.plot=false advanced.train.preflight=true
           train.tiled_mlp=true model.gradient_checkpointing=true train.max_tokens_per_micro_batch=64)
    # (the first call compiles every Triton kernel it meets at this model's shapes: the generous first limit)
    stamp "5/8 the trainer on this device: ${smoke_steps[0]} steps, then resumed to ${smoke_steps[1]} (limit 145s)"
    smoke_log=/tmp/pacs-train-smoke.log
    { timeout 100 "$py" -m pacs train "${smoke[@]}" --max-steps "${smoke_steps[0]}" \
        && timeout 45 "$py" -m pacs train "${smoke[@]}" --max-steps "${smoke_steps[1]}" --resume; } 2>&1 \
        | tee "$smoke_log" || { echo "!!! the trainer's smoke run exited with $?"; status=1; }
    # bf16 autocast over float32 weights: every packed configuration must run PyTorch's flash varlen kernel (the CPU
    # has none: nothing reported there)
    if [ "${PACS_GPU_DRY_RUN:-0}" != "1" ]; then
        grep -q "packed attention: .*one flash varlen call" "$smoke_log" \
            && ! grep -q "packed attention: .*SDPA once per sequence" "$smoke_log" \
            || { echo "!!! the trainer's packed attention did not run the flash varlen kernel (see its line above)"; status=1; }
    fi
    cp /tmp/pacs-train-smoke/metrics.jsonl "$out/train_smoke_metrics.jsonl" 2>/dev/null  # not the model
    # model.dtype auto on a GPU: bfloat16 compute over float32 master weights; every update must move the weights
    "$py" - /tmp/pacs-train-smoke/metrics.jsonl <<'PY' || { echo "!!! the smoke run's weights did not move"; status=1; }
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if '"update_nonzero_frac"' in line]
moved = [row["update_nonzero_frac"] for row in rows if row["update_nonzero_frac"] is not None]
print(f"update_nonzero_frac per step (bf16 compute, float32 master weights): {moved}")
sys.exit(0 if moved and min(moved) > 0.99 else 1)
PY
    # the memory planner (pacs plan) against one real-architecture step on this GPU: its CSV goes into log.txt
    stamp "5b/8 pacs plan vs a measured step at Qwen2.5-1.5B's shape, bf16 over float32 masters (limit 45s)"
    rm -rf /tmp/pacs-plan-accuracy
    timeout 45 "$py" benchmarks/plan_accuracy.py --device cuda ${plan_accuracy_args[@]+"${plan_accuracy_args[@]}"} \
        --out /tmp/pacs-plan-accuracy || { echo "!!! pacs plan's prediction missed by more than 15% (or failed): $?"; status=1; }
    cat /tmp/pacs-plan-accuracy/plan_accuracy_gpu.csv 2>/dev/null
    # its CSV is written after every case; an error over tolerance (or an engine's failure) exits 1
    stamp "6/8 the packed row's attention: flash varlen vs SDPA per sequence vs padded (budget 15s, limit 25s)"
    timeout 25 "$py" benchmarks/packed_attention.py "${packed_attention_args[@]}" --time-budget 15 --out "$out" \
        || { echo "!!! packed-attention benchmark exited with $?"; status=1; }
    # its table goes into log.txt, not into a file of its own: the device tool brings back 8 files at most, and
    # this part writes 8 without it (log, smoke metrics, this CSV, the tiled-MLP cost's 2, the sweep's 3)
    cat "$out"/packed_attention_*.md 2>/dev/null && rm -f "$out"/packed_attention_*.md
    stamp "7/8 what the tiled MLP costs in step time, Qwen2.5-1.5B shapes, L = 4096 (limit 50s)"
    timeout 50 "$py" benchmarks/tiled_mlp_cost.py "${tiled_cost_args[@]}" --out "$out" \
        || { echo "!!! tiled-MLP cost exited with $?"; status=1; }
    # last: its CSV is written after every trial, so a call cut short keeps what it measured
    stamp "8/8 how long can I train here: Qwen2.5-1.5B shapes, 24 GiB (budget 100s, limit 140s)"
    timeout 140 "$py" benchmarks/long_context_train.py "${long_train_args[@]}" --out "$out/long_context_train" \
        || { echo "!!! long-context training sweep exited with $?"; status=1; }
fi

stamp "done (exit $status); files in $out:"
ls -la "$out" "$out"/plots_gpu 2>/dev/null
exit $status
