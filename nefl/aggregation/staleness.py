"""Buffered asynchronous NeFedAvg's settings and its staleness function (FedBuff, Nguyen et al. 2022, for nested
submodels). Torch-free, like the aggregation config, so command lines show the defaults without loading torch.

A device trains on the newest version when it starts a task and uploads its delta with that base version; the
server keeps a buffer of updates and commits a new version when the buffer holds `buffer_size` of them (or its
oldest has waited `commit_after_s`). An update's staleness tau is (current version - its base version); it counts
for s(tau) = (1 + tau) ** -exponent of its weight, per element of its submodel (nefl/aggregation/version_buffer.py),
and is refused above `max_staleness`. `normalise` says what an element's staleness-weighted sum is divided by: the
staleness-weighted coverage (s tilts the mix of the updates covering the element) or the plain coverage (FedBuff's
1/K: a buffer of stale updates also moves the model by less).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

# why an update is not taken into the buffer
StaleReason = Literal["stale", "future-version"]
# per element, sum_i w_i s_i delta_i over the covering updates is divided by sum_i w_i s_i ("staleness") or sum_i w_i
# ("coverage"); the two agree when every update is fresh
Normalise = Literal["staleness", "coverage"]


@dataclass(frozen=True)
class StalenessConfig:
    """Buffered mode's buffer, staleness function and server step."""

    buffer_size: int = 5  # K: updates per committed version
    # s(tau) = (1 + tau) ** -exponent; 0.5 is FedBuff's 1/sqrt(1 + tau): a stale update still moves the model,
    # by less the older its base; 0 weighs every update alike (synchronous NeFedAvg's weights)
    exponent: float = 0.5
    max_staleness: int = 16  # versions behind the current one an update may be; older ones are refused ("stale")
    server_lr: float = 1.0  # the step: new = old + server_lr x the staleness-weighted NeFedAvg of the buffer
    commit_after_s: float | None = None  # commit a non-empty buffer once its oldest update waited this long
    normalise: Normalise = "staleness"  # what an element's staleness-weighted sum is divided by (see Normalise)

    def __post_init__(self) -> None:
        if self.buffer_size < 1:
            raise ValueError(f"the buffer size K must be >= 1, got {self.buffer_size}")
        if not (math.isfinite(self.exponent) and self.exponent >= 0):
            raise ValueError(f"the staleness exponent must be a finite number >= 0, got {self.exponent}")
        if self.max_staleness < 0:
            raise ValueError(f"the staleness bound must be >= 0, got {self.max_staleness}")
        if not (math.isfinite(self.server_lr) and self.server_lr > 0):
            raise ValueError(f"the server learning rate must be a finite number > 0, got {self.server_lr}")
        if self.commit_after_s is not None and not self.commit_after_s > 0:
            raise ValueError(f"the commit time bound must be > 0 s, got {self.commit_after_s}")
        if self.normalise not in ("staleness", "coverage"):
            raise ValueError(f"normalise is 'staleness' or 'coverage', got {self.normalise!r}")

    def weight(self, tau: int) -> float:
        """s(tau): what an update `tau` versions behind counts for, relative to a fresh one."""
        return (1.0 + tau) ** -self.exponent

    def refusal(self, current: int, base: int) -> StaleReason | None:
        """Why an update trained from version `base` is not taken at version `current`; None: it is."""
        if base > current:
            return "future-version"
        if current - base > self.max_staleness:
            return "stale"
        return None
