"""Per-step metrics: ``OUTPUT_DIR/metrics.jsonl`` (one JSON object per line) and a PNG of the curves."""

from __future__ import annotations

import json
import math
import os

CURVES = (
    ("reward_mean", "training reward (mean)"),
    ("eval_accuracy", "held-out accuracy"),
    ("loss", "loss"),
    ("entropy", "entropy (nats/token)"),
    ("response_length", "response length (tokens)"),
    ("sigmoid_psi_correct_mean", "mean sigmoid(psi): correct vs incorrect (critic)"),
    ("grad_norm", "grad norm"),
    ("tokens_per_s", "tokens/s"),
)


class MetricsLog:
    """Appends rows to ``path``; with ``truncate_after`` drops rows of steps after a resumed step."""

    def __init__(self, path: str, truncate_after: int | None = None, enabled: bool = True):
        self.path, self.enabled = path, enabled
        if not enabled:
            return
        if truncate_after is None:
            open(path, "w").close()
        elif os.path.isfile(path):
            kept = [row for row in read_metrics(path) if row.get("step", 0) <= truncate_after]
            with open(path + ".tmp", "w") as fh:
                fh.writelines(json.dumps(row) + "\n" for row in kept)
            os.replace(path + ".tmp", path)

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        with open(self.path, "a") as fh:
            fh.write(json.dumps(clean) + "\n")


def read_metrics(path: str) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


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
        if key == "eval_accuracy" or key == "reward_mean":
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
