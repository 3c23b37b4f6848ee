"""How busy the machine is apart from this process: the device's load probe (edge_client/probe.py) and the server's
large jobs (nefl/support/threads.py) both read it as the CPU time spent between two readings, less their own."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MIN_WINDOW_S = 0.25  # CPU shares over a shorter interval are noise


@dataclass(frozen=True)
class CpuReading:
    """Cumulative CPU seconds at one moment, summed over the watched cores."""

    busy: float  # every core's busy time since boot
    total: float  # busy and idle
    own: float | None  # the watched process's (or process tree's) own time; None where it cannot be read


@dataclass(frozen=True)
class CpuWindow:
    """What the watched cores did between two readings, as shares of the whole window."""

    percent: float  # 0..100: busy
    own_cores: float | None  # cores' worth of the watched process's own work
    external_percent: float | None  # 0..100: busy with anything else


def _busy_total(times: Any) -> tuple[float, float]:
    t = times._asdict()
    idle = t.get("idle", 0.0) + t.get("iowait", 0.0)
    total = sum(v for k, v in t.items() if k not in ("guest", "guest_nice"))  # guest is inside user
    return total - idle, total


def own_cpu_seconds(process: Any, *, tree: bool) -> float | None:
    """CPU seconds of `process` (and its descendants where `tree`), living or reaped: a child's time moves into the
    parent's children_* fields when it is waited for, so nothing is counted twice or lost."""
    if process is None:
        return None
    try:
        procs = [process, *process.children(recursive=True)] if tree else [process]
    except Exception:
        return None
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
        except Exception:  # a child that exited between listing and reading
            continue
        total += t.user + t.system + getattr(t, "children_user", 0.0) + getattr(t, "children_system", 0.0)
    return total


def read_cpu(ps: Any, process: Any, *, cores: Sequence[int] | None = None, tree: bool = True) -> CpuReading:
    """One reading through the psutil module `ps`: the whole machine, or only `cores` (per-CPU times)."""
    if cores is None:
        busy, total = _busy_total(ps.cpu_times())
    else:
        per_cpu = ps.cpu_times(percpu=True)
        pairs = [_busy_total(per_cpu[c]) for c in cores if c < len(per_cpu)]
        busy, total = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
    return CpuReading(busy, total, own_cpu_seconds(process, tree=tree))


def window(before: CpuReading, after: CpuReading, cores: int) -> CpuWindow | None:
    """The shares between two readings of `cores` cores; None where the window is shorter than MIN_WINDOW_S."""
    d_busy, d_total = after.busy - before.busy, after.total - before.total
    if d_total < MIN_WINDOW_S * cores:
        return None
    percent = min(100.0, max(0.0, 100.0 * d_busy / d_total))
    if before.own is None or after.own is None:
        return CpuWindow(percent, None, None)
    own_share = min(1.0, max(0.0, after.own - before.own) / d_total)  # d_total sums every core's time
    return CpuWindow(percent, own_share * cores, max(0.0, percent - 100.0 * own_share))
