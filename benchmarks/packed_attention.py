"""The packed row's attention, forward + backward: one flash varlen call against the per-sequence loop
and against padded rows, on the same inputs (pacs/model/varlen_attention.py).

    python benchmarks/packed_attention.py                        # CUDA if present (bf16, real shapes), else CPU
    python benchmarks/packed_attention.py --device cuda --time-budget 15
    python benchmarks/packed_attention.py --dry-run              # CPU, tiny shapes, one repeat (plumbing)

Engines: ``varlen`` = ``varlen_causal_attention`` (one kernel for the whole row; CUDA, fp16/bf16 only:
elsewhere its row says why it is unavailable), ``loop`` = ``loop_causal_attention`` (one SDPA call per
sequence), ``padded`` = what padded rows cost: the sequences right-padded into (B, H, Lmax, D), key/value
heads repeated and a boolean (B, 1, Lmax, Lmax) causal-and-padding mask, as Hugging Face's sdpa runs them
(sequences of one length: no mask, ``is_causal`` and ``enable_gqa``, as Hugging Face does then too).
Shapes: Qwen2.5-1.5B's and Qwen2.5-7B's attention (bf16) on a row of N = 16384 tokens laid out as 128 x
128, 64 of random lengths in [32, 480], 16 x 1024 and 4 x 4096; on the CPU 4 heads over 2, head_dim 32,
N = 512, float32. Inputs are in Hugging Face's memory layout ((1, N, H, D) transposed).

Method, per (shape, layout, engine): correctness first: the output and the q/k/v gradients for a random
upstream gradient against the per-sequence loop in float32 on float32 copies of the same inputs (max
|err| / max |ref|; tolerance 2e-2 in bf16, 1e-4 in float32; the exit status is 1 when an engine that ran
is over it or failed, and on CUDA when varlen did not run). Then a warm-up step and the median wall time
of --repeats steps (CUDA: synchronized), and on CUDA the peak allocated memory of one step over what
existed before it. Writes OUT/packed_attention_<device>.csv (``_dry`` for --dry-run) after every case, and
the .md table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import random
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from benchmarks.measure import error_line
from benchmarks.report import write_csv_and_markdown
from pacs.model import varlen_attention as va

ENGINES = ("varlen", "loop", "padded")
MODELS = {"cuda": {"qwen2.5-1.5b": (12, 2, 128), "qwen2.5-7b": (28, 4, 128)},  # query heads, kv heads, head_dim
          "cpu": {"tiny": (4, 2, 32)}}
LAYOUTS = {"cuda": (16384, [("128x128", 128), ("64 in [32,480]", (64, 32, 480)), ("16x1024", 16), ("4x4096", 4)]),
           "cpu": (512, [("16x32", 16), ("16 in [8,56]", (16, 8, 56)), ("4x128", 4)])}
TOLERANCE = {"bfloat16": 2e-2, "float32": 1e-4}
REPO = Path(__file__).resolve().parent.parent


def sequence_lengths(tokens: int, spec, seed: int = 0) -> list[int]:
    """B equal sequences (spec = B), or B lengths drawn uniformly in [lo, hi] (spec = (B, lo, hi), seeded),
    scaled to sum to ``tokens`` (the last one takes the rounding, as far as [lo, hi] lets it)."""
    if isinstance(spec, int):
        return [tokens // spec] * spec
    count, lo, hi = spec
    rng = random.Random(seed)
    drawn = [rng.randint(lo, hi) for _ in range(count)]
    lengths = [min(hi, max(lo, round(n * tokens / sum(drawn)))) for n in drawn]
    lengths[-1] = min(hi, max(lo, lengths[-1] + tokens - sum(lengths)))
    return lengths


def pad(x: torch.Tensor, bounds: list[int], longest: int) -> torch.Tensor:
    """(1, H, N, D) packed -> (B, H, Lmax, D) right-padded with zeros (memory laid out as (B, Lmax, H, D))."""
    out = x.new_zeros(len(bounds) - 1, longest, x.shape[1], x.shape[-1]).transpose(1, 2)
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        out[i, :, : e - s] = x[0, :, s:e]
    return out


def unpad(x: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    return torch.cat([x[i, :, : e - s] for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:]))], dim=1)[None]


def prepare(engine: str, q, k, v, upstream, bounds: list[int]):
    """(forward f(q, k, v), its inputs (leaves), its upstream gradient, unpack: its layout -> the packed one)."""
    if engine == "varlen":
        cu = torch.tensor(bounds, device=q.device, dtype=torch.int32)
        return (lambda *qkv: va.varlen_causal_attention(*qkv, cu, bounds)), (q, k, v), upstream, lambda x: x
    if engine == "loop":
        return (lambda *qkv: va.loop_causal_attention(*qkv, bounds)), (q, k, v), upstream, lambda x: x
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    longest, groups = max(lengths), q.shape[1] // k.shape[1]
    position, sizes = torch.arange(longest, device=q.device), torch.tensor(lengths, device=q.device)
    mask = ((position[None, :] <= position[:, None])[None] & (position[None, :] < sizes[:, None])[:, None])[:, None]

    def forward(q, k, v):  # Hugging Face's sdpa_attention_forward: with a mask, repeat_kv and one SDPA call
        if min(lengths) == longest:  # no padding: HF drops the mask (is_causal=True) and passes enable_gqa
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups > 1)
        return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                              attn_mask=mask)
    leaves = tuple(pad(x.detach(), bounds, longest).requires_grad_() for x in (q, k, v))
    return forward, leaves, pad(upstream, bounds, longest), lambda x: unpad(x, bounds)


def step(forward, leaves, upstream):
    """One forward + backward -> (output, gradients of the leaves), or (None, None) where the engine declined."""
    out = forward(*leaves)
    return (None, None) if out is None else (out, torch.autograd.grad(out, leaves, upstream))


def time_step(forward, leaves, upstream, repeats: int, cuda: bool) -> tuple[float, float | None]:
    """(median ms of ``repeats`` steps after a warm-up, CUDA: peak MiB of one step over what existed before)."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times = []
    for _ in range(repeats + 1):
        sync()
        start = time.perf_counter()
        step(forward, leaves, upstream)
        sync()
        times.append(time.perf_counter() - start)
    peak = None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        result = step(forward, leaves, upstream)
        sync()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        del result
    return statistics.median(times[1:]) * 1e3, peak


def unavailable(engine: str, q, k) -> str | None:
    if engine != "varlen":
        return None
    if va.requested_engine() == "loop":
        return f"{va.ENGINE_VARIABLE}=loop"
    return va.varlen_unavailable(q, k)


def run_engine(engine: str, q, k, v, upstream, bounds, reference, args, cuda: bool) -> dict:
    """One engine on one row: its errors against ``reference`` (output, dq, dk, dv), then its time and memory."""
    why = unavailable(engine, q, k)
    if why:
        return {"status": "unavailable", "note": why}
    forward, leaves, up, unpack = prepare(engine, q, k, v, upstream, bounds)
    with warnings.catch_warnings():  # varlen's first call runs its self-check: a failure is this row's note
        warnings.simplefilter("ignore")
        out, grads = step(forward, leaves, up)
    if out is None:
        return {"status": "unavailable", "note": va.decision(q, k) or "returned None"}
    row = {"status": "ok"}
    if reference is not None:
        for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), reference):
            row[f"err_{name}"] = float((unpack(got.detach()).float() - want).abs().max() / want.abs().max())
        row["max_err"] = max(row[f"err_{name}"] for name in ("out", "dq", "dk", "dv"))
        row["within_tolerance"] = row["max_err"] <= TOLERANCE[args.dtype]
    del out, grads
    median_ms, peak_mib = time_step(forward, leaves, up, args.repeats, cuda)
    row["median_ms"], row["peak_mib"] = round(median_ms, 4), None if peak_mib is None else round(peak_mib, 1)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--time-budget", type=float, default=None, help="seconds: no new case starts after them")
    parser.add_argument("--dry-run", action="store_true", help="the CPU's tiny shapes, one repeat (plumbing)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.device, args.repeats = "cpu", 1
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available here", file=sys.stderr)
        return 2
    from benchmarks.run import device_name

    started, device = time.perf_counter(), torch.device(args.device)
    args.dtype = "bfloat16" if cuda else "float32"
    dtype, (tokens, layouts) = getattr(torch, args.dtype), LAYOUTS[args.device]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip() or "unknown"
    except Exception:
        commit = "unknown"
    meta = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "device": args.device,
            "device_name": device_name(args.device), "torch": torch.__version__, "commit": commit, "dtype": args.dtype}
    print(f"[packed-attention] {meta['device_name']}, torch {meta['torch']}, {args.dtype}, commit {commit}", flush=True)
    rows = []
    for seed, ((model, (heads, kv_heads, head_dim)), (layout, spec)) in enumerate(
            (m, lay) for m in MODELS[args.device].items() for lay in layouts):
        lengths = sequence_lengths(tokens, spec)  # the same layouts for every model
        bounds = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
        case = {**meta, "model": model, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "layout": layout,
                "sequences": len(lengths), "tokens": bounds[-1], "longest": max(lengths), "repeats": args.repeats}
        if args.time_budget is not None and time.perf_counter() - started > args.time_budget:
            rows += [{**case, "engine": engine, "status": "budget", "note": "time budget spent"} for engine in ENGINES]
            stem = write_outputs(rows, args, meta)
            continue
        gen = torch.Generator(device=device).manual_seed(seed)
        q, k, v, upstream = (torch.randn(1, bounds[-1], h, head_dim, generator=gen, device=device, dtype=dtype)
                             .transpose(1, 2) for h in (heads, kv_heads, kv_heads, heads))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        reference, reference_note = None, ""
        try:  # the float32 per-sequence loop on float32 copies of the same inputs: (output, dq, dk, dv)
            out, grads = step(lambda *qkv: va.loop_causal_attention(*qkv, bounds),
                              tuple(x.detach().float().requires_grad_() for x in (q, k, v)), upstream.float())
            reference = (out.detach(), *grads)
            del out, grads
        except Exception as exc:  # the engines still run and are timed, without an error
            reference_note = f"no reference ({error_line(exc, 120)}); "
        for engine in ENGINES:
            try:
                result = run_engine(engine, q, k, v, upstream, bounds, reference, args, cuda)
            except torch.OutOfMemoryError:
                result = {"status": "oom", "note": "out of memory"}
            except Exception as exc:  # one engine failing leaves the others measured
                result = {"status": "failed", "note": f"failed: {error_line(exc, 160)}"}
            if result["status"] in ("oom", "failed"):
                gc.collect()  # what the failure's frames held (a collection takes ~0.3 s here: not after every case)
            if cuda:
                torch.cuda.empty_cache()
            result["note"] = reference_note + result.get("note", "")
            rows.append({**case, "engine": engine, **result})
            print(f"[packed-attention] {model} {layout:16s} {engine:7s} " + (
                f"{result['median_ms']:9.3f} ms, error {result.get('max_err', float('nan')):.1e}"
                if result["status"] == "ok" else f"{result['status']}: {result['note']}"), flush=True)
            stem = write_outputs(rows, args, meta)  # after every case: a run cut short keeps what it measured
        del q, k, v, upstream, reference
        if cuda:
            torch.cuda.empty_cache()
    print(f"[packed-attention] wrote {stem}.csv, .md", flush=True)
    if any(r.get("within_tolerance") is False or r["status"] == "failed" for r in rows):
        return 1
    absent = [r["note"] for r in rows if r["engine"] == "varlen" and r["status"] == "unavailable"]
    if cuda and absent:  # the kernel the trainer picks on a GPU did not run: as loud as a wrong result
        print(f"!!! varlen did not run on this GPU ({absent[0]}): packed rows train with SDPA once per sequence",
              flush=True)
        return 1
    return 0


COLUMNS = ("date", "device", "device_name", "torch", "commit", "model", "heads", "kv_heads", "head_dim", "dtype",
           "layout", "sequences", "tokens", "longest", "engine", "status", "median_ms", "peak_mib", "speedup_vs_loop",
           "speedup_vs_padded", "err_out", "err_dq", "err_dk", "err_dv", "max_err", "within_tolerance", "repeats",
           "note")


def write_outputs(rows: list[dict], args, meta: dict) -> Path:
    """OUT/packed_attention_<device>.csv (every row) and .md (the table and the error verdict)."""
    ms = {(r["model"], r["layout"], r["engine"]): r.get("median_ms") for r in rows}
    for row in rows:  # how many times faster this engine is than loop / padded on the same row
        for other in ("loop", "padded"):
            base, own = ms.get((row["model"], row["layout"], other)), row.get("median_ms")
            row[f"speedup_vs_{other}"] = float(f"{base / own:.3g}") if base and own else None
    tolerance = TOLERANCE[args.dtype]
    over = [f"{r['model']} {r['layout']} {r['engine']} ({r['max_err']:.1e})" for r in rows
            if r.get("within_tolerance") is False]
    failed = [f"{r['model']} {r['layout']} {r['engine']}" for r in rows if r["status"] == "failed"]
    checked = [r["max_err"] for r in rows if r.get("max_err") is not None]
    verdict = ("FAIL: " + "; ".join(over + [f"{f} failed" for f in failed]) if over or failed else
               f"ok (largest {max(checked):.1e})" if checked else "nothing checked")
    absent = [r["note"] for r in rows if r["engine"] == "varlen" and r["status"] == "unavailable"]
    if absent and args.device == "cuda":  # the kernel this benchmark exists for did not run on the GPU
        verdict += f"; varlen did not run on this GPU: {absent[0]}"
    lines = [f"## Packed row attention: varlen vs loop vs padded ({args.device}{', dry run' if args.dry_run else ''})",
             "", f"Device: {meta['device_name']}; torch {meta['torch']}; {meta['dtype']}; date: {meta['date']}; "
             f"commit {meta['commit']}. Forward + backward of one attention layer over a packed row; median of "
             f"{args.repeats} step(s) after a warm-up; peak: allocated memory of one step over its inputs (CUDA only).",
             "", f"Errors (output, dq, dk, dv against a float32 per-sequence loop, max |err| / max |ref|, tolerance "
             f"{tolerance:.0e}): {verdict}.", "",
             "| model (H/H_kv/D) | layout | engine | fwd+bwd (ms) | peak (MiB) | max error | x vs loop | x vs padded |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        time_ms = f"{r['median_ms']:.3f}" if r.get("median_ms") else f"{r['status']}: {r.get('note', '')}"
        peak = "" if r.get("peak_mib") is None else f"{r['peak_mib']:.0f}"
        error = "" if r.get("max_err") is None else f"{r['max_err']:.1e}"
        lines.append(f"| {r['model']} ({r['heads']}/{r['kv_heads']}/{r['head_dim']}) | {r['layout']} | {r['engine']} | "
                     f"{time_ms} | {peak} | {error} | {r['speedup_vs_loop'] or ''} | {r['speedup_vs_padded'] or ''} |")
    return write_csv_and_markdown(args.out / f"packed_attention_{'dry' if args.dry_run else args.device}", rows,
                                  COLUMNS, lines)


if __name__ == "__main__":
    sys.exit(main())
