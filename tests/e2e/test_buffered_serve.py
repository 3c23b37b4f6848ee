"""End to end: `aggregator serve --mode buffered` and three `edge-client join`s as real processes over mosquitto:
versions are committed whenever K updates arrived, every device contributes, and each committed update's
staleness is in the metrics line (docs/operations.md, "Buffered mode")."""

from __future__ import annotations

import json

import pytest

from nefl.nested.checkpoint import load_checkpoint
from nefl.nested.profile import load_profile
from tests.harness.procs import PROFILE, client_args, finish, free_port, metrics, needs_mosquitto, serve_args, step_seconds_now


def buffered_args(port: int, versions: int, task_s: float, k: int = 3) -> list[str]:
    return [*serve_args(["--broker", f"mqtt://127.0.0.1:{port}"], versions, task_s, per_round=3),
            "--mode", "buffered", "--buffer-size", str(k), "--min-clients", "3", "--join-wait", "5"]


def committed_versions(tmp) -> dict[int, dict]:
    return {v: m for v, m in metrics(tmp).items() if v >= 1}


@needs_mosquitto
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_buffered_serve_commits_versions_with_every_device(procs, tmp_path):
    # 64 samples at batch 16: 4 steps of at most the full model a task; the bound on one task scales with this
    # machine's speed now (it is shared), and is never what ends a task of an honest device here
    step = step_seconds_now()
    task_s = max(60.0, 40 * step * 4)
    port = free_port()
    procs.mosquitto(port)
    versions = 6
    procs.aggregator("agg", buffered_args(port, versions, task_s))
    for i, sub in enumerate((1, 2, 4), start=1):
        procs.client(f"c{i}", f"mqtt://127.0.0.1:{port}", client_args(i, 64, sub))
    finish(procs, "agg", 120 + versions * 3 * task_s / 2)
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
    assert all(n > 0 for n in lines[versions]["updates_per_submodel_total"][:4]), lines[versions]["updates_per_submodel_total"]
    ckpt = load_checkpoint(tmp_path / "run", load_profile(PROFILE))
    assert ckpt.meta["mode"] == "buffered" and ckpt.meta["version"] == versions == ckpt.meta["round"]
    for i in (1, 2, 3):
        finish(procs, f"c{i}", 30)  # every device saw the end and left
    assert "task " in procs.log("c1") and "version" in procs.log("agg")
    json.dumps(lines)  # the lines are plain JSON
