"""A deliberately mismatched sampler, corrected and not: `pacs train` on the built-in task with the training
rollouts sampled at ``advanced.rollout_correction.sampler_temperature`` (1.1) while the trainer's log-probs are
taken at ``rollout.temperature`` (1.0), with ``advanced.rollout_correction.mode`` none (uncorrected) and
``sequence_truncate`` (each response's ratio pi_trainer / pi_sampler, clamped to [0, c_max], weighs its tokens'
terms: docs/rollout-correction.md), the same seeds.

    python benchmarks/rollout_correction.py                      # 3 seeds x 2 modes, 150 steps each
    python benchmarks/rollout_correction.py --steps 60 --seeds 0  # shorter
    python benchmarks/rollout_correction.py --dry-run            # 2 steps, seed 0 (plumbing)

Each run is a fresh process (1 torch thread); the warmed-up model is cached once (--cache-dir). Held-out accuracy
(greedy, eval.num_problems problems) is measured every --eval-every steps. Writes OUT/runs.jsonl (the curves and
the mismatch columns' means: one JSON line per run, with the conditions), OUT/heldout_accuracy.png and OUT/README.md
(machine, date, conditions, numbers).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.run import cpu_model  # noqa: E402

MODES = {"uncorrected": "none", "corrected": "sequence_truncate"}
MISMATCH = ("mismatch_kl", "mismatch_logp_diff_mean", "mismatch_logp_diff_max", "mismatch_response_out_frac")


def train_run(condition: str, seed: int, args, workdir: str) -> dict:
    """One `pacs train` -> its held-out accuracy curve, the means of its mismatch columns, its wall time."""
    out = os.path.join(workdir, f"{condition}-s{seed}")
    cmd = [sys.executable, "-m", "pacs", "train", "--output-dir", out, "--seed", str(seed),
           "--max-steps", str(args.steps), f"advanced.task.cache_dir={args.cache_dir}",
           f"advanced.rollout_correction.sampler_temperature={args.sampler_temperature}",
           f"advanced.rollout_correction.mode={MODES[condition]}", f"advanced.rollout_correction.c_max={args.c_max}",
           f"eval.every={args.eval_every}", f"eval.num_problems={args.eval_problems}", "checkpoint_every=0",
           "advanced.plot=false", "advanced.torch_threads=1", *args.overrides]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    start = time.time()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.time() - start
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd[1:])}` failed ({done.returncode}):\n{done.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    evals = [[row["step"], row["eval_accuracy"]] for row in rows if row.get("eval_accuracy") is not None]
    train_rows = [row for row in rows if row.get("mismatch_kl") is not None]
    return {"condition": condition, "mode": MODES[condition], "seed": seed, "steps": len(train_rows),
            "wall_s": round(wall, 1), "heldout_accuracy": evals, "final_accuracy": evals[-1][1],
            **{f"{name}_mean": statistics.mean(row[name] for row in train_rows) for name in MISMATCH}}


def plot(runs: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.0, 3.2), dpi=90)
    for condition, color in (("uncorrected", "tab:red"), ("corrected", "tab:blue")):
        curves = [run["heldout_accuracy"] for run in runs if run["condition"] == condition]
        for curve in curves:
            ax.plot([s for s, _ in curve], [a for _, a in curve], color=color, alpha=0.3, linewidth=1)
        steps = [s for s, _ in curves[0]]
        mean = [statistics.mean(curve[i][1] for curve in curves) for i in range(len(steps))]
        ax.plot(steps, mean, color=color, linewidth=2, label=f"{condition} (mean of {len(curves)} seeds)")
    ax.set_xlabel("rollout step")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def report(runs: list[dict], args, date: str) -> str:
    seeds = sorted({run["seed"] for run in runs})

    def run_of(condition, seed):
        return next(run for run in runs if run["condition"] == condition and run["seed"] == seed)

    lines = ["# A mismatched sampler, corrected and not (`pacs train`, built-in task)", "",
             f"{date}; {cpu_model()} ({os.cpu_count()} cores, shared with other jobs), Python "
             f"{platform.python_version()}, 1 torch thread per run, runs one at a time. Rollouts sampled at "
             f"temperature {args.sampler_temperature} (`advanced.rollout_correction.sampler_temperature`), the "
             f"trainer's log-probs at 1.0; PACS with the trainer's defaults otherwise; {args.steps} rollout steps "
             f"per run (the default run is 600), held-out accuracy on {args.eval_problems} problems every "
             f"{args.eval_every} steps. Corrected: `advanced.rollout_correction.mode=sequence_truncate`, "
             f"`c_max={args.c_max}`. Command: `python benchmarks/rollout_correction.py --steps {args.steps} "
             f"--seeds {' '.join(map(str, seeds))}`.", "",
             "| seed | held-out accuracy, uncorrected | corrected | mismatch_kl (mean) | responses outside "
             "[0, c_max] (mean) | wall (s), uncorrected / corrected |", "|---:|---:|---:|---:|---:|---|"]
    for seed in seeds:
        u, c = run_of("uncorrected", seed), run_of("corrected", seed)
        lines.append(f"| {seed} | {u['final_accuracy']:.3f} | {c['final_accuracy']:.3f} | "
                     f"{u['mismatch_kl_mean']:.4f} | {c['mismatch_response_out_frac_mean']:.3f} | "
                     f"{u['wall_s']:.0f} / {c['wall_s']:.0f} |")
    mean_u = statistics.mean(run_of("uncorrected", s)["final_accuracy"] for s in seeds)
    mean_c = statistics.mean(run_of("corrected", s)["final_accuracy"] for s in seeds)
    start = statistics.mean(run["heldout_accuracy"][0][1] for run in runs)
    lines += ["", f"Mean final held-out accuracy: uncorrected {mean_u:.3f}, corrected {mean_c:.3f} "
              f"(start {start:.3f}). Curves: `heldout_accuracy.png`; every number: `runs.jsonl`.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--sampler-temperature", type=float, default=1.1)
    parser.add_argument("--c-max", type=float, default=3.0)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-problems", type=int, default=200)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/rollout_correction (a temporary "
                        "folder with --dry-run)")
    parser.add_argument("--cache-dir", default=str(REPO / "runs" / "warmup_cache"),
                        help="the warmed-up model (made once)")
    parser.add_argument("--dry-run", action="store_true", help="2 steps, seed 0, written to a temporary folder")
    parser.add_argument("overrides", nargs="*", help="more `pacs train` settings, key=value (every run)")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.steps, args.seeds, args.eval_every, args.eval_problems = 2, [0], 1, 20
        args.out = args.out or tempfile.mkdtemp(prefix="pacs-rollout-correction-")
    args.out = args.out or str(REPO / "benchmarks" / "results" / "rollout_correction")
    runs = []
    with tempfile.TemporaryDirectory(prefix="pacs-mismatch-") as workdir:
        for seed in args.seeds:
            for condition in (("uncorrected", "corrected") if seed % 2 == 0 else ("corrected", "uncorrected")):
                run = train_run(condition, seed, args, workdir)
                runs.append(run)
                print(f"[mismatch] seed {seed} {condition}: held-out {run['final_accuracy']:.3f} after "
                      f"{run['steps']} steps, mismatch_kl {run['mismatch_kl_mean']:.4f}, {run['wall_s']:.0f} s",
                      flush=True)
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    os.makedirs(args.out, exist_ok=True)
    conditions = {"date": date, "cpu": cpu_model(), "sampler_temperature": args.sampler_temperature,
                  "trainer_temperature": 1.0, "c_max": args.c_max, "overrides": args.overrides}
    with open(os.path.join(args.out, "runs.jsonl"), "w") as fh:
        for run in runs:
            fh.write(json.dumps({**conditions, **run}) + "\n")
    plot(runs, os.path.join(args.out, "heldout_accuracy.png"),
         f"sampler at T={args.sampler_temperature}, trainer at T=1.0 ({args.steps} steps)")
    text = report(runs, args, date)
    with open(os.path.join(args.out, "README.md"), "w") as fh:
        fh.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
