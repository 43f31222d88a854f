"""Durable directory entries: what a rename or a new file needs to survive a crash."""

from __future__ import annotations

import os


def fsync_dir(path: str) -> None:
    """Make a rename or a new entry in directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
