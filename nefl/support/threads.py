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


SAMPLE_S = 0.2  # how long `busy_elsewhere` watches the CPUs before a large job


def busy_elsewhere(seconds: float = SAMPLE_S) -> float:
    """Cores' worth of CPU time spent outside this process, on the cores it may run on, over the next `seconds`: a
    sample taken now, unlike the load average, which lags by a minute and counts this process's own last large job."""
    import psutil

    me = psutil.Process()
    mine = me.cpu_affinity() or range(psutil.cpu_count())
    own, wall = sum(me.cpu_times()[:2]), time.monotonic()
    percent = psutil.cpu_percent(interval=seconds, percpu=True)
    share = sum(percent[c] for c in mine if c < len(percent)) / 100
    own = (sum(me.cpu_times()[:2]) - own) / max(time.monotonic() - wall, 1e-9)
    return max(0.0, share - own)


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
