"""One cheap, non-blocking snapshot of what the device can give a training round right now.

Every source is optional: edge devices differ (NVML exists on a laptop GPU but not on a Jetson,
whose GPU load lives in sysfs; throttling flags exist only on a Raspberry Pi), so a source that is
absent or fails is listed in `DeviceSnapshot.unknown` with its reason instead of raising. Paths and
the NVML module are constructor arguments so tests can point them at fake trees and fakes.

Expensive discovery (which files exist, NVML init, GPU names, zone types) happens once in
`Prober.__init__`; `snapshot()` only reads values, so it can run every round.

CPU use is split in two over the same interval: the agent's own process tree (this process and its
children: training, calibration workers, inference threads) and everything else. Only the second is
load that slows the device's work down; counting the first would make a device that just trained
think itself busy. The 1-minute load average is read for display only, for the same reason: it
remembers the device's own work of the last minutes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from nefl.support.cpu import CpuReading, read_cpu, window

THERMAL_ROOT = Path("/sys/class/thermal")
JETSON_LOAD_PATHS = (  # GPU load in 0..1000: Nano/TX, Xavier, Orin (JetPack 5 and 6)
    Path("/sys/devices/gpu.0/load"),
    Path("/sys/devices/platform/gpu.0/load"),
    Path("/sys/devices/17000000.gv11b/load"),
    Path("/sys/devices/platform/17000000.ga10b/load"),
    Path("/sys/devices/platform/bus@0/17000000.gpu/load"),
)
PI_THROTTLED_PATH = Path("/sys/devices/platform/soc/soc:firmware/get_throttled")
THROTTLED_NOW_MASK = 0xF  # under-voltage, ARM frequency capped, throttled, soft temperature limit
HOT_LIMIT_C = 80.0  # a thermal zone at or above this counts as throttling (edge_client/load.py)
IGNORED_ZONES = frozenset({"pmic-die"})  # Jetson Nano's PMIC zone reads a fixed 100 C: not a temperature
_AUTO = object()


@dataclass(frozen=True)
class GpuReading:
    name: str
    memory_total: int | None  # bytes
    memory_used: int | None  # bytes
    utilization: float | None  # 0..100


@dataclass(frozen=True)
class ThermalReading:
    zone: str  # the zone's type, e.g. "cpu-thermal", "CPU-therm"
    celsius: float


@dataclass(frozen=True)
class BatteryReading:
    percent: float
    plugged: bool | None


@dataclass(frozen=True)
class DeviceSnapshot:
    """What the device has now; None means unknown (the reason is in `unknown`)."""

    time: float
    cpu_count: int
    memory_total: int | None = None  # bytes
    memory_available: int | None = None  # bytes
    process_rss: int | None = None  # bytes
    cpu_percent: float | None = None  # 0..100, system-wide since the previous snapshot
    own_cpu_cores: float | None = None  # cores this process tree kept busy over the same interval
    external_cpu_percent: float | None = None  # 0..100, system-wide minus this process tree, same interval
    load_per_core: float | None = None  # 1-minute load average / cores (display only: it remembers our own work)
    gpus: tuple[GpuReading, ...] = ()
    jetson_gpu_load: float | None = None  # 0..100
    thermal: tuple[ThermalReading, ...] = ()
    throttled: int | None = None  # Raspberry Pi get_throttled bit mask
    battery: BatteryReading | None = None
    unknown: dict[str, str] = field(default_factory=dict)  # source -> why it is unknown

    @property
    def max_celsius(self) -> float | None:
        temps = [t.celsius for t in self.thermal if t.zone.lower() not in IGNORED_ZONES]
        return max(temps) if temps else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def is_throttled(snapshot: DeviceSnapshot) -> bool:
    """True while the Pi firmware caps the clock now (bits 0-3), not for past events (bits 16-19)."""
    return snapshot.throttled is not None and bool(snapshot.throttled & THROTTLED_NOW_MASK)


def is_hot(snapshot: DeviceSnapshot, limit_c: float) -> bool:
    hottest = snapshot.max_celsius
    return hottest is not None and hottest >= limit_c


def format_bytes(n: int | None) -> str:
    """Human-readable size; "?" for a reading the snapshot could not take."""
    if n is None:
        return "?"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _read_text(path: Path) -> str:
    return path.read_text().strip()


def _first_existing(paths: tuple[Path, ...]) -> Path | None:
    return next((p for p in paths if p.exists()), None)


class Prober:
    """Reads device state; construct once, call `snapshot()` every round."""

    def __init__(
        self,
        *,
        psutil_module: Any = psutil,
        nvml: Any = _AUTO,
        thermal_root: Path = THERMAL_ROOT,
        jetson_load_paths: tuple[Path, ...] = JETSON_LOAD_PATHS,
        throttled_path: Path = PI_THROTTLED_PATH,
        vcgencmd: str | None = "vcgencmd",
    ) -> None:
        self._ps = psutil_module
        self._setup_unknown: dict[str, str] = {}
        self._process = self._guard("process_rss", lambda: self._ps.Process(os.getpid()))
        self._cpu_count = self._guard("cpu_count", lambda: self._ps.cpu_count(logical=True)) or os.cpu_count() or 1
        # psutil.cpu_percent() keeps one process-wide baseline (its first call returns a meaningless 0.0
        # and any other caller shortens our interval), so we keep our own baseline of cpu_times.
        self._cpu_base = self._guard("cpu_percent", self._cpu_sample)
        self._last_cpu: tuple[float, float | None, float | None] | None = None  # (cpu %, own cores, external %)
        self._nvml, self._gpu_handles = self._init_nvml(nvml)
        self._jetson_load = _first_existing(tuple(jetson_load_paths))
        if self._jetson_load is None:
            self._setup_unknown["jetson_gpu_load"] = "absent: no Jetson GPU load file in sysfs"
        self._zones = self._find_zones(Path(thermal_root))
        self._throttled_source = self._find_throttled(Path(throttled_path), vcgencmd)

    def _guard(self, source: str, read: Any) -> Any:
        try:
            return read()
        except Exception as e:  # a probe source must never take the agent down
            self._setup_unknown[source] = f"failed: {type(e).__name__}: {e}"
            return None

    # -- discovery (once) ----------------------------------------------------------------------

    def _init_nvml(self, nvml: Any) -> tuple[Any, list[tuple[Any, str]]]:
        if nvml is _AUTO:
            try:
                import pynvml as nvml  # provided by the nvidia-ml-py package
            except ImportError:
                self._setup_unknown["gpu"] = "absent: pynvml (nvidia-ml-py) not installed"
                return None, []
        if nvml is None:
            self._setup_unknown["gpu"] = "absent: NVML disabled"
            return None, []
        try:
            nvml.nvmlInit()
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
            names = [nvml.nvmlDeviceGetName(h) for h in handles]
        except Exception as e:  # no driver (e.g. a Jetson or a CPU-only box): NVML raises
            self._setup_unknown["gpu"] = f"failed: NVML: {e}"
            return None, []
        if not handles:
            self._setup_unknown["gpu"] = "absent: NVML reports no GPU"
        return nvml, [(h, n.decode() if isinstance(n, bytes) else str(n)) for h, n in zip(handles, names)]

    def _find_zones(self, root: Path) -> list[tuple[Path, str]]:
        zones = []
        for zone in sorted(root.glob("thermal_zone*")):
            try:
                zones.append((zone / "temp", _read_text(zone / "type")))
            except OSError:
                zones.append((zone / "temp", zone.name))
        if not zones:
            self._setup_unknown["thermal"] = f"absent: no thermal zones under {root}"
        return zones

    def _find_throttled(self, path: Path, vcgencmd: str | None) -> Path | str | None:
        if path.exists():
            return path
        exe = shutil.which(vcgencmd) if vcgencmd else None
        if exe is None:
            self._setup_unknown["throttled"] = "absent: not a Raspberry Pi (no get_throttled, no vcgencmd)"
        return exe

    # -- readings (every snapshot) ---------------------------------------------------------------

    def _cpu_sample(self) -> CpuReading:
        return read_cpu(self._ps, self._process)

    def _cpu_readings(self, unknown: dict[str, str]) -> tuple[float | None, float | None, float | None]:
        """(system cpu %, own cores, external cpu %) since the previous snapshot."""
        if self._cpu_base is None:
            self._cpu_base = self._cpu_sample()
            unknown["cpu_percent"] = "warming up: no baseline yet"
            return None, None, None
        now = self._cpu_sample()
        shares = window(self._cpu_base, now, self._cpu_count)
        if shares is not None:  # else too soon after the previous reading: it stands
            self._cpu_base = now
            self._last_cpu = (shares.percent, shares.own_cores, shares.external_percent)
            unknown.pop("cpu_percent", None)
        if self._last_cpu is None:
            unknown["cpu_percent"] = "warming up: sampled too soon after start"
            return None, None, None
        if self._last_cpu[1] is None:
            unknown["external_cpu_percent"] = "failed: cannot read this process tree's CPU times"
        return self._last_cpu

    def _gpus(self, unknown: dict[str, str]) -> tuple[GpuReading, ...]:
        out = []
        for i, (handle, name) in enumerate(self._gpu_handles):
            try:
                mem = self._nvml.nvmlDeviceGetMemoryInfo(handle)
                total, used = int(mem.total), int(mem.used)
            except Exception as e:
                unknown[f"gpu{i}.memory"] = f"failed: {e}"
                total = used = None
            try:
                util = float(self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except Exception as e:  # some GPUs/drivers do not report utilisation
                unknown[f"gpu{i}.utilization"] = f"failed: {e}"
                util = None
            out.append(GpuReading(name, total, used, util))
        return tuple(out)

    def _thermal(self, unknown: dict[str, str]) -> tuple[ThermalReading, ...]:
        out = []
        for path, zone in self._zones:
            try:
                out.append(ThermalReading(zone, int(_read_text(path)) / 1000.0))
            except (OSError, ValueError) as e:  # some zones refuse reads (ENODATA) while powered down
                unknown[f"thermal:{zone}"] = f"failed: {e}"
        return tuple(out)

    def _throttled(self) -> int:
        src = self._throttled_source
        if isinstance(src, Path):
            text = _read_text(src)
        else:
            text = subprocess.run([src, "get_throttled"], capture_output=True, text=True, timeout=2, check=True).stdout
        return int(text.strip().removeprefix("throttled=").removeprefix("0x"), 16)

    def _battery(self) -> BatteryReading | None:
        b = self._ps.sensors_battery()
        return None if b is None else BatteryReading(float(b.percent), b.power_plugged)

    def snapshot(self) -> DeviceSnapshot:
        unknown = dict(self._setup_unknown)

        def read(source: str, fn: Any) -> Any:
            try:
                return fn()
            except Exception as e:
                unknown[source] = f"failed: {type(e).__name__}: {e}"
                return None

        vm = read("memory", self._ps.virtual_memory)
        cpu, own, external = read("cpu_percent", lambda: self._cpu_readings(unknown)) or (None, None, None)
        load = read("load_per_core", self._ps.getloadavg)
        jetson = read("jetson_gpu_load", lambda: int(_read_text(self._jetson_load)) / 10.0) if self._jetson_load else None
        throttled = read("throttled", self._throttled) if self._throttled_source else None
        battery = read("battery", self._battery)
        if battery is None and "battery" not in unknown:
            unknown["battery"] = "absent: no battery reported"
        return DeviceSnapshot(
            time=time.time(),
            cpu_count=self._cpu_count,
            memory_total=None if vm is None else int(vm.total),
            memory_available=None if vm is None else int(vm.available),
            process_rss=read("process_rss", lambda: int(self._process.memory_info().rss)) if self._process else None,
            cpu_percent=cpu,
            own_cpu_cores=own,
            external_cpu_percent=external,
            load_per_core=None if load is None else load[0] / self._cpu_count,
            gpus=self._gpus(unknown),
            jetson_gpu_load=jetson,
            thermal=self._thermal(unknown),
            throttled=throttled,
            battery=battery,
            unknown=unknown,
        )
