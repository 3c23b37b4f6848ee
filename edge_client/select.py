"""Which submodel this device trains this round: the largest one its current state allows.

The rule: the largest submodel whose calibrated peak memory fits in the usable memory (available
memory minus a safety margin) AND whose predicted local-training time fits the round deadline,
capped by --max-submodel. Memory fit is a threshold on each submodel's own peak, so the choice is
monotone in available memory. An unknown reading (no memory figure, no calibrated step time) does
not block a submodel; the fits table shows it as unknown. Nothing fits: index None and a reason
naming the limit that binds, so the client skips the round and says why.

Per round (what `edge-client join` does):

    prober, table = Prober(), calibrate(layout, batch_size)                  # once
    budget = DeviceBudget.parse(memory_budget, cpu_budget)                    # emulation, optional
    sel = select_submodel(table, budget.apply(prober.snapshot()), num_samples, epochs,
                          deadline_s=..., max_submodel=..., speed=budget.cpu_budget)
    sel.index    # 0-based layout index to train (layout.module(sel.index)), or None: skip
    sel.reason   # one line to log and send with the update; sel.binding: memory|deadline|cap|none

Submodel numbers in reasons and `max_submodel` are 1-based, as printed in tables and on the CLI.
Emulation (`DeviceBudget`) makes a big machine act as a small one: memory_available is capped at
the memory budget and predicted times are divided by the CPU budget (`padding` tells a trainer
how long to sleep after work to really run at that speed).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from edge_client.load import RunningCalibration, predict_seconds
from edge_client.probe import HOT_LIMIT_C, DeviceSnapshot, format_bytes
from nefl.support.units import parse_size

if TYPE_CHECKING:
    from edge_client.costmodel import CostTable

DEFAULT_SAFETY_MARGIN = 0.2  # fraction of available memory left untouched (other processes, page cache)
HYSTERESIS = 0.15  # a submodel above the one held must fit the deadline with this fraction to spare


@dataclass(frozen=True)
class DeviceBudget:
    """Emulate a smaller device: at most `memory_budget` bytes available, `cpu_budget` of the speed."""

    memory_budget: int | None = None
    cpu_budget: float = 1.0

    @classmethod
    def parse(cls, memory_budget: str | None = None, cpu_budget: float | None = None) -> "DeviceBudget":
        if cpu_budget is not None and not 0 < cpu_budget <= 1:
            raise ValueError(f"--cpu-budget must be in (0, 1] (a fraction of this device's speed), got {cpu_budget}")
        return cls(None if memory_budget is None else parse_size(memory_budget),
                   1.0 if cpu_budget is None else cpu_budget)

    def apply(self, snapshot: DeviceSnapshot) -> DeviceSnapshot:
        if self.memory_budget is None:
            return snapshot
        avail = snapshot.memory_available
        return replace(snapshot, memory_available=self.memory_budget if avail is None else min(avail, self.memory_budget))

    def padding(self, work_seconds: float) -> float:
        """Seconds to sleep after `work_seconds` of work so it took work_seconds / cpu_budget."""
        return work_seconds * (1.0 / self.cpu_budget - 1.0)


@dataclass(frozen=True)
class Fit:
    index: int
    peak_bytes: int
    calibrated: bool
    memory_ok: bool | None  # None: available memory unknown
    seconds: float | None  # predicted local training of this round
    time_ok: bool | None  # None: no deadline, or no calibrated step time
    capped: bool
    allowed_s: float | None = None  # the time it had to fit: the deadline, less the margin to move up

    @property
    def fits(self) -> bool:
        return self.memory_ok is not False and self.time_ok is not False and not self.capped


@dataclass(frozen=True)
class Selection:
    index: int | None  # 0-based layout index, None: skip this round
    reason: str
    binding: str  # "none" (largest submodel chosen), "memory", "deadline", "cap"
    usable_memory: int | None
    fits: tuple[Fit, ...]

    @property
    def submodel(self) -> int | None:
        return None if self.index is None else self.index + 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"submodel": self.submodel}


def usable_memory(table: CostTable, snapshot: DeviceSnapshot, safety_margin: float) -> int | None:
    """Memory the training may take: GPU free memory for CUDA (NVML), else available RAM (CPU, Jetson)."""
    avail = snapshot.memory_available
    gpu = snapshot.gpus[0] if snapshot.gpus else None
    if table.device != "cpu" and gpu and gpu.memory_total is not None and gpu.memory_used is not None:
        avail = gpu.memory_total - gpu.memory_used
    return None if avail is None else int(avail * (1.0 - safety_margin))


def _why_not(fit: Fit, usable: int | None, deadline_s: float | None, max_submodel: int | None) -> tuple[str, str]:
    if fit.capped:
        return "cap", f"capped by --max-submodel {max_submodel}"
    if fit.memory_ok is False:
        return "memory", f"submodel {fit.index + 1} needs {format_bytes(fit.peak_bytes)}, {format_bytes(usable)} usable"
    limit = f"deadline {deadline_s:.3g} s" if fit.allowed_s == deadline_s else \
        f"{fit.allowed_s:.3g} s of the {deadline_s:.3g} s deadline to move up"
    return "deadline", f"submodel {fit.index + 1} would take {fit.seconds:.3g} s, {limit}"


def select_submodel(
    table: CostTable, snapshot: DeviceSnapshot, num_samples: int, epochs: int = 1,
    deadline_s: float | None = None, max_submodel: int | None = None,
    safety_margin: float = DEFAULT_SAFETY_MARGIN, speed: float = 1.0, hot_limit_c: float = HOT_LIMIT_C,
    hold: int | None = None, running: RunningCalibration | None = None,
) -> Selection:
    """The largest submodel that fits. `hold`: the 0-based submodel the device holds now (-1: none);
    one above it must fit the deadline with HYSTERESIS to spare, so a choice near the limit does not
    flip back and forth with small changes of load. `running`: what real rounds taught (costmodel)."""
    usable = usable_memory(table, snapshot, safety_margin)
    fits = []
    for c in table.costs:
        seconds = predict_seconds(c, table, snapshot, num_samples, epochs, speed, hot_limit_c, running)
        allowed = None if deadline_s is None else \
            deadline_s * (1 - HYSTERESIS) if hold is not None and c.index > hold else deadline_s
        fits.append(Fit(
            c.index, c.peak_bytes, c.measured_peak is not None,
            None if usable is None else c.peak_bytes <= usable,
            seconds,
            None if seconds is None or allowed is None else seconds <= allowed,
            max_submodel is not None and c.index + 1 > max_submodel,
            allowed,
        ))
    ok = [f.index for f in fits if f.fits]
    n = len(fits)
    if not ok:
        binding, why = _why_not(fits[0], usable, deadline_s, max_submodel)
        return Selection(None, f"skip round: {binding} binds: even {why}", binding, usable, tuple(fits))
    k = max(ok)
    head = f"submodel {k + 1}/{n} (gamma {table.costs[k].gamma:g})"
    if k == n - 1:
        return Selection(k, f"{head}: the largest submodel fits", "none", usable, tuple(fits))
    binding, why = _why_not(fits[k + 1], usable, deadline_s, max_submodel)
    return Selection(k, f"{head}: {binding} binds: {why}", binding, usable, tuple(fits))
