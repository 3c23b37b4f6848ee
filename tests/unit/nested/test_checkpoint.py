import json
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import nefl.nested.checkpoint as checkpoint
from aggregator.federation import state_digest
from nefl.nested.checkpoint import (CheckpointError, append_metrics, checkpoint_files, has_checkpoint, load_checkpoint,
                             replay_metrics, save_checkpoint)
from nefl.nested.profile import load_profile
from nefl.nested.state import GlobalState, Layout

CRASHED = 73  # the forked writer's exit status when it died at the chosen step


@pytest.fixture
def layout() -> Layout:
    return Layout.build(load_profile("resnet20-fmnist-wd"))


@pytest.fixture
def saved(tmp_path, layout):
    state = GlobalState.init(layout, seed=5)
    save_checkpoint(tmp_path, state, layout, {"round": 3})
    return tmp_path, layout, state


def state_of(layout: Layout, r: int) -> GlobalState:
    return GlobalState.init(layout, seed=r)


def commit_round(d: Path, layout: Layout, r: int, state: GlobalState | None = None) -> None:
    """What the server does after a round: commit the checkpoint with its metrics line, then append the line."""
    facts = {"round": r, "wall_s": 0.5 * r}
    save_checkpoint(d, state or state_of(layout, r), layout, {"round": r}, metrics=facts)
    if checkpoint._crash_hook is not None:  # the crash tests also kill the writer between commit and append
        checkpoint._crash_hook("append")
    append_metrics(d, facts)


def metric_rounds(d: Path) -> list[int]:
    return [json.loads(line)["round"] for line in (d / "metrics.jsonl").read_text().splitlines()]


def crash_at(n: int, write: Callable[[], None]) -> None:
    """Run `write` in a forked child that dies at its n-th step, as abruptly as a kill -9: no cleanup runs.

    `write` must not compute with torch: its thread pool does not survive a fork and the child hangs.
    """
    pid = os.fork()
    if pid == 0:
        seen = 0

        def hook(step: str) -> None:
            nonlocal seen
            seen += 1
            if seen == n:
                os._exit(CRASHED)

        checkpoint._crash_hook = hook
        try:
            write()
        finally:
            os._exit(0)
    deadline = time.monotonic() + 60
    while (waited := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the forked writer hung before step {n}")
        time.sleep(0.005)
    assert os.waitstatus_to_exitcode(waited[1]) == CRASHED


def steps_of(write: Callable[[], None]) -> list[str]:
    steps: list[str] = []
    checkpoint._crash_hook = steps.append
    try:
        write()
    finally:
        checkpoint._crash_hook = None
    return steps


def test_roundtrip_is_bit_identical(saved) -> None:
    d, layout, state = saved
    ck = load_checkpoint(d)
    assert ck.meta["round"] == 3 and ck.meta["method"] == "nefl"
    for n, t in state.flat().items():
        assert torch.equal(ck.state.flat()[n], t)
    assert has_checkpoint(d) and checkpoint_files(d).parent == d / "checkpoints"
    assert [p.name for p in d.iterdir() if p.name.startswith(".")] == []  # no temp files left
    assert [p.name for p in (d / "checkpoints").iterdir() if p.name.startswith(".")] == []


def test_other_profile_is_refused(saved) -> None:
    d, _, _ = saved
    with pytest.raises(CheckpointError, match="resnet20-fmnist-wd.*not 'resnet20-fmnist-w'"):
        load_checkpoint(d, load_profile("resnet20-fmnist-w"))


def test_corrupt_files_are_refused(saved) -> None:
    d, _, _ = saved
    files = checkpoint_files(d)
    blob = (files / "state.safetensors").read_bytes()
    (files / "state.safetensors").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(CheckpointError, match="corrupt state file"):
        load_checkpoint(d)
    (files / "meta.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt metadata"):
        load_checkpoint(d)
    (d / "CURRENT").write_text("../../etc\n")
    with pytest.raises(CheckpointError, match="names no snapshot"):
        load_checkpoint(d)


def test_a_corrupt_snapshot_names_the_intact_earlier_one_and_the_fix_works(saved) -> None:
    d, layout, _ = saved
    commit_round(d, layout, 4)
    newest = checkpoint_files(d)
    blob = (newest / "state.safetensors").read_bytes()
    (newest / "state.safetensors").write_bytes(blob[: len(blob) // 2])  # a disk that lost the newest writes
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(d)
    earlier = next(p for p in (d / "checkpoints").iterdir() if p != newest)
    assert f"the earlier snapshot {earlier} (round 3) is intact" in str(e.value)
    (d / "CURRENT").write_text(earlier.name + "\n")  # what the message says to do
    assert load_checkpoint(d).meta["round"] == 3


def test_non_finite_state_is_refused(saved) -> None:
    d, layout, state = saved
    state.consistent["fc.weight"][0, 0] = float("nan")
    save_checkpoint(d, state, layout, {"round": 4})
    with pytest.raises(CheckpointError, match="non-finite"):
        load_checkpoint(d)


def test_unserialisable_meta_fails_before_touching_the_disk(saved) -> None:
    d, layout, state = saved
    before = sorted(p.name for p in (d / "checkpoints").iterdir())
    with pytest.raises(TypeError):
        save_checkpoint(d, state, layout, {"round": 4}, metrics={"round": 4, "oops": object()})
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == before and load_checkpoint(d).meta["round"] == 3


def test_tensor_of_wrong_shape_is_refused(tmp_path, saved) -> None:
    d, layout, state = saved
    state.consistent["fc.weight"] = torch.zeros(10, 3)
    save_checkpoint(tmp_path / "bad", state, layout, {"round": 0})
    with pytest.raises(CheckpointError, match="fc.weight"):
        load_checkpoint(tmp_path / "bad")


def test_missing_checkpoint_says_where(tmp_path) -> None:
    assert not has_checkpoint(tmp_path / "nothing")
    with pytest.raises(CheckpointError, match="no checkpoint here"):
        load_checkpoint(tmp_path / "nothing")


def test_meta_records_profile_hash(saved) -> None:
    d, layout, _ = saved
    meta = json.loads((checkpoint_files(d) / "meta.json").read_text())
    assert meta["profile_hash"] == layout.profile.hash and meta["profile"] == "resnet20-fmnist-wd"


def test_old_flat_layout_still_loads_and_is_superseded(saved, tmp_path) -> None:
    d, layout, state = saved
    old = tmp_path / "old"
    shutil.copytree(checkpoint_files(d), old)  # state.safetensors, meta.json, profile.toml directly in DIR
    assert has_checkpoint(old) and checkpoint_files(old) == old
    assert state_digest(load_checkpoint(old).state) == state_digest(state)
    newer = GlobalState.init(layout, seed=6)
    save_checkpoint(old, newer, layout, {"round": 4})
    ck = load_checkpoint(old)
    assert ck.meta["round"] == 4 and state_digest(ck.state) == state_digest(newer)


def test_keeps_the_current_snapshot_and_the_one_before(tmp_path, layout) -> None:
    for r in range(1, 5):
        commit_round(tmp_path, layout, r)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["00000003", "00000004"]
    assert (tmp_path / "CURRENT").read_text() == "00000004\n"
    assert load_checkpoint(tmp_path).meta["round"] == 4 and metric_rounds(tmp_path) == [1, 2, 3, 4]


def test_replay_drops_a_torn_line_and_restores_the_committed_one(tmp_path, layout) -> None:
    commit_round(tmp_path, layout, 1)
    save_checkpoint(tmp_path, GlobalState.init(layout, 2), layout, {"round": 2}, metrics={"round": 2, "wall_s": 1.0})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"round": 2, "wal')  # the crash came mid-append
    assert replay_metrics(tmp_path) == 1
    assert (tmp_path / "metrics.jsonl").read_text().splitlines()[-1] == json.dumps({"round": 2, "wall_s": 1.0})
    assert replay_metrics(tmp_path) == 0 and metric_rounds(tmp_path) == [1, 2]


def test_replay_drops_an_unparsable_last_line(tmp_path, layout) -> None:
    commit_round(tmp_path, layout, 1)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write("\x00\x00\x00\n")  # what a power cut can leave in an extended file
    assert replay_metrics(tmp_path) == 0 and metric_rounds(tmp_path) == [1]


def test_replay_has_nothing_to_do(tmp_path, layout) -> None:
    assert replay_metrics(tmp_path) == 0  # no checkpoint, no metrics
    commit_round(tmp_path, layout, 1)
    before = (tmp_path / "metrics.jsonl").read_bytes()
    assert replay_metrics(tmp_path) == 0 and (tmp_path / "metrics.jsonl").read_bytes() == before
    save_checkpoint(tmp_path / "plain", GlobalState.init(layout, 0), layout, {"round": 0})  # saved without metrics
    assert replay_metrics(tmp_path / "plain") == 0 and not (tmp_path / "plain" / "metrics.jsonl").exists()


@pytest.mark.parametrize("committed", [0, 2], ids=["first-save", "replace"])
def test_a_crash_at_any_step_leaves_the_old_or_the_new_checkpoint(tmp_path, layout, committed) -> None:
    base = tmp_path / "base"
    base.mkdir()
    for r in range(1, committed + 1):
        commit_round(base, layout, r)
    if committed:
        (base / "checkpoints" / ".tmp-orphan").mkdir()  # left by an earlier crash
    new_round = committed + 1
    new_state = state_of(layout, new_round)
    digests = {r: state_digest(state_of(layout, r)) for r in (committed, new_round)}

    probe = tmp_path / "probe"
    shutil.copytree(base, probe)
    steps = steps_of(lambda: commit_round(probe, layout, new_round, new_state))
    assert {"write:state.safetensors", "fsync:meta.json", "rename", "pointer:rename", "append"} <= set(steps)
    assert committed == 0 or "gc:.tmp-orphan" in steps

    for n, step in enumerate(steps, 1):
        d = tmp_path / f"crash-{n}"
        shutil.copytree(base, d)
        crash_at(n, lambda: commit_round(d, layout, new_round, new_state))
        replay_metrics(d)
        if not has_checkpoint(d):  # a first save that never committed: nothing to resume, nothing lost
            assert committed == 0, step
        else:
            ck = load_checkpoint(d)
            got = ck.meta["round"]
            assert got in (committed, new_round) and state_digest(ck.state) == digests[got], step
            assert metric_rounds(d) == list(range(1, got + 1)), step
        commit_round(d, layout, new_round + 1)  # the writer after the crash works and tidies up
        ck = load_checkpoint(d)
        assert ck.meta["round"] == new_round + 1, step
        assert len(list((d / "checkpoints").iterdir())) <= 2 and not list(d.glob(".CURRENT.*")), step
