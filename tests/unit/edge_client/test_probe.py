"""Device probe: fake NVML, Jetson sysfs, thermal zones and Pi flags; failing sources become unknown."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from typer.testing import CliRunner

from edge_client.cli import app
from edge_client.probe import Prober, is_hot, is_throttled

Times = namedtuple("Times", "user nice system idle iowait guest")


def _absent(tmp_path: Path, **kw) -> Prober:
    """A prober whose optional sources all point at nothing, unless overridden."""
    args = dict(nvml=None, thermal_root=tmp_path / "no-thermal", jetson_load_paths=(tmp_path / "no-load",),
                throttled_path=tmp_path / "no-throttled", vcgencmd=None)
    return Prober(**(args | kw))


class FakeNvml:
    def __init__(self, fail_util: bool = False, fail_init: bool = False) -> None:
        self.fail_util, self.fail_init = fail_util, fail_init

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return [b"NVIDIA RTX A2000", b"Tesla T4"][h]

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(total=(h + 1) * 2**30, used=h * 2**29 + 2**20, free=0)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        if self.fail_util and h == 1:
            raise RuntimeError("Not Supported")
        return SimpleNamespace(gpu=17 + h, memory=3)


def test_fake_nvml_is_read_per_gpu_and_a_failing_field_is_unknown(tmp_path):
    s = _absent(tmp_path, nvml=FakeNvml(fail_util=True)).snapshot()
    assert [g.name for g in s.gpus] == ["NVIDIA RTX A2000", "Tesla T4"]
    assert (s.gpus[0].memory_total, s.gpus[0].memory_used, s.gpus[0].utilization) == (2**30, 2**20, 17.0)
    assert s.gpus[1].memory_total == 2 * 2**30 and s.gpus[1].utilization is None
    assert "gpu1.utilization" in s.unknown and "gpu" not in s.unknown


def test_nvml_init_failure_is_reported_not_raised(tmp_path):
    s = _absent(tmp_path, nvml=FakeNvml(fail_init=True)).snapshot()
    assert s.gpus == () and "NVML Shared Library Not Found" in s.unknown["gpu"]


def test_jetson_gpu_load_from_sysfs(tmp_path):
    load = tmp_path / "devices" / "gpu.0" / "load"
    load.parent.mkdir(parents=True)
    load.write_text("537\n")
    s = _absent(tmp_path, jetson_load_paths=(tmp_path / "missing", load)).snapshot()
    assert s.jetson_gpu_load == pytest.approx(53.7)
    load.write_text("garbage")
    s = _absent(tmp_path, jetson_load_paths=(load,)).snapshot()
    assert s.jetson_gpu_load is None and "jetson_gpu_load" in s.unknown


def _zone(root: Path, i: int, kind: str, millideg: str | None) -> None:
    z = root / f"thermal_zone{i}"
    z.mkdir(parents=True)
    (z / "type").write_text(kind + "\n")
    if millideg is None:
        (z / "temp").mkdir()  # reading it fails like a zone that refuses reads
    else:
        (z / "temp").write_text(millideg + "\n")


def test_thermal_zones_parsed_bogus_pmic_ignored_unreadable_unknown(tmp_path):
    root = tmp_path / "thermal"
    _zone(root, 0, "cpu-thermal", "45500")
    _zone(root, 1, "PMIC-Die", "100000")
    _zone(root, 2, "GPU-therm", None)
    s = _absent(tmp_path, thermal_root=root).snapshot()
    assert [(t.zone, t.celsius) for t in s.thermal] == [("cpu-thermal", 45.5), ("PMIC-Die", 100.0)]
    assert "thermal:GPU-therm" in s.unknown
    assert s.max_celsius == 45.5
    assert is_hot(s, 45.0) and not is_hot(s, 46.0)


def test_pi_throttled_flags_from_sysfs_and_vcgencmd(tmp_path):
    flags = tmp_path / "get_throttled"
    flags.write_text("50005\n")
    s = _absent(tmp_path, throttled_path=flags).snapshot()
    assert s.throttled == 0x50005 and is_throttled(s)
    flags.write_text("50000\n")  # throttled since boot, not now
    assert not is_throttled(_absent(tmp_path, throttled_path=flags).snapshot())
    exe = tmp_path / "vcgencmd"
    exe.write_text("#!/bin/sh\necho throttled=0x4\n")
    exe.chmod(0o755)
    s = _absent(tmp_path, vcgencmd=str(exe)).snapshot()
    assert s.throttled == 4 and is_throttled(s)


def test_every_failing_or_missing_source_is_unknown_never_a_crash(tmp_path):
    def boom(*a, **k):
        raise PermissionError("denied")

    broken = SimpleNamespace(Process=boom, cpu_count=boom, cpu_times=boom, virtual_memory=boom,
                             getloadavg=boom, sensors_battery=boom)
    s = _absent(tmp_path, psutil_module=broken).snapshot()
    assert s.cpu_count == (os.cpu_count() or 1)
    assert None is s.memory_available is s.memory_total is s.process_rss is s.cpu_percent is s.load_per_core
    for source in ("memory", "process_rss", "cpu_percent", "load_per_core", "battery", "gpu",
                   "jetson_gpu_load", "thermal", "throttled"):
        assert source in s.unknown, source
    json.dumps(s.to_dict())  # still serialisable for `probe --json`


def test_cpu_percent_uses_its_own_baseline_and_survives_too_soon_samples(tmp_path):
    readings = iter([Times(10, 0, 0, 90, 0, 0), Times(60, 0, 0, 140, 0, 0), Times(60, 0, 0, 140, 0, 0),
                     Times(70, 0, 0, 230, 0, 0)])
    fake = SimpleNamespace(**{n: getattr(psutil, n) for n in ("Process", "cpu_count", "virtual_memory",
                                                               "getloadavg", "sensors_battery")},
                           cpu_times=lambda: next(readings))
    p = _absent(tmp_path, psutil_module=fake)  # primes with the first reading
    assert p.snapshot().cpu_percent == pytest.approx(50.0)
    assert p.snapshot().cpu_percent == pytest.approx(50.0)  # no time passed: last value kept
    s = p.snapshot()
    assert s.cpu_percent == pytest.approx(10.0) and "cpu_percent" not in s.unknown


class FakeProcess:
    """A process whose CPU times (user, system, children_user, children_system) follow a script."""

    def __init__(self, times, children=()) -> None:
        self._times, self._children = iter(times), list(children)

    def cpu_times(self):
        return SimpleNamespace(**dict(zip(("user", "system", "children_user", "children_system"), next(self._times))))

    def children(self, recursive=False):
        return self._children

    def memory_info(self):
        return SimpleNamespace(rss=1 << 20)


def test_own_process_tree_is_not_external_load(tmp_path):
    """2 cores over 10 s: 16 busy seconds, of which this process (4 s), its live calibration child (5 s)
    and a child it already reaped (2 s, now in children_user) are ours; the other 5 s are others'."""
    system = iter([Times(0, 0, 0, 0, 0, 0), Times(16, 0, 0, 4, 0, 0)])
    child = FakeProcess([(0, 0, 0, 0), (4, 1, 0, 0)])
    me = FakeProcess([(0, 0, 0, 0), (3, 1, 2, 0)], [child])
    fake = SimpleNamespace(Process=lambda pid: me, cpu_count=lambda logical=True: 2, cpu_times=lambda: next(system),
                           virtual_memory=psutil.virtual_memory, getloadavg=psutil.getloadavg,
                           sensors_battery=lambda: None)
    s = _absent(tmp_path, psutil_module=fake).snapshot()
    assert s.cpu_percent == pytest.approx(80.0) and s.own_cpu_cores == pytest.approx(1.1)
    assert s.external_cpu_percent == pytest.approx(25.0)


def test_a_busy_child_counts_as_our_own_work(tmp_path):
    p = _absent(tmp_path)
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 1.0\nwhile time.time() < end: pass"])
    child.wait(30)
    s = p.snapshot()  # the child was reaped: its CPU time is in this process's children_* times now
    assert s.own_cpu_cores >= 0.1 and s.external_cpu_percent <= s.cpu_percent


def test_real_snapshot_has_memory_and_is_cheap():
    p = Prober()
    s = p.snapshot()
    assert 0 < s.memory_available <= s.memory_total and s.process_rss > 0 and s.cpu_count >= 1


def test_probe_command_json():
    result = CliRunner().invoke(app, ["probe", "--json", "--interval", "0.05"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["memory_total"] > 0 and isinstance(data["unknown"], dict)
