"""How a run ends: finished (the final model exported, the curves drawn, one summary line), or stopped by an
error or a signal (the engine closed; where the run can be continued from said)."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import torch

from pacs.run import NoSpaceLeft, RunDir, TrainingInterrupted, TrainingStopped, resume_hint
from pacs.run.export import export_hf
from pacs.train.health import health_lines
from pacs.train.metrics import plot_metrics, read_metrics
from pacs.train.step_metrics import peak_memory_mib
from pacs.train.training import Training


@dataclass
class TrainResult:
    """What :func:`train` returns: the last metrics row and the trained policy (still sharded
    under FSDP; :func:`pacs.model.policy.full_named_tensors` gathers it)."""

    metrics: dict
    policy: torch.nn.Module
    output_dir: str


def stopped_training(t: Training, exc: BaseException) -> BaseException | None:
    """A run stopped by ``exc``: the progress bar and the engine closed; a Ctrl-C becomes the returned
    TrainingInterrupted; a crash mid-run (out of memory in generation, a reward function's bug, a lost rank)
    says on this rank where the run can be continued from, and the error itself follows (None returned)."""
    if t.progress is not None:
        t.progress.close()
    try:
        t.engine.close()
    except Exception:  # the error that stopped the run is the one to report
        pass
    if isinstance(exc, KeyboardInterrupt):
        return TrainingInterrupted(f"interrupted at step {t.state['step'] + 1}; {resume_hint(t.cfg.output_dir)}")
    said = (TrainingInterrupted, TrainingStopped, NoSpaceLeft)  # their own line says how to resume
    if isinstance(exc, Exception) and not isinstance(exc, said):
        rank = f" on rank {t.dist_info.rank}" if t.dist_info.world_size > 1 else ""
        try:  # (the hint must not replace the error)
            hint = resume_hint(t.cfg.output_dir)
        except Exception as hint_error:
            hint = f"the last checkpoint could not be listed ({type(hint_error).__name__})"
        print(f"[train] stopped by {type(exc).__name__}{rank} after step {t.state['step']} (the last one "
              f"finished); {hint}", file=sys.stderr, flush=True)
        try:
            exc.pacs_during_training = True  # the CLI then shows the whole traceback, not one line
        except AttributeError:
            pass
    return None


def finish_training(t: Training) -> TrainResult:
    """The final export (HF format, servable by vLLM), the curves, one summary line."""
    export_hf(t.policy, t.run.tokenizer, t.run_dir.final_model, t.dist_info)
    t.engine.close()
    png = None
    if t.dist_info.is_main and t.cfg.plot and os.path.isfile(t.run_dir.metrics):
        png = plot_metrics(t.run_dir.metrics, t.run_dir.metrics_plot,
                           title=f"{t.cfg.optim.algo} on {t.cfg.task.name} ({t.run_dir.path})")
    if t.dist_info.is_main:
        for line in health_lines(read_metrics(t.run_dir.metrics)):
            t.say(line)
        t.say(summary_line(t.run_dir, t.state["step"], time.time() - t.start_time,
                           peak_memory_mib(t.dist_info.device), png))
    return TrainResult(metrics=t.row, policy=t.policy, output_dir=t.run_dir.path)


def summary_line(run_dir: RunDir, steps: int, seconds: float, peak_mib: float, plot: str | None) -> str:
    """The run's last console line: steps, held-out accuracy first -> last, wall time, peak memory,
    where the model, metrics and curves are."""
    evals = [r["eval_accuracy"] for r in read_metrics(run_dir.metrics) if r.get("eval_accuracy") is not None]
    accuracy = f"held-out accuracy {evals[0]:.3f} -> {evals[-1]:.3f}" if evals else "no held-out evaluation"
    minutes, secs = divmod(int(round(seconds)), 60)
    where = f"model {run_dir.final_model}, metrics {run_dir.metrics}"
    if plot:
        where += f", curves {plot}"
    return (f"[train] done: {steps} steps, {accuracy}, {minutes}m{secs:02d}s, peak memory {peak_mib:.0f} MiB; "
            f"{where}")
