"""Which runtime answers requests now, swapped atomically, and how each version has been answering.

A request takes the `Active` pair (runtime, version) once, at its start, and uses only that for its
whole life, so a swap never shows a request half of one version and half of another: requests that
started before the swap finish on the old runtime, the next ones start on the new one. The swap
itself is one reference assignment under a lock; the new runtime is loaded, checked and calibrated
before it (edge_client/follow.py), so no request waits for loading.

Per version it keeps a window of the last requests' outcomes and latencies: the device's own health
check and the fleet's canary rule (aggregator/rollout.py) compare a new version's error rate and
p95 latency with the previous version's last window.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from edge_client.runtime import AdaptiveRuntime
from nefl.protocol.messages import VersionStats

WINDOW = 512  # requests per version kept for the latency percentiles


@dataclass(frozen=True)
class Active:
    runtime: AdaptiveRuntime
    version: int | None  # None: a plain --models directory, not a followed release


class VersionOutcomes:
    """Outcomes of one version: counts since it started serving, latencies of its last `size` requests."""

    def __init__(self, version: int, size: int = WINDOW) -> None:
        self.version = version
        self.requests = self.errors = 0
        self.latencies_ms: deque[float] = deque(maxlen=size)

    def add(self, ok: bool, seconds: float) -> None:
        self.requests += 1
        self.errors += not ok
        self.latencies_ms.append(seconds * 1000)

    def stats(self) -> VersionStats:
        ordered = sorted(self.latencies_ms)
        return VersionStats(version=self.version, requests=self.requests, errors=self.errors,
                            p50_ms=percentile(ordered, 0.50), p95_ms=percentile(ordered, 0.95))


def percentile(ordered: list[float], q: float) -> float | None:
    """Nearest-rank percentile of sorted values (None for none): no interpolation, so it is a latency seen."""
    if not ordered:
        return None
    return round(ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.999999) - 1))], 3)


class Serving:
    def __init__(self, active: Active | None = None, window: int = WINDOW) -> None:
        self._active = active
        self._window = window
        self._lock = threading.Lock()
        self._windows: dict[int, VersionOutcomes] = {}

    def current(self) -> Active | None:
        return self._active

    def observe(self, active: Active, ok: bool, seconds: float) -> None:
        """A request `active` answered (ok) or failed with a server error (not ok), taking `seconds`."""
        if active.version is None:
            return
        with self._lock:
            window = self._windows.get(active.version)
            if window is None:
                window = self._windows[active.version] = VersionOutcomes(active.version, self._window)
            window.add(ok, seconds)

    def swap(self, active: Active) -> float:
        """Serve `active` from the next request on; returns how long the swap held the lock (requests never
        wait for it to read the active pair; an answer being counted may). The windows kept are the new
        version's, fresh (a version swapped in again by a rollback starts over: its old numbers predate
        the trouble), and the replaced version's, which is the 'before' the new one is compared with."""
        with self._lock:
            started = time.perf_counter()
            old = self._active.version if self._active is not None else None
            self._active = active
            held = time.perf_counter() - started
            if active.version is not None:
                self._windows[active.version] = VersionOutcomes(active.version, self._window)
            for version in [v for v in self._windows if v not in (active.version, old)]:
                del self._windows[version]
        return held

    def stats(self, version: int | None) -> VersionStats | None:
        with self._lock:
            window = self._windows.get(version) if version is not None else None
            return window.stats() if window is not None else None
