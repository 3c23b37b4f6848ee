"""What slows a training step down now, and what real rounds taught: the prediction half of the
cost model (edge_client/costmodel.py measures; this scales its measurements to the moment).

`predict_seconds` turns a calibrated step time into a round's time under the current load:
    idle_step * ceil(samples / batch) * epochs * slowdown(snapshot) / speed
(edge_client/slowdown.py). A calibration measured on a busy device is divided by the slowdown during
it, so the table holds idle-device step times and the load is not counted twice.

`RunningCalibration` closes the loop: after every round the device divides the seconds per step
it measured by the slowdown the round's load explains; that idle-device step time replaces the
trained submodel's calibration (a running average). A submodel not trained yet takes its calibration
times the measured-to-calibrated ratio of the trained submodel nearest to it in MACs (calibration
errors depend on size: a busy moment, caches, per-step overhead), and never less than a smaller
submodel or more than a larger one was measured to take. A calibration that is wrong for whatever
reason (data loading, a busy moment, another clock) is thus corrected from the next round on instead
of persisting.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from edge_client.probe import HOT_LIMIT_C, DeviceSnapshot
from edge_client.slowdown import others_demand, saturated, slowdown

if TYPE_CHECKING:
    from edge_client.costmodel import CostTable, SubmodelCost

CORRECTION_ALPHA = 0.5  # weight of the newest round in a submodel's running step time
LOAD_MEMORY_S = 60.0  # how long the load seen during a round still counts as expected in the next


@dataclass
class RunningCalibration:
    """What real rounds taught about this device's step times, on top of the calibration.

    A round's measured seconds per step, divided by the slowdown the load during that round explains,
    is the idle-device step time of the submodel it trained: it replaces that submodel's calibration
    (a running average); the submodels not trained yet are scaled by the nearest trained one's ratio
    to its calibration (`ratio`) and kept between the measured smaller and larger ones. `others_busy` is the load (others' demand, cores) of the latest round,
    kept as a floor for predictions within `memory_s` of it while the machine stays saturated (then
    others' CPU use cannot tell how much they want): load that comes with this device's own rounds
    (a co-located device training in the same rounds) is then expected, and what the device
    announces right after a round and when idle agree, so it does not flip-flop between them. A
    snapshot with idle CPU shows others' demand exactly, and past `memory_s` an idle device trusts
    what it measures now: a floor that outlived its load could keep it announcing "skip" for ever,
    and then it would never train to learn better."""

    alpha: float = CORRECTION_ALPHA
    others_busy: float = 0.0
    measured: dict[int, float] = field(default_factory=dict)  # submodel -> idle-device seconds per step
    calibrated: dict[int, SubmodelCost] = field(default_factory=dict)  # the trained submodels' calibrations
    memory_s: float = LOAD_MEMORY_S
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    observed_at: float = -math.inf

    def others_floor(self, snapshot: DeviceSnapshot) -> float:
        recent = self.clock() - self.observed_at < self.memory_s
        return self.others_busy if recent and saturated(snapshot) else 0.0

    def ratio(self, cost: SubmodelCost) -> float:
        """Measured over calibrated idle step time of the trained submodel nearest to `cost` in MACs
        (1 before any round): how wrong the calibration is for submodels of about this size."""
        if not self.calibrated:
            return 1.0
        near = min(self.calibrated.values(), key=lambda c: (abs(math.log(max(c.macs, 1) / max(cost.macs, 1))), -c.macs))
        assert near.step_seconds is not None  # observe() keeps calibrated submodels only
        return self.measured[near.index] / near.step_seconds

    def idle_step(self, cost: SubmodelCost) -> float | None:
        """Seconds per step on the idle device: measured in rounds if trained, else the calibration times
        the nearest trained submodel's ratio, no faster than a measured smaller submodel and no slower than
        a measured larger one."""
        if cost.index in self.measured:
            return self.measured[cost.index]
        if cost.step_seconds is None:
            return None
        floor = max((self.measured[c.index] for c in self.calibrated.values() if c.macs <= cost.macs), default=0.0)
        ceiling = min((self.measured[c.index] for c in self.calibrated.values() if c.macs >= cost.macs), default=math.inf)
        return min(max(cost.step_seconds * self.ratio(cost), floor), ceiling)

    def step_seconds(self, cost: SubmodelCost, table: CostTable, snapshot: DeviceSnapshot,
                     hot_limit_c: float = HOT_LIMIT_C) -> float | None:
        """Predicted seconds of one step of `cost`'s submodel now; None before calibration."""
        idle = self.idle_step(cost)
        if idle is None:
            return None
        return idle * slowdown(snapshot, table.threads, table.device, hot_limit_c, self.others_floor(snapshot))

    def observe(self, cost: SubmodelCost, table: CostTable, step_seconds: float, during: DeviceSnapshot,
                hot_limit_c: float = HOT_LIMIT_C) -> float | None:
        """Fold in a round's measured seconds per step (`during`: a snapshot whose interval is the
        round's training); returns measured / calibrated for that load, None before calibration."""
        if cost.step_seconds is None or step_seconds <= 0:
            return None
        self.others_busy = others_demand(during, table.threads, working=True) if table.device == "cpu" else 0.0
        self.observed_at = self.clock()
        idle = step_seconds / slowdown(during, table.threads, table.device, hot_limit_c, working=True)
        self.measured[cost.index] = _average(self.measured.get(cost.index), idle, self.alpha)
        self.calibrated[cost.index] = cost
        return idle / cost.step_seconds


def _average(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else old + alpha * (new - old)


def predict_seconds(
    cost: SubmodelCost, table: CostTable, snapshot: DeviceSnapshot, num_samples: int, epochs: int,
    speed: float = 1.0, hot_limit_c: float = HOT_LIMIT_C, running: RunningCalibration | None = None,
) -> float | None:
    """Local-training time of one round; None before calibration (no step time to scale)."""
    step = (running or RunningCalibration()).step_seconds(cost, table, snapshot, hot_limit_c)
    if step is None:
        return None
    return step * math.ceil(num_samples / table.batch_size) * epochs / speed
