"""Where results go: the CSV, the PNG plots and the Markdown table."""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

COLUMNS = ("date", "device", "device_name", "op", "impl", "N", "d", "V", "dtype", "median_ms", "min_ms",
           "repeats", "peak_mem_mib", "tflops", "matmul_tflops", "flop_fraction", "floor_ms", "x_floor",
           "threads", "cpu_util", "loadavg", "status", "note")

IMPL_ORDER = ("naive", "torch", "single_pass", "single_pass_lowmem", "triton", "cce", "cce_exact", "liger_flce",
              "liger_chunked", "naive_gemms")
CONTENDED = 0.75  # a CPU row whose cpu_util is below this fraction of its threads ran on a busy machine


def write_csv(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({key: _fmt(row.get(key)) for key in COLUMNS})


def write_csv_and_markdown(stem: Path, rows: list[dict], columns: list[str], markdown: list[str]) -> Path:
    """STEM.csv (``columns``, other keys ignored) and STEM.md (``markdown``'s lines), the folder made if need be;
    returns ``stem``."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    with open(stem.with_suffix(".csv"), "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    stem.with_suffix(".md").write_text("\n".join(markdown) + "\n")
    return stem


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _num(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _impl_key(impl: str) -> int:
    return IMPL_ORDER.index(impl) if impl in IMPL_ORDER else len(IMPL_ORDER)


def _groups(rows: list[dict]) -> dict[tuple, list[dict]]:
    groups = defaultdict(list)
    for row in rows:
        groups[(row["op"], int(row["d"]), int(row["V"]), row["dtype"])].append(row)
    return dict(sorted(groups.items()))


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
    """One PNG per (op, d, V, dtype): time and peak memory against N, one line per impl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for (op, d, v, dtype), group in _groups(rows).items():
        fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.2))
        for impl in sorted({row["impl"] for row in group}, key=_impl_key):
            points = sorted((int(r["N"]), _num(r["median_ms"]), _num(r["peak_mem_mib"]))
                            for r in group if r["impl"] == impl and r["status"] == "ok")
            if not points:
                continue
            ax_time.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=impl)
            # a log axis cannot show 0 MiB (tiny sizes, below the page granularity of RSS)
            mem_points = [p for p in points if p[2] is not None and p[2] > 0]
            ax_mem.plot([p[0] for p in mem_points], [p[2] for p in mem_points], marker="o", label=impl)
        for ax, label in ((ax_time, "median time (ms)"), (ax_mem, "peak memory over inputs (MiB)")):
            ax.set_xscale("log", base=2)
            if any(len(line.get_ydata()) for line in ax.get_lines()):
                ax.set_yscale("log")
            ax.set_xlabel("N (tokens)")
            ax.set_ylabel(label)
            ax.grid(True, which="both", alpha=0.3)
        ax_time.legend(fontsize=8)
        device = group[0].get("device_name") or group[0]["device"]
        fig.suptitle(f"{op}  d={d} V={v} {dtype}  ({device}, {group[0].get('date', '')})", fontsize=10)
        fig.tight_layout()
        path = out_dir / f"{op}_d{d}_V{v}_{dtype}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def markdown(rows: list[dict], *, title: str, notes: list[str] = ()) -> str:
    """Tables per (op, shape): one row per N, one column per impl, "ms / MiB" in each cell."""
    if not rows:
        return f"## {title}\n\n(no results)\n"
    first = rows[0]
    lines = [f"## {title}", "",
             f"Device: {first.get('device_name') or first['device']} ({first['device']}); "
             f"date: {first.get('date', '')}.", ""]
    lines += [f"- {note}" for note in notes]
    if notes:
        lines.append("")
    lines.append("Each cell: median time in ms / peak memory over the inputs in MiB"
                 + (" / time over the 3-matmul floor (the logits, dh and dW GEMMs at the measured matmul rate)."
                    if any(r.get("x_floor") for r in rows) else "."))
    lines.append("")
    contended = [r for r in rows if contended_row(r)]
    if contended:
        lines.append(f"**{len(contended)} of {len(rows)} CPU rows ran on a busy machine** (process CPU time below "
                     f"{CONTENDED:.0%} of threads x wall time; marked `*`): their times include waiting for cores.")
        lines.append("")
    for (op, d, v, dtype), group in _groups(rows).items():
        impls = sorted({row["impl"] for row in group}, key=_impl_key)
        lines.append(f"### {op}, d={d}, V={v}, {dtype}")
        lines.append("")
        lines.append("| N | " + " | ".join(impls) + " |")
        lines.append("|---:|" + "---:|" * len(impls))
        for n in sorted({int(row["N"]) for row in group}):
            cells = []
            for impl in impls:
                match = [r for r in group if r["impl"] == impl and int(r["N"]) == n]
                cells.append(_cell(match[0]) if match else "")
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def contended_row(row: dict) -> bool:
    """A CPU measurement whose process got well under its threads' worth of CPU time."""
    util, threads = _num(row.get("cpu_util")), _num(row.get("threads"))
    return util is not None and bool(threads) and util < CONTENDED * threads


def _cell(row: dict) -> str:
    if row["status"] != "ok":
        return row["status"]
    text = f"{float(row['median_ms']):.1f} / {float(row['peak_mem_mib']):.0f}"
    over_floor = _num(row.get("x_floor"))
    if over_floor is not None:
        text += f" / {over_floor:.2f}x"
    if contended_row(row):
        text += " *"
    return text
