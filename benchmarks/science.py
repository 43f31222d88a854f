"""PACS vs GRPO, DAPO and Dr.GRPO (and PACS's score-function term on vs off, its class weights on vs off, its reference
reset every 4 rollout steps vs every one, its single-label groups dropped vs kept) across seeds, on the
built-in addition task and on the generated word-problem task, under one small, equal budget.

    python benchmarks/science.py run     # the sweep: one `pacs train` per (seed, task, variant)
    python benchmarks/science.py report  # table + plots from the runs recorded so far

``run`` appends one JSON line per finished run to ``OUT/runs.jsonl`` (OUT defaults to
benchmarks/results/science), so a partial sweep is still reportable and a restarted sweep skips
the runs already recorded. Several ``run`` processes may work on one sweep: each run is claimed
first (a ``.claim`` file in the runs directory; delete those of runs that were killed to redo
them). Seeds are the outer loop: after s seeds every variant has s runs.
Every run uses the same settings except the variant's own (``VARIANTS``); each evaluates the
held-out set every ``--eval-every`` rollout steps with ``--n-samples`` samples per problem at the
paper's temperature (0.6; top-p 1), giving pass@1 (= mean@n) and pass@k for k = 1, 2, 4, ..., n.

To keep edits made during a long sweep away from its runs, freeze the code first and point
``--code-dir`` at the copy (each record keeps the commit: ``code_commit``, and the CPU: ``cpu_model``)::

    d=/tmp/pacs-sweep && mkdir -p $d && git archive HEAD | tar -x -C $d && git rev-parse --short HEAD > $d/COMMIT
    python benchmarks/science.py run --code-dir $d --seeds 5 6 7 8 9

``report`` writes ``OUT/report.md`` (mean and 95% t-interval over seeds of the final pass@k, and
of the paired difference against the baseline variant) and the PNG plots next to it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.run import cpu_model  # noqa: E402

VARIANTS = {
    "pacs": ["optim.algo=pacs"],
    "grpo": ["optim.algo=grpo"],
    # the GRPO family beside them, each with its own defaults (pacs/train/loss_objective.py); any other built-in
    # objective (gspo, cispo) or a user's (module:Class) is a variant too, by that name (variant_overrides)
    "dapo": ["optim.algo=dapo"],
    "dr_grpo": ["optim.algo=dr_grpo"],
    "pacs_sft": ["optim.algo=pacs", "advanced.optim.score_function_term=true"],
    # the paper's ablation: PACS without its class weights (every response weighs 1)
    "pacs_unweighted": ["optim.algo=pacs", "advanced.optim.weighting=none"],
    # the reference kept for 4 rollout steps (the paper's periodic hard reset, period 4 instead of 1)
    "pacs_ref4": ["optim.algo=pacs", "advanced.optim.ref_reset_every=4"],
    # the single-label groups left out of the loss (pacs/train/single_label_groups.py): with a reset every step,
    # and with the reference kept for 4 (where those groups pull toward the reference)
    "pacs_drop": ["optim.algo=pacs", "advanced.optim.drop_single_label_groups=true"],
    "pacs_ref4_drop": ["optim.algo=pacs", "advanced.optim.ref_reset_every=4",
                       "advanced.optim.drop_single_label_groups=true"],
}
TASKS = {
    "embedded": ["task.name=embedded"],
    "wordmath": ["task.name=wordmath", "rollout.max_new_tokens=7"],
}
# what each comparison sets against what (label, variant, baseline variant)
COMPARISONS = [("PACS - GRPO", "pacs", "grpo"), ("PACS - DAPO", "pacs", "dapo"), ("PACS - Dr.GRPO", "pacs", "dr_grpo"),
               ("DAPO - GRPO", "dapo", "grpo"), ("Dr.GRPO - GRPO", "dr_grpo", "grpo"),
               ("PACS score-function term on - off", "pacs_sft", "pacs"),
               ("PACS class weights balanced - none", "pacs", "pacs_unweighted"),
               ("PACS reference reset every 4 - every 1 rollout steps", "pacs_ref4", "pacs"),
               ("PACS single-label groups dropped - kept (reset every step)", "pacs_drop", "pacs"),
               ("PACS reference kept 4 steps: single-label groups dropped - kept", "pacs_ref4_drop", "pacs_ref4"),
               ("PACS reference kept 4 steps, single-label groups dropped - reset every step", "pacs_ref4_drop",
                "pacs")]
TITLES = {"grpo": "PACS vs GRPO", "dapo": "PACS vs DAPO", "dr_grpo": "PACS vs Dr.GRPO",
          "pacs_sft": "PACS's score-function term",
          "pacs_unweighted": "PACS's class weights (balanced vs none)",
          "pacs_ref4": "PACS's reference reset period (4 vs 1 rollout steps)",
          "pacs_drop": "PACS's single-label groups dropped", "pacs_ref4_drop": "PACS's single-label groups dropped "
          "with the reference kept for 4 steps"}


def variant_overrides(variant: str) -> list[str]:
    """A variant's own settings: ``VARIANTS``'s, else the objective it names (a built-in objective, or a user's
    as module:Class, run with that objective's defaults)."""
    if variant in VARIANTS:
        return VARIANTS[variant]
    from pacs.config import check_algo

    check_algo(variant)
    return [f"optim.algo={variant}"]


def comparisons(variants: list[str]) -> list[tuple[str, str, str]]:
    """``COMPARISONS``, and PACS against each other variant that none of them names."""
    named = {v for _, a, b in COMPARISONS for v in (a, b)}
    return COMPARISONS + [(f"PACS - {v}", "pacs", v) for v in variants if v not in named]


def run_dir_name(task: str, variant: str, seed: int) -> str:
    return f"{task}-{variant.replace(':', '.')}-s{seed}"


def run_one(task: str, variant: str, seed: int, args, cache_dir: str) -> dict:
    """One `pacs train` in a fresh process; returns its record (evals from metrics.jsonl)."""
    out = os.path.join(args.runs_dir, run_dir_name(task, variant, seed))
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256) if k <= args.n_samples]
    cmd = [sys.executable, "-m", "pacs", "train", "--output-dir", out, "--seed", str(seed),
           "--max-steps", str(args.max_steps), *TASKS[task], *variant_overrides(variant),
           f"advanced.task.cache_dir={cache_dir}", f"eval.every={args.eval_every}", f"eval.n_samples={args.n_samples}",
           "eval.temperature=0.6", f"eval.ks=[{','.join(map(str, ks))}]", f"eval.num_problems={args.num_problems}",
           "checkpoint_every=0", "advanced.plot=false", "advanced.torch_threads=1"]
    env = dict(os.environ, PYTHONPATH=args.code_dir, VLLM_LOGGING_LEVEL="ERROR")
    start = time.time()
    with open(out + ".log", "w") as log:
        proc = subprocess.run(cmd, cwd=args.code_dir, env=env, stdout=log, stderr=subprocess.STDOUT,
                              timeout=args.run_timeout)
    wall = time.time() - start
    record = {"task": task, "variant": variant, "seed": seed, "max_steps": args.max_steps,
              "returncode": proc.returncode, "wall_s": round(wall, 1), "command": " ".join(cmd[1:]),
              "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "host": platform.node(), "cpu_model": cpu_model(), "code_commit": code_commit(args.code_dir),
              "cpus": os.cpu_count(), "n_samples": args.n_samples, "ks": ks}
    rows = []
    metrics = os.path.join(out, "metrics.jsonl")
    if os.path.isfile(metrics):
        with open(metrics) as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
    record["evals"] = [{k: v for k, v in r.items() if k == "step" or k.startswith("eval_")}
                       for r in rows if "eval_accuracy" in r]
    train_rows = [r for r in rows if "reward_mean" in r]
    record["train"] = {
        "reward_first10": _mean([r["reward_mean"] for r in train_rows[:10]]),
        "reward_last10": _mean([r["reward_mean"] for r in train_rows[-10:]]),
        "response_length_last10": _mean([r["response_length"] for r in train_rows[-10:]]),
        "reward_timeouts": sum(r.get("reward_timeouts", 0.0) for r in train_rows),
        "reward_errors": sum(r.get("reward_errors", 0.0) for r in train_rows),
        "loop_s": train_rows[-1]["elapsed"] if train_rows else None,
        "entropy_first10": _mean([r["entropy"] for r in train_rows[:10] if r.get("entropy") is not None]),
        "entropy_last10": _mean([r["entropy"] for r in train_rows[-10:] if r.get("entropy") is not None]),
        **diagnostics(train_rows),
    }
    return record


DIAGNOSTICS = ("frac_single_label_groups", "single_label_grad_share", "psi_std")


def diagnostics(train_rows: list[dict]) -> dict:
    """Means over a run's rollout steps of the loss diagnostics (``DIAGNOSTICS``; NaN steps left out,
    keys absent where the run did not log them), also by the reference's age when it was kept."""
    out = {}
    for key in DIAGNOSTICS:
        values = [r[key] for r in train_rows if r.get(key) is not None]
        if values:
            out[f"{key}_mean"] = _mean(values)
    ages = sorted({r["ref_age"] for r in train_rows if r.get("ref_age") is not None})
    if ages and any("single_label_grad_share" in r for r in train_rows):
        out["single_label_grad_share_by_ref_age"] = {
            str(int(age)): _mean([r["single_label_grad_share"] for r in train_rows if r.get("ref_age") == age
                                  and r.get("single_label_grad_share") is not None]) for age in ages}
    return out


def code_commit(code_dir: str) -> str | None:
    """The commit the runs' code is: ``git rev-parse`` in a checkout, else the COMMIT file that an
    exported copy (``git archive``, the way a sweep freezes its code) carries, else None."""
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=code_dir, capture_output=True, text=True)
    if done.returncode == 0:
        edited = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=code_dir,
                                capture_output=True, text=True).stdout.strip()
        return done.stdout.strip() + ("+edits" if edited else "")  # a checkout with uncommitted edits
    path = os.path.join(code_dir, "COMMIT")
    return open(path).read().strip() if os.path.isfile(path) else None


def _mean(values):
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else float("nan")


def load_records(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def cmd_run(args) -> int:
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.runs_dir, exist_ok=True)
    path = os.path.join(args.out, "runs.jsonl")
    cache_dir = os.path.join(args.runs_dir, "cache")
    deadline = datetime.datetime.fromisoformat(args.deadline) if args.deadline else None
    for seed in args.seeds:
        for task in args.tasks:
            for variant in args.variants:
                done = {(r["task"], r["variant"], r["seed"]) for r in load_records(path) if r["returncode"] == 0}
                if (task, variant, seed) in done or not _claim(args.runs_dir, task, variant, seed):
                    continue  # finished, or another `run` process (same OUT) has started it
                now = datetime.datetime.now(datetime.timezone.utc)
                if deadline is not None and now >= deadline:
                    print(f"[science] deadline {args.deadline} reached: stopping before {task}/{variant}/seed {seed}")
                    return 0
                print(f"[science] {now:%H:%M:%S} {task} {variant} seed {seed}", flush=True)
                try:
                    record = run_one(task, variant, seed, args, cache_dir)
                except subprocess.TimeoutExpired:
                    print(f"[science] {task}/{variant}/seed {seed} ran past {args.run_timeout} s: skipped", flush=True)
                    continue
                with open(path, "a") as fh:
                    fh.write(json.dumps(record) + "\n")
                last = record["evals"][-1] if record["evals"] else {}
                print(f"[science]   rc {record['returncode']}, {record['wall_s']} s, final pass@1 "
                      f"{last.get('eval_pass@1', float('nan')):.3f}", flush=True)
    return 0


def _claim(runs_dir: str, task: str, variant: str, seed: int) -> bool:
    """True for the one process that creates the run's claim file: `run` processes may share a sweep."""
    try:
        os.close(os.open(os.path.join(runs_dir, run_dir_name(task, variant, seed) + ".claim"),
                         os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


# ---------------------------------------------------------------------------------------- report
# two-sided 95% Student-t quantiles t_{0.975, df} for df = 1..30 (standard table values)
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042]


def t_interval(values: list[float]) -> tuple[float, float, int]:
    """Mean and the half-width of its two-sided 95% Student-t interval (nan below 2 values)."""
    n = len(values)
    mean = sum(values) / n if n else float("nan")
    if n < 2:
        return mean, float("nan"), n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, (T975[n - 2] if n - 1 <= len(T975) else 1.96) * sd / math.sqrt(n), n


def _final(record: dict, key: str) -> float:
    return record["evals"][-1][key] if record["evals"] else float("nan")


def cmd_report(args) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in load_records(os.path.join(args.out, "runs.jsonl")) if r["returncode"] == 0 and r["evals"]]
    if not records:
        print("[science] no finished runs yet", file=sys.stderr)
        return 1
    for r in records:  # entropy of the policy, from the run's own metrics when its directory is still here
        path = os.path.join(args.runs_dir, run_dir_name(r["task"], r["variant"], r["seed"]), "metrics.jsonl")
        rows = [row for row in load_records(path) if row.get("entropy") is not None]
        r["train"].setdefault("entropy_first10", _mean([row["entropy"] for row in rows[:10]]))
        r["train"].setdefault("entropy_last10", _mean([row["entropy"] for row in rows[-10:]]))
    by = {}  # (task, variant) -> seed -> its last run, for the per-variant rows and the plots
    paired = {}  # (task, variant) -> (seed, CPU, commit) -> run, for the paired differences
    for r in records:
        by.setdefault((r["task"], r["variant"]), {})[r["seed"]] = r
        paired.setdefault((r["task"], r["variant"]), {})[(r["seed"], *_provenance(r))] = r
    tasks = [t for t in TASKS if any(k[0] == t for k in by)]
    seen = dict.fromkeys(r["variant"] for r in records)
    variants = [v for v in VARIANTS if v in seen] + [v for v in seen if v not in VARIANTS]
    ks = records[0]["ks"]
    title = ", and ".join(TITLES[v] for v in variants if v in TITLES) or "PACS"
    lines = [f"# {title}, across seeds (small CPU budget)", ""]
    lines += [f"Generated {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC from "
              f"`runs.jsonl` ({len(records)} finished runs) by `python benchmarks/science.py report`.", ""]
    note_path = os.path.join(args.out, "report_note.md")  # the note stays for the next report
    if args.note:
        with open(note_path, "w") as fh:
            fh.write(args.note.strip() + "\n")
    note = args.note or (open(note_path).read().strip() if os.path.isfile(note_path) else "")
    if note:
        lines += [note, ""]
    lines += ["Every cell: mean over seeds +- the half-width of the 95% Student-t interval (n = seeds). "
              f"Metrics on the task's 200 held-out problems after {records[0]['max_steps']} rollout steps, "
              f"{records[0]['n_samples']} samples per problem at temperature 0.6 (pass@1 = mean@n); step 0 is the "
              "warmed-up model before any RL step (the same for every variant of a seed).", ""]
    for task in tasks:
        lines += [f"## {task}", "", "| variant | seeds | pass@1 at step 0 | " + " | ".join(
            f"pass@{k}" for k in ks) + " | train reward (last 10 steps) | entropy (first -> last 10 steps) "
            "| reward timeouts |",
            "|---|---:|---:|" + "---:|" * len(ks) + "---:|---:|---:|"]
        for variant in variants:
            runs = list(by.get((task, variant), {}).values())
            if not runs:
                continue
            cells = []
            for k in ks:
                m, h, _ = t_interval([_final(r, f"eval_pass@{k}") for r in runs])
                cells.append(f"{m:.3f} +- {h:.3f}")
            m0, h0, _ = t_interval([r["evals"][0]["eval_pass@1"] for r in runs])
            mr, hr, _ = t_interval([r["train"]["reward_last10"] for r in runs])
            timeouts = sum(r["train"]["reward_timeouts"] for r in runs)
            known = [r for r in runs if math.isfinite(r["train"]["entropy_first10"])]  # runs whose metrics are kept
            e0 = _mean([r["train"]["entropy_first10"] for r in known])
            e1 = _mean([r["train"]["entropy_last10"] for r in known])
            entropy = f"{e0:.2f} -> {e1:.2f}" if known else "not kept"
            if known and len(known) < len(runs):
                entropy += f" ({len(known)} of {len(runs)} runs)"
            lines.append(f"| {variant} | {len(runs)} | {m0:.3f} +- {h0:.3f} | " + " | ".join(cells)
                         + f" | {mr:.3f} +- {hr:.3f} | {entropy} | {timeouts:.0f} |")
        if len({len(by.get((task, v), {})) for v in variants}) > 1:
            lines += ["", "(The rows hold different numbers of seeds, and so different warm-ups: compare variants "
                      "by the paired differences below, not across rows.)"]
        lines += ["", "Paired differences (same seed: same warm-up, held-out set and prompts):", "",
                  "| comparison | pairs | " + " | ".join(f"d pass@{k}" for k in ks) + " |",
                  "|---|---:|" + "---:|" * len(ks)]
        for label, a, b in comparisons(variants):
            # a pair is one seed run on one machine at one commit: float rounding differs across CPUs
            # (and code that reorders sums), so runs of a seed on two machines are independent draws
            keys = sorted(set(paired.get((task, a), {})) & set(paired.get((task, b), {})), key=str)
            if not keys:
                continue
            cells = []
            for k in ks:
                diffs = [_final(paired[(task, a)][key], f"eval_pass@{k}")
                         - _final(paired[(task, b)][key], f"eval_pass@{k}") for key in keys]
                m, h, _ = t_interval(diffs)
                mark = "" if math.isnan(h) or abs(m) <= h else " *"
                cells.append(f"{m:+.3f} +- {h:.3f}{mark}")
            lines.append(f"| {label} | {len(keys)} | " + " | ".join(cells) + " |")
        lines += ["", "(* the 95% interval excludes 0)", ""]
        lines += _diagnostics_table(task, variants, by)
        _plots(plt, task, variants, by, ks, args.out)
        lines += [f"![pass@1 over training, {task}]({task}_pass1_curve.png)",
                  f"![pass@k vs k, {task}]({task}_pass_at_k.png)", ""]
    provenance: dict[tuple, int] = {}
    for r in records:
        key = (r.get("code_commit") or "an unrecorded commit", r.get("cpu_model") or "an unrecorded CPU")
        provenance[key] = provenance.get(key, 0) + 1
    counts = [f"{n} run{'s' if n != 1 else ''} at commit {commit} on {cpu}" for (commit, cpu), n in provenance.items()]
    lines += ["Code and machine of the runs: " + "; ".join(counts) + ".", ""]
    wall = [r["wall_s"] for r in records]
    lines += ["## Budget and how to reproduce", "",
              f"Runs: {len(records)}, each one `pacs train` process with 1 torch thread "
              f"({min(wall):.0f}-{max(wall):.0f} s wall each, warm-up included when the seed's was not cached yet; "
              f"{sum(wall) / 60:.0f} min in all) on "
              f"{records[0]['host']} ({records[0]['cpus']} CPU cores shared with other jobs). One run's command "
              "(from the repository root):", "",
              "    python " + re.sub(r"/\S*/runs/science", "runs/science", records[0]["command"]), "",
              "The whole sweep and this report:", "", "    " + _sweep_command(args.out, variants, records), ""]
    with open(os.path.join(args.out, "report.md"), "w") as fh:
        fh.write("\n".join(lines))
    print("\n".join(lines))
    return 0


def _diagnostics_table(task: str, variants: list[str], by: dict) -> list[str]:
    """Per variant, the loss diagnostics' means over steps and seeds, where the runs logged them."""
    rows = []
    for variant in variants:
        runs = [r for r in by.get((task, variant), {}).values() if "single_label_grad_share_mean" in r["train"]]
        if not runs:
            continue
        cells = [f"{_mean([r['train'][f'{key}_mean'] for r in runs]):.3f}" for key in DIAGNOSTICS]
        shares = [r["train"].get("single_label_grad_share_by_ref_age", {}) for r in runs]
        ages = sorted({age for share in shares for age in share}, key=int)
        by_age = ", ".join(f"{age}: {_mean([share.get(age) for share in shares]):.3f}" for age in ages) or "-"
        rows.append(f"| {variant} | {len(runs)} | " + " | ".join(cells) + f" | {by_age} |")
    if not rows:
        return []
    return ["Training diagnostics (mean over rollout steps, then over seeds; from the runs' `metrics.jsonl`): the "
            "fraction of groups whose responses all got the same reward, the share of the loss's gradient with "
            "respect to the scores that those groups carry (`single_label_grad_share`: 0 under RLOO while the "
            "reference is the current policy), and the spread of psi:", "",
            "| variant | seeds | single-label groups | their share of the gradient | psi std "
            "| share by the reference's age (rollout steps) |", "|---|---:|---:|---:|---:|---|", *rows, ""]


def _provenance(record: dict) -> tuple:
    return record.get("cpu_model"), record.get("code_commit")


def _sweep_command(out: str, variants: list[str], records: list[dict]) -> str:
    """The commands that run this report's sweep (its variants and seeds) and rebuild the report."""
    default_out = os.path.join(REPO, "benchmarks", "results", "science")
    where = "" if os.path.abspath(out) == default_out else f" --out {os.path.relpath(out, REPO)}"
    seeds = " ".join(str(s) for s in sorted({r["seed"] for r in records}))
    return (f"python benchmarks/science.py run{where} --variants {' '.join(variants)} --seeds {seeds}"
            f" && python benchmarks/science.py report{where}")


def _plots(plt, task, variants, by, ks, out):
    colors = {"pacs": "tab:blue", "grpo": "tab:orange", "pacs_sft": "tab:green", "pacs_unweighted": "tab:red",
              "pacs_ref4": "tab:purple", "pacs_drop": "tab:cyan", "pacs_ref4_drop": "tab:brown", "dapo": "tab:olive",
              "dr_grpo": "tab:pink"}
    fig, ax = plt.subplots(figsize=(6, 4))
    for variant in variants:
        runs = list(by.get((task, variant), {}).values())
        if not runs:
            continue
        steps = [e["step"] for e in runs[0]["evals"]]
        stats = [t_interval([r["evals"][i]["eval_pass@1"] for r in runs if len(r["evals"]) > i])
                 for i in range(len(steps))]
        mean = [s[0] for s in stats]
        half = [0.0 if math.isnan(s[1]) else s[1] for s in stats]
        ax.plot(steps, mean, marker="o", color=colors.get(variant), label=f"{variant} (n={len(runs)})")
        ax.fill_between(steps, [m - h for m, h in zip(mean, half)], [m + h for m, h in zip(mean, half)],
                        color=colors.get(variant), alpha=0.2)
    ax.set_xlabel("rollout step")
    ax.set_ylabel("held-out pass@1 (T = 0.6)")
    ax.set_title(f"{task}: mean over seeds, 95% t-interval")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, f"{task}_pass1_curve.png"), dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for variant in variants:
        runs = list(by.get((task, variant), {}).values())
        if not runs:
            continue
        stats = [t_interval([_final(r, f"eval_pass@{k}") for r in runs]) for k in ks]
        mean = [s[0] for s in stats]
        half = [0.0 if math.isnan(s[1]) else s[1] for s in stats]
        ax.errorbar(ks, mean, yerr=half, marker="o", capsize=3, color=colors.get(variant),
                    label=f"{variant} (n={len(runs)})")
    base = [r for v in variants for r in by.get((task, v), {}).values()]
    ax.plot(ks, [_mean([r["evals"][0][f"eval_pass@{k}"] for r in base]) for k in ks], ls="--", color="gray",
            label="step 0 (warm-up)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k")
    ax.set_ylabel("held-out pass@k (T = 0.6)")
    ax.set_title(f"{task}: pass@k after training, 95% t-interval")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, f"{task}_pass_at_k.png"), dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("run", "report"))
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "science"))
    parser.add_argument("--runs-dir", default=os.path.join(REPO, "runs", "science"),
                        help="the runs' output directories and warm-up cache")
    parser.add_argument("--code-dir", default=REPO, help="repository whose `pacs` the runs import (PYTHONPATH)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS),
                        help=f"of {', '.join(VARIANTS)}, or any objective optim.algo takes (gspo, cispo, "
                             "module:Class), run with its defaults")
    parser.add_argument("--max-steps", type=int, default=80)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--n-samples", type=int, default=16)
    parser.add_argument("--num-problems", type=int, default=200)
    parser.add_argument("--run-timeout", type=float, default=900.0, help="seconds before one run is abandoned")
    parser.add_argument("--note", help="report: text to print under the title (kept in OUT/report_note.md, which "
                        "later reports print when --note is not given)")
    parser.add_argument("--deadline", help="ISO time (with zone) after which no new run starts")
    args = parser.parse_args(argv)
    for variant in args.variants:
        try:
            variant_overrides(variant)
        except ValueError as exc:
            parser.error(f"--variants: {variant!r} is no variant ({', '.join(VARIANTS)}) and no objective: {exc}")
    return cmd_run(args) if args.command == "run" else cmd_report(args)


if __name__ == "__main__":
    sys.exit(main())
