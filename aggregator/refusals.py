"""How often the server answers a refused announce: a refusal costs a signature and a message, and anyone
can publish announces, so each (client, reason) is answered at most once per `every` seconds and all of
them together at most `cap` times per `every` seconds."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

REFUSAL_EVERY_S = 10.0
REFUSALS_CAP = 100  # per REFUSAL_EVERY_S, all clients together
REMEMBERED = 10_000  # (client, reason) pairs kept for the per-client limit (oldest out)


class RefusalLimit:
    def __init__(self, every: float = REFUSAL_EVERY_S, cap: int = REFUSALS_CAP, remembered: int = REMEMBERED,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.every, self.cap, self.remembered, self.clock = every, cap, remembered, clock
        self._last: OrderedDict[tuple[str, str], float] = OrderedDict()  # oldest answer first
        self._window, self._count = -float("inf"), 0
        self.held = 0  # refusals not sent because of a limit

    def allow(self, client: str, reason: str) -> bool:
        now = self.clock()
        while self._last and now - next(iter(self._last.values())) >= self.every:
            self._last.popitem(last=False)
        if now - self._window >= self.every:
            self._window, self._count = now, 0
        if (client, reason) in self._last or self._count >= self.cap:
            self.held += 1
            return False
        self._count += 1
        self._last[(client, reason)] = now
        while len(self._last) > self.remembered:
            self._last.popitem(last=False)
        return True
