"""The output directory of a training run: usable, and never overwritten silently.

A directory "holds a run" when it has a ``metrics.jsonl``, a ``checkpoints/`` directory, a
``config.yaml`` or a ``final_model/``. Starting a run there needs ``--resume`` (continue it) or
``--overwrite`` (move the old run aside to ``OUTPUT_DIR.replaced-<UTC time>``, nothing deleted).
"""

from __future__ import annotations

import datetime as dt
import errno
import os

RUN_FILES = ("metrics.jsonl", "checkpoints", "config.yaml", "final_model")


def run_contents(output_dir: str) -> list[str]:
    """The names of :data:`RUN_FILES` present in ``output_dir`` (empty: it holds no run)."""
    if not os.path.isdir(output_dir):
        return []
    return [name for name in RUN_FILES if os.path.exists(os.path.join(output_dir, name))]


def check_usable(output_dir: str) -> None:
    """Raise a ValueError naming ``--output-dir`` when the directory cannot be created or written.

    Creates the directory (and parents) when missing, and writes then removes a probe file.
    """
    where = f"--output-dir {output_dir!r}"
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ValueError(f"{where} is a file, not a directory; choose another --output-dir")
    try:
        os.makedirs(output_dir, exist_ok=True)
        probe = os.path.join(output_dir, f".pacs-write-probe-{os.getpid()}")
        with open(probe, "w") as fh:
            fh.write("ok")
        os.remove(probe)
    except OSError as exc:
        reason = {errno.EACCES: "no permission", errno.EPERM: "not permitted", errno.EROFS: "read-only file system",
                  errno.ENOSPC: "no space left", errno.ENOTDIR: "a parent is a file"}.get(exc.errno, exc.strerror)
        raise ValueError(f"{where} cannot be written ({reason}); choose a directory you can write to") from exc


def check_free_for_run(output_dir: str, *, resume: bool, overwrite: bool) -> None:
    """Refuse (ValueError) to start a fresh run where a run already is, unless told what to do."""
    if resume and overwrite:
        raise ValueError("--resume and --overwrite exclude each other: continue the run in --output-dir, or "
                         "move it aside and start afresh")
    found = run_contents(output_dir)
    if found and not resume and not overwrite:
        raise ValueError(
            f"--output-dir {output_dir!r} already holds a run ({', '.join(found)}); pass --resume to continue "
            "it, --overwrite to move it aside and start afresh, or choose another --output-dir")


def move_run_aside(output_dir: str) -> str | None:
    """Rename the run in ``output_dir`` to a sibling ``OUTPUT_DIR.replaced-<UTC time>``; returns
    its new path (None when there was no run). Nothing is deleted."""
    if not run_contents(output_dir):
        return None
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    target = f"{os.path.normpath(output_dir)}.replaced-{stamp}"
    suffix = 0
    while os.path.exists(target if not suffix else f"{target}-{suffix}"):
        suffix += 1
    target = target if not suffix else f"{target}-{suffix}"
    os.rename(output_dir, target)
    os.makedirs(output_dir)
    return target
