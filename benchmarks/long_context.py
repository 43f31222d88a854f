"""Long-context sweep: the largest N whose training step fits a memory budget, naive vs fused.

    python benchmarks/long_context.py --device cpu                   # d=128, V=8192, 128 MiB
    python benchmarks/long_context.py --device cuda --budget-gib 40  # d=3584, V=152064

One step is ``logprobs_fwd_bwd`` (or ``--op pacs_loss_fwd_bwd``) on fresh inputs. Its
footprint is everything it needs: the inputs (hidden, weight, targets, upstream gradient) plus
the peak increase of the run (logits or chunks, dh, dW). N doubles from ``--n-start`` until the
step no longer fits (or reaches ``--n-max``), then a bisection narrows the edge to 1/8 of it.

  * CPU: each trial is a fresh subprocess; the footprint is VmHWM minus VmRSS just before the
    inputs are made (the /proc/self/clear_refs method of measure.py); it fits when <= budget.
  * CUDA: the caching allocator is capped at the budget (set_per_process_memory_fraction); a
    trial fits when it runs without running out of memory. The footprint is
    max_memory_allocated over memory allocated before the inputs.

Writes OUT/long_context_<device>.csv, .md and .png.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.measure import REPO_ROOT, WORKER_ENV, error_line, peak_rss_mib, reset_peak_rss
from benchmarks.ops import LOSS_RESPONSES, Case, make_inputs, runner

DEFAULTS = {
    "cpu": {"d": 128, "v": 8192, "dtype": "float32", "budget_mib": 128.0, "n_start": 512, "n_max": 1 << 18,
            "impls": ["naive", "torch"]},
    "cuda": {"d": 3584, "v": 152064, "dtype": "bfloat16", "budget_mib": 40 * 1024.0, "n_start": 4096,
             "n_max": 1 << 21, "impls": ["naive", "triton"]},
}


def trial_in_process(case: Case, budget_mib: float) -> dict:
    """Run one step; returns {"fits", "footprint_mib", "seconds"}."""
    start = time.perf_counter()
    if case.device == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        error = None
        try:
            inputs = make_inputs(case, 7)
            produced = runner(case)(inputs)
            torch.cuda.synchronize()
            footprint = (torch.cuda.max_memory_allocated() - base) / 2**20
            fits = footprint <= budget_mib
        except torch.OutOfMemoryError:
            footprint, fits = None, False
        except Exception as exc:  # anything else ends this impl's search, not the sweep (largest_fitting)
            footprint, fits, error = None, False, error_line(exc)
        inputs = produced = None  # outside the except block: the traceback's tensors are gone now
        gc.collect()
        torch.cuda.empty_cache()
        if error is not None:
            return {"fits": False, "footprint_mib": None, "seconds": time.perf_counter() - start, "error": error}
    else:
        # a small warm-up first: the first call pages in library code, which RSS would count
        warm = Case(**{**case.__dict__, "n": min(case.n, 256)})
        runner(warm)(make_inputs(warm, 3))
        gc.collect()
        base = reset_peak_rss()
        inputs = make_inputs(case, 7)
        produced = runner(case)(inputs)
        footprint = peak_rss_mib() - base
        fits = footprint <= budget_mib
        del inputs, produced
    return {"fits": fits, "footprint_mib": footprint, "seconds": time.perf_counter() - start}


def trial(case: Case, budget_mib: float, timeout_s: float) -> dict:
    if case.device == "cuda":
        return trial_in_process(case, budget_mib)
    payload = json.dumps({"case": case.__dict__, "budget_mib": budget_mib})
    env = dict(os.environ)
    env.update(WORKER_ENV)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "benchmarks.long_context", "--worker", payload],
                              cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"fits": False, "footprint_mib": None, "seconds": timeout_s, "note": "timeout"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:  # killed for memory, or failed: it does not fit
        return {"fits": False, "footprint_mib": None, "seconds": time.perf_counter() - start,
                "note": f"exit {done.returncode}"}
    return json.loads(lines[-1])


class TrialError(RuntimeError):
    """A trial failed with something other than running out of memory: its impl's search stops there."""


def largest_fitting(impl: str, args, device: str, log, *, deadline: float | None = None,
                    on_trial=None) -> tuple[int | None, int | None, list[dict]]:
    """Doubling then bisection. Returns (largest N that fit, smallest N that did not, trials).

    No trial starts after ``deadline`` (a time.perf_counter() value; default: now plus
    ``args.time_budget``). ``on_trial(result)`` is called after every trial. A trial that fails with
    an error other than out-of-memory ends the search (its trial carries ``error``; smallest N that
    did not fit: None), so one broken impl cannot end the sweep of the others.
    """
    step = LOSS_RESPONSES * 16 if args.op == "pacs_loss_fwd_bwd" else 256
    trials = []
    if deadline is None and args.time_budget is not None:
        deadline = time.perf_counter() + args.time_budget

    def run(n):
        case = Case(op=args.op, impl=impl, n=n, d=args.d, v=args.v, dtype=args.dtype, device=device)
        result = trial(case, args.budget_mib, args.timeout)
        result.update(impl=impl, N=n)
        trials.append(result)
        if on_trial is not None:
            on_trial(result)
        if result.get("error"):
            log(f"[long] {impl:7s} N={n:<8d} failed: {result['error']} (its search stops here)")
            raise TrialError(result["error"])
        footprint = "n/a" if result["footprint_mib"] is None else f"{result['footprint_mib']:.0f} MiB"
        log(f"[long] {impl:7s} N={n:<8d} {'fits' if result['fits'] else 'does not fit'} ({footprint}, "
            f"{result['seconds']:.1f}s)")
        return result["fits"]

    def out_of_time():
        return deadline is not None and time.perf_counter() > deadline

    try:
        lo, hi = doubling_bisection(run, args.n_start, args.n_max, step, out_of_time)
    except TrialError:
        fitted = [t["N"] for t in trials if t["fits"]]
        return (max(fitted) if fitted else None), None, trials
    if out_of_time():
        log(f"[long] {impl}: time budget spent")
    return lo, hi, trials


def doubling_bisection(fits, start: int, maximum: int, step: int, out_of_time=lambda: False):
    """The edge of what fits: ``fits(n)`` for n = start, 2 start, ... until one does not fit (or n
    passes ``maximum``), then bisection (multiples of ``step``) until the gap is at most
    max(step, lo / 8). Stops early once ``out_of_time()``. Returns (largest n that fit or None,
    smallest n that did not or None)."""
    lo, hi, n = None, None, start
    while n <= maximum:
        if fits(n):
            lo, n = n, n * 2
        else:
            hi = n
            break
        if n <= maximum and out_of_time():  # (asked only while there is more to try)
            return lo, hi
    if lo is None or hi is None:
        return lo, hi
    while hi - lo > max(step, lo // 8) and not out_of_time():
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--op", choices=("logprobs_fwd_bwd", "pacs_loss_fwd_bwd"), default="logprobs_fwd_bwd")
    parser.add_argument("--impls", nargs="+", default=None, help="default: naive and the fused backend")
    parser.add_argument("--d", type=int, default=None)
    parser.add_argument("--v", type=int, default=None)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    parser.add_argument("--budget-mib", type=float, default=None)
    parser.add_argument("--budget-gib", type=float, default=None)
    parser.add_argument("--n-start", type=int, default=None)
    parser.add_argument("--n-max", type=int, default=None)
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds for the whole sweep: no trial starts after that")
    parser.add_argument("--timeout", type=float, default=300.0, help="CPU: seconds per trial")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--note", action="append", default=[])
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is None:
        defaults = DEFAULTS[args.device]
        for key in ("d", "v", "dtype", "n_start", "n_max", "impls"):
            if getattr(args, key) is None:
                setattr(args, key, defaults[key])
        if args.budget_gib is not None:
            args.budget_mib = args.budget_gib * 1024.0
        if args.budget_mib is None:
            args.budget_mib = defaults["budget_mib"]
        if args.op == "pacs_loss_fwd_bwd" and args.n_start % LOSS_RESPONSES:
            parser.error(f"--n-start must be a multiple of {LOSS_RESPONSES} for the loss op")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        request = json.loads(args.worker)
        print(json.dumps(trial_in_process(Case(**request["case"]), request["budget_mib"])), flush=True)
        return 0
    device = args.device
    if device == "cuda":
        if not torch.cuda.is_available():
            print("--device cuda: CUDA is not available here", file=sys.stderr)
            return 2
        total = torch.cuda.get_device_properties(0).total_memory / 2**20
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.budget_mib / total))
        device_name = torch.cuda.get_device_name()
    else:
        from benchmarks.run import device_name as cpu_name

        device_name = cpu_name("cpu")
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"[long] {device_name}; {args.op}, d={args.d}, V={args.v}, {args.dtype}, budget {args.budget_mib:.0f} MiB",
          flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"long_context_{device}"
    rows, summary = [], []
    deadline = None if args.time_budget is None else time.perf_counter() + args.time_budget
    for impl in args.impls:
        def record(t, impl=impl):  # the CSV after every trial: a killed sweep keeps its rows
            rows.append({"date": date, "device": device, "device_name": device_name, "op": args.op, "impl": impl,
                         "N": t["N"], "d": args.d, "V": args.v, "dtype": args.dtype,
                         "budget_mib": args.budget_mib, "fits": t["fits"],
                         "footprint_mib": t["footprint_mib"], "seconds": t["seconds"],
                         "note": t.get("error") or t.get("note", "")})
            _write_csv(rows, stem.with_suffix(".csv"))

        lo, hi, trials = largest_fitting(impl, args, device, lambda line: print(line, flush=True),
                                         deadline=deadline, on_trial=record)
        summary.append((impl, lo, hi, trials[-1].get("error") if trials else None))
    _write_csv(rows, stem.with_suffix(".csv"))
    lines = [f"## Long-context sweep ({device})", "",
             f"Device: {device_name}; date: {date}. Step: `{args.op}`, d={args.d}, V={args.v}, {args.dtype}; "
             f"memory budget {args.budget_mib:.0f} MiB for the inputs plus the step's peak.", ""]
    lines += [f"- {note}" for note in args.note] + ([""] if args.note else [])
    lines += ["| impl | largest N that fits | smallest N tried that does not |", "|---|---:|---:|"]
    for impl, lo, hi, error in summary:
        lo_text = "none tried fits" if lo is None else (f">= {lo}" if hi is None else str(lo))
        if error:
            lo_text += f" (then failed: {error})"
        lines.append(f"| {impl} | {lo_text} | {'' if hi is None else hi} |")
    naive = dict((impl, lo) for impl, lo, _, _ in summary).get("naive")
    for impl, lo, _, _ in summary:
        if impl != "naive" and naive and lo:
            lines.append(f"\n{impl} fits {lo / naive:.0f}x more tokens than naive in the same budget.")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(rows, summary, args, device_name, date, stem.with_suffix(".png"))
    print(f"[long] wrote {stem}.csv, .md, .png", flush=True)
    failed = [impl for impl, _, _, error in summary if error]
    if failed:  # every impl was still searched; the exit code says that some could not be
        print(f"[long] failed (not out of memory): {', '.join(failed)}", file=sys.stderr, flush=True)
    return 1 if failed else 0


def _write_csv(rows: list[dict], path: Path) -> None:
    columns = ["date", "device", "device_name", "op", "impl", "N", "d", "V", "dtype", "budget_mib", "fits",
               "footprint_mib", "seconds", "note"]
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def plot(rows, summary, args, device_name, date, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for impl, lo, _, _ in summary:
        points = sorted((r["N"], r["footprint_mib"], r["fits"]) for r in rows
                        if r["impl"] == impl and r["footprint_mib"] is not None)
        line = ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                       label=f"{impl}: max N {lo if lo is not None else 'none'}")[0]
        failed = sorted(r["N"] for r in rows if r["impl"] == impl and not r["fits"])
        for n in failed:
            ax.axvline(n, color=line.get_color(), linestyle=":", alpha=0.5)
    ax.axhline(args.budget_mib, color="black", linestyle="--", label=f"budget {args.budget_mib:.0f} MiB")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("N (tokens)")
    ax.set_ylabel("footprint: inputs + peak of the step (MiB)")
    ax.set_title(f"{args.op}, d={args.d}, V={args.v}, {args.dtype}\n{device_name}, {date}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
