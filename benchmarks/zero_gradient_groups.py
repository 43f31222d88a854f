"""What skipping the groups whose gradient is exactly 0 saves: `pacs train` with
``train.skip_zero_gradient_groups`` on and off, the same seed and settings, on the built-in tasks.

    python benchmarks/zero_gradient_groups.py                  # addition and word problems, 40 steps, seeds 0 1
    python benchmarks/zero_gradient_groups.py --dry-run        # 2 steps each (plumbing)

A group whose responses all got one reward adds nothing to the gradient on the first mini-batch after a
reset (pacs/train/single_label_groups.py), so the trainer does not run it there. Each pair of runs (on, off)
starts from the same warmed-up model and samples the same first rollout; the table gives the update's
time per rollout step (the old-policy pass, the forwards and backwards, the optimizer steps: the
``update_time`` the trainer logs, its mean over the steps), the share of groups skipped, the speed-up of
the update, and the held-out accuracy at the end of each run (equal up to float rounding: the runs'
updates agree to rounding, tested in tests/test_single_label_groups.py, though sampling can amplify that
over many steps). The runs of a pair alternate in order (on first for even seeds) and run one at a time,
with 1 torch thread. Writes OUT/zero_gradient_groups_<cpu|cuda>.csv and .md with the machine and date.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.run import cpu_model  # noqa: E402

TASKS = {
    "addition": ["task.name=embedded"],
    "word problems": ["task.name=wordmath", "rollout.max_new_tokens=7"],
}


def run_pair_member(task: str, skip: bool, seed: int, steps: int, workdir: str, cache_dir: str,
                    overrides: list[str]) -> dict:
    """One `pacs train` (a fresh process); the means of its metrics."""
    out = os.path.join(workdir, f"{task.replace(' ', '_')}-s{seed}-{'skip' if skip else 'all'}")
    cmd = [sys.executable, "-m", "pacs", "train", "--output-dir", out, "--seed", str(seed), "--max-steps", str(steps),
           *TASKS[task], f"advanced.task.cache_dir={cache_dir}",
           f"advanced.train.skip_zero_gradient_groups={str(skip).lower()}",
           "eval.every=0", "checkpoint_every=0", "advanced.plot=false", "advanced.torch_threads=1", *overrides]
    env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_LOGGING_LEVEL="ERROR")
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd[1:])}` failed ({done.returncode}):\n{done.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    train_rows = [r for r in rows if "update_time" in r]
    return {"task": task, "seed": seed, "skip": skip, "steps": len(train_rows),
            "update_s": statistics.mean(r["update_time"] for r in train_rows),
            "step_s": statistics.mean(r["step_time"] for r in train_rows),
            "single_label_frac": statistics.mean(r["frac_single_label_groups"] for r in train_rows),
            "skipped_frac": statistics.mean(r.get("skipped_group_frac", 0.0) for r in train_rows),
            "final_accuracy": rows[-1].get("eval_accuracy", float("nan"))}


def shown_command(args) -> str:
    """The command that reruns these runs (the options that differ from the defaults, then the settings)."""
    parts = ["python benchmarks/zero_gradient_groups.py"]
    if args.tasks != list(TASKS):
        parts += ["--tasks", *(f"'{t}'" if " " in t else t for t in args.tasks)]
    if not args.dry_run:
        parts += ["--seeds", *map(str, args.seeds)] if args.seeds != [0, 1] else []
        parts += ["--steps", str(args.steps)] if args.steps != 40 else []
    else:
        parts.append("--dry-run")
    return " ".join(parts + args.overrides)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--cache-dir", default=str(REPO / "runs" / "warmup_cache"),
                        help="the warmed-up models (made once per task and seed)")
    parser.add_argument("--dry-run", action="store_true", help="2 steps, seed 0")
    parser.add_argument("overrides", nargs="*", help="more `pacs train` settings, key=value (both runs)")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.steps, args.seeds = 2, [0]
    results = []
    with tempfile.TemporaryDirectory(prefix="pacs-skip-") as workdir:
        for task in args.tasks:
            for seed in args.seeds:
                for skip in ((True, False) if seed % 2 == 0 else (False, True)):
                    result = run_pair_member(task, skip, seed, args.steps, workdir, args.cache_dir, args.overrides)
                    results.append(result)
                    print(f"[skip] {task} seed {seed} skip={skip}: update {result['update_s'] * 1e3:.0f} ms/step, "
                          f"skipped {result['skipped_frac']:.2f} of the groups, final accuracy "
                          f"{result['final_accuracy']:.3f}", flush=True)
    device = "cpu"
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"zero_gradient_groups_{device}")
    with open(stem + ".csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(results[0]))
        writer.writeheader()
        writer.writerows(results)
    lines = ["# Skipping the groups whose gradient is 0: `pacs train` with train.skip_zero_gradient_groups on / off",
             "", f"{date}; {cpu_model()} ({os.cpu_count()} cores), {platform.python_version()}, 1 torch thread, "
             f"{args.steps} rollout steps per run, the trainer's defaults (32 prompts x 8 responses, 2 mini-batches) "
             f"unless set: `{shown_command(args)}`.", "",
             "| task | seed | single-label groups | skipped | update, all run (ms/step) | update, skipped (ms/step) "
             "| update speed-up | step speed-up | final accuracy (all run / skipped) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for task in args.tasks:
        for seed in args.seeds:
            on = next(r for r in results if r["task"] == task and r["seed"] == seed and r["skip"])
            off = next(r for r in results if r["task"] == task and r["seed"] == seed and not r["skip"])
            lines.append(f"| {task} | {seed} | {off['single_label_frac']:.2f} | {on['skipped_frac']:.2f} | "
                         f"{off['update_s'] * 1e3:.0f} | {on['update_s'] * 1e3:.0f} | "
                         f"{off['update_s'] / on['update_s']:.2f}x | {off['step_s'] / on['step_s']:.2f}x | "
                         f"{off['final_accuracy']:.3f} / {on['final_accuracy']:.3f} |")
    text = "\n".join(lines) + "\n"
    with open(stem + ".md", "w") as fh:
        fh.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
