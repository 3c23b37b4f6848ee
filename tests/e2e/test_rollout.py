"""End to end: `aggregator publish` / `aggregator rollout` and real `edge-client serve --follow` devices over
real mosquitto, answering HTTP requests in a loop while versions are swapped, canaried and rolled back."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import paho.mqtt.client as mqtt
import pytest
from typer.testing import CliRunner, Result

from aggregator.cli import app
from aggregator.keys import KeyDir
from aggregator.rollout import connect_operator
from nefl.protocol.manifest import read_manifest, write_manifest
from nefl.protocol.messages import DeployReport, Release, VersionStats
from nefl.protocol.signing import Signer
from nefl.protocol.topics import Topics
from nefl.protocol.wire import split_chunk
from tests.harness.rollout_helpers import LoadLoop, get_json, release_messages, rollout, slow_export
from tests.harness.procs import free_port, needs_mosquitto, wait_for

pytestmark = [pytest.mark.slow, needs_mosquitto]
T = Topics("t")


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """v1: resnet8's smallest and largest rungs; v2: the same files re-exported later (a new manifest, so a new
    version); slow: v2 with a latency regression that passes every hash and parity check."""
    from export.onnx_export import export_checkpoint
    from nefl.nested.checkpoint import save_checkpoint
    from nefl.nested.profile import load_profile
    from nefl.nested.state import GlobalState, Layout

    root = tmp_path_factory.mktemp("exports")
    layout = Layout.build(load_profile("resnet8-fmnist-w"))
    ckpt = save_checkpoint(root / "ckpt", GlobalState.init(layout, 1), layout, {"round": 3})
    export_checkpoint(ckpt, root / "v1", submodels=[0, layout.num_submodels - 1])
    shutil.copytree(root / "v1", root / "v2")
    write_manifest(root / "v2", msgspec.structs.replace(read_manifest(root / "v1"), created="2030-01-01T00:00:00Z"))
    return {"v1": root / "v1", "v2": root / "v2", "slow": slow_export(root / "v2", root / "slow", extra_matmuls=8)}


@pytest.fixture(autouse=True)
def operator_keys(procs, monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator's commands in this process use the key directory of the test's processes: a rollout
    history of the test's own (it lives with the federation's keys)."""
    monkeypatch.setenv("NEFL_KEY_DIR", str(procs.tmp / "keys"))


def aggregator(*args: str) -> Result:
    """The operator's commands in this process (a new process would spend most of its time importing torch)."""
    return CliRunner().invoke(app, list(args))


def follow(procs, name: str, broker_port: int, *extra: str, models: Path | None = None) -> int:
    """Start a following device; returns its HTTP port (call `listening` before using it)."""
    """An `edge-client serve --follow` device, enrolled first with its device key (`aggregator enroll --follower`)."""
    port = free_port()
    key = KeyDir("t").server_signer().public_text
    device_key = Signer.load_or_create(procs.tmp, f"{name}.key")
    enrolled = aggregator("enroll", name, "--follower", "--public-key", device_key.public_text, "--federation", "t")
    assert enrolled.exit_code == 0, enrolled.output
    procs.start(name, [sys.executable, "-c", "from edge_client.cli import app; app()", "serve", "--follow",
                       f"mqtt://127.0.0.1:{broker_port}", "--federation", "t", "--server-key", key, "--client-id", name,
                       "--device-key", str(procs.tmp / f"{name}.key"), "--models", str(models or procs.tmp / name),
                       "--port", str(port), "--threads", "1", *extra])
    return port


def listening(ports: dict[str, int]) -> None:
    for name, port in ports.items():
        wait_for(lambda: get_json(f"http://127.0.0.1:{port}/health")[0] in (200, 503), 120, f"{name} to listen")


def serving(port: int) -> int | None:
    return get_json(f"http://127.0.0.1:{port}/health")[1].get("version")


def publish(procs, broker: int, export: Path, version: int) -> None:
    """What `aggregator publish --export` without a canary does, in this process (the CLI runs for the canary)."""
    op = connect_operator(str(procs.tmp / "run"), "t", f"mqtt://127.0.0.1:{broker}", (None,) * 5)
    op.publish_files(export, version, 256 * 1024, "plain")
    op.promote(version, "published by the test")
    op.fleet.close()


def broker_args(port: int, procs) -> list[str]:
    return ["--broker", f"mqtt://127.0.0.1:{port}", "--federation", "t", "--checkpoint-dir", str(procs.tmp / "run")]


@pytest.mark.extended
def test_three_devices_swap_while_serving_and_a_slow_canary_is_rolled_back(procs, exports: dict[str, Path]) -> None:
    broker = free_port()
    procs.mosquitto(broker)
    small, large = sorted(read_manifest(exports["v1"]).submodels, key=lambda e: e.gamma)
    need = {e.index: e.weight_bytes + e.activation_bytes_per_sample for e in (small, large)}
    budget = str((64 << 20) + (need[small.index] + need[large.index]) // 2)  # d3 fits the small submodel only
    ports = {name: follow(procs, name, broker, *extra) for name, extra in
             [("d1", ()), ("d2", ()), ("d3", ("--memory-budget", budget))]}
    listening(ports)
    publish(procs, broker, exports["v1"], 1)
    wait_for(lambda: all(serving(p) == 1 for p in ports.values()), 120, "every device to serve v1")
    loops = {name: LoadLoop(port) for name, port in ports.items()}
    for loop in loops.values():
        loop.start()
    try:
        wait_for(lambda: all(len(loop.answers) > 20 for loop in loops.values()), 60, "requests on v1")
        publish(procs, broker, exports["v2"], 2)
        wait_for(lambda: all(serving(p) == 2 for p in ports.values()), 120, "every device to swap to v2")
        wait_for(lambda: all(sum(a.version == 2 for a in loop.answers) > 40 for loop in loops.values()), 60,
                 "requests on v2")
        # an anonymous client of the broker reports the coming version as perfect under a made-up id
        attacker = Signer.load_or_create(procs.tmp, "attacker.key")
        forged = attacker.sign(DeployReport(client="zz", federation="t", key=attacker.public_text, state="serving",
                                            version=3, time=time.time() + 3600,
                                            current=VersionStats(version=3, requests=500, errors=0, p95_ms=1.0)).to_json())
        _publish_raw(broker, [(T.deploy_status("zz"), forged)])
        canary = aggregator("publish", "--export", str(exports["slow"]), "--canary", "0.34", "--min-requests", "20",
                            "--watch-s", "180", *broker_args(broker, procs))
    finally:
        for loop in loops.values():
            loop.stop()
    assert canary.exit_code == 1, canary.output
    state = json.loads((KeyDir("t").rollout_dir / "rollout.json").read_text())
    assert state["stable"] == 2 and state["revoked"] == [3] and state["canary"] is None
    assert "rolled back on the canary" in state["reason"] and "p95" in state["reason"], state["reason"]
    status = aggregator("rollout", "status", "--json", *broker_args(broker, procs))
    assert status.exit_code == 0, status.output
    view = json.loads(status.stdout)
    devices = {d["client"]: d for d in view["devices"]}
    assert set(devices) == {"d1", "d2", "d3"}  # the forged report counted for nothing, and was never a canary
    canaries = [n for n, d in devices.items() if "rolled back v3 -> v2" in d["event"]]
    assert len(canaries) == 1, {n: d["event"] for n, d in devices.items()}  # one of three devices was the canary
    for name, loop in loops.items():
        assert loop.failed == [], (name, loop.failed[:3])
        versions = [a.version for a in sorted(loop.answers, key=lambda a: a.sent)]
        first_v2 = versions.index(2)
        assert set(versions[:first_v2]) == {1} and 1 not in versions[first_v2 + 1:], name  # one swap, between requests
        assert (3 in versions) == (name in canaries), name  # the canary served v3 and went back, without a failure
    for name, d in devices.items():
        assert d["version"] == 2 and d["state"] == "serving", (name, d)
        if name not in canaries:  # the others never fetched a byte of v3
            assert not list((procs.tmp / name).glob("*/v3")) and "v3" not in procs.log(name)
    assert devices["d3"]["submodels"] == [small.index] and devices["d3"]["fetched_bytes"] < devices["d1"]["fetched_bytes"]

    forced = aggregator("rollout", "rollback", "--reason", "forced by the test", *broker_args(broker, procs))
    assert forced.exit_code == 0, forced.output
    wait_for(lambda: all(serving(p) == 1 for p in ports.values()), 120, "every device back on v1")
    for name in ports:  # from disk where v1 was kept; fetched again on the canary, whose v1 made way for v3
        def went_back(name: str = name) -> bool:  # the swap serves before its log line is written
            log = procs.log(name)
            return "rolled back v2 -> v1: the operator's signed rollback (v2 rolled back to v1: forced by the test)" in \
                log or (name in canaries and "swapped v2 -> v1" in log)
        wait_for(went_back, 30, f"{name}'s log to say it went back to v1")


def _publish_raw(port: int, messages: list[tuple[str, bytes]]) -> None:
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv311)
    client.connect("127.0.0.1", port)
    client.loop_start()
    for topic, payload in messages:
        client.publish(topic, payload, qos=1, retain=True).wait_for_publish(10)
    client.disconnect()
    client.loop_stop()


def test_bad_input_is_refused_a_broken_transfer_resumes_and_a_signed_rollback_is_obeyed(procs, exports) -> None:
    broker = free_port()
    procs.mosquitto(broker)
    port = follow(procs, "d1", broker)
    server = KeyDir("t").server_signer()
    release1, chunks1 = release_messages(server, exports["v1"], 1)
    _publish_raw(broker, [*chunks1, (T.deploy_release(1), release1), (T.deploy_rollout, rollout(server, 1, 1))])
    wait_for(lambda: serving(port) == 1, 120, "v1")

    forger = Signer.load_or_create(procs.tmp / "forger")
    unsigned = rollout(server, 5, 2)
    release2, chunks2 = release_messages(server, exports["v2"], 2)
    topic, chunk = chunks2[0]
    data = bytes(split_chunk(chunk)[3])
    bad = [(T.deploy_rollout, unsigned[:unsigned.rindex(b',"sig"')] + b"}"),
           (T.deploy_rollout, rollout(forger, 5, 2)),
           (T.deploy_rollout, rollout(server, 5, 2, federation="other")),
           (T.deploy_rollout, rollout(server, 2, 2)),  # now fetch v2 and meet damaged chunks
           (T.deploy_release(2), release2),
           (topic, chunk[:len(chunk) - len(data)] + data[:-10]),
           (topic, chunk[:len(chunk) - len(data)] + data + b"0123456789"),
           (topic, chunk[:len(chunk) - len(data)] + data[:-1] + bytes([data[-1] ^ 1]))]
    for message in bad:
        _publish_raw(broker, [message])
        time.sleep(0.3)  # one at a time: each retained one replaces the one before
    wait_for(lambda: "does not hash to the digest in its header" in procs.log("d1"), 30, "the damaged chunks to be refused")
    log = procs.log("d1")
    for words in ["refused rollout message: message carries no server signature",
                  "refused rollout message: signature does not match the pinned server key",
                  "refused rollout of federation 'other': this device follows 't'",
                  "bytes, the header says", "does not hash to the digest in its header, which the signed release names"]:
        assert words in log, words
    assert serving(port) == 1  # the old version kept serving through all of it

    # the broker goes away mid-transfer: half of v2's chunks arrived, the rest come after a restart
    half = len(chunks2) // 2
    _publish_raw(broker, chunks2[1:half])
    wait_for(lambda: len(list((procs.tmp / "d1" / "staging" / "v2").glob("*.part"))) > 0, 30, "v2 staging")
    time.sleep(1)  # the rest of the half on its way to disk
    procs.procs[f"mosquitto-{broker}"].kill()
    procs.procs[f"mosquitto-{broker}"].wait(10)
    time.sleep(1)
    procs.mosquitto(broker)  # an empty broker: what the operator publishes again is all there is
    _publish_raw(broker, [*chunks2, (T.deploy_release(2), release2), (T.deploy_rollout, rollout(server, 3, 2))])
    wait_for(lambda: serving(port) == 2, 120, "v2 after the broker came back")
    resumed = re.search(r"resuming v2: (\d+) of (\d+) chunks already staged", procs.log("d1"))
    assert resumed and 0 < int(resumed[1]) < int(resumed[2]) == len(chunks2), procs.log("d1")[-3000:]

    _publish_raw(broker, [(T.deploy_rollout, rollout(server, 4, 1))])  # older, not revoking v2
    wait_for(lambda: "no downgrade unless the operator signs a rollback" in procs.log("d1"), 30, "the downgrade refusal")
    assert serving(port) == 2
    _publish_raw(broker, [(T.deploy_rollout, rollout(server, 5, 1, revoked=[2], reason="forced"))])
    wait_for(lambda: serving(port) == 1, 60, "the signed rollback to v1")
    # the device swaps, then logs: on a loaded machine the line may come a moment after v1 answers
    wait_for(lambda: "rolled back v2 -> v1: the operator's signed rollback (forced)" in procs.log("d1"), 30,
             "the rollback's log line")


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounting a small tmpfs needs root")
def test_a_disk_that_fills_while_staging_leaves_the_old_version_serving(procs, exports: dict[str, Path]) -> None:
    """A real ENOSPC: the device's directory is a tmpfs whose free space passes the check before staging
    (--keep-free 0) but not the page-rounded files of the second version."""
    disk = procs.tmp / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], check=True)
    try:
        broker = free_port()
        procs.mosquitto(broker)
        server = KeyDir("t").server_signer()
        port = follow(procs, "d1", broker, "--keep-free", "0", models=disk / "d1")
        listening({"d1": port})
        release1, chunks1 = release_messages(server, exports["v1"], 1)
        _publish_raw(broker, [*chunks1, (T.deploy_release(1), release1), (T.deploy_rollout, rollout(server, 1, 1))])
        wait_for(lambda: serving(port) == 1, 120, "v1")
        release2, chunks2 = release_messages(server, exports["v2"], 2)
        files = Release.from_json(release2[:release2.rindex(b',"sig"')] + b"}", 1 << 20).files
        pages = sum(-(-f.size // 4096) * 4096 for f in files)  # tmpfs hands out 4 KiB pages
        # room for every chunk and one page more (a state file rewrite), not for the manifest and release
        # written beside them at the end: the disk fills while staging, after the check before it passed
        (disk / "filler").write_bytes(b"\0" * (shutil.disk_usage(disk).free - pages - 4096))
        _publish_raw(broker, [*chunks2, (T.deploy_release(2), release2), (T.deploy_rollout, rollout(server, 2, 2))])
        wait_for(lambda: "No space left on device" in procs.log("d1"), 60, "the disk to fill")
        assert serving(port) == 1 and "staging discarded, retrying in 30 s" in procs.log("d1")
        assert not (disk / "d1" / "staging" / "v2").exists()
    finally:
        procs.stop_all()
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_one_rollout_history_per_federation_and_no_replay_shown_as_current(procs, exports, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    broker = free_port()
    procs.mosquitto(broker)
    where = ["--broker", f"mqtt://127.0.0.1:{broker}", "--federation", "t"]
    first = aggregator("publish", "--export", str(exports["v1"]), *where)
    assert first.exit_code == 0, first.output
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # no runs/t here: the state is the key directory's all the same
    second = aggregator("publish", "--export", str(exports["v2"]), *where)
    assert second.exit_code == 0, second.output
    state = json.loads((KeyDir("t").rollout_dir / "rollout.json").read_text())
    assert state["seq"] == 2 and state["stable"] == 2 and not (elsewhere / "runs").exists()

    stale = tmp_path / "stale-state"  # a state that does not know rollout #2 (another copy, an old backup)
    for args in (["publish", "--export", str(exports["v1"])], ["rollout", "promote"], ["rollout", "rollback"]):
        forked = aggregator(*args, *where, "--state-dir", str(stale))
        assert forked.exit_code == 2, forked.output
        errors = [line for line in forked.output.splitlines() if line.startswith("error:")]  # the rest: log lines
        assert len(errors) == 1 and "rollout #2, newer than #0" in errors[0] and str(stale) in errors[0], forked.output
    assert not stale.exists()

    _publish_raw(broker, [(T.deploy_rollout, rollout(KeyDir("t").server_signer(), 1, 1))])  # an old signed rollout
    status = aggregator("rollout", "status", "--json", *where)
    assert status.exit_code == 0, status.output
    assert json.loads(status.stdout)["rollout"]["seq"] == 2 and json.loads(status.stdout)["rollout"]["stable"] == 2


@pytest.mark.extended
def test_a_report_claimed_first_under_a_real_id_hides_no_device(procs, exports: dict[str, Path]) -> None:
    """Issue 42: someone on the broker reports under an enrolled follower's id before that follower first reports
    (signed by its own key, dated ahead, retained). `rollout status` counts it for nothing, and once the device
    reports it shows, with what it runs."""
    broker = free_port()
    procs.mosquitto(broker)
    publish(procs, broker, exports["v1"], 1)
    real = Signer.load_or_create(procs.tmp, "d1.key")
    assert aggregator("enroll", "d1", "--follower", "--public-key", real.public_text, "--federation", "t").exit_code == 0
    thief = Signer.load_or_create(procs.tmp, "thief.key")
    claim = DeployReport(client="d1", federation="t", key=thief.public_text, state="serving", version=1,
                         time=time.time() + 3600, connection=2**40)
    _publish_raw(broker, [(T.deploy_status("d1"), thief.sign(claim.to_json()))])

    def devices() -> dict[str, dict]:
        status = aggregator("rollout", "status", "--json", *broker_args(broker, procs))
        assert status.exit_code == 0, status.output
        return {d["client"]: d for d in json.loads(status.stdout)["devices"]}

    assert devices() == {}  # the claim is no one's report
    port = follow(procs, "d1", broker)  # enrols the same key again, then starts the device
    listening({"d1": port})
    wait_for(lambda: serving(port) == 1, 120, "d1 to serve v1")
    wait_for(lambda: devices().get("d1", {}).get("version") == 1, 60, "d1's own report in rollout status")
