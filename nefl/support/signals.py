"""SIGTERM, a service manager's stop, ends a command the way Ctrl-C does: one log line, exit code 0.

Every long-running command (join, serve, the inference server) installs the same handler, which
raises `Stop` in the main thread wherever it is, so the command's own `finally` blocks clean up.
"""

from __future__ import annotations

import signal
import subprocess
from types import FrameType


class Stop(Exception):
    """SIGTERM arrived (its text is the signal's name)."""


def _raise(signum: int, frame: FrameType | None) -> None:
    raise Stop(signal.Signals(signum).name)


def stop_on_sigterm() -> None:
    signal.signal(signal.SIGTERM, _raise)


def stop_reason(e: BaseException) -> str:
    """What the "stopping (...)" line says: the signal's name, or Ctrl-C (a KeyboardInterrupt has no text)."""
    return str(e) or "Ctrl-C"


def stop_children(procs: list[subprocess.Popen], timeout_s: float = 10.0) -> None:
    """SIGTERM to each child still running, SIGKILL to one that outlives `timeout_s`: a command that started
    processes of its own (serve's workers, loadtest's shards) takes them down with it, however it ends."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
