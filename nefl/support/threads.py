"""Intra-op thread pools (torch's OpenMP, numpy's OpenBLAS) in processes that take a stream of updates.

An aggregator's work on one update is a few dozen operations of 10^5-10^7 elements each: torch splits every
one over all cores, and the pools' threads spin between operations: with the default pools a worker spends
several times the CPU per MiB and takes fewer updates a second than with one thread (docs/scale.md, "Why the
code is as it is"). Parallelism across updates comes from processes (`--workers N`), one a core;
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
