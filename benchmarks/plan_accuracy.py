"""How close is ``pacs plan`` (pacs/train/memory_plan/) to the peak of a real training step? CPU, small scale.

    python benchmarks/plan_accuracy.py                 # every probe, writes results/plan_accuracy_cpu.{csv,md}
    python benchmarks/plan_accuracy.py --probes none ckpt

Each probe is one lever set on a small Qwen2-shaped model (random init, no download), run in a fresh
subprocess (glibc returning freed blocks to the kernel, as in benchmarks/measure.py). The step is what
the trainer does for a micro-batch that is not the first of its mini-batch: a short micro-batch first
(its gradients are then allocated, as gradient accumulation holds them), then the measured micro-batch
(one group of 4 rows, packed unless the probe says otherwise: forward, the fused PACS loss within
``train.loss_chunk_mib``, backward; benchmarks/long_context_train.py's ``train_step``), then the AdamW
step. A warm-up step before creates the AdamW state and pages the code in.

The ``old_policy_pass*`` probes time no training step: the trainer's no-grad old-policy pass over 16 rows in
one chunk (``advanced.train.old_policy_max_tokens`` above the training micro-batch), after a warm-up pass;
measured = the parameters + the pass's peak increase, predicted = the parameters + the plan's old-policy
transient.

Measured footprint = bytes of parameters and AdamW state (counted from the tensors) + the peak increase
of the resident set over the step: VmHWM after the step minus VmRSS right before it, with VmHWM reset
there (/proc/self/clear_refs; benchmarks/measure.py's helpers). The process's baseline (the Python
interpreter, torch, the model's code) is thereby left out of both sides: the planner predicts training
memory, not an interpreter's. Predicted = the planner's peak for the same model, tokens and levers,
device "cpu" (host memory is device memory: offloaded activations stay counted).
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.measure import REPO_ROOT, WORKER_ENV, peak_rss_mib, reset_peak_rss

MODEL = dict(vocab_size=32768, hidden_size=256, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)
GROUP = 4
PROMPT = 64
# name: (levers of benchmarks/long_context_train.py's train_step, loss_chunk_mib, response length, dtype)
PROBES = {
    "none": (("packed", "fused"), 256.0, 1024, "float32"),
    "ckpt": (("packed", "fused", "ckpt"), 256.0, 1024, "float32"),
    "tiled_mlp": (("packed", "fused", "tiled"), 256.0, 1024, "float32"),
    "ckpt_tiled_mlp": (("packed", "fused", "ckpt", "tiled"), 256.0, 2048, "float32"),
    "offload": (("packed", "fused", "offload"), 256.0, 1024, "float32"),
    "ckpt_offload": (("packed", "fused", "ckpt", "offload"), 256.0, 2048, "float32"),
    "padded": (("fused",), 256.0, 1024, "float32"),
    "loss_chunk_16": (("packed", "fused"), 16.0, 1024, "float32"),
    "loss_chunk_64_ckpt": (("packed", "fused", "ckpt"), 64.0, 2048, "float32"),
    "long_4096_ckpt_tiled": (("packed", "fused", "ckpt", "tiled"), 256.0, 4096, "float32"),
    "bf16_autocast_master_fp32": (("packed", "fused"), 256.0, 512, "mixed"),
    "bf16_autocast_ckpt": (("packed", "fused", "ckpt"), 256.0, 512, "mixed"),
    "ckpt_loss_chunk_16": (("packed", "fused", "ckpt"), 16.0, 2048, "float32"),
    "bf16_autocast_wide_head": (("packed", "fused", "ckpt"), 256.0, 512, "mixed"),
    # not a training step: the no-grad old-policy pass over OLD_POLICY_ROWS rows in one chunk
    # (advanced.train.old_policy_max_tokens above the training micro-batch's one group), against the plan's
    # "old-policy pass" transient; measured = parameters + the pass's peak increase
    "old_policy_pass": (("packed", "old_policy"), 256.0, 1024, "float32"),
    "old_policy_pass_tiled_mlp": (("packed", "tiled", "old_policy"), 256.0, 1024, "float32"),
    "old_policy_pass_bf16_autocast": (("packed", "old_policy"), 256.0, 1024, "mixed"),
    "old_policy_pass_wide_head_bf16": (("packed", "old_policy"), 256.0, 256, "mixed"),
    # LoRA of rank LORA_RANK on all seven projections: the frozen base in bfloat16, float32 adapters, autocast
    "lora_bf16": (("packed", "fused"), 256.0, 512, "lora"),
    "lora_bf16_ckpt": (("packed", "fused", "ckpt"), 256.0, 1024, "lora"),
    "bf16_autocast_ckpt_wide_layers": (("packed", "fused", "ckpt"), 256.0, 64, "mixed"),
    "bf16_autocast_wide_layers": (("packed", "fused"), 256.0, 64, "mixed"),
}
LORA_RANK = 16
OLD_POLICY_ROWS = 4 * GROUP
# probes on another model than MODEL: these changes to it. A Qwen2.5-sized vocabulary over hidden 256, untied:
# the LM head (39M parameters) outweighs the 4 layers, so what the step holds of it shows (under autocast, its
# 16-bit copy and the 16-bit gradient the fused loss hands back)
WIDE_HEAD = dict(vocab_size=151936, tie_word_embeddings=False)
# hidden 1024, MLP 4096, 8/2 heads of 128: the layers (17M parameters each) outweigh the head and the activations
WIDE_LAYERS = dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=8, num_key_value_heads=2,
                   head_dim=128, vocab_size=8192)
PROBE_MODELS = {"bf16_autocast_wide_head": WIDE_HEAD, "old_policy_pass_wide_head_bf16": WIDE_HEAD,
                "bf16_autocast_ckpt_wide_layers": WIDE_LAYERS, "bf16_autocast_wide_layers": WIDE_LAYERS}


def probe_model(probe: str) -> dict:
    return MODEL | PROBE_MODELS.get(probe, {})


# --device cuda (benchmarks/gpu.sh): one real architecture's step on the GPU, the planner's default GPU path
# (bfloat16 autocast over float32 master weights, packed rows, checkpointing, the 2 GiB CUDA loss chunk); the
# model's published config (configs/models/), random weights. --dry-run: a 2-layer cut on the CPU.
REAL_MODEL = "qwen2.5-1.5b"
CUDA_PROBE = ("real_model_ckpt_bf16", ("packed", "fused", "ckpt"), 2048.0, 4096, "mixed")


def real_model_config(dry_run: bool) -> dict:
    from pacs.train.memory_plan import MODELS_DIR

    with open(os.path.join(MODELS_DIR, REAL_MODEL, "config.json")) as fh:
        config = json.load(fh)
    if dry_run:
        config.update(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=512)
    return config


def equal_rows_batch(response: int, seed: int, vocab: int | None = None, rows: int = GROUP):
    """``rows`` (default: one group of GROUP) full-length rows (the planner's worst case)."""
    from pacs.train.batch import build_batch

    gen = torch.Generator().manual_seed(seed)
    vocab = vocab or MODEL["vocab_size"]
    prompt = torch.randint(3, vocab, (PROMPT,), generator=gen).tolist()
    responses = [torch.randint(3, vocab, (response,), generator=gen).tolist() for _ in range(rows)]
    return build_batch([prompt] * rows, responses, [float(i % 2) for i in range(rows)], pad_token_id=0)


def probe_tokens(levers, response: int) -> int:
    """Tokens the step computes on: packed rows, or padded rows x the longest (the same here: equal rows); the
    old-policy pass: all its rows."""
    return (OLD_POLICY_ROWS if "old_policy" in levers else GROUP) * (PROMPT + response)


def build_policy(levers, dtype: str, model: dict | None = None, device: torch.device = torch.device("cpu")):
    """benchmarks/long_context_train.py's model and levers; ``dtype`` "mixed": bfloat16 autocast over float32
    master weights; "lora": LoRA adapters (rank LORA_RANK, float32) over a bfloat16 base, as load_policy puts
    them, under autocast, AdamW over the adapters."""
    from benchmarks.long_context_train import build
    from pacs.model.lora import add_lora
    from pacs.model.mixed_precision import Precision

    precision = Precision(torch.bfloat16, torch.float32) if dtype in ("mixed", "lora") else None
    base_dtype = torch.bfloat16 if dtype == "lora" else torch.float32
    policy, optimizer = build(model or MODEL, tuple(levers), device, base_dtype, precision=precision)
    if dtype == "lora":
        add_lora(policy.causal_lm, LORA_RANK, 2.0 * LORA_RANK, "all-linear", torch.float32)
        optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-6)
    return policy, optimizer


def old_policy_worker(request: dict) -> None:
    """The trainer's no-grad old-policy pass (pacs.train.old_policy.old_policy_logprobs) over OLD_POLICY_ROWS rows
    in one chunk, after a warm-up pass."""
    from pacs.train.old_policy import old_policy_logprobs

    levers, _, response, dtype = PROBES[request["probe"]]
    model = probe_model(request["probe"])
    policy, _ = build_policy(tuple(lever for lever in levers if lever != "old_policy"), dtype, model)
    batch = equal_rows_batch(response, 3, model["vocab_size"], rows=OLD_POLICY_ROWS)
    everything = [(0, OLD_POLICY_ROWS)]
    old_policy_logprobs(policy, batch, everything, 1.0, "auto", packed="packed" in levers)
    base = reset_peak_rss()
    old_policy_logprobs(policy, batch, everything, 1.0, "auto", packed="packed" in levers)
    params = sum(p.numel() * p.element_size() for p in policy.parameters()) / 2**20
    print(json.dumps({"state_mib": params, "increase_mib": peak_rss_mib() - base}), flush=True)


def worker(request: dict) -> None:
    from benchmarks.long_context_train import state_mib, train_step

    torch.set_num_threads(request.get("threads") or 2)
    if "old_policy" in PROBES[request["probe"]][0]:
        return old_policy_worker(request)
    levers, chunk, response, dtype = PROBES[request["probe"]]
    levers, model = tuple(levers), probe_model(request["probe"])
    policy, optimizer = build_policy(levers, dtype, model)
    cpu, vocab = torch.device("cpu"), model["vocab_size"]
    train_step(policy, optimizer, equal_rows_batch(8, 1, vocab), levers, cpu, chunk)  # AdamW state, code paged in
    short, batch = equal_rows_batch(4, 2, vocab), equal_rows_batch(response, 3, vocab)
    base = reset_peak_rss()
    train_step(policy, None, short, levers, cpu, chunk)  # gradients allocated, as accumulation holds them
    train_step(policy, optimizer, batch, levers, cpu, chunk)
    increase = peak_rss_mib() - base
    print(json.dumps({"state_mib": state_mib(policy, optimizer), "increase_mib": increase}), flush=True)


def cuda_worker(request: dict) -> None:
    """The real architecture's step (CUDA_PROBE) on ``request["device"]``: CUDA's allocator peak over the step
    (torch.cuda.max_memory_allocated, reset right before it) on a GPU, the resident set's on the CPU."""
    from benchmarks.long_context_train import state_mib, train_step

    device = torch.device(request["device"])
    _, levers, chunk, response, dtype = CUDA_PROBE
    config = real_model_config(request["dry_run"])
    response = 64 if request["dry_run"] else response
    policy, optimizer = build_policy(levers, dtype, config, device)
    vocab = config["vocab_size"]
    train_step(policy, optimizer, equal_rows_batch(8, 1, vocab).to(device), levers, device, chunk)  # AdamW state
    short, batch = equal_rows_batch(4, 2, vocab).to(device), equal_rows_batch(response, 3, vocab).to(device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
    else:
        base = reset_peak_rss()
    train_step(policy, None, short, levers, device, chunk)
    train_step(policy, optimizer, batch, levers, device, chunk)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else peak_rss_mib()
    print(json.dumps({"state_mib": state_mib(policy, optimizer), "increase_mib": peak - base,
                      "response": response, "config": config}), flush=True)


def cuda_row(request: dict) -> dict:
    """Measured (a fresh process) and predicted peak of the real architecture's step; the planner's assumed
    CUDA context (not in the allocator's count) is left out of the prediction."""
    from pacs.train.memory_plan import CUDA_RESERVE_GIB, GiB, Levers, PlanInputs, plan_memory, shape_from_config

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.plan_accuracy", "--cuda-worker", json.dumps(request)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=request["timeout"])
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the real model's step: worker exit {proc.returncode}: {tail[:300]}")
    measured = json.loads(lines[-1])
    name, levers, chunk, _, dtype = CUDA_PROBE
    shape = shape_from_config(dict(measured["config"], model_type="qwen2"), name=REAL_MODEL)
    inputs = PlanInputs(model=shape, gpu_gib=1024, gpus=1, prompt_len=PROMPT, response_len=measured["response"],
                        group_size=GROUP, prompts_per_step=1, compute_dtype="bfloat16", master_dtype="float32",
                        gpu_memory_utilization=0.0, device=request["device"])
    chosen = Levers(gradient_checkpointing=True, packing=True, loss_chunk_mib=chunk)
    plan = plan_memory(inputs, chosen, tokens=GROUP * (PROMPT + measured["response"]))
    context = CUDA_RESERVE_GIB * GiB if request["device"] == "cuda" else 0
    predicted = (plan.peak - context + sum(plan.host.values())) / 2**20
    footprint = measured["state_mib"] + measured["increase_mib"]
    return {"probe": f"{REAL_MODEL}_{name}", "levers": "+".join(levers), "dtype": dtype, "loss_chunk_mib": chunk,
            "tokens": GROUP * (PROMPT + measured["response"]), "measured_mib": round(footprint, 1),
            "state_mib": round(measured["state_mib"], 1), "step_increase_mib": round(measured["increase_mib"], 1),
            "predicted_mib": round(predicted, 1), "error_pct": round(100 * (predicted / footprint - 1), 1)}


def predict(probe: str):
    from pacs.train.memory_plan import Levers, PlanInputs, plan_memory, shape_from_config

    levers, chunk, response, dtype = PROBES[probe]
    shape = shape_from_config(dict(probe_model(probe), model_type="qwen2"), name="plan-accuracy")
    old_policy = "old_policy" in levers
    inputs = PlanInputs(model=shape, gpu_gib=1024, gpus=1, prompt_len=PROMPT, response_len=response,
                        group_size=GROUP, prompts_per_step=OLD_POLICY_ROWS // GROUP if old_policy else 1,
                        compute_dtype="bfloat16" if dtype in ("mixed", "lora") else "float32",
                        master_dtype="float32", gpu_memory_utilization=0.0, device="cpu",
                        lora_rank=LORA_RANK if dtype == "lora" else None)
    chosen = Levers(gradient_checkpointing="ckpt" in levers, tiled_mlp="tiled" in levers,
                    offload_activations="offload" in levers, packing="packed" in levers, loss_chunk_mib=chunk,
                    old_policy_max_tokens=OLD_POLICY_ROWS * (PROMPT + response) if old_policy else None)
    return plan_memory(inputs, chosen, tokens=GROUP * (PROMPT + response))  # the training micro-batch


def predicted_mib(probe: str) -> float:
    """The planner's peak for the probe (host memory included: the CPU's is the device's); the old-policy probe:
    the parameters and the pass's transient."""
    from pacs.train.memory_plan import OLD_POLICY_PASS

    plan = predict(probe)
    if "old_policy" in PROBES[probe][0]:
        weights = next(value for name, value in plan.components.items() if name.startswith("weights (master"))
        return (weights + plan.transient[OLD_POLICY_PASS]) / 2**20
    return (plan.peak + sum(plan.host.values())) / 2**20


def run_probe(probe: str, threads: int | None, timeout: float) -> dict:
    env = dict(os.environ)
    env.update(WORKER_ENV)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.plan_accuracy", "--worker",
                           json.dumps({"probe": probe, "threads": threads})], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"probe {probe}: worker exit {proc.returncode}: {tail[:300]}")
    measured = json.loads(lines[-1])
    predicted = predicted_mib(probe)
    footprint = measured["state_mib"] + measured["increase_mib"]
    levers, chunk, response, dtype = PROBES[probe]
    return {"probe": probe, "levers": "+".join(levers), "dtype": dtype, "loss_chunk_mib": chunk,
            "tokens": probe_tokens(levers, response), "measured_mib": round(footprint, 1),
            "state_mib": round(measured["state_mib"], 1), "step_increase_mib": round(measured["increase_mib"], 1),
            "predicted_mib": round(predicted, 1), "error_pct": round(100 * (predicted / footprint - 1), 1)}


COLUMNS = ["date", "device_name", "probe", "levers", "dtype", "loss_chunk_mib", "tokens", "state_mib",
           "step_increase_mib", "measured_mib", "predicted_mib", "error_pct"]


def write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def markdown(rows: list[dict], name: str, date: str) -> str:
    m = MODEL
    lines = ["## `pacs plan` against measured peaks (CPU)", "",
             f"Device: {name}; date: {date}. Model: Qwen2-shaped, hidden {m['hidden_size']}, MLP "
             f"{m['intermediate_size']}, {m['num_hidden_layers']} layers, {m['num_attention_heads']}/"
             f"{m['num_key_value_heads']} heads of {m['head_dim']}, vocab {m['vocab_size']}, tied; random init. One "
             f"micro-batch = one group of {GROUP} rows of {PROMPT} prompt + the response tokens, after a short "
             "micro-batch (gradients held, as under accumulation), then the AdamW step.", "",
             "Measured = parameters + AdamW state (bytes of the tensors) + the peak resident-set increase over the "
             "step (VmHWM reset right before it; the interpreter's and torch's baseline resident set is left out "
             "of both sides). Predicted: `pacs.train.memory_plan.plan_memory` for the same shapes, tokens and levers "
             "(device cpu: offloaded activations counted, host memory being the device's). Method: "
             "the script's docstring."]
    lines += [f"Probe {probe} on another model: {', '.join(f'{k} {v}' for k, v in changes.items())}."
              for probe, changes in PROBE_MODELS.items() if any(r["probe"] == probe for r in rows)]
    if any(r["probe"].startswith("old_policy") for r in rows):
        lines.append(f"The old_policy_pass probes run no training step: the trainer's no-grad old-policy pass over "
                     f"{OLD_POLICY_ROWS} rows in one chunk; measured = the parameters + the pass's peak increase, "
                     "predicted = the parameters + the plan's old-policy transient (tokens: the chunk's).")
    lines += ["",
             "| probe | levers | dtype | loss chunk MiB | tokens | measured MiB | predicted MiB | error | "
             "step part: measured / predicted MiB (error) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        step_pred = float(r["predicted_mib"]) - float(r["state_mib"])
        step_err = 100 * (step_pred / float(r["step_increase_mib"]) - 1)
        lines.append(f"| {r['probe']} | {r['levers']} | {r['dtype']} | {float(r['loss_chunk_mib']):g} | "
                     f"{r['tokens']} | "
                     f"{float(r['measured_mib']):.1f} | {float(r['predicted_mib']):.1f} | "
                     f"{float(r['error_pct']):+.1f}% | {float(r['step_increase_mib']):.1f} / {step_pred:.1f} "
                     f"({step_err:+.1f}%) |")
    worst = max((abs(float(r["error_pct"])) for r in rows), default=0.0)
    lines += ["", f"Largest error of the total: {worst:.1f}% (target: within 15% for every lever). The step part "
              "is the total without the parameters and AdamW state (which the planner counts exactly): gradients, "
              "activations, the loss's working memory; its error is the stricter figure."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--probes", nargs="+", choices=sorted(PROBES), default=list(PROBES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds per probe (the *_wide_layers probes take about 5 minutes on 2 CPU cores: "
                             "bfloat16 GEMMs are slow there)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--report-only", action="store_true", help="rewrite the Markdown from the CSV in --out")
    parser.add_argument("--repredict", action="store_true",
                        help="with --report-only: the measured peaks kept, the predictions recomputed by the planner "
                             "as it is now (the CSV rewritten too)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: one step of a real architecture (Qwen2.5-1.5B's shape) on the GPU, predicted vs "
                             "measured, written as plan_accuracy_gpu.{csv,md} (benchmarks/gpu.sh)")
    parser.add_argument("--dry-run", action="store_true", help="with --device: a 2-layer cut on the CPU (plumbing)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cuda-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(json.loads(args.worker))
        return 0
    if args.cuda_worker is not None:
        cuda_worker(json.loads(args.cuda_worker))
        return 0
    if args.device == "cuda":
        from benchmarks.run import device_name

        device = "cpu" if args.dry_run else "cuda"
        date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        row = {"date": date, "device_name": device_name(device),
               **cuda_row({"device": device, "dry_run": args.dry_run, "timeout": args.timeout})}
        print(f"[plan-accuracy] {row['probe']}: measured {row['measured_mib']:.1f} MiB, predicted "
              f"{row['predicted_mib']:.1f} MiB ({row['error_pct']:+.1f}%; the allocator's peak, without the "
              "CUDA context)", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        write_csv(args.out / "plan_accuracy_gpu.csv", [row])
        return 0 if args.dry_run or abs(row["error_pct"]) <= 15 else 1  # (a dry run checks the plumbing)
    if args.repredict and not args.report_only:
        parser.error("--repredict goes with --report-only")
    if args.report_only:
        with open(args.out / "plan_accuracy_cpu.csv") as fh:
            rows = list(csv.DictReader(fh))
        if args.repredict:
            for row in rows:
                predicted = predicted_mib(row["probe"])
                row.update(predicted_mib=round(predicted, 1),
                           error_pct=round(100 * (predicted / float(row["measured_mib"]) - 1), 1))
            write_csv(args.out / "plan_accuracy_cpu.csv", rows)
        dates = ", ".join(dict.fromkeys(row["date"] for row in rows))  # rows appended from another run keep theirs
        (args.out / "plan_accuracy_cpu.md").write_text(markdown(rows, rows[0]["device_name"], dates))
        return 0
    from benchmarks.run import device_name

    name, date = device_name("cpu"), dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rows = []
    for probe in args.probes:
        row = {"date": date, "device_name": name, **run_probe(probe, args.threads, args.timeout)}
        rows.append(row)
        print(f"[plan-accuracy] {probe:28s} measured {row['measured_mib']:8.1f} MiB, predicted "
              f"{row['predicted_mib']:8.1f} MiB ({row['error_pct']:+.1f}%)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "plan_accuracy_cpu.csv", rows)
    (args.out / "plan_accuracy_cpu.md").write_text(markdown(rows, name, date))
    return 0


if __name__ == "__main__":
    sys.exit(main())
