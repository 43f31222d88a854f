"""The loss grid: naive, each of our paths, ``auto`` and the peers at every (V, d, N) point, in one run.

    python benchmarks/loss_grid.py --grid cpu-quick            # about 12 min on 2 quiet cores
    python benchmarks/loss_grid.py --grid cpu --estimate       # how long the full CPU grid would take
    python benchmarks/loss_grid.py --grid cpu --resume         # time only what the CSV lacks (a cut run, a column)
    python benchmarks/loss_grid.py --grid cpu --paired         # then auto vs our fastest path, in alternation
    python benchmarks/loss_grid.py --grid cpu-quick --paired --against ours cce naive   # and vs CCE, naive
    python benchmarks/loss_grid.py --grid gpu --device cuda    # GPU shapes (benchmarks/gpu.sh)
    python benchmarks/loss_grid.py --grid dry                  # tiny shapes: the plumbing (tests, gpu.sh dry run)
    python benchmarks/loss_grid.py --grid gpu-quick --objective dapo   # a GRPO-family objective instead of PACS

Each point times the PACS loss forward + backward (ops.py's ``pacs_loss_fwd_bwd``: 16 responses of up to
N/16 tokens, groups of 8, float32 on the CPU, bf16 on a GPU) for

    naive          the N x V logits materialized (fused_linear_pacs_loss(backend="naive"))
    single_pass    path="single_pass", a chunk budget of one group (3 matmuls)
    two_pass       path="two_pass" (chunked torch on the CPU, the Triton kernels on CUDA)
    one_sweep      the first step after a rollout (old_lse given: ops.py's ``pacs_loss_first_step``)
    auto           fused_linear_pacs_loss's defaults: the path and budget pacs_kernels/engine/plan.py picks
    cce            Cut Cross-Entropy's log-probs + pacs_loss (its torch_compile impl on the CPU)
    liger_chunked  Liger-Kernel's chunked log-prob step + pacs_loss
    trl_chunked    TRL's fused LM-head log-probs (trl.kernels, TRL 1.15+) + pacs_loss
    naive_gemms    not a loss: naive's 3 GEMMs alone (all response tokens in each, ops.py); naive less this
                   is the elementwise work and autograd a fused path can save

and writes OUT/loss_grid_<grid>.csv, .md (times relative to naive, and ``auto`` against the fastest of
single_pass / two_pass) and .png, with the device and the date. A point where naive's logits (and CCE's,
which materializes them too on the CPU) would not fit in memory is skipped for those two, with the reason.
Peers that are not importable are skipped with the reason (ops.impl_unavailable_reason).

``--paired`` (after the grid, on OUT's CSV): at every point, auto against the faster of single_pass / two_pass,
the two timed in alternation in one worker (measure.measure_pair: the median of 3 to 9 per-round ratios, as many
rounds as fit in a minute of timed runs on the CPU, and their range; ``--against cce naive``: against those
columns too, e.g. for the targets at V=151,936), into
OUT/loss_grid_<grid>_paired.csv and a ``paired`` column of the table: separate runs of the same work differ by
more than the 5% the target allows on a shared machine. Points already paired are kept; ``--again V,d,N ...``
times those points again (the new pair replaces the old, whose ratio its note keeps) and ``--paired-seconds``
allows more rounds where a run is long. ``--note`` is not kept by ``--resume`` and ``--paired``: give it again.

``--resume`` first times the cheapest case the CSV kept again: where that run is off by more than DRIFT
(either way) the machine is not the one that timed the kept cases (another host, a busy neighbour), cells
timed now would not compare with them, and the run stops, unless ``--accept-drift``. The Markdown's note gives
the case timed again, both times and their ratio, within DRIFT too: a ratio across runs is only as good as that.

``--objective`` grpo | dapo | dr_grpo | gspo | cispo races that objective at its defaults instead (ops.py's
``objective_loss_fwd_bwd``, benchmarks/grpo_family.py), on the same inputs, into
OUT/loss_grid_<grid>_<objective>.*: naive (materialized logits + the objective), single_pass, two_pass and
auto (fused_linear_objective_loss), cce (its log-probs + the objective), and liger_fused (Liger-Kernel's
fused linear GRPO loss with the matching loss_type, or the sequence level for GSPO); one_sweep is PACS's
own (skipped with the reason).
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import math
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks import grpo_family, report
from benchmarks.measure import measure_case, measure_pair
from benchmarks.ops import OBJECTIVE_OP, Case, impl_unavailable_reason, selected_tokens
from benchmarks.run import device_name

# PACS: column -> (op, impl on the CPU, impl on CUDA)
COLUMNS = {
    "naive": ("pacs_loss_fwd_bwd", "naive", "naive"),
    "single_pass": ("pacs_loss_fwd_bwd", "single_pass", "single_pass"),
    "two_pass": ("pacs_loss_fwd_bwd", "torch", "triton"),
    "one_sweep": ("pacs_loss_first_step", "torch", "triton"),
    "auto": ("pacs_loss_fwd_bwd", "auto", "auto"),
    "cce": ("pacs_loss_fwd_bwd", "cce", "cce"),
    "liger_chunked": ("pacs_loss_fwd_bwd", "liger_chunked", "liger_chunked"),
    "trl_chunked": ("pacs_loss_fwd_bwd", "trl_chunked", "trl_chunked"),
    "naive_gemms": ("pacs_loss_fwd_bwd", "naive_gemms", "naive_gemms"),  # a reference point, not a loss
}
# a GRPO-family objective (--objective): column -> (op, impl on the CPU, impl on CUDA), or None: not for it
OBJECTIVE_COLUMNS = {
    "naive": (OBJECTIVE_OP, "naive", "naive"),
    "single_pass": (OBJECTIVE_OP, "single_pass", "single_pass"),
    "two_pass": (OBJECTIVE_OP, "torch", "triton"),
    "one_sweep": None,
    "auto": (OBJECTIVE_OP, "auto", "auto"),
    "cce": (OBJECTIVE_OP, "cce", "cce"),
    "liger_fused": (OBJECTIVE_OP, "liger_fused", "liger_fused"),
    "naive_gemms": (OBJECTIVE_OP, "naive_gemms", "naive_gemms"),
}
NOT_FOR_OBJECTIVES = {
    "one_sweep": "the one-sweep first step (old_lse) is PACS's own: fused_linear_objective_loss has none",
    "liger_chunked": "the PACS race's Liger column (its log-probs + pacs_loss); for an objective see liger_fused",
}
NOT_FOR_PACS = {"liger_fused": "Liger's GRPO-family loss; PACS couples a group's responses before any gradient, "
                               "which its per-chunk reduction cannot hold (see liger_chunked)"}
OBJECTIVES = ("pacs",) + grpo_family.OBJECTIVES
ALL_COLUMNS = tuple(dict.fromkeys([*COLUMNS, *OBJECTIVE_COLUMNS]))  # every column, in table (and colour) order
OUR_PATHS = ("single_pass", "two_pass")  # what auto chooses among for this op (one_sweep needs old_lse)
MATERIALIZING = ("naive", "cce", "naive_gemms")  # hold the N x V logits (CCE on the CPU: its torch_compile impl)
LOGIT_COPIES = {"naive": 4, "cce": 4, "naive_gemms": 1}  # naive: logits, log-softmax, its gradient, a temporary
MEMORY_SHARE = 0.6  # of the machine's memory (CPU) or the GPU's, for the materializing impls

# (V, d) of the LM heads users train
HEADS = {"qwen2.5-1.5b": (151936, 1536), "qwen2.5-7b": (152064, 3584), "llama-3-8b": (128256, 4096),
         "gemma-2-2b": (256000, 2304)}
FULL_V = (32768, 128256, 151936)
FULL_D = (512, 896, 2048)
FULL_N = (1024, 4096, 16384)
GRIDS = {
    # the full grid of issue 29 (CPU: the estimate says how long it takes)
    "cpu": {"device": "cpu", "dtype": "float32", "points": [(v, d, n) for v in FULL_V for d in FULL_D for n in FULL_N]},
    # a few points that run in about 12 min on 2 quiet cores, with the target point of issue 29
    "cpu-quick": {"device": "cpu", "dtype": "float32",
                  "points": [(32768, 512, 1024), (32768, 512, 4096), (151936, 896, 2048), (128256, 2048, 1024)]},
    # GPU shapes: the same V, the widths of Qwen2.5-1.5B / 3B / 7B, N from 4k to 64k tokens
    "gpu": {"device": "cuda", "dtype": "bfloat16",
            "points": [(v, d, n) for v in FULL_V for d in (1536, 2048, 3584) for n in (4096, 16384, 65536)]},
    "gpu-quick": {"device": "cuda", "dtype": "bfloat16",
                  "points": [(151936, 896, 16384), (152064, 3584, 16384), (128256, 2048, 65536)]},
    "dry": {"device": "cpu", "dtype": "float32", "points": [(512, 32, 64)]},
    # the heads users train (issue 47): Qwen2.5-1.5B and 7B, Llama 3 8B, Gemma 2 2B (its 256k vocabulary), at 8k
    # and 32k tokens; ours first (PACS_GPU_PART=race), the peers' columns in a later call (PACS_GPU_PART=peers)
    "gpu-heads": {"device": "cuda", "dtype": "bfloat16",
                  "points": [(v, d, n) for v, d in HEADS.values() for n in (8192, 32768)]},
}
# a run's timed repeats: at most ``repeats``, none started past ``max_seconds`` of timed runs (measure.py)
# and on the CPU, a warm-up run over ``long_run_s`` is timed instead of repeated (measure.py says why)
TIMING = {"cpu": dict(warmup=1, repeats=3, max_seconds=15.0, long_run_s=60.0),
          "cuda": dict(warmup=1, repeats=5, max_seconds=10.0)}  # 5 repeats of any run under 2 s
# time of each column over the 3-matmul floor, roughly (for the estimate only; CPU, measured on 2 cores)
ESTIMATE_FACTOR = {"naive": 2.0, "single_pass": 1.1, "two_pass": 1.5, "one_sweep": 1.4, "auto": 1.1,
                   "cce": 1.6, "liger_chunked": 3.5, "liger_fused": 3.5, "trl_chunked": 2.0, "naive_gemms": 1.0}
RUN_OVERHEAD_S = 4.0  # a fresh worker process, its imports and inputs


def memory_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.get_device_properties(0).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def skip_reason(column: str, case: Case, memory: int) -> str | None:
    """Why (column, case) is not timed: the peer's or path's own reason, or the logits not fitting."""
    reason = impl_unavailable_reason(case.op, case.impl, case.device, case.objective)
    if reason:
        return reason
    if column in MATERIALIZING and (column != "cce" or case.device != "cuda"):
        need = LOGIT_COPIES[column] * 4 * selected_tokens(case) * case.v
        if need > MEMORY_SHARE * memory:
            return (f"its N x V float32 logits need about {need / 2 ** 30:.0f} GiB, over {MEMORY_SHARE:.0%} of "
                    f"the {memory / 2 ** 30:.0f} GiB here")
    return None


def default_columns(objective: str = "pacs") -> list[str]:
    return list(COLUMNS if objective == "pacs" else OBJECTIVE_COLUMNS)


def column_case(column: str, objective: str, point: tuple, dtype: str, device: str) -> tuple[Case, str | None]:
    """The case a column times at ``point`` = (V, d, N) for ``objective``, and a reason when the column is not
    one of that objective's (its row then says why; the case is the column's PACS case, for the record)."""
    v, d, n = point
    spec = COLUMNS.get(column) if objective == "pacs" else OBJECTIVE_COLUMNS.get(column)
    fixed = (NOT_FOR_PACS if objective == "pacs" else NOT_FOR_OBJECTIVES).get(column)
    if spec is None:
        spec = COLUMNS.get(column) or OBJECTIVE_COLUMNS[column]
    op, cpu_impl, cuda_impl = spec
    case = Case(op, cuda_impl if device == "cuda" else cpu_impl, n, d, v, dtype, device,
                objective=None if objective == "pacs" else objective)
    return case, fixed


def cases(grid: str, device: str, columns, objective: str = "pacs") -> list[tuple[str, Case, str | None]]:
    """(column, case, reason it is not for this objective or None) for every point and column of the grid, the
    cheapest point (N x V x d) first: a run cut by its time budget has measured as many points as it could."""
    spec = GRIDS[grid]
    return [(column, *column_case(column, objective, point, spec["dtype"], device))
            for point in sorted(spec["points"], key=lambda p: p[0] * p[1] * p[2]) for column in columns]


def estimate_seconds(grid: str, device: str, columns, gemm_flops_per_s: float, objective: str = "pacs") -> float:
    """How long the grid's CPU run takes, roughly: per timed impl, its runs (warmup + repeats within the cap)
    at ESTIMATE_FACTOR x the 3-matmul floor at ``gemm_flops_per_s``, plus a worker's start."""
    timing, memory, total = TIMING["cuda" if device == "cuda" else "cpu"], memory_bytes(device), 0.0
    for column, case, fixed in cases(grid, device, columns, objective):
        if fixed or skip_reason(column, case, memory):
            continue
        one = ESTIMATE_FACTOR[column] * 6.0 * selected_tokens(case) * case.v * case.d / gemm_flops_per_s
        timed = max(1, min(timing["repeats"], int(timing["max_seconds"] // max(one, 1e-9)) + 1))
        runs = 1 if one > timing.get("long_run_s", float("inf")) else timing["warmup"] + timed
        total += RUN_OVERHEAD_S + one * runs
    return total


SPREAD = 1.25  # a row whose median run took over this times its fastest run is unsteady


def unsteady(row: dict) -> str | None:
    """Why a measured row's time is not to be trusted as it stands, or None: its process got well under its
    threads' worth of CPU (report.contended_row: a busy machine), or its runs spread over SPREAD."""
    if _ms(row) is None:
        return None
    if report.contended_row(row):
        return f"a busy machine (CPU use {float(row['cpu_util']):.2f} of {int(float(row['threads']))} threads)"
    low, runs = report._num(row.get("min_ms")), report._num(row.get("repeats"))
    if low and runs and runs > 1 and _ms(row) > SPREAD * low:
        return f"runs spread from {low:.0f} to a median of {_ms(row):.0f} ms"
    return None


def earlier_rows(path: Path, device: str, objective: str, flag: str = "--resume") -> list[dict]:
    """The rows of an earlier run's CSV (none where there is no such file); a CSV of another device or
    objective is refused."""
    if not path.exists():
        return []
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    for row in rows:
        if row["device"] != device or row["objective"] != objective:
            raise ValueError(f"{flag}: {path} holds {row['objective']} rows measured on {row['device']}, "
                             f"not {objective} on {device}; give another --out")
    return rows


def measured_rows(path: Path, device: str, objective: str) -> dict[tuple, dict]:
    """The rows of an earlier run's CSV worth keeping (status ok and not :func:`unsteady`; skip reasons are
    found again), by (column, V, d, N); a CSV of another device or objective is refused."""
    return {(row["column"], int(row["V"]), int(row["d"]), int(row["N"])): row
            for row in earlier_rows(path, device, objective) if row["status"] == "ok" and not unsteady(row)}


DRIFT = 1.25  # --resume: the kept case timed again off by more than this factor, either way: another machine


def drift_check(kept: dict[tuple, dict], grid: str, device: str, objective: str, timing: dict) -> dict | None:
    """``--resume``'s guard: the cheapest case ``kept`` holds (first in column order at a tie) timed again now.
    Returns its column, point, kept and new median (ms) and their ratio; None where nothing is kept or the new
    run failed."""
    if not kept:
        return None
    column, v, d, n = min(kept, key=lambda key: (key[1] * key[2] * key[3], ALL_COLUMNS.index(key[0])))
    case, _ = column_case(column, objective, (v, d, n), GRIDS[grid]["dtype"], device)
    now = measure_case(case, timeout_s=900.0, **timing)
    then, again = _ms(kept[(column, v, d, n)]), _ms(now)
    if then is None or again is None:
        return None
    return dict(column=column, V=v, d=d, N=n, kept_ms=then, now_ms=again, ratio=again / then)


def run_grid(grid: str, device: str, columns, out: Path, note: str = "", objective: str = "pacs",
             time_budget: float | None = None, resume: bool = False, accept_drift: bool = False) -> list[dict]:
    """Time every (point, column); cases not started within ``time_budget`` seconds get status "budget".
    ``resume``: cases the CSV in ``out`` already holds as measured (ok, steady) are kept, with their run's date;
    the CSV's cases of columns this run does not time are kept as they are (skipped, timed out or budget too).
    Where there is something to time, :func:`drift_check` first: a kept case off by more than DRIFT stops the
    run (RuntimeError) unless ``accept_drift``, which puts the drift in the Markdown's note."""
    timing = dict(TIMING["cuda" if device == "cuda" else "cpu"])
    if grid == "dry":
        timing.update(repeats=1, max_seconds=1.0)
    memory = memory_bytes(device)
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    name = device_name(device)
    csv_path = out / f"{stem_name(grid, objective)}.csv"
    kept = measured_rows(csv_path, device, objective) if resume else {}
    todo = cases(grid, device, columns, objective)
    planned = {(column, case.v, case.d, case.n) for column, case, _ in todo}
    anything_to_time = any((column, case.v, case.d, case.n) not in kept
                           and not (fixed or skip_reason(column, case, memory)) for column, case, fixed in todo)
    drift = drift_check(kept, grid, device, objective, timing) if anything_to_time else None
    if drift:
        seen = (f"{drift['column']} at V={drift['V']} d={drift['d']} N={drift['N']} ran {drift['now_ms']:.0f} ms "
                f"against the kept {drift['kept_ms']:.0f} ms ({drift['ratio']:.2f}x)")
        over = not 1 / DRIFT <= drift["ratio"] <= DRIFT
        if over and not accept_drift:
            raise RuntimeError(f"--resume: {seen}: this machine is not in the state that timed the kept cases, and "
                               "cells timed now would not compare with them; time the grid anew into another --out, "
                               "or give --accept-drift (the Markdown then says so)")
        # within DRIFT too: a ratio across runs is only as good as this agreement, so the Markdown keeps it
        note = " ".join(filter(None, [note, f"{'--accept-drift' if over else '--resume'}: timed again before "
                                            f"this run ({date}), {seen}."]))
    # the cases of other columns (or points) that this run does not time stay as they were, whatever their status
    rows = [row for row in (earlier_rows(csv_path, device, objective) if resume else [])
            if (row["column"], int(row["V"]), int(row["d"]), int(row["N"])) not in planned]
    started = time.perf_counter()
    for column, case, fixed in todo:
        row = dict(date=date, device=device, device_name=name, objective=objective, column=column, impl=case.impl,
                   op=case.op, N=case.n, d=case.d, V=case.v, dtype=case.dtype)
        reason = fixed or skip_reason(column, case, memory)
        if (column, case.v, case.d, case.n) in kept:
            row = kept[(column, case.v, case.d, case.n)]
        elif reason:
            row.update(status="skipped", note=reason)
        elif time_budget is not None and time.perf_counter() - started > time_budget:
            row.update(status="budget", note=f"not started: the run's time budget ({time_budget:g}s) was spent")
        else:
            row.update(measure_case(case, timeout_s=900.0, **timing))
        rows.append(row)
        print(f"[grid] V={case.v} d={case.d} N={case.n} {column}: {row.get('status')} "
              f"{row.get('median_ms', '')} {row.get('note', '')}", flush=True)
        write(rows, grid, out, note, objective)  # after every case: a run cut short keeps what it measured
    return rows


# rounds of the paired check (measure.measure_pair_in_process): at least PAIRED_MIN_ROUNDS, at most PAIRED_ROUNDS,
# none past the minimum started once the timed runs add up to PAIRED_SECONDS (a run on a shared 2-core CPU
# moves by up to 20% from one round to the next: a median of 3 can follow one disturbed round); on a GPU at
# least PAIRED_MIN_ROUNDS_CUDA (issue 47: at least 5 repeats of auto against the fastest path in one worker)
PAIRED_ROUNDS, PAIRED_MIN_ROUNDS = 9, 3
PAIRED_MIN_ROUNDS_CUDA = 5
PAIRED_SECONDS = {"cpu": 60.0, "cuda": 10.0}
PAIRED_COLUMNS = ["date", "device", "device_name", "objective", "V", "d", "N", "against", "auto_ms", "against_ms",
                  "ratio", "ratio_min", "ratio_max", "rounds", "threads", "cpu_util", "loadavg", "status", "note"]


def paired_path(out: Path, grid: str, objective: str = "pacs") -> Path:
    return out / f"{stem_name(grid, objective)}_paired.csv"


OURS = "ours"  # --against's default: the faster of OUR_PATHS at the point (as the grid measured them)


def measured_pairs(out: Path, grid: str, objective: str = "pacs") -> list[dict]:
    """The paired check's measured (status ok) rows in ``out``, every ``against``; none where it has not run."""
    path = paired_path(out, grid, objective)
    return [r for r in report.read_csv(path) if r["status"] == "ok"] if path.exists() else []


def paired_kind(column: str) -> str:
    return OURS if column in OUR_PATHS else column


def pair_key(row: dict) -> tuple[int, int, int, str]:
    """(V, d, N, kind) of a paired row: one pair per point and kind (OURS or a column)."""
    return int(row["V"]), int(row["d"]), int(row["N"]), paired_kind(row["against"])


def run_paired(grid: str, device: str, out: Path, note: str = "", objective: str = "pacs",
               time_budget: float | None = None, against: tuple[str, ...] = (OURS,),
               seconds: float | None = None, again: tuple[tuple[int, int, int], ...] = ()) -> list[dict]:
    """``--paired``: at every point of ``out``'s grid CSV where ``auto`` and one of our paths were measured,
    auto against the faster of our paths (``against``: OURS, and/or columns such as cce or naive, where the
    grid measured them) timed in alternation in one worker (measure.measure_pair: the median of 3 to 9
    per-round ratios on the same inputs; no round past the third starts once the timed runs add up to
    ``seconds``, default PAIRED_SECONDS), cheapest point first; pairs already measured are kept, except at the
    (V, d, N) points of ``again``: timed anew, the new row replaces the old and its note keeps the old ratio.
    Writes OUT/loss_grid_<grid>[_<objective>]_paired.csv and rebuilds the grid's table and plot."""
    grid_csv = out / f"{stem_name(grid, objective)}.csv"
    rows = earlier_rows(grid_csv, device, objective, flag="--paired")
    if not rows:
        raise FileNotFoundError(f"--paired: no grid results in {grid_csv}; run the grid first")
    spec = GRIDS[grid]
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    name = device_name(device)
    path = paired_path(out, grid, objective)
    if seconds is not None and not (isinstance(seconds, (int, float)) and seconds >= 0):
        raise ValueError(f"--paired-seconds must be a number of seconds >= 0, got {seconds!r}")
    seconds = PAIRED_SECONDS["cuda" if device == "cuda" else "cpu"] if seconds is None else seconds
    again = {tuple(int(x) for x in point) for point in again}
    done, replaced, failed_again = [], {}, []
    for r in measured_pairs(out, grid, objective):
        if pair_key(r)[:3] in again:
            replaced[pair_key(r)] = r
        else:
            done.append(r)
    kept = {pair_key(r) for r in done}
    started = time.perf_counter()
    pairs = [(point, cells, kind) for point, cells in sorted(points(rows).items(), key=lambda item: math.prod(item[0]))
             for kind in against]
    for (v, d, n), cells, kind in pairs:
        ours = {c: _ms(cells[c]) for c in OUR_PATHS if c in cells and _ms(cells[c]) is not None}
        other = min(ours, key=ours.get) if kind == OURS and ours else kind
        if (v, d, n, kind) in kept or not ours or _ms(cells.get("auto", {})) is None \
                or _ms(cells.get(other, {})) is None:
            continue
        row = dict(date=date, device=device, device_name=name, objective=objective, V=v, d=d, N=n, against=other)
        if time_budget is not None and time.perf_counter() - started > time_budget:
            row.update(status="budget", note=f"not started: the run's time budget ({time_budget:g}s) was spent")
        else:
            auto_case, _ = column_case("auto", objective, (v, d, n), spec["dtype"], device)
            other_case, _ = column_case(other, objective, (v, d, n), spec["dtype"], device)
            result = measure_pair(auto_case, other_case, rounds=PAIRED_ROUNDS,
                                  min_rounds=PAIRED_MIN_ROUNDS_CUDA if device == "cuda" else PAIRED_MIN_ROUNDS,
                                  timeout_s=3600.0, max_seconds=seconds)
            row.update(status=result["status"], note=result.get("note", ""))
            if result["status"] == "ok":
                row.update(auto_ms=statistics.median(result["first_ms"]), against_ms=statistics.median(
                    result["second_ms"]), **{k: result.get(k) for k in ("ratio", "ratio_min", "ratio_max", "rounds",
                                                                         "threads", "cpu_util", "loadavg")})
        earlier = replaced.get((v, d, n, kind))
        if earlier is not None and row["status"] == "ok":  # timed again: the new pair replaces the old
            del replaced[(v, d, n, kind)]
            row["note"] = "; ".join(filter(None, [row["note"], earlier_pair_note(earlier)]))
        if earlier is None or row["status"] == "ok":
            done.append(row)
        else:  # not timed again: the old row stays in the CSV; the run still reports the failure
            failed_again.append(row)
        print(f"[paired] V={v} d={d} N={n} auto vs {other}: {row['status']} {row.get('ratio', '')} "
              f"{row.get('note', '')}", flush=True)
        report.write_csv_and_markdown(path.with_suffix(""),
                                      [{k: report._fmt(r.get(k)) for k in PAIRED_COLUMNS}
                                       for r in [*done, *replaced.values()]],
                                      PAIRED_COLUMNS, paired_markdown([*done, *replaced.values()]))
        write(rows, grid, out, note, objective)
    return [*done, *replaced.values(), *failed_again]


def earlier_pair_note(row: dict) -> str:
    """What a pair timed again keeps of the row it replaces: its ratio, range, rounds and date."""
    ratio, low, high = (report._num(row.get(k)) for k in ("ratio", "ratio_min", "ratio_max"))
    text = f"timed again ({row.get('date', '')}: {ratio:.2f}" if ratio is not None else "timed again ("
    if low is not None and high is not None:
        text += f", {low:.2f}-{high:.2f}"
    return text + f", {row.get('rounds', '?')} rounds)"


def parse_point(text: str) -> tuple[int, int, int]:
    """``V,d,N`` (argparse type for --again)."""
    try:
        v, d, n = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a point as V,d,N (three integers), got {text!r}") from None
    return v, d, n


def paired_markdown(rows: list[dict]) -> list[str]:
    lines = ["auto against the faster of our paths (or the column asked with --against), timed in alternation in "
             "one worker (loss_grid.py --paired)", "",
             "| V | d | N | against | auto ms | against ms | ratio | per-round range | rounds | status |",
             "|---:|---:|---:|---|---:|---:|---:|---|---:|---|"]
    for r in rows:
        ratio, low, high = (report._num(r.get(k)) for k in ("ratio", "ratio_min", "ratio_max"))
        spread = "" if low is None or high is None else f"{low:.2f}-{high:.2f}"
        lines.append(f"| {r['V']} | {r['d']} | {r['N']} | {r['against']} | {report._fmt(r.get('auto_ms'))} | "
                     f"{report._fmt(r.get('against_ms'))} | {'' if ratio is None else f'{ratio:.3f}'} | "
                     f"{spread} | {report._fmt(r.get('rounds'))} | {r['status']} |")
    return lines


def stem_name(grid: str, objective: str = "pacs") -> str:
    """The results' file stem: loss_grid_<grid> for PACS, loss_grid_<grid>_<objective> for the others."""
    return f"loss_grid_{grid}" if objective == "pacs" else f"loss_grid_{grid}_{objective}"


CSV_COLUMNS = ["date", "device", "device_name", "objective", "column", "impl", "op", "N", "d", "V", "dtype",
               "median_ms", "min_ms", "repeats", "peak_mem_mib", "x_naive", "threads", "cpu_util", "loadavg", "status",
               "note"]


def _ms(row) -> float | None:
    return float(row["median_ms"]) if row.get("status") == "ok" and row.get("median_ms") not in (None, "") else None


def points(rows: list[dict]) -> dict[tuple, dict[str, dict]]:
    by_point: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        by_point.setdefault((int(row["V"]), int(row["d"]), int(row["N"])), {})[row["column"]] = row
    return by_point


def auto_over_fastest(cells: dict[str, dict]) -> float | None:
    """auto's time over the fastest of our paths (single_pass, two_pass) at one point."""
    ours = [_ms(cells[c]) for c in OUR_PATHS if c in cells and _ms(cells[c]) is not None]
    auto = _ms(cells["auto"]) if "auto" in cells else None
    return None if auto is None or not ours else auto / min(ours)


def write(rows: list[dict], grid: str, out: Path, note: str = "", objective: str = "pacs") -> Path:
    by_point = points(rows)
    for cells in by_point.values():
        naive = _ms(cells["naive"]) if "naive" in cells else None
        for row in cells.values():
            ms = _ms(row)
            row["x_naive"] = None if naive is None or ms is None else ms / naive
    columns = [c for c in ALL_COLUMNS if any(r["column"] == c for r in rows)]
    first = rows[0] if rows else {}
    dates = sorted({r.get("date", "?") for r in rows}) or ["?"]
    label = "PACS" if objective == "pacs" else objective
    if objective == "pacs":
        what = ("one_sweep is the first step after a rollout (given old_lse); cce and liger_chunked give log-probs, "
                "followed by pacs_loss.")
    else:
        what = (f"The objective is pacs_kernels' {type(grpo_family.make_objective(objective, 1)).__name__} at its "
                "defaults (old log-probs: the current ones plus N(0, 0.05) noise; 0/1 rewards); naive materializes "
                "the logits; cce gives log-probs, followed by the objective; "
                + grpo_family.liger_note(objective) + ".")
    if "naive_gemms" in columns:
        what += (" naive_gemms is not a loss: naive's 3 GEMMs alone (logits, dh, dW of all response tokens at "
                 "once), no softmax, no loss; naive less it is what a fused path can save.")
    lines = [f"## {label} loss grid `{grid}`", "",
             f"Device: {first.get('device_name', '?')} ({first.get('device', '?')}); "
             + (f"date: {dates[0]}." if len(dates) == 1 else
                f"runs of {', '.join(dates)} (--resume; each row's date is in the CSV; a ratio marked * compares "
                "columns of different runs)."),
             "", f"{label} loss forward + backward (16 responses of up to N/16 tokens, groups of 8, "
             f"{first.get('dtype', '?')}); each cell: median ms, and in brackets the time relative to naive. "
             "`auto / fastest`: auto over the faster of single_pass and two_pass (target: at most 1.05). " + what, ""]
    if note:
        lines += [note, ""]
    pairs = measured_pairs(out, grid, objective)
    paired = {(int(r["V"]), int(r["d"]), int(r["N"])): report._num(r.get("ratio")) for r in pairs
              if paired_kind(r["against"]) == OURS}
    if paired:
        lines += [f"`paired`: auto over the faster of our paths, the two timed in alternation in one worker "
                  f"({PAIRED_MIN_ROUNDS} ({PAIRED_MIN_ROUNDS_CUDA} on a GPU) to {PAIRED_ROUNDS} rounds on the same inputs, the median of the per-round "
                  f"ratios; `--paired`, `{paired_path(out, grid, objective).name}`): separate runs of the same work "
                  "differ by more than 5% on a shared machine.", ""]
    lines += ["| V | d | N | " + " | ".join(columns) + " | auto / fastest |" + (" paired |" if paired else ""),
              "|---:|---:|---:|" + "---:|" * (len(columns) + 1 + bool(paired))]
    skipped, shaky = {}, []
    for (v, d, n), cells in sorted(by_point.items()):
        shown = []
        for column in columns:
            row = cells.get(column)
            if row is None:
                shown.append("")
            elif _ms(row) is None:
                skipped.setdefault((column, row.get("note", "")), []).append(f"V={v} d={d} N={n}")
                shown.append(row.get("status", "?"))
            else:
                ratio = row.get("x_naive")
                why = unsteady(row)
                if why:
                    shaky.append(f"{column} at V={v} d={d} N={n}: {why}")
                shown.append(f"{_ms(row):.0f}" + (f" ({ratio:.2f})" if ratio is not None else "")
                             + ("†" if why else ""))
        ratio = auto_over_fastest(cells)
        mixed = len({cells[c].get("date") for c in ("auto", *OUR_PATHS) if c in cells}) > 1
        shown_ratio = "" if ratio is None else f"{ratio:.2f}" + ("*" if mixed else "")
        lines.append(f"| {v} | {d} | {n} | " + " | ".join(shown) + f" | {shown_ratio} |"
                     + (f" {paired[(v, d, n)]:.2f} |" if (v, d, n) in paired else " |" if paired else ""))
    ratios = [r for r in (auto_over_fastest(cells) for cells in by_point.values()) if r is not None]
    if ratios:
        lines += ["", f"auto / fastest of ours, separate runs: median {statistics.median(ratios):.2f}, worst "
                  f"{max(ratios):.2f}, within 1.05 at {sum(r <= 1.05 for r in ratios)} of {len(ratios)} points"
                  + (f"; paired: median {statistics.median(paired.values()):.2f}, worst {max(paired.values()):.2f}, "
                     f"within 1.05 at {sum(r <= 1.05 for r in paired.values())} of {len(paired)} points"
                     if paired else "") + "."]
    others = [r for r in pairs if paired_kind(r["against"]) != OURS]
    for column in dict.fromkeys(r["against"] for r in others):
        found = [float(r["ratio"]) for r in others if r["against"] == column]
        lines += ["", f"auto / {column}, paired: median {statistics.median(found):.2f}, worst {max(found):.2f}, "
                  f"best {min(found):.2f} at {len(found)} points ({paired_path(out, grid, objective).name})."]
    if shaky:
        lines += ["", "Unsteady (marked †; `--resume` times them again):", ""] + [f"- {line}" for line in shaky]
    if skipped:
        lines += ["", "Not timed:", ""]
        lines += [f"- {column} at {', '.join(where)}: {why}" for (column, why), where in skipped.items()]
    stem = report.write_csv_and_markdown(out / stem_name(grid, objective), [
        {k: report._fmt(r.get(k)) for k in CSV_COLUMNS} for r in rows], CSV_COLUMNS, lines)
    plot(by_point, columns, stem.with_suffix(".png"), title=f"{label} loss grid {grid}: "
         f"{first.get('device_name', '')}, {', '.join(dates)}", paired=paired)
    return stem


def plot(by_point: dict, columns: list[str], path: Path, title: str, paired: dict | None = None) -> None:
    """Two panels: each column's time relative to naive, in bars per point (points where naive did not run
    are left out); below, auto over the fastest of our paths at every point that has both (bars: separate
    runs; dots: ``paired``, timed in alternation), with the target (1.05)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [k for k, cells in sorted(by_point.items()) if "naive" in cells and _ms(cells["naive"]) is not None]
    ratios = [(k, auto_over_fastest(cells)) for k, cells in sorted(by_point.items())]
    ratios = [(k, r) for k, r in ratios if r is not None]
    shown = [c for c in columns if c != "naive"]
    width_in = max(6.0, 1.2 * len(labels) * max(1, len(shown)) / 4, 0.45 * len(ratios))
    fig, (ax, below) = plt.subplots(2, 1, figsize=(width_in, 6.6), height_ratios=(3, 2))
    width = 0.8 / max(1, len(shown))
    for i, column in enumerate(shown):
        xs, ys = [], []
        for j, key in enumerate(labels):
            row = by_point[key].get(column)
            if row is not None and row.get("x_naive") is not None:
                xs.append(j + i * width)
                ys.append(row["x_naive"])
        if xs:  # a column never timed against naive has no bar and no legend entry; each column keeps its colour
            ax.bar(xs, ys, width=width, label=column, color=f"C{ALL_COLUMNS.index(column) % 10}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))])
    ax.set_xticklabels([f"V={v}\nd={d}\nN={n}" for v, d, n in labels], fontsize=7)
    ax.set_ylabel("time / naive")
    ax.grid(True, axis="y", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, ncol=3)
    ax.set_title(title, fontsize=9)
    below.bar(range(len(ratios)), [r for _, r in ratios], color="tab:gray", label="separate runs")
    dots = [(i, paired[key]) for i, (key, _) in enumerate(ratios) if paired and key in paired]
    if dots:
        below.plot([i for i, _ in dots], [r for _, r in dots], "o", color="black", markersize=4, label="paired")
    below.axhline(1.0, color="black", linewidth=0.8)
    below.axhline(1.05, color="tab:red", linewidth=0.8, linestyle="--", label="target 1.05")
    below.set_xticks(range(len(ratios)))
    below.set_xticklabels([f"{v}\n{d}\n{n}" for (v, d, n), _ in ratios], fontsize=6)
    below.set_ylabel("auto / fastest of ours")
    below.set_xlabel("V, d, N", fontsize=7)
    if ratios:
        shown_ratios = [r for _, r in ratios] + [r for _, r in dots]
        below.set_ylim(min(0.9, min(shown_ratios) - 0.02), max(1.15, max(shown_ratios) + 0.02))
        below.legend(fontsize=7)
    below.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", choices=sorted(GRIDS), default="cpu-quick")
    parser.add_argument("--objective", choices=OBJECTIVES, default="pacs",
                        help="the loss raced (default pacs; the others at their defaults: benchmarks/grpo_family.py)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: the grid's")
    parser.add_argument("--columns", nargs="+", choices=list(ALL_COLUMNS),
                        default=None, help="default: the objective's (a column not for it is listed, skipped)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds: cases not started by then are recorded as 'budget' (the table stays whole)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the cases OUT's CSV of this grid already measured (ok and steady), time the rest")
    parser.add_argument("--accept-drift", action="store_true",
                        help=f"with --resume: go on where the kept case timed again is off by more than {DRIFT:g}x "
                             "(the Markdown says so)")
    parser.add_argument("--paired", action="store_true",
                        help="time auto against the faster of our paths in alternation at every point of OUT's CSV "
                             "(after the grid; points already paired are kept)")
    parser.add_argument("--against", nargs="+", default=[OURS], choices=[OURS, *ALL_COLUMNS],
                        help="with --paired: what auto is timed against (default: ours, the faster of our paths; "
                             "or columns the grid measured, e.g. cce naive)")
    parser.add_argument("--paired-seconds", type=float, default=None,
                        help="with --paired: no round past the third starts once a pair's timed runs add up to this "
                             f"(default {PAIRED_SECONDS['cpu']:g} s on the CPU, {PAIRED_SECONDS['cuda']:g} s on CUDA; "
                             f"at most {PAIRED_ROUNDS} rounds)")
    parser.add_argument("--again", nargs="+", type=parse_point, default=[], metavar="V,d,N",
                        help="with --paired: time these points again (the new pair replaces the old; its note keeps "
                             "the old ratio)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--estimate", action="store_true", help="print how long the run would take, run nothing")
    parser.add_argument("--gflops", type=float, default=None,
                        help="with --estimate: the GEMM rate to assume (default: the device's cost constants, measured "
                             "on small GEMMs, so low; 2 quiet Xeon cores reach about 150 on the grid's shapes)")
    parser.add_argument("--note", default="", help="a line for the Markdown (e.g. how quiet the machine was)")
    args = parser.parse_args(argv)
    if args.accept_drift and not args.resume:
        parser.error("--accept-drift goes with --resume")
    if not args.paired and (args.again or args.paired_seconds is not None):
        parser.error("--again and --paired-seconds go with --paired")
    if args.paired_seconds is not None and not args.paired_seconds >= 0:
        parser.error(f"--paired-seconds must be a number of seconds >= 0, got {args.paired_seconds}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device or GRIDS[args.grid]["device"]
    columns = args.columns or default_columns(args.objective)
    if args.estimate:
        from pacs_kernels.engine.device import measure_costs

        rate = args.gflops * 1e9 if args.gflops else 1.0 / measure_costs(
            torch.device(device), getattr(torch, GRIDS[args.grid]["dtype"])).gemm_s_per_flop
        seconds = estimate_seconds(args.grid, device, columns, rate, args.objective)
        print(f"grid {args.grid} on {device_name(device)}: about {seconds / 60:.0f} min "
              f"(GEMMs at {rate / 1e9:.0f} GFLOP/s{'' if args.gflops else ', calibrated'})")
        return 0
    started = time.perf_counter()
    if args.paired:
        done = run_paired(args.grid, device, args.out, args.note, args.objective, args.time_budget,
                          tuple(args.against), args.paired_seconds, tuple(args.again))
        for kind in args.against:
            ratios = [float(r["ratio"]) for r in done if r["status"] == "ok" and paired_kind(r["against"]) == kind]
            print(f"[paired] auto / {'fastest of ours' if kind == OURS else kind}: " + (
                f"{len(ratios)} points, median {statistics.median(ratios):.2f}, worst {max(ratios):.2f}"
                if ratios else "n/a") + f" ({time.perf_counter() - started:.0f}s)")
        return 0 if all(r["status"] in ("ok", "budget") for r in done) else 1
    rows = run_grid(args.grid, device, columns, args.out, args.note, args.objective, args.time_budget, args.resume,
                    args.accept_drift)
    ratios = [r for r in (auto_over_fastest(cells) for cells in points(rows).values()) if r is not None]
    print(f"[grid] {args.objective}: {len(rows)} cases in {time.perf_counter() - started:.0f}s; auto / fastest of "
          "ours: " + (f"median {statistics.median(ratios):.2f}, worst {max(ratios):.2f}" if ratios else "n/a")
          + f"; wrote {args.out / stem_name(args.grid, args.objective)}.csv/.md/.png")
    return 0 if all(r["status"] in ("ok", "skipped", "budget") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
