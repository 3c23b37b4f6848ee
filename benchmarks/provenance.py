"""Where a benchmark's numbers came from (CPU, commit, load), written beside them in docs/ by every
benchmark that publishes results, so the two reports describe a machine the same way."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    return model or platform.processor()


def commit_label() -> str:
    """The short HEAD commit, flagged when tracked files differ from it."""
    git = ["git", "-C", str(ROOT)]
    sha = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout
    return sha + (" (with uncommitted changes in the working tree)" if dirty.strip() else "")


def load_average() -> str:
    load = os.getloadavg()
    return f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1 / 5 / 15 min)"


def write_section(doc: Path, start: str, end: str, lines: list[str]) -> None:
    """Replace what lies between the `start` and `end` markers of `doc` with `lines` (markers included)."""
    text = doc.read_text()
    head, rest = text.split(start, 1)
    doc.write_text(head + "\n".join([start, *lines, end]) + rest.split(end, 1)[1])
    print(f"wrote {doc}")
