"""Durable directory entries: what a rename or a new file needs to survive a crash, and a directory
replaced so that a process killed at any moment leaves the old one or the new one in place.

:func:`replace_dir` puts a complete directory ``X.tmp`` at ``X``. When ``X`` exists it is first renamed
to ``X.replaced.tmp``, then ``X.tmp`` is renamed to ``X`` and the parent fsynced, then the old one is
deleted. A process killed between the two renames leaves no ``X``, only ``X.replaced.tmp`` (the old one)
and ``X.tmp`` (the new one, complete): :func:`recover_replaced` renames one of them back, and whatever
scans for ``X`` or writes it again calls it first (a ``*.tmp`` is otherwise an unfinished leftover).
"""

from __future__ import annotations

import os
import shutil

REPLACED_SUFFIX = ".replaced.tmp"


def fsync_dir(path: str) -> None:
    """Make a rename or a new entry in directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """fsync every file and directory under ``path`` (and ``path``): written by code that does not fsync
    (``save_pretrained``), before the directory is renamed into place."""
    for directory, _, files in os.walk(path, topdown=False):
        for name in files:
            file_path = os.path.join(directory, name)
            if os.path.islink(file_path):
                continue
            fd = os.open(file_path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(directory)


def _parent(path: str) -> str:
    return os.path.dirname(os.path.abspath(path))


def replace_dir(tmp: str, final: str) -> None:
    """Rename the complete directory ``tmp`` to ``final`` (see the module docstring); an existing ``final``
    is moved aside to ``final + REPLACED_SUFFIX`` first and deleted once the new one is in place and its
    rename is durable. A failed second rename puts the old one back and raises."""
    parent = _parent(final)
    if not os.path.isdir(final):
        os.rename(tmp, final)
        fsync_dir(parent)
        return
    replaced = final + REPLACED_SUFFIX
    if os.path.exists(replaced):  # a finished replacement's leftover (``final`` exists): the older one
        shutil.rmtree(replaced)
    os.rename(final, replaced)
    try:
        os.rename(tmp, final)
    except BaseException as exc:
        # another process's recover_replaced may have renamed our complete tmp into place already
        done = os.path.isdir(final) and not os.path.exists(tmp)
        if not done and not os.path.exists(final):
            try:
                os.rename(replaced, final)
            except OSError:
                pass  # recover_replaced mends it at the next scan
        fsync_dir(parent)
        if not (done and isinstance(exc, FileNotFoundError)):
            raise
    fsync_dir(parent)
    shutil.rmtree(replaced, ignore_errors=True)


def recover_replaced(final: str, complete) -> bool:
    """Mend a :func:`replace_dir` killed between its two renames (no ``final``, a ``final + REPLACED_SUFFIX``):
    ``final + ".tmp"`` is renamed to ``final`` when ``complete(path)`` says it is complete (the new one), else
    the old one is renamed back; the parent is fsynced. Returns whether it renamed anything. Safe with several
    processes at once: a rename onto an existing directory fails, the first one stands and the others return
    False."""
    replaced, tmp = final + REPLACED_SUFFIX, final + ".tmp"
    if os.path.isdir(final) or not os.path.isdir(replaced):
        return False
    source = tmp if os.path.isdir(tmp) and complete(tmp) else replaced
    try:
        os.rename(source, final)
    except OSError:
        if not os.path.isdir(final):
            raise
        return False  # another process recovered it first
    fsync_dir(_parent(final))
    return True
