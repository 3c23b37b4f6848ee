"""manifest.json: the one file a device reads to trust and use an export.

It is written last and atomically, only after every file passed parity, so a manifest on disk
always describes a complete, verified export. The runtime (edge_client/runtime.py) reads the same
format; FORMAT_VERSION changes whenever a field it relies on changes meaning.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(directory: str | Path, manifest: dict[str, Any]) -> Path:
    """Write via a temp file + rename so a reader never sees a half-written manifest."""
    d = Path(directory)
    target = d / MANIFEST_FILE
    fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{MANIFEST_FILE}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"format_version": FORMAT_VERSION, **manifest}, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the manifest from a service user
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
