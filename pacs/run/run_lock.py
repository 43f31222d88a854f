"""One process per run directory: an exclusive OS file lock on ``DIR/.lock``.

``pacs train`` (its output directory), ``pacs eval`` (its eval directory) and ``PACSTrainer`` (its
output directory, main process) take the lock before they read or write anything there, and hold it
for the life of the process. The lock is ``fcntl.flock``: the kernel releases it when the process
ends, however it ends (kill -9, a crash, a power loss), so a stale lock never blocks a run. The file
holds the holder's pid and program name, for the message the next process prints.

Taking the lock again in the process that holds it is a no-op (``pacs train`` run twice from Python,
a trainer built twice); a lock file moved away with its directory (``--overwrite`` moves the old run
aside) is taken anew at the path.
"""

from __future__ import annotations

import fcntl
import os
import sys

from pacs.run.run_dir import CHECKPOINTS_NAME, CONFIG_NAME, LOCK_NAME, RunDir  # noqa: F401  (LOCK_NAME: the lock file's name)

_held: dict[str, int] = {}  # real path of the lock file -> its open descriptor, in this process


class RunDirectoryLocked(ValueError):
    """Another process holds the lock of the directory (a ValueError: the CLI prints it as one line, exit 2)."""


def _holder(path: str) -> str:
    try:
        with open(path) as fh:
            text = fh.read().strip()
    except OSError:
        return "another process"
    pid, _, command = text.partition(" ")
    return f"process {pid}" + (f" ({command})" if command else "") if pid.isdigit() else "another process"


def _program() -> str:
    """What the holder is, for people: its program and subcommand (``__main__.py train``), no arguments (a
    command line may carry what others should not read)."""
    argv = [arg for arg in sys.argv[:2] if arg and not arg.startswith("-") and "=" not in arg]
    return " ".join([os.path.basename(argv[0]), *argv[1:]]) if argv else ""


def _still_held(path: str, fd: int) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except OSError:
        return False


def lock_run_directory(directory: str, what: str = "--output-dir") -> str:
    """Take the exclusive lock of ``directory`` (created when missing) for this process's life; returns
    the lock file's path. Raises :class:`RunDirectoryLocked` naming the holder's pid when another process
    holds it; ``what`` names the directory's setting in that message."""
    path = os.path.realpath(RunDir(directory).lock)
    fd = _held.get(path)
    if fd is not None:
        if _still_held(path, fd):
            return path
        os.close(fd)
        del _held[path]
    try:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ValueError(f"{what} {directory!r} cannot be written ({exc.strerror}); choose a directory you can "
                         "write to") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunDirectoryLocked(
            f"{what} {directory!r} is in use by {_holder(path)}, which holds {path}; wait for it to end or "
            f"choose another {what}") from None
    except OSError as exc:  # a file system without locks (some network mounts): said, then run unlocked
        os.close(fd)
        print(f"[warning] {path} cannot be locked ({exc.strerror}): nothing stops a second process from using "
              f"{what} {directory!r} at the same time", file=sys.stderr)
        return path
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {_program()}".strip().encode() + b"\n")
    os.fsync(fd)
    _held[path] = fd
    return path


def release_run_directory(directory: str) -> None:
    """Give up this process's lock of ``directory`` (no-op when it holds none)."""
    path = os.path.realpath(RunDir(directory).lock)
    fd = _held.pop(path, None)
    if fd is not None:
        os.close(fd)


def abandon_run_directory(directory: str, remove_directory: bool, config_too: bool = False) -> None:
    """A refused run leaves its directory as it found it: the lock file this process created is removed and
    released, and the directory too when this run created it and nothing else is in it. ``config_too``: a new
    run refused after it wrote its ``config.yaml`` (and nothing else: no metrics, checkpoints or model) removes
    that file too, so that the same command, mended, starts there."""
    run = RunDir(directory)
    if config_too and run.contents() == [CONFIG_NAME]:
        try:
            os.remove(run.config)
        except OSError:
            pass
    path = os.path.realpath(run.lock)
    if path in _held:
        try:
            os.remove(path)
        except OSError:
            pass
        release_run_directory(directory)
    if remove_directory:
        try:
            os.rmdir(directory)
        except OSError:  # not empty (something else wrote there) or already gone: kept
            pass


def check_no_other_holder(directory: str, what: str = "--output-dir") -> None:
    """Raise :class:`RunDirectoryLocked` when another process holds a lock below ``directory`` (a ``pacs eval``
    of the run holds ``DIR/eval/.lock``): the directory must not be moved away under it."""
    for root, dirs, files in os.walk(directory):
        dirs[:] = [d for d in dirs if d != CHECKPOINTS_NAME]  # (no lock is ever there)
        if LOCK_NAME not in files:
            continue
        path = os.path.realpath(os.path.join(root, LOCK_NAME))
        if path in _held:
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirectoryLocked(
                f"{what} {directory!r} is in use by {_holder(path)}, which holds {path}; wait for it to end or "
                f"choose another {what}") from None
        except OSError:  # a file system without locks: nothing to learn
            pass
        finally:
            os.close(fd)
