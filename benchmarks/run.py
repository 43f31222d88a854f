"""Benchmark the log-prob ops and the PACS loss against naive and peers; write CSV, PNG and Markdown.

    pacs bench --set cpu                       # CPU set, a few minutes
    pacs bench --set gpu --device cuda         # real model shapes, bf16
    pacs bench --set cpu --d 32 --v 256 --n 64 128 --out /tmp/x   # tiny override
    pacs bench calibrate --device cuda --dtype bfloat16   # measure this device's profile and store it

(``python benchmarks/run.py`` takes the same arguments.)

Writes ``OUT/<set>.csv``, ``OUT/<set>.md`` and ``OUT/plots_<set>/*.png``. Method: measure.py;
what each op and impl is: ops.py.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/run.py`: make `benchmarks` and `pacs_kernels` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks import report
from benchmarks.measure import measure_case
from benchmarks.ops import IMPLS, OBJECTIVE_OP, OPS, Case, impl_unavailable_reason

# (d, V, [N...]) per set; the GPU shapes are Qwen2.5-7B's (d=3584, V=152064) and a 2048-wide
# model with V=151936 (Qwen2.5-3B-like width)
SETS = {
    # about 8 minutes on 2 quiet cores (25 on a busy shared VM); max_seconds: the default cap on
    # the timed runs of one case
    "cpu": {"device": "cpu", "dtype": "float32", "max_seconds": 10.0,
            "shapes": [(256, 8192, [512, 1024, 2048, 4096]), (512, 32768, [512, 1024, 2048])]},
    # the PACS loss paths raced on the GPU, sized for one ~3-minute slot of benchmarks/gpu.sh: Qwen2.5-7B's head
    "gpu": {"device": "cuda", "dtype": "bfloat16",
            "shapes": [(3584, 152064, [8192, 16384, 32768, 65536])]},
    "gpu-quick": {"device": "cuda", "dtype": "bfloat16",
                  "shapes": [(3584, 152064, [4096, 65536])]},
    # every power of two from 4k to 128k tokens: needs about 15 minutes
    "gpu-full": {"device": "cuda", "dtype": "bfloat16",
                 "shapes": [(3584, 152064, [4096, 8192, 16384, 32768, 65536, 131072]),
                            (2048, 151936, [4096, 8192, 16384, 32768, 65536, 131072])]},
}
STOP_STATUSES = ("oom", "timeout")  # no larger N is tried for that (op, impl, shape)
DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{cpu_model()}, {torch.get_num_threads()} threads"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


def matmul_tflops(device: str, dtype: torch.dtype) -> float:
    """Dense matmul rate measured now: 8192^3 with CUDA events on GPU (1024^3 with perf_counter on CPU)."""
    size = 8192 if device == "cuda" else 1024
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    flops = 2.0 * size ** 3
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10 if device == "cuda" else 5):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            a @ b
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            start_s = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start_s)
    return flops / statistics.median(times) / 1e12


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="pacs bench", description=__doc__.replace("``", ""),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", dest="size_set", choices=sorted(SETS), default="cpu")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: the set's device (cpu for --set cpu, cuda for the gpu sets)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="default: float32 on the CPU set, bfloat16 on the GPU sets")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ops = [op for op in OPS if op != OBJECTIVE_OP]  # the objectives' op races in loss_grid.py --objective
    parser.add_argument("--ops", nargs="+", choices=ops, default=ops)
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS),
                        help="those that cannot run on the device are left out (with the reason printed)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="cap on the timed runs of one case: no further run starts once they add up to "
                             "more (default: 10 on the CPU set, none on the GPU sets)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds for the whole run; cases not started by then are recorded as 'budget'")
    parser.add_argument("--timeout", type=float, default=600.0, help="CPU: seconds per case subprocess")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU: torch intra-op threads in each case's worker (default: all cores)")
    parser.add_argument("--d", type=int, default=None, help="override the set's shapes: hidden width")
    parser.add_argument("--v", type=int, default=None, help="override the set's shapes: vocabulary")
    parser.add_argument("--n", type=int, nargs="+", default=None, help="override the set's token counts")
    parser.add_argument("--name", default=None, help="file name stem (default: the set name)")
    parser.add_argument("--note", action="append", default=[], help="a line for the Markdown header")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--report-only", action="store_true",
                        help="measure nothing: rebuild the Markdown and plots from OUT/<name>.csv")
    args = parser.parse_args(argv)
    for name in ("warmup", "repeats"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            parser.error(f"--{name} must be >= {0 if name == 'warmup' else 1}, got {getattr(args, name)}")
    if (args.d is None) != (args.v is None):
        parser.error("--d and --v go together")
    for name in ("d", "v", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.n is not None and min(args.n) < 1:
        parser.error(f"--n values must be >= 1, got {min(args.n)}")
    for name in ("max_seconds", "time_budget", "timeout"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    return args


def plan(args) -> tuple[str, str, list[tuple[int, int, list[int]]]]:
    spec = SETS[args.size_set]
    device = args.device or spec["device"]
    dtype = args.dtype or spec["dtype"]
    shapes = spec["shapes"]
    if args.d is not None:
        shapes = [(args.d, args.v, args.n or shapes[0][2])]
    elif args.n is not None:
        shapes = [(d, v, args.n) for d, v, _ in shapes]
    return device, dtype, shapes


def calibrate(argv) -> int:
    """``pacs bench calibrate``: measure the device's cost-model constants and store its profile, which later loss
    calls read (pacs_kernels/engine/device.py; a loss call itself never measures nor writes)."""
    from pacs_kernels.engine.device import calibrate_device_profile, profile_path

    parser = argparse.ArgumentParser(prog="pacs bench calibrate", description=calibrate.__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="default: bfloat16 on CUDA, float32 elsewhere")
    parser.add_argument("--no-store", action="store_true", help="print the profile, write nothing")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    profile = calibrate_device_profile(device, dtype, store=not args.no_store)
    costs = profile.costs
    print(f"[calibrate] {profile.name} ({device.type}, {str(dtype).removeprefix('torch.')}): "
          f"{1e-9 / costs.gemm_s_per_flop:.1f} GFLOP/s GEMMs, {1e-9 / costs.pass_s_per_element:.2f} G elements/s "
          f"a pass; GPU table entries for this device: {len(profile.table)}"
          + ("" if args.no_store else f"; stored in {profile_path()}"))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "calibrate":
        return calibrate(argv[1:])
    args = parse_args(argv)
    name = args.name or args.size_set
    if args.report_only:
        write_report(args, name, report.read_csv(args.out / f"{name}.csv"))
        return 0
    device, dtype, shapes = plan(args)
    if args.max_seconds is None:
        args.max_seconds = SETS[args.size_set].get("max_seconds")
    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available here", file=sys.stderr)
        return 2
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    dev_name = device_name(device)
    # the matmul floor is measured on the GPU only: on a (shared) CPU one rate measured at the
    # start says little about the cores' speed minutes later
    rate = matmul_tflops(device, torch.bfloat16) if device == "cuda" else None
    print(f"[bench] {name}: {dev_name}, {dtype}"
          + (f"; bf16 matmul rate {rate:.0f} TFLOP/s" if rate else ""), flush=True)

    impls = []
    for impl in args.impls:
        reasons = {op: impl_unavailable_reason(op, impl, device) for op in args.ops}
        if all(reasons.values()):
            print(f"[bench] skipping {impl}: {next(iter(reasons.values()))}", flush=True)
        else:
            impls.append(impl)

    rows, stopped = [], set()
    args.out.mkdir(parents=True, exist_ok=True)
    csv_path = args.out / f"{name}.csv"
    started = time.perf_counter()
    for d, v, n_values in shapes:
        for n in n_values:
            for op in args.ops:
                for impl in impls:
                    reason = impl_unavailable_reason(op, impl, device)
                    if reason:
                        continue
                    case = Case(op=op, impl=impl, n=n, d=d, v=v, dtype=dtype, device=device)
                    row = {"date": date, "device": device, "device_name": dev_name, "op": op, "impl": impl,
                           "N": n, "d": d, "V": v, "dtype": dtype, "matmul_tflops": rate}
                    key = (op, impl, d, v)
                    if key in stopped:
                        row.update(status="skipped", note="failed at a smaller N")
                    elif args.time_budget is not None and time.perf_counter() - started > args.time_budget:
                        row.update(status="budget", note="time budget spent")
                    else:
                        result = measure_case(case, warmup=args.warmup, repeats=args.repeats,
                                              timeout_s=args.timeout, max_seconds=args.max_seconds,
                                              threads=args.threads)
                        row.update(result)
                        if row["status"] in STOP_STATUSES:
                            stopped.add(key)
                        if row["status"] == "ok":
                            seconds = row["median_ms"] / 1e3
                            row["tflops"] = case.flops() / seconds / 1e12
                            if rate:  # the floor: the op's matmuls at the measured rate
                                row["flop_fraction"] = row["tflops"] / rate
                                row["floor_ms"] = case.flops() / (rate * 1e12) * 1e3
                                row["x_floor"] = row["median_ms"] / row["floor_ms"]
                    rows.append(row)
                    _print_row(row)
                    report.write_csv(rows, csv_path)  # after every case: a killed run keeps its rows

    report.write_csv(rows, csv_path)  # also when nothing could run (a header only)
    written = write_report(args, name, report.read_csv(csv_path))
    print(f"[bench] done in {time.perf_counter() - started:.0f}s; wrote " + ", ".join(str(p) for p in written),
          flush=True)
    return 0


def write_report(args, name: str, csv_rows: list[dict]) -> list[Path]:
    """The Markdown table and the plots from the CSV rows; returns the paths written."""
    notes = [f"torch {torch.__version__}, python {platform.python_version()}; warm-up {args.warmup}, "
             f"median of up to {args.repeats} runs on fresh random inputs"] + list(args.note)
    md_path = args.out / f"{name}.md"
    md_path.write_text(report.markdown(csv_rows, title=f"Benchmark `{name}`", notes=notes))
    written = [args.out / f"{name}.csv", md_path]
    if not args.no_plots:
        written += report.plot(csv_rows, args.out / f"plots_{name}")
    return written


def _print_row(row: dict) -> None:
    head = f"[bench] {row['op']:20s} {row['impl']:13s} N={row['N']:<6d} d={row['d']} V={row['V']}"
    if row["status"] == "ok":
        extra = f"  {row['x_floor']:.2f}x the 3-matmul floor" if row.get("x_floor") is not None else ""
        if row.get("cpu_util") is not None:
            extra += f"  cpu {row['cpu_util']:.1f}/{row['threads']} threads"
        print(f"{head}: {row['median_ms']:9.1f} ms  {row['peak_mem_mib']:9.1f} MiB  "
              f"(x{row['repeats']}){extra}", flush=True)
    else:
        print(f"{head}: {row['status']} {row.get('note', '')}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
