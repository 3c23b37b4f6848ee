"""Submodel selection from injected readings, the cost model's meters, and real calibrations."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from dataclasses import replace
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from edge_client.cli import app
from edge_client.costmodel import CostTable, CudaMeter, RssMeter, SubmodelCost, cache_path, calibrate, idle_seconds
from edge_client.load import RunningCalibration
from edge_client.slowdown import MIN_ACTIVE, SATURATED, THROTTLED_SLOWDOWN, others_demand, slowdown
from edge_client.probe import DeviceSnapshot, GpuReading, ThermalReading
from edge_client.select import HYSTERESIS, DeviceBudget, select_submodel
from nefl.nested.profile import load_profile
from nefl.nested.state import Layout
from nefl.support.units import parse_size

MB = 2**20
ROOT = Path(__file__).resolve().parents[3]


def table(peaks_mb=(100, 200, 300, 400, 500), steps_s=(0.01, 0.02, 0.03, 0.04, 0.05), device="cpu") -> CostTable:
    costs = tuple(SubmodelCost(k, (k + 1) / len(peaks_mb), 1000 * (k + 1), 10**6 * (k + 1), int(p * MB), int(p * MB), s)
                  for k, (p, s) in enumerate(zip(peaks_mb, steps_s)))
    return CostTable("synthetic", "nefl", 32, device, 1, costs)


def snap(avail_mb: float | None = 10_000, **kw) -> DeviceSnapshot:
    base = dict(time=0.0, cpu_count=2, memory_total=16_000 * MB, cpu_percent=0.0, load_per_core=0.0,
                memory_available=None if avail_mb is None else int(avail_mb * MB))
    return DeviceSnapshot(**(base | kw))


def pick(t: CostTable, s: DeviceSnapshot, **kw):
    return select_submodel(t, s, num_samples=320, epochs=1, safety_margin=0.0, **kw)


def test_less_free_memory_selects_a_smaller_submodel():
    t = table()
    assert pick(t, snap(10_000)).index == 4 and pick(t, snap(10_000)).binding == "none"
    sel = pick(t, snap(350))
    assert sel.index == 2 and sel.binding == "memory" and "submodel 4 needs 400.0 MiB" in sel.reason
    assert pick(t, snap(150)).index == 0


def test_safety_margin_is_taken_off_available_memory():
    t = table()
    assert select_submodel(t, snap(500), 320, 1, safety_margin=0.0).index == 4
    assert select_submodel(t, snap(500), 320, 1, safety_margin=0.2).index == 3


def test_cap_is_honoured_and_named():
    sel = pick(table(), snap(), max_submodel=2)
    assert sel.index == 1 and sel.submodel == 2 and sel.binding == "cap" and "--max-submodel 2" in sel.reason
    assert [f.fits for f in sel.fits] == [True, True, False, False, False]


def test_nothing_fits_skips_with_the_binding_limit():
    sel = pick(table(), snap(50))
    assert sel.index is None and sel.binding == "memory" and sel.reason.startswith("skip round")
    assert "submodel 1 needs 100.0 MiB" in sel.reason
    sel = pick(table(), snap(), deadline_s=0.05)  # 10 steps x 0.01 s = 0.1 s even for the smallest
    assert sel.index is None and sel.binding == "deadline" and "would take 0.1 s, deadline 0.05 s" in sel.reason


def test_deadline_binds_on_predicted_round_time():
    # 320 samples / batch 32 = 10 steps per epoch, 2 epochs: submodel k takes 0.2 * (k + 1) s
    sel = select_submodel(table(), snap(), 320, 2, deadline_s=0.65, safety_margin=0.0)
    assert sel.index == 2 and sel.binding == "deadline"
    assert [round(f.seconds, 3) for f in sel.fits] == [0.2, 0.4, 0.6, 0.8, 1.0]


@pytest.mark.parametrize("hot", [
    dict(throttled=0x4),  # Raspberry Pi: throttled now
    dict(thermal=(ThermalReading("cpu-thermal", 85.0),)),
])
def test_throttled_or_hot_device_is_slower_and_picks_smaller(hot):
    t, deadline = table(), 0.45  # cool: submodel 4 (0.4 s) fits
    cool = pick(t, snap(), deadline_s=deadline)
    warm = pick(t, snap(**hot), deadline_s=deadline)
    assert cool.index == 3
    assert warm.fits[0].seconds == pytest.approx(cool.fits[0].seconds * THROTTLED_SLOWDOWN)
    assert warm.index == 1 and warm.binding == "deadline"


def busy(own: float, others: float, cores: int = 2) -> DeviceSnapshot:
    """A snapshot whose interval saw our tree use `own` cores and everything else `others` cores."""
    return snap(cpu_count=cores, cpu_percent=100.0 * (own + others) / cores, own_cpu_cores=own,
                external_cpu_percent=100.0 * others / cores)


def test_only_others_load_slows_a_step_down():
    assert slowdown(snap(), threads=1) == 1.0
    assert slowdown(busy(own=2.0, others=0.0), threads=2) == 1.0  # our own training is not load
    assert slowdown(busy(own=0.0, others=2.0), threads=1) == pytest.approx(1.5)  # 2 busy loops + 1 thread on 2 cores
    # training beside the same two loops, the fair share gave us 2/3 of a core: they want 2, as before
    assert slowdown(busy(own=2 / 3, others=4 / 3), threads=1) == pytest.approx(1.5)
    assert slowdown(replace(busy(0.0, 0.0), load_per_core=3.0), threads=1) == 1.0  # it remembers our past work
    assert slowdown(snap(cpu_percent=100.0), threads=1) == pytest.approx(1.5)  # no own-tree reading: system-wide
    assert slowdown(snap(cpu_percent=None, load_per_core=None), threads=1) == 1.0  # unknown: idle


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 16), st.integers(1, 4), st.floats(0.0, 24.0))
def test_others_demand_recovers_what_a_fair_scheduler_hides(cores, threads, others):
    """Brute force: a fair scheduler shares `cores` among our `threads` and `others` CPU-bound threads'
    worth of demand; from the shares it gave out, others_demand finds that demand again (unless our
    share was so small that the interval cannot be told from one where we idled: then what they got)."""
    threads = min(threads, cores)
    runnable = threads + others
    share = min(1.0, cores / runnable)  # of a core, per runnable thread
    own, got = threads * share, others * share
    found = others if share >= MIN_ACTIVE else got
    idle = (1 - SATURATED) * cores  # a machine this close to full counts as saturated: the error is at most its idle part
    assert others_demand(busy(own, got, cores), threads) == pytest.approx(found, abs=idle + 1e-6)
    if share >= MIN_ACTIVE:
        assert slowdown(busy(own, got, cores), threads) == pytest.approx(max(1.0, runnable / cores), abs=idle / cores + 1e-6)


def test_a_submodel_above_the_one_held_must_fit_with_a_margin():
    t = table()  # 10 steps: submodel k + 1 takes 0.1 * (k + 1) s
    assert pick(t, snap(), deadline_s=0.42).index == 3
    up = pick(t, snap(), deadline_s=0.42, hold=2)  # 0.4 s > 0.42 x (1 - HYSTERESIS): stays
    assert up.index == 2 and "to move up" in up.reason and up.fits[3].allowed_s == pytest.approx(0.42 * (1 - HYSTERESIS))
    assert pick(t, snap(), deadline_s=0.42, hold=3).index == 3  # held: the plain deadline
    assert pick(t, snap(), deadline_s=0.42, hold=4).index == 3  # no longer fits: down at once
    assert pick(t, snap(), deadline_s=0.42, hold=-1).index == 2  # held nothing: every submodel needs the margin


def test_running_calibration_learns_the_measured_step_time():
    t = table()
    cost, run = t.costs[2], RunningCalibration()  # calibrated 0.03 s a step on the idle device
    loaded = busy(own=2 / 3, others=4 / 3)  # the round ran beside two busy loops: x1.5 expected
    assert run.step_seconds(cost, t, snap()) == pytest.approx(0.03)
    assert run.observe(cost, t, 0.09, loaded) == pytest.approx(2.0)  # twice what calibration and load explain
    assert run.measured == {2: pytest.approx(0.06)} and run.others_busy == pytest.approx(2.0)
    assert run.ratio(t.costs[4]) == pytest.approx(2.0)  # the submodels not trained yet are scaled by it
    # the next prediction: the loops are still there (and count at least as much as during the round)
    assert run.step_seconds(cost, t, busy(own=0.0, others=2.0)) == pytest.approx(0.06 * 1.5)
    assert run.step_seconds(t.costs[4], t, snap()) == pytest.approx(0.05 * 2.0 * 1.5)
    run.observe(cost, t, 0.045, loaded)  # the next round matched the calibration: both move halfway
    assert run.measured[2] == pytest.approx(0.045) and run.ratio(t.costs[0]) == pytest.approx(1.5)
    sel = select_submodel(t, busy(0.0, 2.0), 320, 1, deadline_s=0.7, safety_margin=0.0, running=run)
    assert [round(f.seconds, 3) for f in sel.fits] == [round(10 * s * 1.5, 3) for s in (0.015, 0.03, 0.045, 0.06, 0.075)]
    assert sel.index == 2  # 0.675 s of the 0.7 s deadline; the calibration alone would have allowed all five


def test_an_untrained_submodel_is_scaled_by_its_nearest_trained_one_and_kept_in_order():
    """Calibration errors depend on size: an untrained submodel takes the ratio of the trained one
    nearest in MACs, and is never predicted faster than a smaller one or slower than a larger one was
    measured (the benchmark's case: submodel 5 predicted under submodel 3's measured step)."""
    t, run = table(), RunningCalibration()  # calibrated 0.01 .. 0.05 s a step; MACs 1e6 .. 5e6
    run.observe(t.costs[0], t, 0.03, snap())  # submodel 1 ran at 3x its calibration
    run.observe(t.costs[2], t, 0.033, snap())  # submodel 3 at 1.1x
    assert run.ratio(t.costs[4]) == pytest.approx(1.1) and run.ratio(t.costs[1]) == pytest.approx(1.1)  # 2e6 is nearer 3e6
    assert run.idle_step(t.costs[4]) == pytest.approx(0.055)
    assert run.idle_step(t.costs[1]) == pytest.approx(0.03)  # 0.02 x 1.1 is under submodel 1's measured 0.03
    slow_mid = RunningCalibration()
    slow_mid.observe(t.costs[2], t, 0.09, snap())  # submodel 3 at 3x
    slow_mid.observe(t.costs[4], t, 0.05, snap())  # submodel 5 as calibrated
    assert slow_mid.idle_step(t.costs[3]) == pytest.approx(0.05)  # 0.04 x 1 (nearest: 5) under 3's 0.09, over 5's


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.001, 1.0), min_size=5, max_size=5), st.sets(st.integers(0, 4), min_size=1),
       st.lists(st.floats(0.001, 1.0), min_size=5, max_size=5))
def test_untrained_predictions_stay_between_the_measured_neighbours(calib, trained, truth):
    """Brute force: whatever the calibrations and measurements, an untrained submodel's prediction is the
    nearest trained submodel's ratio times its calibration, clamped to [largest measured step among
    smaller submodels, smallest among larger ones] (the ceiling wins when the measurements disagree)."""
    t = table(steps_s=tuple(calib))
    run = RunningCalibration()
    for k in sorted(trained):
        run.observe(t.costs[k], t, truth[k], snap())
    for k in range(5):
        if k in trained:
            assert run.idle_step(t.costs[k]) == pytest.approx(truth[k])
            continue
        near = min(trained, key=lambda j: (abs(math.log((j + 1) / (k + 1))), -j))
        guess = calib[k] * truth[near] / calib[near]
        floor = max((truth[j] for j in trained if j < k), default=0.0)
        ceiling = min((truth[j] for j in trained if j > k), default=math.inf)
        assert run.idle_step(t.costs[k]) == pytest.approx(min(max(guess, floor), ceiling))


def test_the_load_of_the_last_round_is_expected_only_for_a_while():
    now = [0.0]
    t, run = table(), RunningCalibration(clock=lambda: now[0])
    run.observe(t.costs[0], t, 0.03, busy(own=1 / 3, others=5 / 3))  # a round beside others wanting 5 cores
    full = busy(own=0.0, others=2.0)  # the device idles, the others keep both cores busy: they may want more
    assert run.step_seconds(t.costs[0], t, full) == pytest.approx(0.01 * 3.0)
    assert run.step_seconds(t.costs[0], t, busy(own=0.0, others=0.5)) == pytest.approx(0.01)  # spare CPU: known
    now[0] += run.memory_s
    assert run.step_seconds(t.costs[0], t, full) == pytest.approx(0.01 * 1.5)  # long after: what it measures now


def test_choice_is_monotone_in_available_memory_even_for_unordered_peaks():
    rng = random.Random(4)
    for _ in range(30):
        peaks = [rng.uniform(50, 800) for _ in range(5)]  # calibrations need not be ordered
        t = table(peaks)
        cap = rng.choice([None, 2, 4])
        chosen = [pick(t, snap(m), max_submodel=cap).index for m in range(0, 1000, 7)]
        ranks = [-1 if k is None else k for k in chosen]
        assert ranks == sorted(ranks)
        assert ranks[-1] == (4 if cap is None else cap - 1)


def test_unknown_memory_or_uncalibrated_time_does_not_block():
    t = table(steps_s=(None,) * 5)
    sel = pick(t, snap(None), deadline_s=1.0)
    assert sel.index == 4 and all(f.memory_ok is None and f.time_ok is None for f in sel.fits)


def test_cuda_selection_uses_gpu_free_memory():
    gpu = GpuReading("fake", 1000 * MB, 750 * MB, 0.0)
    assert pick(table(device="cuda"), snap(10_000, gpus=(gpu,))).index == 1
    assert pick(table(device="cpu"), snap(10_000, gpus=(gpu,))).index == 4


def test_device_budget_emulates_a_smaller_slower_device():
    assert parse_size("300MB") == 300 * 10**6 and parse_size("512MiB") == parse_size("512M") == 512 * MB
    assert parse_size("1.5GB") == 1_500_000_000 and parse_size("4096") == 4096
    with pytest.raises(ValueError, match="300MB"):
        parse_size("lots")
    with pytest.raises(ValueError, match="cpu-budget"):
        DeviceBudget.parse(None, 1.5)
    b = DeviceBudget.parse("250MiB", 0.5)
    s = b.apply(snap(10_000))
    assert s.memory_available == 250 * MB
    sel = select_submodel(table(), s, 320, 1, safety_margin=0.0, speed=b.cpu_budget)
    assert sel.index == 1 and sel.fits[0].seconds == pytest.approx(0.2)
    assert b.padding(1.0) == pytest.approx(1.0)
    assert DeviceBudget().apply(snap(123)).memory_available == 123 * MB


def test_cuda_meter_with_fake_cuda():
    calls = []
    allocated = iter([100, 100])
    fake = SimpleNamespace(synchronize=lambda: calls.append("sync"), reset_peak_memory_stats=lambda: calls.append("reset"),
                           memory_allocated=lambda: next(allocated), max_memory_allocated=lambda: 1100)
    m = CudaMeter(fake)
    m.start()
    assert m.stop() == 1000 and calls == ["sync", "reset", "sync"]


def test_rss_meter_sees_a_real_allocation():
    m = RssMeter()
    m.start()
    block = bytearray(64 * MB)
    block[::4096] = b"x" * len(block[::4096])  # touch every page
    grown = m.stop()
    assert 60 * MB <= grown <= 80 * MB


# -- real measurements on this machine ---------------------------------------------------------------

@pytest.fixture(scope="module")
def wd_layout() -> Layout:
    return Layout.build(load_profile("resnet20-fmnist-wd"))


@pytest.mark.timeout(240)
def test_calibration_measures_real_steps_and_is_cached(wd_layout, tmp_path):
    first = calibrate(wd_layout, 8, threads=1, cache_dir=tmp_path, indices=[0, 4])
    assert first.measured_now == (0, 4)
    small, large = first.costs[0], first.costs[4]
    assert large.measured_peak > small.measured_peak > 0 and 0 < small.step_seconds
    assert first.costs[2].measured_peak is None  # not asked for: still the analytic estimate
    mtime = first.cache_file.stat().st_mtime_ns
    second = calibrate(wd_layout, 8, threads=1, cache_dir=tmp_path, indices=[0, 4])
    assert second.measured_now == () and second.costs == first.costs
    assert first.cache_file.stat().st_mtime_ns == mtime
    assert cache_path(wd_layout, 16, "cpu", 1, tmp_path) != first.cache_file  # another batch size: another entry
    cached = json.loads(first.cache_file.read_text())["submodels"]
    assert small.step_seconds == cached["0"]["cpu_seconds"] > 0  # one thread: the step's CPU time


def test_idle_step_time_is_cpu_time_on_one_thread_else_wall_time_over_the_slowdown():
    entry = {"seconds": 0.3, "cpu_seconds": 0.12, "slowdown": 1.5}  # measured beside two busy loops
    assert idle_seconds(entry, "cpu", 1) == 0.12  # the busy loops stretched the wall time, not the CPU time
    assert idle_seconds(entry, "cpu", 2) == pytest.approx(0.2)  # several threads: CPU time sums them
    assert idle_seconds(entry, "cuda", 1) == pytest.approx(0.2)
    assert idle_seconds({"seconds": 0.3, "slowdown": 1.5}, "cpu", 1) == pytest.approx(0.2)  # a cache from before


@pytest.fixture(scope="module")
def w_table(tmp_path_factory) -> tuple[Layout, CostTable]:
    layout = Layout.build(load_profile("resnet20-fmnist-w"))
    return layout, calibrate(layout, 16, threads=1, cache_dir=tmp_path_factory.mktemp("cal"))


@pytest.mark.timeout(240)
def test_calibrated_memory_is_monotone_in_gamma(w_table):
    layout, t = w_table
    peaks = [c.measured_peak for c in t.costs]
    assert all(p is not None for p in peaks) and peaks == sorted(peaks), peaks
    assert t.costs[-1].step_seconds > t.costs[0].step_seconds
    estimates = [c.estimated_peak for c in t.costs]
    assert all(0.5 < m / e < 2 for m, e in zip(peaks, estimates)), (peaks, estimates)


TRAIN_UNDER_BUDGET = r"""
import json, sys, torch
from nefl.nested.profile import load_profile
from nefl.nested.state import Layout
from nefl.nested.train import TrainConfig, local_train, module_state
torch.set_num_threads(1)
profile, k, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
layout = Layout.build(load_profile(profile))
shape = layout.profile.input_shape
batches = [(torch.randn(batch, *shape), torch.randint(0, 10, (batch,))) for _ in range(3)]
def kib(field):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(field + ":"))
open("/proc/self/clear_refs", "w").write("5")  # peak RSS := current RSS
base = kib("VmRSS")
model = layout.module(k)
local_train(model, module_state(model), batches, TrainConfig(local_epochs=2))
print(json.dumps({"growth": kib("VmHWM") - base}))
"""


@pytest.mark.timeout(240)
def test_selected_submodel_trains_within_the_memory_budget(w_table):
    layout, t = w_table
    peaks = [c.measured_peak for c in t.costs]
    margin = 0.2
    budget = DeviceBudget(memory_budget=int((peaks[1] + peaks[-1]) / 2 / (1 - margin)))
    sel = select_submodel(t, budget.apply(snap(10_000)), 160, 1, safety_margin=margin)
    assert sel.index is not None and 1 <= sel.index < layout.num_submodels - 1 and sel.binding == "memory"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", TRAIN_UNDER_BUDGET, "resnet20-fmnist-w", str(sel.index), "16"],
                         capture_output=True, text=True, env=env, timeout=200, check=True)
    growth = json.loads(out.stdout.strip().splitlines()[-1])["growth"]
    assert growth <= budget.memory_budget, (growth, budget.memory_budget, sel.reason)
    assert growth >= 2 * 4 * t.costs[sel.index].params  # at least its weights and gradients: a real measurement


def test_plan_command_estimates_and_reports_the_choice(tmp_path):
    args = ["plan", "--profile", "resnet20-fmnist-wd", "--no-calibrate", "--cache-dir", str(tmp_path), "--threads", "1"]
    ok = CliRunner().invoke(app, args + ["--json"])
    assert ok.exit_code == 0, ok.output
    data = json.loads(ok.output)
    assert data["selection"]["submodel"] == 5 and len(data["costs"]) == 5
    capped = CliRunner().invoke(app, args + ["--max-submodel", "2"])
    assert capped.exit_code == 0 and "choice:" in capped.output and "--max-submodel 2" in capped.output
    skip = CliRunner().invoke(app, args + ["--memory-budget", "1MB"])
    assert skip.exit_code == 3 and "skip round" in skip.output
    bad = CliRunner().invoke(app, args + ["--memory-budget", "lots"])
    assert bad.exit_code == 2
