"""Intra-op thread pools (torch's OpenMP, numpy's OpenBLAS) in processes that take a stream of updates.

An aggregator's work on one update is a few dozen operations of 10^5-10^7 elements each: torch splits every
one over all cores, and the pools' threads spin between operations. Measured under the fleet load test
(docs/scale.md, "Seventh pass"): an `aggregator worker` with the default pools spent 10.9 ms of CPU per MiB
of resnet20 updates, 6.0 of it in those threads, against 3.5 ms with one thread, and took 114 updates/s
against about 180; plain `serve` 17.9 against 7.3 ms. OpenBLAS alone spent 3.4 ms of CPU on a product that
takes 0.3 ms on one thread. Parallelism across updates comes from processes (`--workers N`), one a core;
work that is one large computation (evaluation, FLTrust's root training) gets every core back for its
duration (`all_cores`).
"""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def all_cores() -> Iterator[None]:
    """Torch's default pool for the block (a no-op where `one_per_process` was never called)."""
    if _default is None:
        yield
        return
    import torch

    torch.set_num_threads(_default)
    try:
        yield
    finally:
        torch.set_num_threads(1)
