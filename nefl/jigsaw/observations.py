"""What one client has seen each module do: its accuracy when used, how long ago, how often.

The policy reads these beside a module's metadata, so modules of the same kind from different sources differ
in what the client has experienced of them, not only in their source id. The log is the client's own: it
records its own validation accuracy in the rounds it used a module, never leaves the device and never reads
another client's state.

Accuracy enters relative to the client's typical accuracy (the same moving average over all its rounds): clients'
accuracies differ widely with their data, and "this module did better than usual" means the same for all.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

OBS_FEATURES = 4  # recent accuracy when used (relative to the client's typical one), ever used, use count, age
HORIZON = 50  # rounds after which "long ago" and "often" saturate


@dataclass
class ModuleRecord:
    accuracy: float  # moving average of the client's validation accuracy in rounds that used the module
    uses: int
    last_used: int  # the round it was last part of the client's chain


class ObservationLog:
    """Per module key, the client's own record; `decay` weighs the past in the accuracy average."""

    def __init__(self, decay: float = 0.5) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.records: dict[str, ModuleRecord] = {}
        self.typical: float | None = None  # moving average of every accuracy recorded

    def record(self, keys: Iterable[str], accuracy: float, round_index: int) -> None:
        """The chain used `keys` in `round_index` and scored `accuracy` (a module used twice counts once)."""
        self.typical = accuracy if self.typical is None else self.decay * self.typical + (1 - self.decay) * accuracy
        for key in set(keys):
            rec = self.records.get(key)
            if rec is None:
                self.records[key] = ModuleRecord(accuracy, 1, round_index)
            else:
                rec.accuracy = self.decay * rec.accuracy + (1 - self.decay) * accuracy
                rec.uses += 1
                rec.last_used = round_index

    def features(self, key: str, round_index: int) -> list[float]:
        """[accuracy when used minus the typical one (in [-1, 1]), used at all, uses, age (each in [0, 1])];
        a module never used: [0, 0, 0, 1]."""
        rec = self.records.get(key)
        if rec is None or self.typical is None:
            return [0.0, 0.0, 0.0, 1.0]
        saturate = math.log1p(HORIZON)
        age = max(0, round_index - rec.last_used)
        return [rec.accuracy - self.typical, 1.0, min(1.0, math.log1p(rec.uses) / saturate),
                min(1.0, math.log1p(age) / saturate)]
