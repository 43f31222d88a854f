#!/usr/bin/env bash
# The prepared GPU run (one GPU, no network), in parts ordered by value; each part is one device call (or
# PACS_GPU_PART=all runs them in this order), and each part saves what it measured as it goes: after every
# step its folder is packed into OUT/<part>.tgz, so a call cut short still brings back what ran. Only
# OUT/log.txt and the parts' .tgz files are written to OUT (the device tool brings back 8 files at most); the
# parts' folders live under PACS_GPU_WORK (default /tmp/pacs-gpu-work).
#
# PACS_GPU_PART=race (default; hard limits add up to 8m15s):
#   1. correctness at real shapes of every kernel that changed, against a float32 chunked reference: the
#      Triton kernels (the backward with both GEMM engines: the dh/dW kernels walk their tiles in bands), every
#      path of the fused loss (two passes, single pass with Triton row kernels and with eager torch) and, on the
#      first 4096-token case, GRPO, DAPO, Dr. GRPO, GSPO and CISPO through fused_linear_objective_loss; at
#      Qwen2.5-7B's, Qwen2.5-1.5B's, Llama 3 8B's and Gemma 2's (256k vocabulary) heads
#   2. the Triton backward's gradient GEMMs on its staged dz chunks: our kernels vs torch.mm (cuBLAS); the
#      race below runs the faster one
#   3. the loss race at the heads users train (loss_grid.py --grid gpu-heads: Qwen2.5-1.5B and 7B, Llama 3 8B,
#      Gemma 2 2B; 8k and 32k tokens), ours only: single pass, two passes, one sweep, auto, and naive's 3 GEMMs
#      alone (the cuBLAS floor of the same work); 1 warm-up and 5 timed runs a cell; then dispatch.json (what
#      auto should pick there, by measurement) and the cost model against the measured times
#   4. auto against our fastest path at each point, the two alternated in one worker, 5 to 9 rounds
#      (loss_grid.py --paired)
# PACS_GPU_PART=long (training steps; hard limits add up to 6m45s):
#   5. the trainer itself (pacs train on the built-in task: preflight, tiled MLP, split groups), resumed;
#      pacs plan's predicted peak against one measured training step at Qwen2.5-1.5B's shape
#   6. the packed row's attention (flash varlen vs SDPA per sequence vs padded rows) at Qwen2.5-1.5B's and 7B's
#      heads; 7. the tiled MLP's cost in step time; 8. the longest response whose full training step
#      (Qwen2.5-1.5B-shaped model) fits 24 GiB, padded naive vs packed fused, the memory levers
# PACS_GPU_PART=peers (hard limits add up to 5m45s):
#   9. the peers' log-probs and gradients against the same reference (informational)
#  10. the peers at the same heads and tokens as step 3 (loss_grid.py --grid gpu-heads): naive, Cut
#      Cross-Entropy, Liger-Kernel's chunked step, TRL's fused log-prob kernel (trl.kernels, TRL 1.15+), each
#      with the PACS loss on its log-probs; a peer that cannot be imported is a row saying why
#  11. the log-prob race at Qwen2.5-7B's head (run.py, 8k and 32k tokens): naive, CCE (filtered and exact),
#      Liger's fused linear cross-entropy and chunked step, TRL's kernel, with our single pass and Triton two
#      passes timed in the same run; 12. the long-context sweep (largest N within 40 GiB, naive vs Triton)
# PACS_GPU_PART=grid: the PACS and DAPO loss grids at GPU shapes (loss_grid.py, PACS_GRID, default gpu-quick),
#   the peers included (Liger's fused linear GRPO loss for DAPO); 60 s budget each, 75 s limit each.
#
# Usage: bash benchmarks/gpu.sh [--dry-run] OUT_DIR   (run from anywhere)
#   --dry-run (or PACS_GPU_DRY_RUN=1): every step's script on the CPU at tiny shapes (the Triton interpreter for
#   the kernels), every part unless PACS_GPU_PART names one, each step's limit 5 times its GPU limit: checks this
#   script's plumbing (all four parts took 20 min on 2 shared CPU cores under a load average of 16, 2026-12-07).
# Peers: wheels in .whl/ (see benchmarks/README.md) are installed into /tmp/site when present.
# Environment knobs: PACS_GPU_PART (race | long | peers | grid | all), PACS_GRID, PYTHON (default python3),
# PACS_GPU_WORK (the parts' folders).
set -uo pipefail

dry="${PACS_GPU_DRY_RUN:-0}"
if [ "${1:-}" = "--dry-run" ]; then
    dry=1
    shift
fi
if [ $# -ne 1 ]; then
    echo "usage: bash benchmarks/gpu.sh [--dry-run] OUT_DIR" >&2
    exit 2
fi
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$1"
out="$(cd "$1" && pwd)"
log="$out/log.txt"
py="${PYTHON:-python3}"
site="${PACS_PEER_SITE:-/tmp/site}"
if [ "$dry" = "1" ]; then
    part="${PACS_GPU_PART:-all}"
    work="${PACS_GPU_WORK:-$out/work}"
else
    part="${PACS_GPU_PART:-race}"
    work="${PACS_GPU_WORK:-/tmp/pacs-gpu-work}"
fi
case "$part" in race|long|peers|grid|all) ;; *) echo "PACS_GPU_PART must be race, long, peers, grid or all, got '$part'" >&2; exit 2;; esac
cd "$root"
exec > >(tee -a "$log") 2>&1

# limit SECONDS: a step's hard limit; the CPU dry run allows 5 times as long (a shared CPU, the interpreter)
limit() { if [ "$dry" = "1" ]; then echo $(( $1 * 5 )); else echo "$1"; fi; }
started=$(date +%s)
stamp() { echo "=== [$(( $(date +%s) - started ))s] $*"; }
status=0
current=""
# begin_part NAME: the part's folder (emptied: a rerun on a warm machine starts afresh)
begin_part() {
    current="$1"
    dir="$work/$1"
    rm -rf "$dir"
    mkdir -p "$dir"
}
# save: pack the current part's folder into OUT/<part>.tgz (after every step, so a cut call keeps what ran)
save() {
    tar czf "$out/$current.tgz.tmp" -C "$work" "$current" && mv "$out/$current.tgz.tmp" "$out/$current.tgz" \
        || echo "!!! could not pack $work/$current into $out/$current.tgz"
}

stamp "pacs GPU run, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), part $part$([ "$dry" = "1" ] && echo ', CPU dry run')"
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
for name in ("triton", "cut_cross_entropy", "liger_kernel", "trl"):
    try:
        module = importlib.import_module(name)
        print(f"{name}: {getattr(module, '__version__', 'importable')}")
    except Exception as exc:
        print(f"{name}: not importable ({type(exc).__name__}: {exc})")
try:
    from trl.kernels import ChunkedLogProbFunction  # noqa: F401
    print("trl.kernels.ChunkedLogProbFunction: importable (the TRL peer runs)")
except Exception as exc:
    print(f"trl.kernels.ChunkedLogProbFunction: not importable, the TRL peer is skipped ({type(exc).__name__}: {exc})")
EOF

# the CPU dry run swaps in tiny shapes; everything else is the same
if [ "$dry" = "1" ]; then
    check_args=(--device cpu --small)
    heads_args=(--grid dry)
    race_args=(--set cpu --device cpu --d 32 --v 512 --n 64)
    gemm_args=(--set cpu --device cpu --d 32 --v 512 --n 64 128)
    long_args=(--device cpu --d 32 --v 512 --budget-mib 24 --n-start 256 --n-max 4096)
    long_train_args=(--dry-run)
    tiled_cost_args=(--dry-run)
    packed_attention_args=(--dry-run)
    plan_accuracy_args=(--dry-run)
    grid_args=(--grid dry --columns naive single_pass two_pass auto)
    grid_name=dry
    smoke_steps=(2 3)
else
    check_args=(--device cuda)
    heads_args=(--grid gpu-heads --device cuda)
    race_args=(--set gpu --device cuda --n 8192 32768)  # Qwen2.5-7B's head
    gemm_args=(--set gpu --device cuda --n 8192 32768)  # Qwen2.5-7B's head; 1 GiB dz chunks, as the backward stages
    long_args=(--device cuda --budget-gib 40 --n-start 8192 --n-max 1048576)
    long_train_args=(--device cuda --budget-gib 24 --time-budget 100)  # 7 searches of ~14 s; 80 GiB: by hand
    tiled_cost_args=(--device cuda --repeats 5)
    packed_attention_args=(--device cuda --repeats 5)
    plan_accuracy_args=()
    grid_name="${PACS_GRID:-gpu-quick}"
    grid_args=(--grid "$grid_name" --device cuda)
    smoke_steps=(4 6)
fi
heads_grid="${heads_args[1]}"

if [ "$part" = "race" ] || [ "$part" = "all" ]; then
    begin_part race
    # the limit leaves room for compiling every kernel variant the cases need (a second or two each on the host
    # CPU): the race below then finds them in Triton's on-disk cache
    stamp "1/4 correctness at real shapes, every changed kernel (limit 150s)"
    timeout "$(limit 150)" "$py" benchmarks/check_gpu_correctness.py "${check_args[@]}" --peers without 2>&1 | tee "$dir/correctness.txt"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then
        echo "!!! CORRECTNESS CHECK FAILED OR TIMED OUT (exit $rc): the benchmark numbers below are not trustworthy"
        status=1
    fi
    save

    # this GPU's profile (its cost-model constants, keyed by device name and capability) for the loss planner:
    # copy OUT/race/device_profile/device_profiles.json into the profile folder (pacs_kernels/engine/device.py)
    stamp "1b/4 this device's profile: pacs bench calibrate (limit 30s)"
    PACS_KERNELS_PROFILE_DIR="$dir/device_profile" timeout "$(limit 30)" "$py" benchmarks/run.py calibrate \
        --device "${check_args[1]}" 2>&1 | tee "$dir/device_profile.txt" \
        || { echo "!!! calibrate exited with $?"; status=1; }
    save

    stamp "2/4 the Triton backward's gradient GEMMs: our kernels vs torch.mm / cuBLAS (budget 15s, limit 35s)"
    timeout "$(limit 35)" "$py" benchmarks/run.py "${gemm_args[@]}" --out "$dir" --name gpu_grad_gemms --ops grad_gemms \
        --impls torch triton --warmup 1 --repeats 5 --time-budget 15 --no-plots \
        || { echo "!!! grad-GEMM race exited with $?"; status=1; }
    # the race below runs the Triton backward with the engine measured faster just now
    if timeout "$(limit 20)" "$py" benchmarks/dispatch_table.py "$dir/gpu_grad_gemms.csv" --out "$dir/grad_gemms"; then
        export PACS_BENCH_DISPATCH_TABLE="$dir/grad_gemms/dispatch.json"  # read by benchmarks/ops.py
    else
        echo "!!! the grad-GEMM table exited with $?: the race runs the default engine (cuBLAS)"; status=1
    fi
    save

    stamp "3/4 the loss race at the heads users train, ours (budget 130s, limit 160s); dispatch table, cost model"
    timeout "$(limit 160)" "$py" benchmarks/loss_grid.py "${heads_args[@]}" --columns single_pass two_pass one_sweep auto naive_gemms \
        --time-budget 130 --out "$dir" || { echo "!!! the heads race exited with $?"; status=1; }
    gemm_csv=(); [ -f "$dir/gpu_grad_gemms.csv" ] && gemm_csv=("$dir/gpu_grad_gemms.csv")
    timeout "$(limit 20)" "$py" benchmarks/dispatch_table.py "$dir/loss_grid_$heads_grid.csv" ${gemm_csv[@]+"${gemm_csv[@]}"} \
        --out "$dir" || { echo "!!! dispatch table exited with $?"; status=1; }
    rate=$("$py" -c "import csv,sys; r=[x['matmul_tflops'] for x in csv.DictReader(open(sys.argv[1])) if x.get('matmul_tflops')]; print(r[0] if r else '')" "$dir/gpu_grad_gemms.csv" 2>/dev/null)
    timeout "$(limit 20)" "$py" benchmarks/roofline.py ${rate:+--matmul-tflops "$rate"} --measured "$dir/measured_for_roofline.csv" \
        --out "$dir" > /dev/null || { echo "!!! roofline exited with $?"; status=1; }
    [ -f "$dir/roofline_measured.csv" ] && cat "$dir/roofline_measured.csv"
    save

    stamp "4/4 auto against our fastest path at each point, alternated in one worker (budget 60s, limit 90s)"
    timeout "$(limit 90)" "$py" benchmarks/loss_grid.py "${heads_args[@]}" --paired --time-budget 60 --out "$dir" \
        || { echo "!!! the paired race exited with $?"; status=1; }
    save
fi

if [ "$part" = "long" ] || [ "$part" = "all" ]; then
    begin_part long
    # the trainer itself on this device, first: the built-in task, HF generation (no vLLM here), the
    # preflight, the tiled MLP, checkpointing and a token budget that splits groups; then a resume
    rm -rf /tmp/pacs-train-smoke  # a rerun on a warm machine starts afresh (a used output dir is refused)
    smoke=(--output-dir /tmp/pacs-train-smoke advanced.task.cache_dir=/tmp/pacs-smoke-cache advanced.task.warmup_steps=200
           rollout.engine=hf eval.every=0 eval.num_problems=16 checkpoint_every=2 advanced.plot=false advanced.train.preflight=true
           train.tiled_mlp=true model.gradient_checkpointing=true train.max_tokens_per_micro_batch=64)
    # (the first call compiles every Triton kernel it meets at this model's shapes: the generous first limit)
    stamp "5/8 the trainer on this device: ${smoke_steps[0]} steps, then resumed to ${smoke_steps[1]} (limit 145s)"
    smoke_log="$dir/train_smoke.log"
    { timeout "$(limit 100)" "$py" -m pacs train "${smoke[@]}" --max-steps "${smoke_steps[0]}" \
        && timeout "$(limit 45)" "$py" -m pacs train "${smoke[@]}" --max-steps "${smoke_steps[1]}" --resume; } 2>&1 \
        | tee "$smoke_log" || { echo "!!! the trainer's smoke run exited with $?"; status=1; }
    # bf16 autocast over float32 weights: every packed configuration must run PyTorch's flash varlen kernel (the CPU
    # has none: nothing reported there)
    if [ "$dry" != "1" ]; then
        grep -q "packed attention: .*one flash varlen call" "$smoke_log" \
            && ! grep -q "packed attention: .*SDPA once per sequence" "$smoke_log" \
            || { echo "!!! the trainer's packed attention did not run the flash varlen kernel (see its line above)"; status=1; }
    fi
    cp /tmp/pacs-train-smoke/metrics.jsonl "$dir/train_smoke_metrics.jsonl" 2>/dev/null  # not the model
    # model.dtype auto on a GPU: bfloat16 compute over float32 master weights; every update must move the weights
    "$py" - /tmp/pacs-train-smoke/metrics.jsonl <<'PY' || { echo "!!! the smoke run's weights did not move"; status=1; }
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if '"update_nonzero_frac"' in line]
moved = [row["update_nonzero_frac"] for row in rows if row["update_nonzero_frac"] is not None]
print(f"update_nonzero_frac per step (bf16 compute, float32 master weights): {moved}")
sys.exit(0 if moved and min(moved) > 0.99 else 1)
PY
    # the memory planner (pacs plan) against one real-architecture step on this GPU
    stamp "5b/8 pacs plan vs a measured step at Qwen2.5-1.5B's shape, bf16 over float32 masters (limit 45s)"
    # (--device cuda --dry-run: its 2-layer cut on the CPU)
    timeout "$(limit 45)" "$py" benchmarks/plan_accuracy.py --device cuda ${plan_accuracy_args[@]+"${plan_accuracy_args[@]}"} \
        --out "$dir/plan_accuracy" \
        || { echo "!!! pacs plan's prediction missed by more than 15% (or failed): $?"; status=1; }
    cat "$dir"/plan_accuracy/plan_accuracy_*.csv 2>/dev/null
    save
    stamp "6/8 the packed row's attention: flash varlen vs SDPA per sequence vs padded (budget 15s, limit 25s)"
    timeout "$(limit 25)" "$py" benchmarks/packed_attention.py "${packed_attention_args[@]}" --time-budget 15 --out "$dir" \
        || { echo "!!! packed-attention benchmark exited with $?"; status=1; }
    save
    stamp "7/8 what the tiled MLP costs in step time, Qwen2.5-1.5B shapes, L = 4096 (limit 50s)"
    timeout "$(limit 50)" "$py" benchmarks/tiled_mlp_cost.py "${tiled_cost_args[@]}" --out "$dir" \
        || { echo "!!! tiled-MLP cost exited with $?"; status=1; }
    save
    # last: its CSV is written after every trial, so a call cut short keeps what it measured
    stamp "8/8 how long can I train here: Qwen2.5-1.5B shapes, 24 GiB (budget 100s, limit 140s)"
    timeout "$(limit 140)" "$py" benchmarks/long_context_train.py "${long_train_args[@]}" --out "$dir/long_context_train" \
        || { echo "!!! long-context training sweep exited with $?"; status=1; }
    save
fi

if [ "$part" = "peers" ] || [ "$part" = "all" ]; then
    begin_part peers
    stamp "9/12 peers' log-probs against the same reference, informational (limit 30s; compiles their kernels)"
    timeout "$(limit 30)" "$py" benchmarks/check_gpu_correctness.py "${check_args[@]}" --peers only 2>&1 | tee "$dir/peers_check.txt" \
        || echo "(peer check exited with ${PIPESTATUS[0]}; the benchmark records each peer's own status)"
    save
    stamp "10/12 the peers at the heads of step 3: naive, CCE, Liger's chunked step, TRL's kernel (budget 120s, limit 150s)"
    timeout "$(limit 150)" "$py" benchmarks/loss_grid.py "${heads_args[@]}" --columns naive cce liger_chunked trl_chunked \
        --time-budget 120 --out "$dir" || { echo "!!! the peers' heads race exited with $?"; status=1; }
    save
    stamp "11/12 the log-prob race at Qwen2.5-7B's head, the peers with two of ours (budget 100s, limit 130s)"
    timeout "$(limit 130)" "$py" benchmarks/run.py "${race_args[@]}" --out "$dir" --name gpu --ops logprobs_fwd_bwd pacs_loss_fwd_bwd \
        --impls naive cce cce_exact liger_flce liger_chunked trl_chunked single_pass triton \
        --warmup 1 --repeats 5 --time-budget 100 --no-plots \
        --note "one GPU lent for a single prepared run; peers installed from wheels without network"
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "!!! benchmark exited with $rc; rebuilding the table from the rows it wrote"
        "$py" benchmarks/run.py "${race_args[@]}" --out "$dir" --name gpu --report-only --no-plots
        status=1
    fi
    save
    stamp "12/12 long-context sweep, 40 GiB budget, naive vs Triton (15s of trials, limit 35s)"
    timeout "$(limit 35)" "$py" benchmarks/long_context.py "${long_args[@]}" --time-budget 15 --out "$dir" \
        || { echo "!!! long-context sweep exited with $?"; status=1; }
    save
fi

if [ "$part" = "grid" ] || [ "$part" = "all" ]; then
    begin_part grid
    # two halves of the part's 150 s: each grid stops starting cases after its budget, its timeout is the backstop
    stamp "grid 1/2: the PACS loss at GPU shapes, naive / paths / auto / peers (budget 60s, limit 75s)"
    timeout "$(limit 75)" "$py" benchmarks/loss_grid.py "${grid_args[@]}" --time-budget 60 --out "$dir" \
        || { echo "!!! PACS loss grid exited with $?"; status=1; }
    save
    stamp "grid 2/2: the DAPO loss at the same shapes, naive / paths / auto / CCE / Liger's fused loss (budget 60s, limit 75s)"
    timeout "$(limit 75)" "$py" benchmarks/loss_grid.py "${grid_args[@]}" --objective dapo --time-budget 60 --out "$dir" \
        || { echo "!!! DAPO loss grid exited with $?"; status=1; }
    save
fi

stamp "done (exit $status); files in $out:"
ls -la "$out"
exit $status
