"""Turn a GPU benchmark CSV into the table that ``backend="auto"`` / ``path="auto"`` follow on CUDA.

    python benchmarks/dispatch_table.py OUT/gpu.csv [OUT/gpu_grad_gemms.csv ...] --out OUT

Writes ``OUT/dispatch.json``: per (op, d, V, dtype, N; N the tokens that get log-probs, as the fused
losses look it up, and ``positions`` the benchmark's N) the measured times of our implementations
(torch, triton, single_pass, single_pass_lowmem; for the ``grad_gemms`` op the Triton backward's
GEMM engines) and the fastest of them, and ``OUT/measured_for_roofline.csv``: the
same times under the cost model's variant names (``benchmarks/roofline.py --measured``), with N the
tokens that get log-probs. Copy ``dispatch.json`` to ``pacs_kernels/gpu_dispatch.json`` and commit
it with the run's results: pacs_kernels then picks by measurement, not by guess (dispatch.py).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.ops import Case, selected_tokens

OURS = ("torch", "triton", "single_pass", "single_pass_lowmem")
# benchmark impl -> cost-model variant, per op
ROOFLINE_VARIANT = {
    "naive": "naive", "torch": "torch_two_pass", "single_pass": "single_pass_compact",
    "triton": "triton_two_pass", "liger_chunked": "liger_chunked", "cce_exact": "cce",
}


def build(rows: list[dict]) -> tuple[dict, list[dict]]:
    """CSV rows -> (dispatch table, roofline rows)."""
    entries, measured = {}, []
    for row in rows:
        if row.get("status") != "ok" or row.get("device") != "cuda":
            continue
        op, impl = row["op"], row["impl"]
        n, d, v, dtype, ms = int(row["N"]), int(row["d"]), int(row["V"]), row["dtype"], float(row["median_ms"])
        selected = selected_tokens(Case(op=op, impl=impl, n=n, d=d, v=v, dtype=dtype, device="cuda"))
        if impl in OURS:
            key = (op, d, v, dtype, n)
            entry = entries.setdefault(key, {"op": op, "d": d, "V": v, "dtype": dtype, "N": selected,
                                             "positions": n, "ms": {}})
            entry["ms"][impl] = ms
        variant = ROOFLINE_VARIANT.get(impl)
        if op == "pacs_loss_first_step" and impl == "triton":
            variant = "triton_one_sweep"
        if variant and op in ("pacs_loss_fwd_bwd", "pacs_loss_first_step", "logprobs_fwd_bwd"):
            measured.append({"variant": variant, "n": selected, "d": d, "v": v, "dtype": dtype, "ms": ms, "op": op})
    for entry in entries.values():
        entry["best"] = min(entry["ms"], key=entry["ms"].get)
    first = next((r for r in rows if r.get("status") == "ok"), {})
    table = {"device_name": first.get("device_name", ""), "date": first.get("date", ""),
             "entries": sorted(entries.values(), key=lambda e: (e["op"], e["d"], e["V"], e["N"]))}
    return table, measured


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", type=Path, nargs="+", help="benchmark CSVs written by benchmarks/run.py on CUDA")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    rows = []
    for path in args.csv:
        if not path.is_file():
            parser.error(f"{path} is not a file")
        with open(path, newline="") as handle:
            rows += list(csv.DictReader(handle))
    table, measured = build(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dispatch.json").write_text(json.dumps(table, indent=1) + "\n")
    with open(args.out / "measured_for_roofline.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=("variant", "n", "d", "v", "dtype", "ms", "op"))
        writer.writeheader()
        writer.writerows(measured)
    for entry in table["entries"]:
        times = ", ".join(f"{k} {v:.1f} ms" for k, v in sorted(entry["ms"].items(), key=lambda kv: kv[1]))
        print(f"[dispatch] {entry['op']:22s} N={entry['N']:<6d} d={entry['d']} V={entry['V']}: best "
              f"{entry['best']} ({times})")
    print(f"[dispatch] wrote {args.out / 'dispatch.json'} ({len(table['entries'])} entries) and "
          f"{args.out / 'measured_for_roofline.csv'} ({len(measured)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
