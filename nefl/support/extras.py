"""What the small inference install lacks, and the one-line error that names the fix.

A device installs plain `nefl-edge` (onnxruntime, numpy, ...) so that inference never pays for
torch; training, the federation server and export need `nefl-edge[full]`. Running one of those on
the small install must say so in one line instead of ending in an ImportError traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

FULL_INSTALL = "pip install 'nefl-edge[full]'"
# top-level modules that only the `full` extra installs
FULL_ONLY_MODULES = frozenset({"torch", "torchvision", "safetensors", "amqtt", "onnx", "onnxscript"})


def missing_full_module(error: ModuleNotFoundError) -> str | None:
    """The full-install module whose absence raised `error`; None when something else is missing (a real bug)."""
    root = (error.name or "").partition(".")[0]
    return root if root in FULL_ONLY_MODULES else None


@contextmanager
def full_install_required(command: str) -> Iterator[None]:
    """Imports in this block need the full install: without it, print the fix and exit with status 2."""
    try:
        yield
    except ModuleNotFoundError as e:
        module = missing_full_module(e)
        if module is None:
            raise
        print(f"error: {command} needs the full install ({module} is not installed): {FULL_INSTALL}", file=sys.stderr)
        raise SystemExit(2) from None
