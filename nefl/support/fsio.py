"""Durable file writes: the one helper every writer of state on disk uses.

A reader (a resumed aggregator, a device loading a manifest, a dashboard polling status.json) must
never see a half-written file, and after a power cut the file must be either the old or the new
version. That takes three steps that are easy to forget one of: write a temp file in the same
directory, fsync it, rename it over the target, then fsync the directory so the rename itself is
on disk.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def fsync_dir(directory: str | Path) -> None:
    """Persist renames and creations inside `directory` (a no-op where directories can't be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | Path) -> None:
    """Flush a file's bytes to disk: a rename alone makes only the name durable, not the data."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def atomic_write(path: str | Path, write: Callable[[str], None], mode: int = 0o644) -> Path:
    """Call `write(tmp_path)` to fill a temp file, then make it `path` atomically and durably."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, mode)  # mkstemp's 0600 would hide the file from a service user
        fsync_file(tmp)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)
    return target


def atomic_write_bytes(path: str | Path, data: bytes, mode: int = 0o644) -> Path:
    return atomic_write(path, lambda tmp: Path(tmp).write_bytes(data), mode)


def atomic_write_text(path: str | Path, text: str, mode: int = 0o644) -> Path:
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text), mode)
