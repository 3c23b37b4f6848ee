"""End to end: `aggregator serve --mode buffered` and three `edge-client join`s as real processes over mosquitto:
versions are committed whenever K updates arrived, every device contributes, and each committed update's
staleness is in the metrics line (docs/operations.md, "Buffered mode")."""

from __future__ import annotations

import json
import re
import signal
import sys

import pytest

from nefl.nested.checkpoint import load_checkpoint
from nefl.nested.profile import load_profile
from tests.harness.procs import (PROFILE, client_args, finish, free_port, metrics, needs_mosquitto, serve_args,
                                 step_seconds_now, wait_for)


def buffered_args(port: int, versions: int, task_s: float, k: int = 3, wait_for_devices: int = 3) -> list[str]:
    return [*serve_args(["--broker", f"mqtt://127.0.0.1:{port}"], versions, task_s, per_round=3),
            "--mode", "buffered", "--buffer-size", str(k), "--min-clients", str(wait_for_devices), "--join-wait", "5"]


def task_bound_s() -> float:
    """--round-timeout, the bound on one task: 64 samples at batch 16 are 4 steps of at most the full model, and the
    bound scales with this machine's speed now (it is shared); it never ends an honest device's task here."""
    return max(60.0, 40 * step_seconds_now() * 4)


def committed_versions(tmp) -> dict[int, dict]:
    return {v: m for v, m in metrics(tmp).items() if v >= 1}


@needs_mosquitto
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_buffered_serve_commits_versions_with_every_device(procs, tmp_path):
    task_s, port, versions = task_bound_s(), free_port(), 6
    procs.mosquitto(port)
    procs.aggregator("agg", buffered_args(port, versions, task_s))
    for i, sub in enumerate((1, 2, 4), start=1):
        procs.client(f"c{i}", f"mqtt://127.0.0.1:{port}", client_args(i, 64, sub))
    finish(procs, "agg", 60 + versions * task_s)  # a version needs K tasks of three devices training at once
    lines = committed_versions(tmp_path)
    assert sorted(lines) == list(range(1, versions + 1)), sorted(lines)
    contributors = set()
    for v, line in lines.items():
        assert line["mode"] == "buffered" and line["committed"] and line["version"] == v
        assert len(line["staleness"]) == 3 and all(0 <= t <= 16 for t in line["staleness"]), line["staleness"]
        assert sum(line["updates_per_submodel"]) == 3
        for c in line["clients"].values():
            assert c["staleness"] == v - 1 - c["version"], c  # the staleness is that of the version it trained from
        contributors |= set(line["reported"])
    assert contributors == {"c1", "c2", "c3"}, contributors
    # c1 can train only submodel 1: its updates are submodel 1's; the coverage rule gives every submodel <= 4 a task
    for line in lines.values():
        for c in line["clients"].values():
            if c["client"] == "c1":
                assert c["submodel"] == 1
    given = {int(k) for k in re.findall(r"task \d+: c\d trains submodel (\d+)", procs.log("agg"))}
    assert given == {1, 2, 3, 4}, given  # submodel 3 is nobody's bound: c3 gets it once it went 4 versions untasked
    totals = lines[versions]["updates_per_submodel_total"]
    assert all(totals[k] > 0 for k in (0, 1, 3)), totals  # whether submodel 3's update lands by version 6 is timing
    ckpt = load_checkpoint(tmp_path / "run", load_profile(PROFILE))
    assert ckpt.meta["mode"] == "buffered" and ckpt.meta["version"] == versions == ckpt.meta["round"]
    for i in (1, 2, 3):
        finish(procs, f"c{i}", 30)  # every device saw the end and left
    assert "task " in procs.log("c1") and "version" in procs.log("agg")
    json.dumps(lines)  # the lines are plain JSON


def contributions(tmp, first: int = 1) -> dict[str, int]:
    """Updates each device got committed, in versions from `first` on."""
    out: dict[str, int] = {}
    for v, line in committed_versions(tmp).items():
        for c in line["clients"].values() if v >= first else ():
            out[c["client"]] = out.get(c["client"], 0) + 1
    return out


@pytest.mark.extended
@needs_mosquitto
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_buffered_serve_survives_a_device_killed_mid_task_a_server_restart_and_a_busy_device(procs, tmp_path):
    task_s, port, versions = task_bound_s(), free_port(), 14
    broker = f"mqtt://127.0.0.1:{port}"
    procs.mosquitto(port)
    # the resumed server waits for the two survivors (c3's retained announce outlives it)
    agg = procs.aggregator("agg", buffered_args(port, versions, task_s, k=2, wait_for_devices=2))
    for n in (1, 2):  # two busy loops beside c2, as scripts/with-busy-loops.sh runs them (here the test's processes,
        procs.start(f"busy{n}", [sys.executable, "-c", "while 1: pass"])  # killed at teardown whatever happens)
    procs.client("c1", broker, client_args(1, 64, 1))
    procs.client("c2", broker, client_args(2, 64, 2))
    # c3's tasks are long (1,500 samples of submodel 3): it is killed while one runs
    victim = procs.client("c3", broker, client_args(3, 1500, 3))
    wait_for(lambda: re.search(r"task \d+: c3 trains", procs.log("agg")), 60 + 10 * task_s, "a task for c3")
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    assert "trained submodel" not in procs.log("c3")  # killed mid-task: it never uploaded
    killed_at = max(committed_versions(tmp_path), default=0)
    wait_for(lambda: max(committed_versions(tmp_path), default=0) >= killed_at + 3, 10 * task_s,
             "three versions after c3 was killed")
    agg.send_signal(signal.SIGKILL)
    agg.wait(10)
    saved = load_checkpoint(tmp_path / "run", load_profile(PROFILE)).meta["version"]
    assert saved >= killed_at + 3
    procs.aggregator("agg2", [*buffered_args(port, versions, task_s, k=2, wait_for_devices=2), "--resume"])
    finish(procs, "agg2", 60 + versions * task_s / 2)
    assert f"resuming federation 't' at round {saved + 1}" in procs.log("agg2")
    lines = committed_versions(tmp_path)
    assert sorted(lines) == list(range(1, versions + 1))  # none lost, none repeated
    after = contributions(tmp_path, first=saved + 1)
    assert after.get("c1", 0) >= 1 and after.get("c2", 0) >= 1, after  # both survivors kept contributing
    assert "c3" not in contributions(tmp_path, first=killed_at + 2)  # a dead device holds nothing up
    assert load_checkpoint(tmp_path / "run", load_profile(PROFILE)).meta["version"] == versions
    for c in ("c1", "c2"):
        finish(procs, c, 30)
