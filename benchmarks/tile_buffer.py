"""The CPU single pass with its shared tile buffer against fresh tiles, timed in alternation.

    python benchmarks/tile_buffer.py [--points V,d,N ...] [--rounds R] [--out DIR]

On the CPU the single pass builds every logits tile of a call in one buffer
(``pacs_kernels.single_pass_rows.TileBuffer``). This times the PACS loss, forward + backward, with
``path="auto"`` (the loss grid's ``auto`` case), once as it is and once with every tile allocated
afresh, in alternation (the order flips each round, both on the same fresh inputs), and reports the
median of the per-round ratios. Writes DIR/tile_buffer_cpu.csv and .md with the device and the date.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import statistics
from pathlib import Path

import torch

from benchmarks.measure import alternate
from benchmarks.ops import Case, make_inputs, runner
from benchmarks.report import write_csv_and_markdown
from benchmarks.run import device_name
from pacs_kernels.single_pass_rows import TileBuffer

POINTS = ((151936, 896, 2048), (151936, 896, 4096))
COLUMNS = ["date", "device", "V", "d", "N", "tiles", "shared_ms", "fresh_ms", "ratio", "ratio_min", "ratio_max",
           "rounds"]


@contextlib.contextmanager
def tiles_counted(fresh: bool, counter: list):
    """TileBuffer.take, counting the tiles taken; with ``fresh``, each tile a new allocation."""
    take = TileBuffer.take

    def counted(self, rows):
        counter.append(rows)
        if fresh:
            return torch.empty(rows, self.vocab, dtype=self.dtype, device=self.device)
        return take(self, rows)

    TileBuffer.take = counted
    try:
        yield
    finally:
        TileBuffer.take = take


def pair(v: int, d: int, n: int, rounds: int) -> dict:
    """One point: a warm-up of each side, then ``rounds`` rounds of one run each (:func:`measure.alternate`)."""
    case = Case("pacs_loss_fwd_bwd", "auto", n, d, v, "float32", "cpu")
    run = runner(case)
    tiles: list = []

    def side(fresh: bool, counter: list):
        def timed(inputs):
            with tiles_counted(fresh, counter):
                return run(inputs)
        return timed

    shared, fresh = side(False, tiles), side(True, [])
    for warm_up in (shared, fresh):
        warm_up(make_inputs(case, 1))
    counted = len(tiles)  # the tiles of one call
    timed = alternate((shared, fresh), lambda i, which: make_inputs(case, 100 + i), rounds=rounds, device="cpu")
    return dict(V=v, d=d, N=n, tiles=counted, shared_ms=round(statistics.median(timed["first_ms"]), 1),
                fresh_ms=round(statistics.median(timed["second_ms"]), 1), ratio=round(timed["ratio"], 3),
                ratio_min=round(timed["ratio_min"], 3), ratio_max=round(timed["ratio_max"], 3),
                rounds=timed["rounds"])


def write(rows: list[dict], out: Path) -> None:
    lines = ["The CPU single pass (`path=\"auto\"`, PACS loss forward + backward, float32) with one shared tile "
             "buffer against a fresh allocation per tile, timed in alternation (benchmarks/tile_buffer.py)", "",
             "| V | d | N | tiles | shared ms | fresh ms | shared / fresh | per-round range | rounds |",
             "|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    lines += [f"| {r['V']} | {r['d']} | {r['N']} | {r['tiles']} | {r['shared_ms']} | {r['fresh_ms']} | {r['ratio']} | "
              f"{r['ratio_min']}-{r['ratio_max']} | {r['rounds']} |" for r in rows]
    lines += ["", f"{rows[0]['device']}, {rows[0]['date']}" if rows else ""]
    write_csv_and_markdown(out / "tile_buffer_cpu", rows, COLUMNS, lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", nargs="+", default=[",".join(map(str, p)) for p in POINTS],
                        help="V,d,N points (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds per point (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    points = []
    for text in args.points:
        try:
            v, d, n = (int(x) for x in text.split(","))
        except ValueError:
            parser.error(f"--points: each point is V,d,N (three integers), got {text!r}")
        points.append((v, d, n))
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rows = []
    for v, d, n in points:
        row = dict(date=date, device=device_name("cpu"), **pair(v, d, n, args.rounds))
        rows.append(row)
        print(f"[tile_buffer] V={v} d={d} N={n}: tiles {row['tiles']}, shared / fresh {row['ratio']} "
              f"({row['ratio_min']}-{row['ratio_max']}, {row['rounds']} rounds)", flush=True)
        write(rows, args.out)
    print(f"wrote {args.out / 'tile_buffer_cpu.csv'} and .md")


if __name__ == "__main__":
    main()
