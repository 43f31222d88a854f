"""What ``pacs eval`` writes: per-problem JSONL, the metrics as JSON, and a pass@k-vs-k plot."""

from __future__ import annotations

import json
import os

from pacs.eval.evaluate import EvalReport


def write_eval_outputs(report: EvalReport, out_dir: str, *, info: dict | None = None,
                       plot: bool = True) -> dict[str, str]:
    """Write ``eval_problems.jsonl`` (one line per problem), ``eval_metrics.json`` (the metrics and
    ``info``, e.g. the model and sampling settings) and, with ``plot`` and at least two k,
    ``pass_at_k.png`` under ``out_dir``. Returns the paths written, by kind."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"problems": os.path.join(out_dir, "eval_problems.jsonl"),
             "metrics": os.path.join(out_dir, "eval_metrics.json")}
    with open(paths["problems"], "w") as fh:
        for record in report.records:
            fh.write(json.dumps(record) + "\n")
    with open(paths["metrics"], "w") as fh:
        json.dump({**(info or {}), **report.metrics}, fh, indent=1)
    ks = pass_at_k_points(report.metrics)
    if plot and len(ks) >= 2:
        paths["plot"] = plot_pass_at_k({info.get("label", "model") if info else "model": report.metrics},
                                       os.path.join(out_dir, "pass_at_k.png"))
    return paths


def pass_at_k_points(metrics: dict[str, float]) -> list[int]:
    """The k of every ``pass@k`` entry of ``metrics``, ascending."""
    return sorted(int(key.split("@", 1)[1]) for key in metrics if key.startswith("pass@"))


def plot_pass_at_k(curves: dict[str, dict[str, float]], path: str, title: str = "pass@k") -> str:
    """One line per entry of ``curves`` (label -> metrics holding ``pass@k`` keys), k on a log2 axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for label, metrics in curves.items():
        ks = pass_at_k_points(metrics)
        ax.plot(ks, [metrics[f"pass@{k}"] for k in ks], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k")
    ax.set_ylabel("pass@k")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
