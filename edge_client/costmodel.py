"""What each submodel costs to train on this device: parameters, FLOPs, peak memory, step time.

Two layers. `estimate_costs` is analytic (no torch work): weights + gradients + optimiser state +
saved activations + a framework constant. `calibrate` replaces the guesses with one real training
step per submodel measured on this device, in a child process: an out-of-memory kill there costs
the calibration of one submodel, not the agent, and the child's allocator starts clean. Results are
cached under ~/.cache/nefl/calibration (override with `cache_dir` or $NEFL_CALIBRATION_DIR), keyed by the
device fingerprint, profile hash, method, batch size, device and threads, so it runs once.

Peak memory on CPU is peak RSS growth (Linux: VmHWM reset through /proc/self/clear_refs; elsewhere
a 1 ms RSS sampling thread); on CUDA it is torch.cuda.max_memory_allocated growth. The child first
measures the smallest submodel cold and warm: the difference is the one-time framework cost (lazy
kernel pages, thread pools) that a real first round also pays, so it is added to every submodel.

How those costs scale with the load now, and what real rounds teach about them, is
edge_client/load.py. The table holds idle-device step times: on one CPU thread the step's CPU time,
otherwise the wall time divided by the slowdown others caused during it (`calibrate(load=...)`).
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

from edge_client.cache import CALIBRATION_DIR
from edge_client.slowdown import slowdown
from edge_client.probe import DeviceSnapshot
from nefl.nested.cost import submodel_cost, training_peak_bytes
from nefl.nested.methods import get_method
from nefl.nested.models import build_submodel
from nefl.nested.profile import parse_profile
from nefl.nested.state import Layout
from nefl.nested.train import TrainConfig
from nefl.support.fsio import atomic_write_text

TIMED_STEPS = 3


@dataclass(frozen=True)
class SubmodelCost:
    index: int  # 0-based, as layout.module(index)
    gamma: float
    params: int
    macs: int  # per sample, forward
    estimated_peak: int  # bytes, analytic
    measured_peak: int | None = None  # bytes, calibrated on this device
    step_seconds: float | None = None  # one training step at the table's batch size on the idle device, calibrated
    error: str | None = None  # why calibration failed (e.g. killed: out of memory)

    @property
    def peak_bytes(self) -> int:
        """The number selection trusts: measured when calibrated, else the analytic estimate."""
        return self.estimated_peak if self.measured_peak is None else self.measured_peak


@dataclass(frozen=True)
class CostTable:
    profile: str
    method: str
    batch_size: int
    device: str
    threads: int
    costs: tuple[SubmodelCost, ...]
    measured_now: tuple[int, ...] = ()  # indices measured by this call (empty: all from cache)
    cache_file: Path | None = None


def estimate_peak(layout: Layout, index: int, batch_size: int, momentum: float = TrainConfig.momentum) -> int:
    cost = submodel_cost(layout.profile, layout.profile.submodels[index])
    return training_peak_bytes(cost.params, cost.activations, math.prod(layout.profile.input_shape), batch_size, momentum)


def estimate_costs(layout: Layout, batch_size: int, device: str = "cpu", threads: int = 1) -> CostTable:
    costs = []
    for k, spec in enumerate(layout.profile.submodels):
        c = submodel_cost(layout.profile, spec)
        costs.append(SubmodelCost(k, spec.gamma, c.params, c.macs, estimate_peak(layout, k, batch_size)))
    return CostTable(layout.profile.name, layout.method.name, batch_size, device, threads, tuple(costs))


# -- measurement (runs in the child process) -------------------------------------------------------

def _trim_allocator() -> None:
    """Hand freed heap pages back to the OS so the next baseline is honest (glibc only)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"{field} not in /proc/self/status")


class RssMeter:
    """Peak RSS growth of this process between start() and stop()."""

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self._base = self._peak = 0
        self._sampler: threading.Thread | None = None
        self._running = False

    def _reset_hwm(self) -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
            _status_kib("VmHWM")
            return True
        except OSError:
            return False

    def _sample(self) -> None:
        while self._running:
            self._peak = max(self._peak, self._proc.memory_info().rss)
            time.sleep(0.001)

    def start(self) -> None:
        _trim_allocator()
        exact = self._reset_hwm()
        self._base = self._peak = self._proc.memory_info().rss
        if not exact:
            self._running = True
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampler.start()

    def stop(self) -> int:
        if self._sampler is None:
            self._peak = _status_kib("VmHWM")
        else:
            self._running = False
            self._sampler.join()
            self._sampler = None
        return max(0, self._peak - self._base)


class CudaMeter:
    """Peak allocated CUDA memory growth; `cuda` is injectable so the logic is testable without a GPU."""

    def __init__(self, cuda: Any = None) -> None:
        self._cuda = cuda or torch.cuda
        self._base = 0

    def start(self) -> None:
        self._cuda.synchronize()
        self._cuda.reset_peak_memory_stats()
        self._base = self._cuda.memory_allocated()

    def stop(self) -> int:
        self._cuda.synchronize()
        return max(0, self._cuda.max_memory_allocated() - self._base)


def measure_step(build: Callable[[], Any], layout_profile: Any, batch_size: int, device: str, meter: Any,
                 sync: Callable[[], None] = lambda: None, repeats: int = TIMED_STEPS) -> tuple[int, float, float]:
    """Peak memory growth of building + one SGD step from scratch, then the fastest of `repeats` steps in
    wall time and in this process's CPU time (what the step needs whatever else the cores run)."""
    meter.start()
    model = build().to(device).train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=TrainConfig.lr, momentum=TrainConfig.momentum)
    x = torch.randn(batch_size, *layout_profile.input_shape, device=device)
    y = torch.randint(0, layout_profile.num_classes, (batch_size,), device=device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        sync()

    step()
    peak = meter.stop()
    times, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return peak, min(times), min(cpu)


def _measure_all(job: dict[str, Any]) -> Iterator[dict[str, Any]]:
    torch.set_num_threads(job["threads"])
    profile, method = parse_profile(job["profile"]), get_method(job["method"])
    device = job["device"]
    meter: Any = RssMeter() if device == "cpu" else CudaMeter()
    sync = (lambda: None) if device == "cpu" else torch.cuda.synchronize

    def measure(k: int) -> tuple[int, float, float]:
        spec = profile.submodels[k]
        return measure_step(lambda: build_submodel(profile, spec, method.learnable_steps), profile,
                            job["batch_size"], device, meter, sync)

    indices = job["indices"]
    cold, _, _ = measure(indices[0])
    warm, _, _ = measure(indices[0])
    overhead = max(0, cold - warm)
    for k in indices:
        peak, seconds, cpu_seconds = measure(k)
        yield {"index": k, "peak": peak + overhead, "seconds": seconds, "cpu_seconds": cpu_seconds, "overhead": overhead}


def worker_main() -> None:
    """Child-process entry: a JSON job on stdin, one JSON line per measured submodel on stdout."""
    job = json.loads(sys.stdin.read())
    for result in _measure_all(job):
        print(json.dumps(result), flush=True)


# -- calibration with cache (runs in the agent) ----------------------------------------------------

def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_fingerprint(device: str, threads: int) -> dict[str, Any]:
    """What makes a measurement valid on this machine: a change here means calibrate again."""
    return {
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_total": psutil.virtual_memory().total,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else None,
        "device": device,
        "threads": threads,
    }


def cache_path(layout: Layout, batch_size: int, device: str, threads: int, cache_dir: Path = CALIBRATION_DIR) -> Path:
    key = {"fingerprint": device_fingerprint(device, threads), "profile": layout.profile.hash,
           "method": layout.method.name, "batch_size": batch_size}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"{layout.profile.name}-{layout.method.name}-b{batch_size}-{digest}.json"


def _load_cache(path: Path) -> dict[str, dict[str, Any]]:
    try:
        return json.loads(path.read_text())["submodels"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}  # absent or unreadable: measure again


def _write_cache(path: Path, entries: dict[str, dict[str, Any]], layout: Layout, batch_size: int,
                 device: str, threads: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"fingerprint": device_fingerprint(device, threads), "profile": layout.profile.name,
           "profile_hash": layout.profile.hash, "method": layout.method.name, "batch_size": batch_size,
           "submodels": entries}
    atomic_write_text(path, json.dumps(doc, indent=1, sort_keys=True))  # a crash or a concurrent probe never leaves a torn cache


def _run_worker(layout: Layout, indices: list[int], batch_size: int, device: str, threads: int,
                on_result: Callable[[int], None]) -> tuple[dict[int, dict[str, Any]], str | None]:
    job = {"profile": layout.profile.to_dict(), "method": layout.method.name, "indices": indices,
           "batch_size": batch_size, "device": device, "threads": threads}
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(64 * 1024))  # glibc: tensors get their own pages, freed at once
    cmd = [sys.executable, "-m", "edge_client.costmodel"]  # the same interpreter finds the package, installed or not
    results: dict[int, dict[str, Any]] = {}
    with subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=env) as proc:
        assert proc.stdin and proc.stdout and proc.stderr
        proc.stdin.write(json.dumps(job))
        proc.stdin.close()
        for line in proc.stdout:
            r = json.loads(line)
            results[r["index"]] = r
            on_result(r["index"])
        err = proc.stderr.read()
    if proc.returncode == 0:
        return results, None
    if proc.returncode < 0:
        return results, f"calibration process killed by signal {-proc.returncode} (out of memory?)"
    return results, f"calibration process failed: {err.strip().splitlines()[-1] if err.strip() else proc.returncode}"


def idle_seconds(entry: dict[str, Any], device: str, threads: int) -> float:
    """A cached measurement's step time on the idle device. One CPU thread: its CPU time, which others'
    load does not stretch (the fastest wall time of a few steps beside busy loops is not: a small step
    may fit in one time slice at full speed, a large one is shared, so dividing both by one slowdown
    makes small submodels too fast against large ones: docs/device-selection.md). Otherwise (several threads, a GPU, a
    cache without CPU times): the wall time divided by the slowdown others caused meanwhile."""
    if device == "cpu" and threads == 1 and isinstance(entry.get("cpu_seconds"), (int, float)) and entry["cpu_seconds"] > 0:
        return float(entry["cpu_seconds"])
    return entry["seconds"] / entry.get("slowdown", 1.0)


def calibrate(
    layout: Layout, batch_size: int, *, device: str = "cpu", threads: int | None = None,
    cache_dir: Path = CALIBRATION_DIR, indices: list[int] | None = None, force: bool = False,
    on_result: Callable[[int], None] = lambda k: None, load: Callable[[], DeviceSnapshot] | None = None,
) -> CostTable:
    """Calibrated costs for `indices` (default all); cached ones are reused unless `force`.

    `load` (a Prober's snapshot) is read before and after measuring: the slowdown others caused
    meanwhile is stored with each measurement and divided out, so step_seconds are the idle device's."""
    threads = threads or torch.get_num_threads()
    table = estimate_costs(layout, batch_size, device, threads)
    wanted = list(range(layout.num_submodels)) if indices is None else sorted(set(indices))
    path = cache_path(layout, batch_size, device, threads, cache_dir)
    entries = {} if force else _load_cache(path)
    missing = [k for k in wanted if str(k) not in entries]
    errors: dict[int, str] = {}
    if missing:
        if load is not None:
            load()  # the interval the next snapshot reads starts here
        results, error = _run_worker(layout, missing, batch_size, device, threads, on_result)
        busy = 1.0 if load is None else slowdown(load(), threads, device, working=True)
        entries.update({str(k): {**{n: r[n] for n in ("peak", "seconds", "cpu_seconds", "overhead")}, "slowdown": busy}
                        for k, r in results.items()})
        errors = {k: error for k in missing if k not in results and error}
        _write_cache(path, entries, layout, batch_size, device, threads)
    costs = tuple(
        replace(c, measured_peak=entries[str(c.index)]["peak"], step_seconds=idle_seconds(entries[str(c.index)], device, threads))
        if str(c.index) in entries else replace(c, error=errors.get(c.index))
        for c in table.costs
    )
    measured = tuple(k for k in missing if str(k) in entries)
    return replace(table, costs=costs, measured_now=measured, cache_file=path)


if __name__ == "__main__":  # the calibration child: `python -m edge_client.costmodel`, see _run_worker
    worker_main()
