"""Intra-op thread pools (torch's OpenMP, numpy's OpenBLAS) in processes that take a stream of updates.

An aggregator's work on one update is a few dozen operations of 10^5-10^7 elements each: torch splits every
one over all cores, and the pools' threads spin between operations: with the default pools a worker spends
several times the CPU per MiB and takes fewer updates a second than with one thread (docs/scale.md, "Why the
code is as it is"). Parallelism across updates comes from processes (`--workers N`), one a core;
work that is one large computation (evaluation, FLTrust's root training) gets the cores back for its duration
(`spare_cores`), but only those no other process keeps busy: OpenMP's threads wait for each other at every operation,
so on a core shared with a busy process the whole pool waits for its slowest thread (docs/scale.md, "Large jobs on a
busy machine").
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from nefl.support.cpu import MIN_WINDOW_S, CpuReading, read_cpu, window

_default: int | None = None  # torch's thread count before `one_per_process`


def one_per_process() -> None:
    """Run torch's and the BLAS's operations on the calling thread only, for the rest of the process."""
    import torch  # here, not at the top: the command lines import this module for their --help too
    from threadpoolctl import threadpool_limits

    global _default
    if _default is None:
        _default = torch.get_num_threads()
    torch.set_num_threads(1)
    threadpool_limits(1, user_api="blas")


MAX_WINDOW_S = 5.0  # a window since the previous large job older than this says more about the past than now
_last: tuple[float, CpuReading] | None = None  # (monotonic time, reading) where the previous window ended


def busy_elsewhere() -> float:
    """Cores' worth of CPU time spent outside this process on the cores it may run on: since the previous large job
    where that ended under MAX_WINDOW_S ago (back-to-back jobs wait for nothing), else over the next MIN_WINDOW_S.
    Unlike the load average, which lags by a minute, this counts none of this process's own work."""
    import psutil

    global _last
    me = psutil.Process()
    cores = (me.cpu_affinity() if hasattr(me, "cpu_affinity") else None) or list(range(psutil.cpu_count()))  # macOS: none
    now, at = read_cpu(psutil, me, cores=cores, tree=False), time.monotonic()
    start = _last if _last is not None and at - _last[0] <= MAX_WINDOW_S else (at, now)
    shares = window(start[1], now, len(cores))
    while shares is None and at - start[0] < 4 * MIN_WINDOW_S:  # per-core times tick in 10 ms: top up till it counts
        time.sleep(max(0.01, MIN_WINDOW_S - (at - start[0])))
        now, at = read_cpu(psutil, me, cores=cores, tree=False), time.monotonic()
        shares = window(start[1], now, len(cores))
    _last = (at, now)
    if shares is None:  # the per-core times never moved (a sandbox that hides them): every core, as before
        return 0.0
    busy = shares.percent if shares.external_percent is None else shares.external_percent
    return busy / 100 * len(cores)


def free_cores(cores: int, busy: float) -> int:
    """Threads for a large job on `cores` cores while other processes keep `busy` cores' worth busy: the cores they
    leave free, at least 1, rounded down unless within a quarter of the next. A thread too few costs at most the
    job's idle time doubled on 2 cores; a thread too many makes it several times slower."""
    return max(1, min(cores, int(cores - busy + 0.25)))


@contextlib.contextmanager
def spare_cores() -> Iterator[None]:
    """Torch's default pool for the block, less the cores other processes keep busy (`free_cores`); a no-op where
    `one_per_process` was never called."""
    if _default is None:
        yield
        return
    import torch

    torch.set_num_threads(free_cores(_default, busy_elsewhere()))
    try:
        yield
    finally:
        torch.set_num_threads(1)
