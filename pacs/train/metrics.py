"""Per-step metrics: ``OUTPUT_DIR/metrics.jsonl`` (one JSON object per line) and a PNG of the curves."""

from __future__ import annotations

import json
import math
import os

from pacs.run.durable import fsync_dir

CURVES = (
    ("reward_mean", "training reward (mean)"),
    ("eval_accuracy", "held-out accuracy"),
    ("mixed_reward_group_frac", "groups with mixed rewards (the learning signal)"),
    ("update_nonzero_frac", "share of the weights each step moved"),
    ("loss", "loss (PACS: ln 2 on-policy by design)"),
    ("entropy", "entropy (nats/token)"),
    ("response_length", "response length (tokens)"),
    ("sigmoid_psi_correct_mean", "mean sigmoid(psi): correct vs incorrect (critic)"),
    ("grad_norm", "grad norm"),
    ("tokens_per_s", "tokens/s"),
)


class MetricsLog:
    """Appends one JSON row per line to ``path`` (rank 0 only when ``enabled`` is False elsewhere).

    ``resume_step=None`` starts a new log (the run directory was checked to hold no run). With a
    step, the existing log is cut back to the rows of steps <= ``resume_step``, so that the resumed
    run appends exactly the rows an uninterrupted run would have written after them; a torn last
    line (a crash mid-write) is dropped with a warning through ``warn``, and so are steps up to
    ``resume_step`` that have no row (one line).

    Every row is flushed and fsynced before :meth:`write` returns: the trainer writes a step's row
    before its checkpoint, so a checkpoint that survives a power loss never has rows missing behind it.
    """

    def __init__(self, path: str, resume_step: int | None = None, enabled: bool = True, warn=print):
        self.path, self.enabled = path, enabled
        if not enabled:
            return
        if resume_step is None or not os.path.isfile(path):
            open(path, "w").close()
            fsync_dir(os.path.dirname(os.path.abspath(path)))
            if resume_step is not None and resume_step > 0:
                warn(f"[resume] {path} was missing: the rows of steps 0-{resume_step} are lost (the checkpoint "
                     f"of step {resume_step} is not); the log continues from step {resume_step + 1}")
            return
        rows, torn = read_metrics(path, allow_torn_tail=True)
        if torn:
            warn(f"[resume] {path}: dropped a torn last line (a crash mid-write): {torn[:80]!r}")
        kept = [row for row in rows if row.get("step", 0) <= resume_step]
        missing = missing_steps([row.get("step", 0) for row in kept], resume_step)
        if missing:
            warn(f"[resume] {path} has no rows for steps {missing} behind the checkpoint of step {resume_step} "
                 "(lost before they reached the disk, or removed): the log keeps that gap")
        with open(path + ".tmp", "w") as fh:
            fh.writelines(json.dumps(row) + "\n" for row in kept)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(path + ".tmp", path)
        fsync_dir(os.path.dirname(os.path.abspath(path)))

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        try:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(clean) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            from pacs.run.disk_space import DISK_FULL, NoSpaceLeft, no_space_message

            if exc.errno in DISK_FULL:  # a torn row is dropped on resume
                raise NoSpaceLeft(no_space_message("metrics row to", self.path, None)) from exc
            raise


def missing_steps(steps: list[int], last: int) -> str:
    """The steps 0..``last`` absent from ``steps``, as ranges ("6-7, 9"; empty: none)."""
    present, ranges = set(steps), []
    for step in range(last + 1):
        if step in present:
            continue
        if ranges and ranges[-1][1] == step - 1:
            ranges[-1][1] = step
        else:
            ranges.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def read_metrics(path: str, allow_torn_tail: bool = False):
    """The rows of a ``metrics.jsonl``.

    A line that is not a JSON object is a ValueError naming the file and line, except, with
    ``allow_torn_tail``, the last line when it is cut short (no newline at the end of the file):
    then ``(rows, torn_text)`` is returned, ``torn_text`` empty when the file was whole.
    """
    with open(path) as fh:
        lines = fh.read().split("\n")
    # a complete file ends with "\n", so the last piece is "" unless the last line was cut short
    body, tail = lines[:-1], lines[-1]
    rows = []
    for number, line in enumerate(body, 1):
        if line.strip():
            rows.append(_parse_row(line, path, number))
    torn = ""
    if tail.strip():
        try:  # a whole row that only lacks its newline is kept
            rows.append(_parse_row(tail, path, len(lines)))
        except ValueError:
            if not allow_torn_tail:
                raise
            torn = tail
    return (rows, torn) if allow_torn_tail else rows


def _parse_row(line: str, path: str, number: int) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} line {number} is not JSON ({exc.msg}); fix or remove that line") from exc
    if not isinstance(row, dict):
        raise ValueError(f"{path} line {number} is not a JSON object: {line[:80]!r}")
    return row


def plot_metrics(metrics_path: str, out_png: str, title: str | None = None) -> str:
    """Draw the curves of ``metrics_path`` into ``out_png`` (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    curves = [(key, label) for key, label in CURVES if any(r.get(key) is not None for r in rows)]
    cols = 2
    nrows = max(1, math.ceil(len(curves) / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(10, 2.6 * nrows), squeeze=False)
    for ax, (key, label) in zip(axes.flat, curves):
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o" if key == "eval_accuracy" else None, markersize=3)
        if key in ("eval_accuracy", "reward_mean", "mixed_reward_group_frac", "update_nonzero_frac"):
            ax.set_ylim(-0.02, 1.02)
        if key == "sigmoid_psi_correct_mean":
            wrong = [(r["step"], r["sigmoid_psi_incorrect_mean"]) for r in rows
                     if r.get("sigmoid_psi_incorrect_mean") is not None]
            if wrong:
                ax.lines[-1].set_label("correct")
                ax.plot(*zip(*wrong), alpha=0.7, label="incorrect")
                ax.legend(fontsize=7)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("rollout step", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(curves):]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
