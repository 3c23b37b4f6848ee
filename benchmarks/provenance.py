"""Where a benchmark's numbers came from (CPU, commit, load), written beside them in docs/ by every
benchmark that publishes results, so the two reports describe a machine the same way."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import time
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


def provenance(started: float, note: str | None) -> dict:
    """The machine, commit and load of a run that started at `started` (time.time()), as results JSON keeps them."""
    return {"date": time.strftime("%Y-%m-%d", time.gmtime(started)), "cpu": cpu_name(), "cores": os.cpu_count(),
            "commit": commit_label(), "load": load_average(), "note": note}


def measured_by(command: str, p: dict) -> str:
    """The first line of a published section: the command, machine, commit and load of `provenance()`'s dict `p`."""
    return (f"Measured by `{command}` on {p['date']}: {p['cpu']}, {p['cores']} cores, commit {p['commit']}, "
            f"load {p['load']} at the end" + (f" ({p['note']})." if p["note"] else "."))


def replace_section(out: Path, section: str, lines: list[str]) -> None:
    """Replace a benchmark's `## ` section of a report where it stands (or append it), leaving the others alone."""
    text = out.read_text() if out.exists() else "# System benchmarks\n"
    parts = re.split(r"(?m)^(?=## )", text)
    new = "\n".join(lines).rstrip() + "\n\n"
    at = next((i for i, p in enumerate(parts) if p.startswith(section)), None)
    parts = [*parts, new] if at is None else [*parts[:at], new, *parts[at + 1:]]
    out.write_text("".join(p if p.endswith("\n\n") or p is parts[-1] else p.rstrip() + "\n\n" for p in parts).rstrip() + "\n")


def write_section(doc: Path, start: str, end: str, lines: list[str]) -> None:
    """Replace what lies between the `start` and `end` markers of `doc` with `lines` (markers included)."""
    text = doc.read_text()
    head, rest = text.split(start, 1)
    doc.write_text(head + "\n".join([start, *lines, end]) + rest.split(end, 1)[1])
    print(f"wrote {doc}")
