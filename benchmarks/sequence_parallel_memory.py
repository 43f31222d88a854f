"""What sequence parallelism saves: one training step's memory per rank, 1 process against a group of ranks
that split the micro-batch's tokens (train.sequence_parallel_size, pacs/model/sequence_parallel.py).

    python benchmarks/sequence_parallel_memory.py                 # CPU: 1 process, then 2 ranks (gloo)
    python benchmarks/sequence_parallel_memory.py --dry-run       # tiny lengths (plumbing)

The step is benchmarks/long_context_train.py's: one group of G = 4 responses after a shared prompt (lengths
L, 3L/4, L/2, L/4), packed into one row, on its small Qwen2 (d=128, 4 query / 2 key-value heads, 2 layers,
V=16384, float32), the trainer's own functions: the forward, the PACS loss (old log-probs given), the
backward (no optimizer step: its state is the same with and without the split). With
``sequence_parallel_size`` ranks each rank runs its share of the tokens (the Ulysses attention and the
gathered log-probs of the trainer); the parameters are replicated on every rank here (under FSDP2 they are
also sharded, the same in both cases), so the difference is the activations. Variants: the plain packed step
and the one with activation checkpointing and the tiled MLP (model.gradient_checkpointing, train.tiled_mlp).

Measured on each rank: the activations the forward saves for the backward (autograd's saved tensors, each
storage counted once, the parameters left out: deterministic, and what the split divides), the peak increase
of the resident set over the step (the high-water mark reset before it: benchmarks/measure.py; the same step
run once before, so that allocations made once are not counted; the workers run with benchmarks/measure.py's
glibc settings, which hand freed blocks back at once, so the resident set follows the live tensors), and the
step's wall time (one torch thread per rank). Every configuration runs in fresh processes.
Writes OUT/sequence_parallel_memory_<device>.csv and .md with the machine and date.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

VARIANTS = {"packed": ("packed", "fused"), "packed_ckpt_tiled": ("packed", "fused", "ckpt", "tiled")}


def step(policy, batch, sp, loss_chunk_mib: float) -> tuple[float, float]:
    """Forward, loss, backward of the one-group micro-batch, as the trainer runs it (this rank's tokens under
    ``sp``). Returns the loss value and the MiB of activations the forward saved for the backward (tensors
    saved by autograd, each storage once, the parameters left out)."""
    import torch

    from benchmarks.long_context_train import GROUP
    from pacs.config import Config
    from pacs.model.packing import slice_micro_batch, to_layout
    from pacs.model.sequence_parallel import whole_micro_batch
    from pacs.train.update import policy_loss
    from pacs_kernels import GatheredLogprobs

    cfg = Config()
    cfg.rollout.group_size = GROUP
    cfg.train.loss_chunk_mib = loss_chunk_mib
    old_logp = torch.rand(batch.targets.shape, generator=torch.Generator().manual_seed(1)) * -4.0 * batch.mask
    part = slice_micro_batch(batch, 0, GROUP, True, sp)
    parameters = {p.untyped_storage().data_ptr() for p in policy.parameters()}
    saved: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        if sp is None:
            loss, _ = policy_loss(cfg, policy, part, to_layout(part, 0, old_logp))
        else:
            piece = GatheredLogprobs(lambda logp: whole_micro_batch(part, logp, 0, old_logp.shape[1]), old_logp,
                                     batch.mask, part.rewards)  # every rank's log-probs, gathered
            loss, _ = policy_loss(cfg, policy, part, to_layout(part, 0, old_logp), piece=piece)
    loss.backward()
    for p in policy.parameters():
        p.grad = None
    return float(loss.detach()), sum(saved.values()) / 2**20


def worker(args) -> None:
    """One rank (or the single process): every length of the list, one step each; rank 0 writes the JSON."""
    import torch
    import torch.distributed as dist

    from benchmarks.long_context_train import build, make_batch
    from benchmarks.measure import peak_rss_mib, reset_peak_rss
    from pacs.model.sequence_parallel import enable_sequence_parallel_attention, new_sequence_parallel

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    sp = None
    if world > 1:
        dist.init_process_group("gloo")
        sp = new_sequence_parallel(world, dist.get_rank(), world)
    levers = VARIANTS[args.variant]
    policy, _ = build("cpu-small", levers, torch.device("cpu"), torch.float32)
    if sp is not None:
        enable_sequence_parallel_attention(policy.causal_lm, sp.size)
    vocab = 16384
    rows = []
    for longest in args.lengths:
        batch = make_batch(longest, args.prompt_len, vocab, 7, "cpu")
        step(policy, batch, sp, args.loss_chunk_mib)  # the same step once before: its allocations made once
        if sp is not None:
            dist.barrier()
        base = reset_peak_rss()
        start = time.perf_counter()
        loss, saved = step(policy, batch, sp, args.loss_chunk_mib)
        seconds = time.perf_counter() - start
        measured = [(peak_rss_mib() - base, saved)]
        if sp is not None:
            measured = [None] * sp.size
            dist.all_gather_object(measured, (peak_rss_mib() - base, saved))
        rows.append({"longest": longest, "tokens": int(batch.attention_mask.sum()), "loss": loss,
                     "seconds": seconds, "peak_mib_per_rank": [m[0] for m in measured],
                     "saved_mib_per_rank": [m[1] for m in measured]})
        del batch
    if sp is None or dist.get_rank() == 0:
        Path(args.json_out).write_text(json.dumps(rows))
    if sp is not None:
        dist.barrier()
        dist.destroy_process_group()


def run_config(variant: str, ranks: int, lengths: list[int], args) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        script = [str(Path(__file__).resolve()), "--worker", "--variant", variant, "--json-out", out,
                  "--prompt-len", str(args.prompt_len), "--loss-chunk-mib", str(args.loss_chunk_mib),
                  "--lengths", *map(str, lengths)]
        launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
                    if ranks > 1 else [sys.executable])
        from benchmarks.measure import WORKER_ENV  # glibc hands freed blocks back: the resident set follows

        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **WORKER_ENV)
        done = subprocess.run(launcher + script, cwd=REPO, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{variant} on {ranks} rank(s) failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(Path(out).read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192],
                        help="longest response L of each step (the group: L, 3L/4, L/2, L/4)")
    parser.add_argument("--ranks", type=int, default=2, help="sequence_parallel_size to compare with 1 process")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--loss-chunk-mib", type=float, default=16.0, help="train.loss_chunk_mib of the step")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--dry-run", action="store_true", help="lengths 32 and 64 only")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="packed", help=argparse.SUPPRESS)
    parser.add_argument("--json-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.ranks < 2:
        parser.error(f"--ranks must be >= 2 (the sequence-parallel group to compare with 1 process), got {args.ranks}")
    lengths = [32, 64] if args.dry_run else args.lengths
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    from benchmarks.run import cpu_model

    machine = f"cpu: {cpu_model()}, {os.cpu_count()} cores"
    rows = []
    for variant in args.variants:
        one = run_config(variant, 1, lengths, args)
        split = run_config(variant, args.ranks, lengths, args)
        for a, b in zip(one, split):
            if abs(a["loss"] - b["loss"]) > 1e-4 * (1 + abs(a["loss"])):
                raise RuntimeError(f"{variant} L={a['longest']}: the split step's loss {b['loss']} differs from "
                                   f"one process's {a['loss']}")
            row = {"variant": variant, "longest": a["longest"], "tokens": a["tokens"],
                   "saved_mib_1_process": a["saved_mib_per_rank"][0],
                   f"saved_mib_per_rank_{args.ranks}_ranks": max(b["saved_mib_per_rank"]),
                   "saved_ratio": max(b["saved_mib_per_rank"]) / a["saved_mib_per_rank"][0],
                   "peak_mib_1_process": a["peak_mib_per_rank"][0],
                   f"peak_mib_per_rank_{args.ranks}_ranks": max(b["peak_mib_per_rank"]),
                   "peak_ratio": max(b["peak_mib_per_rank"]) / max(a["peak_mib_per_rank"][0], 1e-3),
                   "seconds_1_process": a["seconds"], f"seconds_{args.ranks}_ranks": b["seconds"],
                   "loss": a["loss"], "device": machine, "date": date, "python": platform.python_version()}
            rows.append(row)
            print(f"{variant:18s} L={row['longest']:6d} ({row['tokens']} tokens): saved for the backward "
                  f"{row['saved_mib_1_process']:7.1f} -> {row[f'saved_mib_per_rank_{args.ranks}_ranks']:7.1f} MiB "
                  f"(x{row['saved_ratio']:.2f}), peak {row['peak_mib_1_process']:7.1f} -> "
                  f"{row[f'peak_mib_per_rank_{args.ranks}_ranks']:7.1f} MiB (x{row['peak_ratio']:.2f}), "
                  f"{a['seconds']:.2f} -> {b['seconds']:.2f} s", flush=True)
    if args.dry_run:
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "sequence_parallel_memory_cpu.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [f"# Sequence parallelism: one step's memory per rank ({machine}, {date})", "",
             f"`python benchmarks/sequence_parallel_memory.py --lengths {' '.join(map(str, lengths))} --ranks "
             f"{args.ranks}`: one group of 4 responses (L, 3L/4, L/2, L/4) after a {args.prompt_len}-token prompt, "
             "packed, on benchmarks/long_context_train.py's cpu-small Qwen2 (float32); forward, PACS loss, backward. "
             "Per rank (the largest): the activations the forward saved for the backward (autograd's saved tensors, "
             "each storage once, parameters left out) and the step's peak resident-set increase (the step run once "
             "before at the same length); the step's time, one torch thread per rank.", "",
             f"| variant | L | tokens | saved, 1 process (MiB) | saved per rank, {args.ranks} ranks (MiB) | ratio | "
             f"peak, 1 process (MiB) | peak per rank, {args.ranks} ranks (MiB) | ratio | 1 process (s) | "
             f"{args.ranks} ranks (s) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['longest']} | {r['tokens']} | {r['saved_mib_1_process']:.1f} | "
                     f"{r[f'saved_mib_per_rank_{args.ranks}_ranks']:.1f} | {r['saved_ratio']:.2f} | "
                     f"{r['peak_mib_1_process']:.1f} | {r[f'peak_mib_per_rank_{args.ranks}_ranks']:.1f} | "
                     f"{r['peak_ratio']:.2f} | {r['seconds_1_process']:.2f} | {r[f'seconds_{args.ranks}_ranks']:.2f} |")
    (out / "sequence_parallel_memory_cpu.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'sequence_parallel_memory_cpu.csv'} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
