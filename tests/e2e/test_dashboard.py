"""End to end, one federation for three checks: embedded broker + `aggregator serve --http` + two
`edge-client join --http` processes for 2 rounds. The scraped /metrics must agree with
metrics.jsonl, the json logs must carry round/client/submodel/reason as keys, and headless Chromium
(Debian's `chromium`) must show both devices and the finished rounds on the dashboard; its
screenshot is kept as a test artifact in runs/test-artifacts/.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.request

import paho.mqtt.client as mqtt
import pytest
from prometheus_client.parser import text_string_to_metric_families

from aggregator.enrolment import Grant, append
from aggregator.keys import KeyDir
from nefl.protocol.messages import DeployReport, Rollout, VersionStats
from nefl.protocol.signing import Signer
from nefl.protocol.topics import Topics

from tests.harness.procs import (ROOT, Procs, client_args, free_port, metrics, port_open, serve_args, server_state,
                                   wait_for)

ROUNDS = 2
ARTIFACTS = ROOT / "runs" / "test-artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text as {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    """Runs the federation to its end; the aggregator's --http lingers so both tests can look at it."""
    tmp = tmp_path_factory.mktemp("observability")
    procs = Procs(tmp)
    broker_port, http_port, device_port = free_port(), free_port(), free_port()
    url = f"http://127.0.0.1:{http_port}/"
    try:
        procs.aggregator("agg", [*serve_args(["--embedded-port", str(broker_port)], ROUNDS, 60, per_round=2, evaluate=True),
                                 "--http", str(http_port), "--http-linger", "300", "--log-format", "json"])
        wait_for(lambda: port_open(broker_port), 60, "the embedded broker")
        broker = f"mqtt://127.0.0.1:{broker_port}"
        bad = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="garbage", protocol=mqtt.MQTTv311)
        bad.connect("127.0.0.1", broker_port)
        bad.loop_start()
        # retained, so the server counts it whenever it subscribes: one rejection in round 1
        bad.publish(Topics("t").update("mallory"), b"not a NEFL chunk", qos=1, retain=True).wait_for_publish(10)
        for topic, payload in _followed_fleet(tmp):  # what a model rollout leaves on the broker
            bad.publish(topic, payload, qos=1, retain=True).wait_for_publish(10)
        bad.disconnect()
        bad.loop_stop()
        procs.client("c1", broker, client_args(1, 320, 1, "--http", str(device_port), "--log-format", "json"))
        procs.client("c2", broker, client_args(2, 320, 2))
        # the device's own metrics, while it is still in the federation (it leaves at the end)
        device = wait_for(lambda: _scraped_after_upload(f"http://127.0.0.1:{device_port}/metrics"), 300,
                          "c1's /metrics after its first upload")
        wait_for(lambda: server_state(tmp).get("state") == "finished", 300, "the federation to finish")
        wait_for(lambda: procs.procs["agg"].poll() is None and port_open(http_port), 10, "the lingering --http")
        yield tmp, url, device, procs
    finally:
        procs.stop_all()


def _followed_fleet(tmp) -> list[tuple[str, bytes]]:
    """A signed rollout (v2 stable, v3 on canary d8) and the signed reports of two following devices."""
    t, server = Topics("t"), KeyDir("t", tmp / "keys").server_signer()  # the running aggregator's key
    messages = [(t.deploy_rollout, server.sign(Rollout(federation="t", seq=4, stable=2, canary=3,
                                                       canary_devices=["d8"]).to_json()))]
    for name, version in (("d8", 3), ("d9", 2)):
        key = Signer.load_or_create(tmp / "devices", f"{name}.key")
        append(KeyDir("t", tmp / "keys").journal, Grant(client=name, role="follower", created=time.time(),
                                                        key=key.public_text))  # their reports count only once enrolled
        report = DeployReport(client=name, federation="t", key=key.public_text, state="serving", version=version,
                              target=version, health="ok", time=time.time(), fetched_bytes=1000, release_bytes=3000,
                              current=VersionStats(version=version, requests=40, errors=0, p95_ms=3.25))
        messages.append((t.deploy_status(name), key.sign(report.to_json())))
    return messages


def _scraped_after_upload(url: str) -> dict | None:
    try:
        samples = scrape(url)
    except OSError:
        return None
    return samples if (sample(samples, "nefl_device_upload_bytes_total") or 0) > 0 else None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_metrics_agree_with_metrics_jsonl(federation):
    tmp, url, device, procs = federation
    lines = [m for r, m in sorted(metrics(tmp).items()) if r >= 1]
    assert [m["round"] for m in lines] == [1, 2]
    s = scrape(url + "metrics")
    assert sample(s, "nefl_rounds_completed_total") == ROUNDS
    assert sample(s, "nefl_rounds_committed_total") == sum(m["committed"] for m in lines)
    n = len(lines[0]["updates_per_submodel"])
    for k in range(n):
        label = str(k + 1)
        assert sample(s, "nefl_updates_accepted_total", submodel=label) == sum(m["updates_per_submodel"][k] for m in lines)
        assert sample(s, "nefl_participants_total", submodel=label) == sum(
            list(m["assigned"].values()).count(k + 1) for m in lines)
        assert sample(s, "nefl_accuracy", submodel=label) == pytest.approx(lines[-1]["accuracy"][k])
        assert sample(s, "nefl_submodel_committed_updates", submodel=label) == lines[-1]["updates_per_submodel_total"][k]
    assert sum(sample(s, "nefl_updates_accepted_total", submodel=str(k + 1)) for k in range(n)) == 2 * ROUNDS
    assert sample(s, "nefl_received_bytes_total") == sum(m["bytes_in"] for m in lines)
    assert sample(s, "nefl_sent_bytes_total") == sum(m["bytes_out"] for m in lines)
    rejected: dict[str, int] = {}
    for m in lines:
        for reason, count in m["rejected"].items():
            rejected[reason] = rejected.get(reason, 0) + count
    assert rejected, "the garbage update was not counted in metrics.jsonl"
    for reason, count in rejected.items():
        assert sample(s, "nefl_rejected_total", reason=reason) == count
    assert sample(s, "nefl_round_duration_seconds_count") == ROUNDS
    assert sample(s, "nefl_round_duration_seconds_sum") == pytest.approx(sum(m["wall_s"] for m in lines), abs=0.01)
    assert sample(s, "nefl_aggregation_seconds_sum") == pytest.approx(sum(m["aggregate_s"] for m in lines), abs=0.001)
    assert sample(s, "nefl_checkpoint_seconds_count") == ROUNDS
    assert sample(s, "nefl_server_state", nefl_server_state="finished") == 1
    # the device side, scraped during the run
    assert sample(device, "nefl_device_selected_submodel") == 1  # --max-submodel 1
    assert sample(device, "nefl_device_selection_binding", nefl_device_selection_binding="cap") == 1
    assert sample(device, "nefl_device_rounds_trained_total", submodel="1") >= 1
    assert sample(device, "nefl_device_step_seconds_count") >= 1
    assert sample(device, "nefl_device_memory_available_bytes") > 0
    assert sample(device, "nefl_device_upload_bytes_total") >= lines[0]["clients"]["c1"]["bytes"]


@pytest.mark.slow
def test_json_logs_carry_event_fields(federation):
    _, _, _, procs = federation
    events = {name: [json.loads(line) for line in procs.log(name).splitlines() if line.startswith("{")]
              for name in ("agg", "c1")}
    assert events["agg"] and events["c1"]
    assert any(e.get("reason") == "malformed_header" and e.get("client") == "mallory" for e in events["agg"])
    updates = [e for e in events["agg"] if "update from" in e["msg"]]
    assert {(e["round"], e["client"]) for e in updates} == {(r, c) for r in (1, 2) for c in ("c1", "c2")}
    assert all(e["submodel"] in (1, 2) and e["federation"] == "t" for e in updates)
    assert all(e["client"] == "c1" for e in events["c1"])  # every line of a device names it
    trained = [e for e in events["c1"] if "trained submodel" in e["msg"]]
    assert [(e["round"], e["submodel"]) for e in trained] == [(1, 1), (2, 1)]


def chromium(*args: str) -> subprocess.CompletedProcess:
    argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
            "--virtual-time-budget=8000", *args]
    home = ARTIFACTS / "chromium-home"  # its profile, out of the way
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": str(home)})


@pytest.mark.slow
def test_api_rollout_shows_which_device_runs_which_version(federation):
    _, url, _, _ = federation
    view = wait_for(lambda: (v := json.loads(urllib.request.urlopen(url + "api/rollout", timeout=10).read()))["devices"]
                    and v, 30, "the rollout view")
    assert view["rollout"]["stable"] == 2 and view["rollout"]["canary_devices"] == ["d8"]
    assert {d["client"]: d["version"] for d in view["devices"]} == {"d8": 3, "d9": 2}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dashboard_in_headless_chromium(federation):
    if CHROMIUM is None:
        message = "chromium is not installed: run scripts/install-system-deps.sh as root (apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    tmp, url, _, _ = federation
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    dom = chromium("--dump-dom", url).stdout
    rows = dict(re.findall(r'<tr data-client="([^"]+)">(.*?)</tr>', dom))
    assert set(rows) == {"c1", "c2"}, dom[:3000]
    assert "≤ 1" in rows["c1"] and "≤ 2" in rows["c2"]  # what each may train (their --max-submodel)
    assert all("(round 2)" in row for row in rows.values())  # assigned in, and reported a loss for, round 2
    accuracy = dom[dom.index('id="accuracy"'):dom.index('id="bytes"')]
    submodels = len(metrics(tmp)[0]["accuracy"])
    for k in range(1, submodels + 1):  # every submodel's line has a point per evaluated round
        points = set(re.findall(rf'<circle [^>]*data-submodel="{k}" data-round="(\d+)"', accuracy))
        assert points == {"0", "1", "2"}, (k, points)
    assert set(re.findall(r'<tr data-round="(\d+)"', dom)) == {"1", "2"}
    assert re.search(r'<tr data-reason="[a-z_]+">', dom), "rejections by reason are not shown"
    followers = dict(re.findall(r'<tr data-follower="([^"]+)">(.*?)</tr>', dom))
    assert set(followers) == {"d8", "d9"} and "<td>v3</td>" in followers["d8"] and "3.3" in followers["d9"], followers
    assert "rollout #4: stable v2, canary v3 on d8" in dom
    shot = ARTIFACTS / "dashboard.png"
    shot.unlink(missing_ok=True)
    chromium("--screenshot=" + str(shot), "--window-size=1400,1700", url)
    assert shot.exists() and shot.stat().st_size > 10_000
    assert time.time() - shot.stat().st_mtime < 120
