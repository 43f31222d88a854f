"""The LM head's three GEMMs at several row counts: how fast a GEMM runs on the rows it is given.

Every exact implementation of the PACS loss runs the same three GEMMs per token (the logits h W^T, then
dh = dz W and dW += dz^T h), but not on the same number of rows at a time: naive and Cut Cross-Entropy's
CPU implementation (``torch_compile``) run each on all tokens at once, the single pass on one chunk of
whole groups, the torch two passes on chunks of a few thousand logits' worth. Where a GEMM's rate
depends on its rows, so does the loss's time. This times the three at each row count (best of
``--repeats`` runs after a warm-up, fresh random operands), and writes their rates and the seconds the
three take per 1,000 tokens.

    python benchmarks/gemm_rows.py                                  # V=151,936, d=896, CPU, float32
    python benchmarks/gemm_rows.py --vocab 128256 --d 2048 --rows 256 1024 4096
    python benchmarks/gemm_rows.py --device cuda --dtype bfloat16   # a GPU (dW accumulated in the dtype)

Writes OUT/gemm_rows_<device>.csv and .md (device and date in both).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks import report
from benchmarks.run import device_name

GEMMS = ("logits", "dh", "dw")  # h W^T; dz W; dW += dz^T h
COLUMNS = ["date", "device", "device_name", "dtype", "V", "d", "rows", "logits_gflops", "dh_gflops", "dw_gflops",
           "s_per_1k_tokens"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn, device: torch.device, repeats: int) -> float:
    """The fastest of ``repeats`` runs of ``fn`` after one warm-up run."""
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure(rows: int, vocab: int, d: int, device: torch.device, dtype: torch.dtype, repeats: int) -> dict:
    """The three GEMMs' rates (GFLOP/s) at ``rows`` tokens, and their seconds per 1,000 tokens."""
    gen = torch.Generator(device=device).manual_seed(rows)
    weight = torch.randn(vocab, d, generator=gen, device=device, dtype=dtype).mul_(d ** -0.5)
    hidden = torch.randn(rows, d, generator=gen, device=device, dtype=dtype)
    dz = torch.randn(rows, vocab, generator=gen, device=device, dtype=dtype)  # values do not change a GEMM's time
    d_weight = torch.zeros_like(weight)
    seconds = {"logits": best_seconds(lambda: hidden @ weight.T, device, repeats),
               "dh": best_seconds(lambda: dz @ weight, device, repeats),
               "dw": best_seconds(lambda: d_weight.addmm_(dz.T, hidden), device, repeats)}
    flops = 2.0 * rows * vocab * d
    return {**{f"{name}_gflops": flops / seconds[name] / 1e9 for name in GEMMS},
            "s_per_1k_tokens": sum(seconds.values()) * 1000.0 / rows}


def markdown(rows: list[dict]) -> list[str]:
    first = rows[0]
    fastest = min(r["s_per_1k_tokens"] for r in rows)
    lines = [f"## The LM head's three GEMMs by rows: V={first['V']}, d={first['d']}, {first['dtype']}", "",
             f"Device: {first['device_name']} ({first['device']}); date: {first['date']}. "
             "`benchmarks/gemm_rows.py`: the logits GEMM (h W^T), dh (dz W) and dW += dz^T h on the given rows, "
             "best of the repeats after a warm-up; the last columns: the three's seconds per 1,000 tokens, and "
             "that over the fastest row count's.", "",
             "| rows | logits GFLOP/s | dh GFLOP/s | dW GFLOP/s | s per 1k tokens | over the fastest |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['rows']} | {r['logits_gflops']:.0f} | {r['dh_gflops']:.0f} | {r['dw_gflops']:.0f} | "
                     f"{r['s_per_1k_tokens']:.3f} | {r['s_per_1k_tokens'] / fastest:.2f} |")
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--d", type=int, default=896)
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 512, 768, 1024, 1536, 2048])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    for name in ("vocab", "d", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if min(args.rows) < 1:
        parser.error(f"--rows must all be at least 1, got {args.rows}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    base = dict(date=date, device=args.device, device_name=device_name(args.device), dtype=args.dtype,
                V=args.vocab, d=args.d)
    results = []
    for count in sorted(set(args.rows)):
        row = dict(base, rows=count, **measure(count, args.vocab, args.d, device, dtype, args.repeats))
        results.append(row)
        print(f"[gemm_rows] rows={count}: logits {row['logits_gflops']:.0f}, dh {row['dh_gflops']:.0f}, "
              f"dW {row['dw_gflops']:.0f} GFLOP/s; {row['s_per_1k_tokens']:.3f} s per 1k tokens", flush=True)
    stem = report.write_csv_and_markdown(args.out / f"gemm_rows_{args.device}",
                                         [{k: report._fmt(v) for k, v in r.items()} for r in results], COLUMNS,
                                         markdown(results))
    print(f"[gemm_rows] wrote {stem}.csv/.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
