"""TRL long context: how long a completion can a TRL user train within a memory budget?

For each case, the longest completion C (the longest of the micro-batch, in benchmarks/trl_dropin.py's
``--varied-lengths`` layout: prompts of P..P/2 tokens left-padded, completions of C down to C/8 tokens
right-padded, 8 responses in groups of 4) whose TRL training micro-step (``trainer.compute_loss`` +
``backward``, no generation) raises the resident set by at most ``--budget-mib`` (peak RSS increase over the
state before the step, benchmarks/measure.py's method). Cases (trl_dropin.py builds them):

    trl_default      GRPOTrainer, GRPOConfig defaults (TRL's loss and its chunked fused LM head)
    pacs_padded      PACSTrainer, the loss's forward on TRL's padded rows (pacs_padding_free=False)
    pacs             PACSTrainer, padding-free (its default): the real tokens packed into one row
    pacs_ckpt        pacs + gradient checkpointing (gradient_checkpointing=True, switched on as train() does)
    pacs_ckpt_tiled  pacs_ckpt + pacs_tiled_mlp=True (each decoder MLP in tiles of d tokens)

Search, per case: each probe is one fresh subprocess (``trl_dropin.py --case CASE --repeats 1``: one warm-up
step, then the measured one); it fits when its peak RSS increase is <= the budget. A probe that dies (killed:
out of memory, or over ``--kill-rss-mib`` of resident set, when this script kills it) or runs past
``--probe-timeout`` does not fit. C doubles from ``--start`` until a probe does not fit (or halves from it
until one fits), then bisection narrows the edge until the bracket [longest that fits, shortest that does
not] is at most min(``--resolution``, longest/8) tokens wide. The search assumes the peak grows with C; every
probe is kept, and the summary says where they disagree with that.

Every probe is appended to OUT/NAME.csv as it finishes (case, completion_len, peak_rss_increase_mib, fits,
seconds, status, ..., with the device and the UTC date); then OUT/NAME.md (longest C per case, x vs
trl_default, peak at that C, probes) and OUT/NAME.png (peak vs C per case). Times are wall-clock on whatever
else the machine runs: indicative only; the memory numbers are what the search uses.

    python benchmarks/trl_long_context.py            # ~15-20 min, 2 cores: benchmarks/results/trl_long_context_cpu.*
    python benchmarks/trl_long_context.py --dry-run  # tiny model and budget, 2 probes per case, a temp dir
    python benchmarks/trl_long_context.py --cases pacs pacs_ckpt --budget-mib 1024 --out-dir /tmp/tlc
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import trl_dropin

REPO_ROOT = Path(__file__).resolve().parent.parent
CASES = ("trl_default", "pacs_padded", "pacs", "pacs_ckpt", "pacs_ckpt_tiled")
BASELINE = "trl_default"
# The full run (calibrated on an Intel Xeon, 2 cores: about 15 minutes when quiet) and the dry run (seconds per
# probe, most of it importing TRL). Flags given on the command line win over these.
FULL = dict(vocab=32000, hidden=256, layers=4, responses=8, prompt_len=32, budget_mib=512.0, start=256,
            resolution=128, max_len=65536, max_probes=None, threads=2, name="trl_long_context_cpu",
            out_dir=str(REPO_ROOT / "benchmarks" / "results"))
DRY_RUN = dict(vocab=256, hidden=32, layers=2, responses=4, prompt_len=4, budget_mib=1.0, start=16,
               resolution=8, max_len=64, max_probes=2, threads=1, name="trl_long_context_dry_run", out_dir=None)
COLUMNS = ["case", "completion_len", "peak_rss_increase_mib", "fits", "seconds", "status", "step_ms", "cpu_util",
           "loadavg_1min", "loss", "completion_tokens", "padded_completion_tokens", "max_rss_mib", "budget_mib",
           "vocab", "hidden", "layers", "responses", "prompt_len", "threads", "device", "date", "note"]
MEMORY_STATUSES = ("oom", "killed")  # died of memory: does not fit


# ----------------------------------------------------------------------------- the search


@dataclass
class Search:
    """One case's search: ``longest`` fits (0: not even 1 token), ``first_failing`` does not (None: nothing
    failed, ``longest`` is the --max-len cap); ``complete`` is False when --max-probes cut it short."""

    longest: int = 0
    first_failing: int | None = None
    probes: list = field(default_factory=list)  # (C, fits) in probe order
    complete: bool = True


def tolerance(longest: int, resolution: int) -> int:
    """How wide the final bracket may be: --resolution tokens, or an eighth of the longest C that fits when
    that is finer (short edges: an edge at 24 tokens is not reported as "0 or 128"); at least 1."""
    return max(1, min(resolution, longest // 8))


def search_longest(fits, *, start: int, resolution: int, max_len: int, max_probes: int | None = None) -> Search:
    """The longest C in [1, max_len] with ``fits(C)`` true, assuming fits is true up to an edge and false after
    it: doubling from ``start`` (halving when ``start`` does not fit), then bisection until the bracket is at most
    :func:`tolerance` wide. ``fits`` is called once per length; ``max_probes`` caps the calls."""
    if start < 1 or resolution < 1 or max_len < 1:
        raise ValueError(f"start, resolution and max_len must be >= 1, got {start}, {resolution}, {max_len}")
    result = Search()

    def probe(length: int) -> bool:
        ok = bool(fits(length))
        result.probes.append((length, ok))
        if ok:
            result.longest = max(result.longest, length)
        elif result.first_failing is None or length < result.first_failing:
            result.first_failing = length
        return ok

    def spent() -> bool:
        if max_probes is not None and len(result.probes) >= max_probes:
            result.complete = False
            return True
        return False

    length = min(start, max_len)
    if probe(length):  # doubling up
        while length < max_len and not spent():
            length = min(2 * length, max_len)
            if not probe(length):
                break
    else:  # halving down
        while length > 1 and not spent():
            length //= 2
            if probe(length):
                break
    if result.first_failing is None:  # max_len fits (or the probes ran out on the way up)
        return result
    while result.first_failing - result.longest > tolerance(result.longest, resolution) and not spent():
        probe((result.longest + result.first_failing) // 2)
    return result


def disagreements(rows: list[dict]) -> list[str]:
    """Where one case's probes contradict a peak that grows with C: a shorter C that did not fit while a longer
    one did, or a peak that fell by more than 5% (and 8 MiB) from a shorter C to a longer one."""
    notes = []
    measured = sorted((r["completion_len"], r["peak_rss_increase_mib"], r["fits"]) for r in rows)
    for i, (c_a, peak_a, fits_a) in enumerate(measured):
        for c_b, peak_b, fits_b in measured[i + 1:]:
            if c_b == c_a:
                continue
            if not fits_a and fits_b:
                notes.append(f"C={c_a} did not fit but C={c_b} did")
            if peak_a is not None and peak_b is not None and peak_b < peak_a - max(8.0, 0.05 * peak_a):
                notes.append(f"peak fell from {peak_a:.0f} MiB at C={c_a} to {peak_b:.0f} MiB at C={c_b}")
    return notes


# ----------------------------------------------------------------------------- one probe


def _rss_mib(pid: int) -> float | None:
    """Process ``pid``'s resident set, MiB; None once it is gone (or a zombie without one)."""
    from benchmarks.measure import rss_mib

    try:
        return rss_mib(pid)
    except (OSError, ValueError, RuntimeError):
        return None


def probe_case(case: str, completion_len: int, args) -> dict:
    """One fresh subprocess: trl_dropin.py's worker for ``case`` at ``completion_len``, --repeats 1. Returns the
    CSV row's measured fields. A process that dies of memory (SIGKILL, MemoryError), goes over
    ``args.kill_rss_mib`` of resident set (killed here) or runs past ``args.probe_timeout`` does not fit; any
    other failure raises RuntimeError (a bug is not a data point)."""
    worker_args = trl_dropin.parse_args([
        f"--vocab={args.vocab}", f"--hidden={args.hidden}", f"--layers={args.layers}",
        f"--responses={args.responses}", f"--prompt-len={args.prompt_len}", f"--completion-len={completion_len}",
        "--repeats=1", f"--threads={args.threads}", "--varied-lengths"])
    command = trl_dropin.worker_command(case, worker_args)
    start = time.perf_counter()
    status, max_rss, note = "ok", 0.0, ""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(command, cwd=REPO_ROOT, env=trl_dropin.worker_env(), stdout=out, stderr=err,
                                text=True)
        while proc.poll() is None:
            rss = _rss_mib(proc.pid)
            max_rss = max(max_rss, rss or 0.0)
            if args.kill_rss_mib and rss is not None and rss > args.kill_rss_mib:
                proc.kill()
                status, note = "killed", f"resident set {rss:.0f} MiB > --kill-rss-mib {args.kill_rss_mib:.0f}"
            elif time.perf_counter() - start > args.probe_timeout:
                proc.kill()
                status, note = "timeout", f"over --probe-timeout {args.probe_timeout:.0f} s"
            else:
                time.sleep(0.05)
                continue
            proc.wait()
        seconds = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if status == "ok" and proc.returncode == 0 and lines else None
    if status == "ok" and result is None:
        if proc.returncode in (-9, 137) or "MemoryError" in stderr or "out of memory" in stderr.lower():
            status, note = "oom", f"exit {proc.returncode}"
        else:
            tail = "\n".join(stderr.strip().splitlines()[-15:])
            raise RuntimeError(f"probe {case} C={completion_len} failed (exit {proc.returncode}):\n{tail}")
    _, completion_lens = trl_dropin.row_lengths(args.responses, args.prompt_len, completion_len, True)
    peak = None if result is None else result["peak_rss_increase_mib"]
    return {"case": case, "completion_len": completion_len, "peak_rss_increase_mib": peak,
            "fits": peak is not None and peak <= args.budget_mib, "seconds": seconds, "status": status,
            "step_ms": None if result is None else result["time_ms"],
            "cpu_util": None if result is None else result["cpu_util"],
            "loadavg_1min": os.getloadavg()[0] if result is None else result["loadavg_1min"],
            "loss": None if result is None else result["loss"],
            "completion_tokens": sum(completion_lens), "padded_completion_tokens": args.responses * completion_len,
            "max_rss_mib": max_rss, "note": note}


# ----------------------------------------------------------------------------- outputs


def _fmt(value, digits=1):
    if value is None or value == "":
        return ""
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def summarise(rows: list[dict], searches: dict[str, Search]) -> list[dict]:
    """One line per case: the longest C that fits, its ratio to trl_default's, the peak at that C."""
    base = searches.get(BASELINE)
    lines = []
    for case, search in searches.items():
        mine = [r for r in rows if r["case"] == case]
        at_longest = [r for r in mine if r["completion_len"] == search.longest and r["fits"]]
        ratio = (search.longest / base.longest) if base is not None and base.longest else None
        lines.append({"case": case, "longest": search.longest, "first_failing": search.first_failing,
                      "ratio": ratio, "peak_mib": at_longest[-1]["peak_rss_increase_mib"] if at_longest else None,
                      "probes": len(search.probes), "seconds": sum(r["seconds"] for r in mine),
                      "complete": search.complete, "notes": disagreements(mine)})
    return lines


def write_markdown(path: Path, summary: list[dict], args, device: str, date: str, wall_s: float) -> None:
    out = [f"# TRL micro-step: the longest completion within {args.budget_mib:g} MiB", "",
           f"{device}, {date}. One on-policy TRL training micro-step (`trainer.compute_loss` + `backward`, no "
           f"generation), tiny Llama built in code: V = {args.vocab}, d = {args.hidden}, {args.layers} layers, "
           f"MLP 2d, float32, {args.responses} responses in groups of {trl_dropin.GROUP}, prompts of "
           f"{args.prompt_len}..{args.prompt_len // 2} tokens (left-padded), completions of C..C/8 tokens "
           f"(right-padded; `benchmarks/trl_dropin.py --varied-lengths`), torch threads: {args.threads}. "
           f"Fits: the peak RSS increase of the step (fresh subprocess per probe, after one warm-up step) "
           f"<= {args.budget_mib:g} MiB. Search: doubling from C = {args.start}, then bisection to "
           f"min({args.resolution}, C/8) tokens.",
           "",
           "| case | longest C that fits | x vs trl_default | peak at that C (MiB) | first C that did not fit | "
           "probes | probe time (s) |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for line in summary:
        longest = f"{line['longest']:,}" + ("" if line["complete"] else " (search cut short)")
        ratio = "" if line["ratio"] is None else f"{line['ratio']:.1f}x"
        failing = (f"{line['first_failing']:,}" if line["first_failing"] is not None
                   else "none (--max-len)" if line["complete"] else "none probed")
        out.append(f"| {line['case']} | {longest} | {ratio} | {_fmt(line['peak_mib'], 0)} | {failing} | "
                   f"{line['probes']} | {line['seconds']:.0f} |")
    out += ["", f"Whole run: {wall_s / 60:.1f} min, {sum(x['probes'] for x in summary)} probes. Times are "
            "wall-clock on a machine shared with other work: indicative only (each probe also imports TRL, about "
            "10 s). Every probe: the CSV next to this file; the plot: the PNG.", "",
            "trl_default on a CPU: without Triton, TRL's fused LM head scores every position of the padded rows "
            "(prompt and padding included) in blocks of up to 4,096 tokens x 32,768 vocabulary entries, about "
            "1 MiB per padded token here up to a flat ~4 GiB: its ratio is this CPU path's, not a GPU's."]
    notes = [(line["case"], note) for line in summary for note in line["notes"]]
    if notes:
        out += ["", "Probes that contradict a peak growing with C (the bisection assumes it does):", ""]
        out += [f"- {case}: {note}" for case, note in notes]
    path.write_text("\n".join(out) + "\n")


def plot(path: Path, rows: list[dict], summary: list[dict], args, device: str, date: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for line in summary:
        points = sorted((r["completion_len"], r["peak_rss_increase_mib"], r["fits"]) for r in rows
                        if r["case"] == line["case"] and r["peak_rss_increase_mib"] is not None)
        if not points:
            continue
        drawn = ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=4,
                        label=f"{line['case']}: longest C {line['longest']:,}")[0]
        failed = [p for p in points if not p[2]]
        ax.scatter([p[0] for p in failed], [p[1] for p in failed], s=40, facecolors="white",
                   edgecolors=drawn.get_color(), zorder=3)
    ax.axhline(args.budget_mib, color="black", linestyle="--", label=f"budget {args.budget_mib:g} MiB")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("longest completion C of the micro-batch (tokens)")
    ax.set_ylabel("peak RSS increase of the micro-step (MiB)")
    ax.set_title(f"TRL micro-step, V={args.vocab}, d={args.hidden}, {args.layers} layers, {args.responses} "
                 f"responses (hollow: over budget)\n{device}, {date}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny model (V=256, d=32, 2 layers, 4 responses), 1 MiB budget, 2 probes per case, "
                             "written to a new temp dir unless --out-dir")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--budget-mib", type=float, help="peak RSS increase allowed (default 512; dry run 1)")
    parser.add_argument("--vocab", type=int, help="default 32000")
    parser.add_argument("--hidden", type=int, help="default 256")
    parser.add_argument("--layers", type=int, help="default 4")
    parser.add_argument("--responses", type=int, help=f"default 8, in groups of {trl_dropin.GROUP}")
    parser.add_argument("--prompt-len", type=int, help="P: prompts of P..P/2 tokens (default 32)")
    parser.add_argument("--start", type=int, help="first C probed (default 256)")
    parser.add_argument("--resolution", type=int, help="final bracket, tokens (default 128; finer below 8x)")
    parser.add_argument("--max-len", type=int, help="longest C probed (default 65536)")
    parser.add_argument("--max-probes", type=int, help="probes per case at most (default: no cap; dry run 2)")
    parser.add_argument("--threads", type=int, help="torch threads in each probe (default 2)")
    parser.add_argument("--probe-timeout", type=float, default=900.0,
                        help="seconds before a probe is killed (counts as not fitting; default 900)")
    parser.add_argument("--kill-rss-mib", type=float,
                        help="kill a probe whose resident set exceeds this (counts as not fitting; default "
                             "4 x budget + 2048 MiB; 0: never)")
    parser.add_argument("--out-dir", help="default benchmarks/results (dry run: a new temp dir)")
    parser.add_argument("--name", help="file stem (default trl_long_context_cpu)")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    for key, value in (DRY_RUN if args.dry_run else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out_dir is None:
        args.out_dir = tempfile.mkdtemp(prefix="trl_long_context_")
    if args.kill_rss_mib is None:
        args.kill_rss_mib = 4 * args.budget_mib + 2048.0
    if args.responses <= 0 or args.responses % trl_dropin.GROUP:
        parser.error(f"--responses must be a positive multiple of {trl_dropin.GROUP}, got {args.responses}")
    if min(args.start, args.resolution, args.max_len) < 1 or args.budget_mib <= 0:
        parser.error("--start, --resolution, --max-len and --budget-mib must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, md_path, png_path = (out_dir / f"{args.name}.{ext}" for ext in ("csv", "md", "png"))
    device = trl_dropin.device_name()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    fixed = {"budget_mib": args.budget_mib, "vocab": args.vocab, "hidden": args.hidden, "layers": args.layers,
             "responses": args.responses, "prompt_len": args.prompt_len, "threads": args.threads,
             "device": device, "date": date}
    rows: list[dict] = []
    searches: dict[str, Search] = {}
    started = time.perf_counter()
    print(f"[trl_long_context] {device}, {date}: budget {args.budget_mib:g} MiB, V={args.vocab}, d={args.hidden}, "
          f"{args.layers} layers, {args.responses} responses, P={args.prompt_len}; writing {csv_path}", flush=True)
    with open(csv_path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        handle.flush()
        for case in dict.fromkeys(args.cases):
            def fits(length: int, case=case) -> bool:
                row = {**probe_case(case, length, args), **fixed}
                rows.append(row)
                writer.writerow({key: _fmt(row.get(key), 3) if isinstance(row.get(key), float) and key != "loss"
                                 else row.get(key) for key in COLUMNS})
                handle.flush()
                peak = "n/a" if row["peak_rss_increase_mib"] is None else f"{row['peak_rss_increase_mib']:.0f} MiB"
                print(f"  {case:15s} C={length:<6d} {'fits' if row['fits'] else 'over':4s} {peak:>9s} "
                      f"({row['status']}, {row['seconds']:.1f} s, load {row['loadavg_1min']:.2f})", flush=True)
                return row["fits"]

            searches[case] = search = search_longest(fits, start=args.start, resolution=args.resolution,
                                                     max_len=args.max_len, max_probes=args.max_probes)
            print(f"[trl_long_context] {case}: longest C {search.longest} (first over: {search.first_failing}), "
                  f"{len(search.probes)} probes", flush=True)
    wall = time.perf_counter() - started
    summary = summarise(rows, searches)
    write_markdown(md_path, summary, args, device, date, wall)
    if not args.no_plot:
        plot(png_path, rows, summary, args, device, date)
    print(md_path.read_text())
    print(f"saved {csv_path}, {md_path}" + ("" if args.no_plot else f", {png_path}") + f" ({wall / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
