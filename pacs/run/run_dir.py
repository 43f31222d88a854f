"""The output directory of a training run: its layout, usable, and never overwritten silently.

Every path under a run's directory comes from :class:`RunDir`::

    OUTPUT_DIR/
      config.yaml             the settings the run started with (``pacs train --config ... --resume``)
      config_history.jsonl    each resume's changed settings
      metrics.jsonl           one row per step (pacs/train/metrics.py), metrics.png its curves
      checkpoints/step_000010/ ...  checkpoints (pacs/run/checkpoint.py), ``latest`` names the newest
      final_model/            the trained policy in Hugging Face format
      eval/                   ``pacs eval``'s journal and outputs for this run's model
      .lock                   held by the process training here (pacs/run/run_lock.py)

A directory "holds a run" when it has a ``metrics.jsonl``, a ``checkpoints/`` directory, a
``config.yaml`` or a ``final_model/``. Starting a run there needs ``--resume`` (continue it) or
``--overwrite`` (move the old run aside to ``OUTPUT_DIR.replaced-<UTC time>``, nothing deleted).
"""

from __future__ import annotations

import datetime as dt
import errno
import os
import re
from dataclasses import dataclass

CONFIG_NAME = "config.yaml"
HISTORY_NAME = "config_history.jsonl"
METRICS_NAME = "metrics.jsonl"
CHECKPOINTS_NAME = "checkpoints"
FINAL_MODEL_NAME = "final_model"
LOCK_NAME = ".lock"
RUN_FILES = (METRICS_NAME, CHECKPOINTS_NAME, CONFIG_NAME, FINAL_MODEL_NAME)
CHECKPOINT_DIR = re.compile(r"step_(\d+)")  # a checkpoint's directory name: its step


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint of ``step`` (matched by :data:`CHECKPOINT_DIR`)."""
    return f"step_{step:06d}"


def run_of_config_file(config_path: str | None) -> str | None:
    """The run directory (absolute) whose own ``config.yaml`` ``config_path`` is, or None: the file is named
    config.yaml and sits beside the run's ``metrics.jsonl`` or ``checkpoints/``."""
    if config_path is None or os.path.basename(config_path) != CONFIG_NAME or not os.path.isfile(config_path):
        return None
    run = RunDir(os.path.dirname(os.path.abspath(config_path)))
    return run.path if os.path.isfile(run.metrics) or os.path.isdir(run.checkpoints) else None


@dataclass(frozen=True)
class RunDir:
    """One run's output directory (``path``): where each of its files is, and the checks before a run
    starts there."""

    path: str

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def config(self) -> str:
        return self._file(CONFIG_NAME)

    @property
    def config_history(self) -> str:
        return self._file(HISTORY_NAME)

    @property
    def metrics(self) -> str:
        return self._file(METRICS_NAME)

    @property
    def metrics_plot(self) -> str:
        return self._file("metrics.png")

    @property
    def checkpoints(self) -> str:
        return self._file(CHECKPOINTS_NAME)

    def checkpoint(self, step: int) -> str:
        return os.path.join(self.checkpoints, checkpoint_name(step))

    @property
    def final_model(self) -> str:
        return self._file(FINAL_MODEL_NAME)

    @property
    def eval(self) -> str:
        return self._file("eval")

    @property
    def lock(self) -> str:
        return self._file(LOCK_NAME)

    def contents(self) -> list[str]:
        """The names of :data:`RUN_FILES` present (empty: it holds no run)."""
        if not os.path.isdir(self.path):
            return []
        return [name for name in RUN_FILES if os.path.exists(self._file(name))]

    def check_usable(self) -> None:
        """Raise a ValueError naming ``--output-dir`` when the directory cannot be created or written.

        Creates the directory (and parents) when missing, and writes then removes a probe file.
        """
        where = f"--output-dir {self.path!r}"
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise ValueError(f"{where} is a file, not a directory; choose another --output-dir")
        try:
            os.makedirs(self.path, exist_ok=True)
            probe = self._file(f".pacs-write-probe-{os.getpid()}")
            with open(probe, "w") as fh:
                fh.write("ok")
            os.remove(probe)
        except OSError as exc:
            reason = {errno.EACCES: "no permission", errno.EPERM: "not permitted", errno.EROFS: "read-only file system",
                      errno.ENOSPC: "no space left", errno.ENOTDIR: "a parent is a file"}.get(exc.errno, exc.strerror)
            raise ValueError(f"{where} cannot be written ({reason}); choose a directory you can write to") from exc

    def check_free_for_run(self, *, resume: bool, overwrite: bool) -> None:
        """Refuse (ValueError) to start a fresh run where a run already is, unless told what to do."""
        if resume and overwrite:
            raise ValueError("--resume and --overwrite exclude each other: continue the run in --output-dir, or "
                             "move it aside and start afresh")
        found = self.contents()
        if found and not resume and not overwrite:
            raise ValueError(
                f"--output-dir {self.path!r} already holds a run ({', '.join(found)}); pass --resume to continue "
                "it, --overwrite to move it aside and start afresh, or choose another --output-dir")

    def move_aside(self) -> str | None:
        """Rename the run to a sibling ``OUTPUT_DIR.replaced-<UTC time>`` and recreate the directory empty;
        returns the run's new path (None when there was no run). Nothing is deleted."""
        if not self.contents():
            return None
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
        target = f"{os.path.normpath(self.path)}.replaced-{stamp}"
        suffix = 0
        while os.path.exists(target if not suffix else f"{target}-{suffix}"):
            suffix += 1
        target = target if not suffix else f"{target}-{suffix}"
        os.rename(self.path, target)
        os.makedirs(self.path)
        return target
