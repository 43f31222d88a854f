"""How it is measured: time and peak memory of one benchmark case.

Time: ``warmup`` untimed runs, then the median of ``repeats`` timed runs, each on fresh random
inputs made outside the timed region. CUDA: CUDA events around the run. CPU: perf_counter, and
the process's CPU time over the same run: ``cpu_util`` = CPU time / wall time, which is about the
thread count on an idle machine and falls when other processes take the cores (the report flags
such rows: their times say more about the neighbours than about the code). The worker sets its
thread count explicitly (``threads``, default: all cores) and records the load average.

Peak memory, as the increase over the inputs (the inputs exist before measuring starts; what
the run leaves behind, e.g. dh and dW, is part of its peak):
  * CUDA: reset_peak_memory_stats once the inputs exist, then max_memory_allocated minus the
    memory allocated right before the run; the largest value over the timed runs.
  * CPU: every case runs in a fresh subprocess (``python -m benchmarks.measure CASE_JSON``).
    Once the inputs exist, "5" is written to /proc/self/clear_refs, which resets the kernel's
    high-water mark of the resident set (VmHWM) to the current resident set; after the run,
    VmHWM minus VmRSS-at-reset is the peak increase. The subprocess sets
    MALLOC_MMAP_THRESHOLD_=131072 so that glibc serves every block >= 128 KiB with mmap and
    returns it to the kernel on free: memory freed by the warm-up run cannot be silently reused
    by the measured run, and the resident set tracks the live tensors. Caveats: RSS counts pages
    touched, not bytes requested (allocations round up to pages, untouched pages of an
    allocation do not count); small blocks (< 128 KiB) can still come from the heap; one-time
    buffers of the BLAS library are counted in the first measured run only if the warm-up did
    not create them already. These errors are a few MiB at most, the same for every impl, and
    far below the differences being measured (MiB to GiB).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from .ops import Case, make_inputs, runner

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKER_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


# ----------------------------------------------------------------------------- CPU memory


def _proc_status_kib(field: str, pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/status has no {field} line")


def rss_mib(pid: int | str = "self") -> float:
    """Current resident set of this process (or of process ``pid``), MiB."""
    return _proc_status_kib("VmRSS", pid) / 1024.0


def reset_peak_rss() -> float:
    """Reset VmHWM to the current resident set; returns that resident set, MiB."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    return rss_mib()


def peak_rss_mib() -> float:
    """High-water mark of the resident set since the last reset, MiB."""
    return _proc_status_kib("VmHWM") / 1024.0


# ----------------------------------------------------------------------------- one case


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _release(inputs: dict, produced) -> None:
    for tensor in inputs.values():
        if isinstance(tensor, torch.Tensor):
            tensor.grad = None
    del produced
    inputs.clear()
    gc.collect()


def measure_in_process(case: Case, *, warmup: int, repeats: int, max_seconds: float | None = None,
                       long_run_s: float | None = None) -> dict:
    """Time and peak memory of ``case`` in this process. Returns a dict of results.

    ``max_seconds`` caps the timed runs: no further run starts once the timed runs so far add up
    to more than that (at least one is made). The returned ``repeats`` says how many were made.
    ``long_run_s`` (CPU only): a first warm-up run longer than that counts as the first timed run
    (its time, CPU use and peak memory; the result's note says so). What a warm-up absorbs on the
    CPU, lazy set-up, was at most 0.5 s per case in the CPU worker (first run against the next ones,
    2 cores), under 1% of a run of a minute, and a second run of that length would double the cost.
    """
    run = runner(case)
    on_cuda = case.device == "cuda"
    seed = case.seed * 1_000_003
    times_ms, peaks_mib, utils = [], [], []
    for i in range(max(warmup, 0)):
        inputs = make_inputs(case, seed + i)
        counting = i == 0 and long_run_s is not None and not on_cuda
        base = reset_peak_rss() if counting else None
        start, cpu_start = time.perf_counter(), time.process_time()
        produced = run(inputs)
        _sync(case.device)
        wall = time.perf_counter() - start
        if counting and wall > long_run_s:
            times_ms.append(wall * 1e3)
            utils.append((time.process_time() - cpu_start) / max(wall, 1e-9))
            peaks_mib.append(peak_rss_mib() - base)
            _release(inputs, produced)
            break
        _release(inputs, produced)

    first_counted = bool(times_ms)
    for i in range(repeats - len(times_ms)):
        if max_seconds is not None and sum(times_ms) / 1e3 > max_seconds:
            break
        inputs = make_inputs(case, seed + 1000 + i)
        gc.collect()
        if on_cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start_event = torch.cuda.Event(enable_timing=True)
            end_event = torch.cuda.Event(enable_timing=True)
            start_event.record()
            produced = run(inputs)
            end_event.record()
            torch.cuda.synchronize()
            times_ms.append(start_event.elapsed_time(end_event))
            peaks_mib.append((torch.cuda.max_memory_allocated() - base) / 2**20)
        else:
            base = reset_peak_rss() if i == 0 else None
            start, cpu_start = time.perf_counter(), time.process_time()
            produced = run(inputs)
            wall = time.perf_counter() - start
            times_ms.append(wall * 1e3)
            utils.append((time.process_time() - cpu_start) / max(wall, 1e-9))
            if base is not None:  # memory from the first timed run, right after the reset
                peaks_mib.append(peak_rss_mib() - base)
        _release(inputs, produced)
    result = {
        "median_ms": statistics.median(times_ms),
        "min_ms": min(times_ms),
        "repeats": len(times_ms),
        "peak_mem_mib": max(peaks_mib),
        "status": "ok",
        "threads": torch.get_num_threads(),
    }
    if utils:
        result["cpu_util"] = statistics.median(utils)
        result["loadavg"] = os.getloadavg()[0]
    if first_counted:
        result["note"] = f"the warm-up run took over {long_run_s:g} s and was timed (measure.py)"
    return result


def alternate(runs: tuple, make_inputs_for, *, rounds: int, device: str, max_seconds: float | None = None,
              min_rounds: int = 1) -> dict:
    """Time two runs in alternation: up to ``rounds`` rounds of one call of each on fresh inputs
    (``make_inputs_for(round, which)``, ``which`` 0 or 1, made outside the timed region), the first run first in
    even rounds and second in odd ones. ``max_seconds``: no round past the first ``min_rounds`` starts once the
    timed runs add up to more than that. Returns both runs' times (ms), the median of the per-round ratios
    (first / second) and the lowest and highest; on the CPU also the median CPU use and the load average.
    Warm-ups are the caller's."""
    times_ms: tuple[list, list] = ([], [])
    utils = []
    for i in range(max(rounds, 1)):
        if i >= max(min_rounds, 1) and max_seconds is not None and \
                (sum(times_ms[0]) + sum(times_ms[1])) / 1e3 > max_seconds:
            break
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):
            inputs = make_inputs_for(i, which)
            gc.collect()
            _sync(device)
            start, cpu_start = time.perf_counter(), time.process_time()
            produced = runs[which](inputs)
            _sync(device)
            wall = time.perf_counter() - start
            times_ms[which].append(wall * 1e3)
            utils.append((time.process_time() - cpu_start) / max(wall, 1e-9))
            _release(inputs, produced)
    ratios = [a / b for a, b in zip(*times_ms)]
    result = {"first_ms": times_ms[0], "second_ms": times_ms[1], "ratio": statistics.median(ratios),
              "ratio_min": min(ratios), "ratio_max": max(ratios), "rounds": len(ratios), "status": "ok",
              "threads": torch.get_num_threads()}
    if device == "cpu":
        result.update(cpu_util=statistics.median(utils), loadavg=os.getloadavg()[0])
    return result


def measure_pair_in_process(first: Case, second: Case, *, rounds: int, max_seconds: float | None = None,
                            min_rounds: int = 1) -> dict:
    """Time two cases in alternation, in this process: one warm-up run of each, then :func:`alternate`, each
    case on its inputs from the same seed in a round.

    Separate runs of two cases on a shared machine differ by more than the few percent being compared (the
    CPU loss grid timed ``auto`` 8% slower than ``single_pass`` where both ran the same chunks); the median of
    the per-round ratios cancels what drifts slower than a round, and more rounds outvote a disturbed one."""
    runs = (runner(first), runner(second))
    seed = first.seed * 1_000_003
    for run, case in zip(runs, (first, second)):
        inputs = make_inputs(case, seed)
        _release(inputs, run(inputs))
    return alternate(runs, lambda i, which: make_inputs((first, second)[which], seed + 1000 + i), rounds=rounds,
                     device=first.device, max_seconds=max_seconds, min_rounds=min_rounds)


def measure_pair(first: Case, second: Case, *, rounds: int, timeout_s: float, max_seconds: float | None = None,
                 min_rounds: int = 1, threads: int | None = None) -> dict:
    """``measure_pair_in_process`` in a fresh Python process (a failure comes back as a status, as in
    :func:`measure_in_subprocess`)."""
    return _in_worker({"case": asdict(first), "pair": asdict(second), "rounds": rounds, "max_seconds": max_seconds,
                       "min_rounds": min_rounds, "threads": threads}, timeout_s)


def measure_in_subprocess(case: Case, *, warmup: int, repeats: int, timeout_s: float,
                          max_seconds: float | None = None, threads: int | None = None,
                          long_run_s: float | None = None) -> dict:
    """Run ``measure_in_process`` in a fresh Python process (the CPU memory method)."""
    return _in_worker({"case": asdict(case), "warmup": warmup, "repeats": repeats, "max_seconds": max_seconds,
                       "threads": threads, "long_run_s": long_run_s}, timeout_s)


def _in_worker(request: dict, timeout_s: float) -> dict:
    """Run the worker (``python -m benchmarks.measure REQUEST_JSON``) and return its result line."""
    payload = json.dumps(request)
    env = dict(os.environ)
    env.update(WORKER_ENV)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    try:
        done = subprocess.run([sys.executable, "-m", "benchmarks.measure", payload], cwd=REPO_ROOT,
                              env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "note": f"over {timeout_s:.0f}s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        status = "oom" if done.returncode in (-9, 137) or "MemoryError" in done.stderr else "error"
        return {"status": status, "note": f"exit {done.returncode}: {tail[0][:200]}"}
    return json.loads(lines[-1])


def measure_case(case: Case, *, warmup: int, repeats: int, timeout_s: float = 600.0,
                 max_seconds: float | None = None, threads: int | None = None,
                 long_run_s: float | None = None) -> dict:
    """The benchmark's method for ``case``: in-process on CUDA, a fresh subprocess on CPU.

    Out-of-memory on CUDA is reported as status "oom" (the allocator is emptied afterwards).
    ``threads``: torch's intra-op threads in the CPU worker (default: torch's default, all cores).
    """
    if case.device == "cpu":
        return measure_in_subprocess(case, warmup=warmup, repeats=repeats, timeout_s=timeout_s,
                                     max_seconds=max_seconds, threads=threads, long_run_s=long_run_s)
    try:
        return measure_in_process(case, warmup=warmup, repeats=repeats, max_seconds=max_seconds)
    except torch.OutOfMemoryError as exc:
        failure = {"status": "oom", "note": (str(exc).splitlines() or [""])[0][:200]}
    except Exception as exc:  # a peer failing must not stop the whole benchmark
        failure = {"status": "error", "note": error_line(exc)}
    # outside the except block: the traceback (and the tensors its frames hold) is gone now
    gc.collect()
    torch.cuda.empty_cache()
    return failure


def error_line(exc: BaseException, limit: int = 200) -> str:
    """An exception in one line for a report: its type and the first line of its message."""
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:limit]}"


def _worker(argv: list[str]) -> None:
    """Subprocess entry: measure the case (or the pair) given as JSON and print the result as one JSON line."""
    request = json.loads(argv[0])
    if request.get("threads"):
        torch.set_num_threads(int(request["threads"]))
    case = Case(**request["case"])
    if "pair" in request:
        result = measure_pair_in_process(case, Case(**request["pair"]), rounds=request["rounds"],
                                         max_seconds=request.get("max_seconds"),
                                         min_rounds=request.get("min_rounds", 1))
    else:
        result = measure_in_process(case, warmup=request["warmup"], repeats=request["repeats"],
                                    max_seconds=request.get("max_seconds"), long_run_s=request.get("long_run_s"))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    _worker(sys.argv[1:])
