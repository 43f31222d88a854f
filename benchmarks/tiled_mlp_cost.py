"""What the tiled MLP costs in time: one training step (long_context_train.py's step: one group of
4 responses L, 3L/4, L/2, L/4 after a prompt; backbone forward and backward, the fused PACS loss,
AdamW) with and without ``train.tiled_mlp``, with and without gradient checkpointing, at a fixed L.

    python benchmarks/tiled_mlp_cost.py                           # CPU, cpu-small model, L = 2048
    python benchmarks/tiled_mlp_cost.py --device cuda              # Qwen2.5-1.5B shapes, bf16, L = 4096
    python benchmarks/tiled_mlp_cost.py --dry-run                 # tiny, seconds (plumbing)

Each case: a warm-up step, then the median of --repeats steps on the same batch (CUDA: synchronized
wall time). First, on the same model and batch, the checkpointed step's gradients with and without
tiling are compared (largest |tiled - untiled| over a parameter's largest |untiled|; the exit
status is 1 when over the dtype's tolerance). Writes OUT/tiled_mlp_cost_<device>.csv and .md with the
device and date.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks import long_context_train as steps
from benchmarks.measure import error_line
from benchmarks.report import write_csv_and_markdown

CASES = {  # name: the trainer's switches (long_context_train.py's levers)
    "packed_fused": ("packed", "fused"),
    "packed_fused_tiled": ("packed", "fused", "tiled"),
    "packed_fused_ckpt": ("packed", "fused", "ckpt"),
    "packed_fused_ckpt_tiled": ("packed", "fused", "ckpt", "tiled"),
}


GRADIENT_TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}  # largest error over the largest |gradient|


def gradient_error(models: dict, device: torch.device, batch) -> float:
    """Largest relative gradient error of the tiled checkpointed step against the untiled one (the
    same random weights: ``build`` is seeded; the same batch), over the parameters. ``models``: case
    -> (policy, optimizer), the two checkpointed cases; their gradients are cleared afterwards."""
    grads = []
    for case in ("packed_fused_ckpt", "packed_fused_ckpt_tiled"):
        policy, _ = models[case]
        steps.train_step(policy, None, batch, CASES[case], device)
        grads.append({name: p.grad.float() for name, p in policy.named_parameters() if p.grad is not None})
        policy.zero_grad(set_to_none=True)
    untiled, tiled = grads
    if untiled.keys() != tiled.keys():
        return float("inf")
    return max(float((tiled[k] - untiled[k]).abs().max() / untiled[k].abs().max().clamp_min(1e-30)) for k in untiled)


def time_steps(policy, optimizer, levers: tuple[str, ...], device: torch.device, batch, repeats: int) -> float:
    """Median seconds of one training step on ``batch`` (after one warm-up step)."""
    times = []
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        steps.train_step(policy, optimizer, batch, levers, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", choices=sorted(steps.MODELS), default=None)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    parser.add_argument("--longest", type=int, default=None, help="the group's longest response L (tokens)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="CPU: torch threads")
    parser.add_argument("--dry-run", action="store_true", help="tiny model, L = 64, one repeat (plumbing)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.model, args.longest, args.repeats, args.device = "tiny", 64, 1, "cpu"
    cuda = args.device == "cuda"
    args.model = args.model or ("qwen2.5-1.5b" if cuda else "cpu-small")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.longest = args.longest or (4096 if cuda else 2048)  # short enough to fit without checkpointing
    if args.repeats < 1 or args.longest < steps.GROUP:
        parser.error(f"--repeats must be >= 1 and --longest >= {steps.GROUP}")
    if cuda and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available here", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    from benchmarks.run import device_name

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    name, date = device_name(args.device), dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    tokens = steps.GROUP * args.prompt_len + sum(steps.response_lengths(args.longest))
    print(f"[tiled-mlp] {name}; {args.model} ({args.dtype}), L = {args.longest} ({tokens} packed tokens)", flush=True)
    batch = steps.make_batch(args.longest, args.prompt_len, steps.MODELS[args.model]["vocab_size"], 7, device)
    # the checkpointed pair is built once: checked first (correctness before speed), then timed
    models = {case: steps.build(args.model, CASES[case], device, dtype)
              for case in ("packed_fused_ckpt", "packed_fused_ckpt_tiled")}
    tolerance = GRADIENT_TOLERANCE[args.dtype]
    try:
        error = gradient_error(models, device, batch)
        verdict = "ok" if error <= tolerance else "FAIL"
        check = (f"Gradients of the tiled checkpointed step against the untiled one (same model and batch): "
                 f"largest error {error:.2e} of the largest gradient (tolerance {tolerance:.0e}): {verdict}.")
    except Exception as exc:  # the timings are still taken (each case on its own); the exit code says FAIL
        verdict = "FAIL"
        check = f"The gradient check could not run: {failure(exc)}: FAIL."
    print(f"[tiled-mlp] {check}", flush=True)
    rows = []
    for case in ("packed_fused_ckpt", "packed_fused_ckpt_tiled", "packed_fused", "packed_fused_tiled"):
        note = ""
        try:
            policy, optimizer = models.pop(case, None) or steps.build(args.model, CASES[case], device, dtype)
            seconds = round(time_steps(policy, optimizer, CASES[case], device, batch, args.repeats), 4)
        except torch.OutOfMemoryError:
            seconds, note = None, "out of memory"
        except Exception as exc:  # one case failing leaves the others timed
            seconds, note = None, failure(exc)
        policy = optimizer = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        rows.append({"date": date, "device": args.device, "device_name": name, "model": args.model,
                     "dtype": args.dtype, "case": case, "longest_response": args.longest, "packed_tokens": tokens,
                     "repeats": args.repeats, "median_step_s": seconds, "note": note})
        print(f"[tiled-mlp] {case:26s} {note if seconds is None else f'{seconds:.3f} s'}", flush=True)
        stem = write_outputs(rows, check, args, name, date, tokens)  # after every case: a timeout keeps the rest
    print(f"[tiled-mlp] wrote {stem}.csv, .md", flush=True)
    failed = any(row["note"].startswith("failed") for row in rows)
    return 0 if verdict == "ok" and not failed else 1


def failure(exc: BaseException) -> str:
    """An exception in one line, marked as a failure."""
    return f"failed: {error_line(exc, 160)}"


def write_outputs(rows: list[dict], check: str, args, name: str, date: str, tokens: int) -> Path:
    rows = sorted(rows, key=lambda r: list(CASES).index(r["case"]))
    by_case = {r["case"]: r["median_step_s"] for r in rows}
    lines = [f"## Tiled MLP: training step time ({args.device}{', dry run' if args.dry_run else ''})", "",
             f"Device: {name}; date: {date}. Model `{args.model}` ({args.dtype}), one group of {steps.GROUP} "
             f"responses, longest L = {args.longest} ({tokens} packed tokens); median of {args.repeats} steps "
             "after a warm-up (backbone forward and backward, fused PACS loss, AdamW).", "", check, "",
             "| case | median step (s) | vs the same without tiling |", "|---|---:|---:|"]
    for row in rows:
        seconds, base = row["median_step_s"], by_case.get(row["case"].replace("_tiled", ""))
        ratio = f"{seconds / base:.2f}x" if row["case"].endswith("_tiled") and seconds and base else ""
        lines.append(f"| {row['case']} | {row['note'] if seconds is None else f'{seconds:.3f}'} | {ratio} |")
    return write_csv_and_markdown(args.out / f"tiled_mlp_cost_{'dry' if args.dry_run else args.device}", rows,
                                  list(rows[0]), lines)


if __name__ == "__main__":
    sys.exit(main())
