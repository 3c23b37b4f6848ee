"""Updates that went missing on the way: a device says it sent its update (a signed notice on
`sent/{client}`, which reaches the coordinator itself, never a shared subscription), and when no update
or worker receipt for it follows within a bound, the coordinator counts it `lost_to_unknown` and asks
the device, once, to publish it again on `resend/{client}`, which only the coordinator reads. So a
silent member of the workers' shared subscription, a full inbox or a lost message costs one resend, not
the round's deadline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Resends:
    after_s: float = 5.0  # a notice without its update (or receipt) for this long: lost on the way
    noticed: dict[str, float] = field(default_factory=dict)  # client -> when its notice came, this round
    asked: list[str] = field(default_factory=list)  # clients asked to resend this round

    def open_round(self) -> None:
        self.noticed, self.asked = {}, []

    def notice(self, client: str, now: float | None = None) -> None:
        self.noticed.setdefault(client, time.monotonic() if now is None else now)

    def due(self, received: set[str], now: float | None = None) -> list[str]:
        """Clients whose update is overdue and who were not asked yet this round (now they are)."""
        now = time.monotonic() if now is None else now
        late = sorted(c for c, t in self.noticed.items()
                      if c not in received and c not in self.asked and now - t >= self.after_s)
        self.asked += late
        return late

    def facts(self) -> dict[str, Any]:
        return {"lost_to_unknown": len(self.asked), **({"resend_requested": list(self.asked)} if self.asked else {})}
