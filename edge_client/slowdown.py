"""How much slower than on the idle device a training step runs now, from a load snapshot:
slowdown = max(1, (others' CPU demand in cores + training threads) / cores), the fair share the
scheduler gives the training threads, times THROTTLED_SLOWDOWN when the Pi firmware throttles or a
thermal zone is at or above `hot_limit_c` (the clock is then capped at roughly half). "Others" is
everything outside this process tree (edge_client/probe.py): the device's own training is never
its own load. The measuring half (edge_client/costmodel.py) and the predicting half (edge_client/load.py)
both divide or multiply by it.
"""

from __future__ import annotations

from edge_client.probe import HOT_LIMIT_C, DeviceSnapshot, is_hot, is_throttled

THROTTLED_SLOWDOWN = 2.0
SATURATED = 0.97  # machine busy share from which others' CPU use may understate what they would take
MIN_ACTIVE = 0.2  # of its threads' worth: our tree was working in the interval, not idling


def others_demand(snapshot: DeviceSnapshot, threads: int, working: bool = False) -> float:
    """Cores the rest of the machine would take (its demand, not only what it got).

    Others' use is their demand until the machine is saturated; then the scheduler's fair share
    tells: if our `threads` got `own` cores of the `cores`, others want threads * (cores - own) / own.
    That needs our threads to have wanted the CPU all along: `working` says so (the interval was a
    training round or a calibration); otherwise a tree using under MIN_ACTIVE of its threads is
    taken for idle, not starved. Without a reading of our own tree, the system-wide figure stands in
    (it overstates)."""
    cores = snapshot.cpu_count
    if snapshot.external_cpu_percent is None or snapshot.own_cpu_cores is None:
        return (snapshot.cpu_percent or 0.0) / 100.0 * cores
    others, own = snapshot.external_cpu_percent / 100.0 * cores, snapshot.own_cpu_cores
    active = own > 0 if working else own >= MIN_ACTIVE * threads
    if active and saturated(snapshot):
        return max(others, threads * (cores - own) / own)
    return others


def saturated(snapshot: DeviceSnapshot) -> bool:
    """Every core was busy: what others used may be less than what they wanted (or it is unknown)."""
    if snapshot.external_cpu_percent is None or snapshot.own_cpu_cores is None:
        return True
    return snapshot.external_cpu_percent / 100.0 * snapshot.cpu_count + snapshot.own_cpu_cores >= \
        SATURATED * snapshot.cpu_count


def slowdown(snapshot: DeviceSnapshot, threads: int, device: str = "cpu", hot_limit_c: float = HOT_LIMIT_C,
             others_floor: float = 0.0, working: bool = False) -> float:
    """How much slower than on the idle device a step runs now (>= 1); unknown load counts as idle.
    `others_floor`: cores others demanded while this device last trained (RunningCalibration);
    `working`: the snapshot's interval was spent training (see others_demand)."""
    if device == "cpu":
        demand = max(others_demand(snapshot, threads, working), others_floor)
        factor = max(1.0, (demand + threads) / snapshot.cpu_count)
    else:
        util = snapshot.gpus[0].utilization if snapshot.gpus else snapshot.jetson_gpu_load
        factor = 1.0 + (util or 0.0) / 100.0  # GPU time-slices between contexts
    if is_throttled(snapshot) or is_hot(snapshot, hot_limit_c):
        factor *= THROTTLED_SLOWDOWN
    return factor
