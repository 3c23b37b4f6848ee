"""An emulated heterogeneous fleet for `aggregator simulate --mode buffered|sync`: devices whose training steps take
1x to `slowest`x as long as the fastest one's, whose load varies from task to task, and which vanish (losing the task
they train) and come back later (a constant hazard per simulated second, drawn once per device for the whole run, so both modes
see the same availability whatever tasks they give). Time is simulated (the loops in aggregator/fleet_sim.py pop events off a queue), so a fleet
with a 10x spread of speeds is compared in minutes on 2 CPU cores. Torch-free: pure arithmetic on seeded draws.

A device's task budget is `budget` x the time the fastest device needs for the full model on a median shard; each device trains, at
most, the largest submodel whose task fits its budget at its speed (at least the smallest), as a device does with
its own time budget per task.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
import statistics
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

FleetMode = Literal["buffered", "sync"]


@dataclass(frozen=True)
class CoverageConfig:
    """Buffered mode's coverage rule, there being no rounds (`Coverage`)."""

    # each task trains the submodel within the device's bound given the fewest of the last N tasks (steer_task;
    # N = 40, two per device of a 20-device fleet); None: the lag rule (assign_task)
    steer_window: int | None = 40
    lag: int = 4  # the lag rule's: a submodel no task was given for this many versions goes to the next able device

    def __post_init__(self) -> None:
        if self.lag < 1 or (self.steer_window is not None and self.steer_window < 1):
            raise ValueError(f"need lag >= 1 and steer_window >= 1 (or None), got {self.lag}, {self.steer_window}")


@dataclass(frozen=True)
class FleetConfig:
    """The emulated devices and how the server drives them."""

    mode: FleetMode = "buffered"
    slowest: float = 10.0  # step-time multipliers spread geometrically from 1x to this over the devices
    step_s: float = 1.0  # simulated seconds of one full-model step on the fastest device
    budget: float = 3.0  # a task's time budget, in full-model tasks of the fastest device
    load_jitter: float = 0.5  # a task's steps take 1 to 1 + this x as long (the device's other load)
    # the chance that an online device vanishes within any simulated minute, training or not (a constant hazard); a
    # task it was training when it vanished is lost
    vanish: float = 0.05
    away_s: float = 200.0  # mean simulated seconds a vanished device stays away
    concurrency: int = 5  # sync: participants per round
    # buffered: devices training at once; None: every online device, each starting its next task as its update is
    # sent (the device side, FedBuff's all-available regime), so fast devices contribute more often
    in_flight: int | None = None
    deadline: float = 1.5  # sync: a round closes at this x the task budget at the latest
    coverage: CoverageConfig = CoverageConfig()  # buffered: which submodel each task trains
    time_budget_s: float = 3000.0  # simulated seconds the run lasts
    eval_every_s: float = 150.0  # evaluate the newest version every this many simulated seconds

    def __post_init__(self) -> None:
        if not self.slowest >= 1 or not self.step_s > 0 or not self.budget > 0 or self.load_jitter < 0:
            raise ValueError("need slowest >= 1, step_s > 0, budget > 0 and load_jitter >= 0")
        if not 0 <= self.vanish < 1 or not self.away_s > 0:
            raise ValueError(f"need 0 <= vanish < 1 and away_s > 0, got {self.vanish}, {self.away_s}")
        if self.concurrency < 1 or (self.in_flight is not None and self.in_flight < 1) or not self.deadline >= 1:
            raise ValueError("need concurrency >= 1, in_flight >= 1 (or None) and deadline >= 1")
        if not self.time_budget_s > 0 or not self.eval_every_s > 0:
            raise ValueError("need a positive time budget and evaluation interval")


@dataclass(frozen=True)
class Task:
    """One device's task: what it trains, from which version, when it ends, and whether its update arrives."""

    device: int
    submodel: int
    base: int  # the version it trained from
    start: float
    end: float
    vanishes: bool


@dataclass
class Fleet:
    """The devices' speeds and availability (`away`: per device, the sorted (leaves, returns) spans it is away), and the
    seeded draws of every task's load."""

    cfg: FleetConfig
    costs: Sequence[float]  # per submodel: its training step's cost relative to the full model's
    steps: Sequence[int]  # per device: the training steps of one of its tasks (local epochs over its shard)
    rng: random.Random
    multipliers: list[float] = field(default_factory=list)
    away: list[list[tuple[float, float]]] = field(default_factory=list)

    @classmethod
    def build(cls, cfg: FleetConfig, costs: Sequence[float], steps: Sequence[int], seed: int) -> Fleet:
        """One device per entry of `steps`, device i's steps taking slowest ** (i / (devices - 1)) x the fastest's."""
        n = len(steps)
        mult = [cfg.slowest ** (i / max(1, n - 1)) for i in range(n)]
        return cls(cfg, costs, steps, random.Random(seed * 7919 + 17), mult,
                   [away_spans(cfg, random.Random(seed * 7919 + 31 * (d + 1))) for d in range(n)])

    def task_s(self, device: int, k: int) -> float:
        """Seconds submodel k's task takes device `device` without other load."""
        return self.steps[device] * self.cfg.step_s * self.multipliers[device] * self.costs[k]

    @property
    def task_budget_s(self) -> float:
        """Every device's budget per task: `budget` full-model tasks of the fastest device on the median shard."""
        return self.cfg.budget * statistics.median(self.steps) * self.cfg.step_s

    def bound(self, device: int) -> int:
        """The largest submodel whose task fits the device's budget at its speed (at least the smallest)."""
        fits = [k for k in range(len(self.costs)) if self.task_s(device, k) <= self.task_budget_s]
        return max(fits, default=0)

    def _span(self, device: int, now: float) -> tuple[float, float] | None:
        """The away span of `device` that `now` falls in; None: it is online."""
        spans = self.away[device]
        i = bisect.bisect_right(spans, (now, math.inf)) - 1
        return spans[i] if i >= 0 and spans[i][0] <= now < spans[i][1] else None

    def online(self, now: float) -> list[int]:
        return [d for d in range(len(self.away)) if self._span(d, now) is None]

    def next_return(self, now: float) -> float | None:
        """The first time after `now` an away device comes back; None: every device is online."""
        back = [span[1] for d in range(len(self.away)) if (span := self._span(d, now)) is not None]
        return min(back, default=None)

    def start(self, device: int, k: int, base: int, now: float) -> Task:
        """A task begun now: its length under a load drawn now; it is lost if the device leaves before its end."""
        load = 1.0 + self.rng.random() * self.cfg.load_jitter
        end = now + self.task_s(device, k) * load
        spans = self.away[device]
        i = bisect.bisect_right(spans, (now, math.inf))  # the first span it leaves for after now
        vanishes = i < len(spans) and spans[i][0] <= end
        return Task(device, k, base, now, end, vanishes)

    def pick(self, idle: Sequence[int], n: int) -> list[int]:
        """n of the idle online devices, uniformly (fewer when fewer are there), in index order."""
        return sorted(self.rng.sample(list(idle), min(n, len(idle))))


def away_spans(cfg: FleetConfig, rng: random.Random) -> list[tuple[float, float]]:
    """One device's away spans over the run: online for exponential times at the hazard `cfg.vanish` per minute, then
    away for exponential times of mean `away_s`."""
    if cfg.vanish == 0:
        return []
    rate = -math.log1p(-cfg.vanish) / 60.0
    spans: list[tuple[float, float]] = []
    t = rng.expovariate(rate)
    while t <= cfg.time_budget_s:
        back = t + rng.expovariate(1.0 / cfg.away_s)
        spans.append((t, back))
        t = back + rng.expovariate(rate)
    return spans


def assign_task(bound: int, given: list[int], version: int, lag: int) -> int:
    """The submodel a device of `bound` trains in buffered mode: its bound, unless a submodel within it was given to
    no task for `lag` versions (the largest such): slow devices keep the small submodels trained, fast ones the
    large, and the ones between catch a fast device now and then. `given[k]`: the version submodel k was last given
    at, updated here."""
    starved = [k for k in range(bound + 1) if version - given[k] >= lag]
    k = max(starved) if starved else bound
    given[k] = version
    return k


class Coverage:
    """Which submodel a buffered task trains, there being no rounds: steering by the last tasks given (`steer_task`),
    or the lag rule (`assign_task`) where the config has no window. Its state is checkpointed."""

    def __init__(self, num_submodels: int, cfg: CoverageConfig, version: int = 0,
                 state: Mapping[str, Any] | None = None) -> None:
        state = state or {}
        self.cfg = cfg
        recent = [int(k) for k in state.get("recent", []) if 0 <= int(k) < num_submodels]
        self.recent: deque[int] = deque(recent, maxlen=cfg.steer_window)
        given = state.get("given")
        self.given = [int(v) for v in given] if given is not None and len(given) == num_submodels \
            else [version] * num_submodels

    def pick(self, bound: int, version: int) -> int:
        """The submodel of a task starting now for a device of `bound` at model `version`; noted as given."""
        if self.cfg.steer_window is not None:
            return steer_task(bound, self.recent)
        return assign_task(bound, self.given, version, self.cfg.lag)

    def state_dict(self) -> dict[str, Any]:
        return {"recent": list(self.recent), "given": list(self.given)}


def steer_task(bound: int, recent: deque[int]) -> int:
    """The submodel a device of `bound` trains in buffered mode under steering: the one within its bound given the
    fewest of the `recent` tasks (the largest of those tied), appended to `recent` (a window: its maxlen). A fast
    device's surplus tasks thus go wherever coverage is thinnest, the small submodels the slow devices train too."""
    given = Counter(recent)
    k = min(range(bound + 1), key=lambda j: (given[j], -j))
    recent.append(k)
    return k


class EventQueue:
    """Simulated time: (time, payload) events popped in time order, ties in the order they were pushed."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Any]] = []
        self._n = 0

    def push(self, t: float, payload: Any) -> None:
        heapq.heappush(self._heap, (t, self._n, payload))
        self._n += 1

    def pop(self) -> tuple[float, Any]:
        t, _, payload = heapq.heappop(self._heap)
        return t, payload

    def __len__(self) -> int:
        return len(self._heap)
