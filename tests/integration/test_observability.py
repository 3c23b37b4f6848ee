"""Metrics and the dashboard's data: the aggregator's Observer after a scripted round, its HTTP face
(routes, token), the device-side metrics, the edge HTTP API's /metrics, and json log context.
The end-to-end run against a real federation is in tests/e2e/test_dashboard.py."""

from __future__ import annotations

import io
import json
import logging
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from aggregator import metrics as agg_metrics
from aggregator.federation import ClientInfo
from aggregator.metrics import DashboardState, Observer
from aggregator.web import TokenRequired, start_http
from edge_client.http_api import make_server
from edge_client.metrics import DeviceMetrics, InferenceMetrics, MeteredDevice, MeteredTransport
from edge_client.probe import BatteryReading, DeviceSnapshot, GpuReading, ThermalReading
from edge_client.runtime import Result
from edge_client.select import Selection
from nefl.nested.train import TrainResult
from nefl.protocol.messages import DeviceSummary, ServerStatus
from nefl.support.listen import is_loopback, parse_listen
from nefl.support.logs import setup_logging
from tests.harness.procs import ROOT


def value(registry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def info(cid: str, max_submodel: int, online: bool = True, why: str = "") -> ClientInfo:
    return ClientInfo(cid, max_submodel, 100, DeviceSummary(machine="x86_64", cpus=2, mem_available_mb=900), online, why)


def round_line(index: int, updates: list[int], committed: bool = True, **extra) -> dict:
    """A metrics.jsonl line as the round driver writes it (only the keys the observer reads)."""
    return {"round": index, "quorum": committed, "committed": committed, "updates_per_submodel": updates,
            "updates_per_submodel_total": updates, "wall_s": 3.5, "aggregate_s": 0.02, "bytes_in": 1000,
            "bytes_out": 5000, "rejected": {}, "late_updates": 0, "declined": {}, "went_offline": [], **extra}


def scripted_round() -> Observer:
    obs = Observer("t", "resnet20-fmnist-w", 3, rounds=2, round_timeout=60)
    obs.metrics_line({"round": 0, "accuracy": [0.1, 0.1, 0.1]})
    obs.client_changed(info("c1", 0, why="submodel 1/3: memory binds"))
    obs.client_changed(info("c2", 2))
    obs.client_changed(info("c3", -1, why="skip round: memory binds"))  # online, can train nothing
    obs.client_changed(info("c4", 1, online=False))
    obs.client_changed(None)  # a status from a client that never announced
    obs.status(ServerStatus(state="training", federation="t", round=1, rounds=2))
    obs.round_opened(1, {"c1": 0, "c2": 2}, 60.0)
    obs.rejected("stale_round")
    obs.rejected("stale_round")
    obs.rejected("malformed_header")
    obs.checkpoint_saved(0.25)
    obs.metrics_line(round_line(1, [1, 0, 1], accuracy=[0.4, 0.1, 0.6], rejected={"stale_round": 2, "malformed_header": 1},
                                assigned={"c1": 1, "c2": 3}, reported=["c1", "c2"], declined={"c4": "went cold"},
                                late_updates=2, clients={"c1": {"loss": 1.25}, "c2": {"loss": 0.75}}))
    return obs


def test_metrics_after_a_scripted_round():
    obs = scripted_round()
    r = obs.metrics.registry
    assert value(r, "nefl_rounds_completed_total") == 1
    assert value(r, "nefl_rounds_committed_total") == 1
    assert value(r, "nefl_rounds_without_quorum_total") == 0
    assert [value(r, "nefl_participants_total", submodel=k) for k in "123"] == [1, 0, 1]
    assert [value(r, "nefl_updates_accepted_total", submodel=k) for k in "123"] == [1, 0, 1]
    assert value(r, "nefl_rejected_total", reason="stale_round") == 2
    assert value(r, "nefl_rejected_total", reason="malformed_header") == 1
    assert value(r, "nefl_received_bytes_total") == 1000 and value(r, "nefl_sent_bytes_total") == 5000
    assert value(r, "nefl_tasks_declined_total") == 1 and value(r, "nefl_late_updates_total") == 2
    assert value(r, "nefl_clients_online") == 3 and value(r, "nefl_clients_ready") == 2  # c3 online, can't train
    assert [value(r, "nefl_accuracy", submodel=k) for k in "123"] == [0.4, 0.1, 0.6]
    assert [value(r, "nefl_submodel_rounds_since_update", submodel=k) for k in "123"] == [0, 1, 0]
    assert value(r, "nefl_round_duration_seconds_count") == 1 and value(r, "nefl_round_duration_seconds_sum") == 3.5
    assert value(r, "nefl_aggregation_seconds_sum") == 0.02
    assert value(r, "nefl_checkpoint_seconds_count") == 1 and value(r, "nefl_checkpoint_seconds_sum") == 0.25
    assert value(r, "nefl_round") == 1
    assert value(r, "nefl_server_state", nefl_server_state="training") == 1


def test_dashboard_state_after_a_scripted_round():
    obs = scripted_round()
    obs.client_changed(info("c2", 2, online=False))  # goes offline after the round
    state = msgspec.json.decode(obs.snapshot_json(), type=DashboardState)  # the page's JSON is the typed message
    assert (state.v, state.federation, state.state, state.submodels) == (1, "t", "training", 3)
    assert state.clients_online == 2 and state.clients_ready == 1
    rows = {d.id: d for d in state.devices}
    assert set(rows) == {"c1", "c2", "c3", "c4"}
    assert state.devices[0].id == "c2"  # most recently seen first
    assert (rows["c1"].assigned, rows["c1"].last_loss, rows["c1"].max_submodel) == (1, 1.25, 1)
    assert rows["c1"].reason == "submodel 1/3: memory binds"
    assert (rows["c2"].online, rows["c2"].assigned, rows["c2"].last_loss) == (False, 3, 0.75)
    assert rows["c3"].max_submodel == 0 and rows["c4"].assigned is None
    assert [h.round for h in state.rounds_history] == [0, 1]
    done = state.rounds_history[1]
    assert done.opened is not None and done.closed >= done.opened and done.deadline_s == 60
    assert (done.assigned, done.declined, done.accuracy) == ({"c1": 1, "c2": 3}, {"c4": "went cold"}, [0.4, 0.1, 0.6])
    assert (done.participants, done.reports, done.declines) == (2, 2, 1)
    assert state.open_round is None
    assert state.rejected_total == {"stale_round": 2, "malformed_header": 1}


def test_buffered_versions_show_their_staleness_on_the_dashboard_and_in_prometheus():
    obs = Observer("t", "resnet20-fmnist-w", 3, rounds=5, round_timeout=60)
    obs.client_changed(info("c1", 2))
    obs.task_given("c1", 1, 4)
    obs.metrics_line(round_line(5, [1, 1, 0], mode="buffered", version=5, staleness=[0, 2], reported=["c1"]))
    obs.metrics_line(round_line(6, [1, 0, 0], committed=False, mode="buffered", version=6, staleness=[9]))
    r = obs.metrics.registry
    assert value(r, "nefl_update_staleness_count") == 2 and value(r, "nefl_update_staleness_sum") == 2
    assert value(r, "nefl_update_staleness_bucket", le="1.0") == 1  # an uncommitted buffer's staleness is not counted
    assert value(r, "nefl_participants_total", submodel="2") == 1
    state = msgspec.json.decode(obs.snapshot_json(), type=DashboardState)
    row = state.rounds_history[0]
    assert (row.round, row.mode, row.staleness, row.reports) == (5, "buffered", [0, 2], 1)
    (device,) = state.devices
    assert (device.assigned, device.assigned_round) == (2, 4)  # its task: submodel 2 from version 4


def test_a_device_that_reports_every_round_is_seen_every_round(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("aggregator.metrics.time.time", lambda: now[0])
    obs = Observer("t", "p", 2, rounds=5, round_timeout=30)
    obs.client_changed(info("a", 1))
    obs.client_changed(info("b", 1))  # b announced last
    now[0] += 283  # rounds go by without a new announce: the device's choice did not change
    obs.round_opened(1, {"a": 1}, 30.0)
    obs.update_accepted("a")
    state = obs.snapshot()
    assert state.devices[0].id == "a" and state.devices[0].last_seen == 1283.0  # not "283 s ago"


def test_open_round_is_shown_until_its_line_arrives():
    obs = Observer("t", "p", 2, rounds=5, round_timeout=30)
    obs.round_opened(4, {"a": 1, "b": 0}, 30.0)
    obs.update_accepted("a")
    obs.update_accepted("a")  # counted once
    state = obs.snapshot()
    assert state.open_round.round == 4 and state.open_round.assigned == {"a": 2, "b": 1}
    assert (state.open_round.reports, state.open_round.participants, state.open_round.reported) == (1, 2, ["a"])
    obs.metrics_line(round_line(4, [0, 1]))
    assert obs.snapshot().open_round is None


def test_history_seeds_a_resumed_dashboard_and_skips_unreadable_lines():
    history = [{"round": 0, "accuracy": [0.1, 0.1]}, round_line(1, [1, 0]), {"round": "x"}, round_line(2, [1, 0])]
    obs = Observer("t", "p", 2, rounds=5, round_timeout=30, history=history)
    assert [r.round for r in obs.snapshot().rounds_history] == [0, 1, 2]
    assert value(obs.metrics.registry, "nefl_submodel_rounds_since_update", submodel="2") == 2
    assert value(obs.metrics.registry, "nefl_rounds_completed_total") == 0  # counters count this process's rounds


def test_older_rounds_are_sent_as_counts(monkeypatch):
    monkeypatch.setattr(agg_metrics, "DETAILED_ROUNDS", 1)
    obs = scripted_round()
    obs.metrics_line(round_line(2, [1, 0, 0], assigned={"c1": 1}, reported=["c1"]))
    old, new = obs.snapshot().rounds_history[-2:]
    assert (old.round, old.participants, old.reports, old.declines, old.assigned, old.declined) == (1, 2, 2, 1, {}, {})
    assert (new.round, new.participants, new.assigned, new.reported) == (2, 1, {"c1": 1}, ["c1"])


def test_device_table_is_bounded(monkeypatch):
    monkeypatch.setattr(agg_metrics, "MAX_DEVICES", 3)
    obs = Observer("t", "p", 2, rounds=1, round_timeout=30)
    for i in range(5):
        obs.client_changed(info(f"d{i}", 1))
    obs.client_changed(info("d2", 1))  # seen again: moves to the front
    assert [d.id for d in obs.snapshot().devices] == ["d2", "d4", "d3"]
    assert value(obs.metrics.registry, "nefl_clients_online") == 5  # the gauge counts every online device


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 3), min_size=3, max_size=3)), min_size=1, max_size=12))
def test_starving_gauge_matches_brute_force(rounds):
    obs = Observer("t", "p", 3, rounds=len(rounds), round_timeout=30)
    for i, (committed, updates) in enumerate(rounds, start=1):
        obs.metrics_line(round_line(i, updates, committed))
    for k in range(3):
        trained = [i for i, (c, u) in enumerate(rounds) if c and u[k]]
        expected = len(rounds) - 1 - trained[-1] if trained else len(rounds)
        assert value(obs.metrics.registry, "nefl_submodel_rounds_since_update", submodel=str(k + 1)) == expected


# -- HTTP --------------------------------------------------------------------------------------------
def get(url: str, headers: dict | None = None) -> tuple[int, bytes, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as resp:
            return resp.status, resp.read(), resp.headers["Content-Type"]
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers["Content-Type"]


@pytest.fixture
def web():
    servers = []

    def start(token: str | None = None):
        servers.append(start_http(scripted_round(), "127.0.0.1", 0, token))
        return servers[-1].url

    yield start
    for s in servers:
        s.close()


def test_http_routes(web):
    url = web()
    status, body, ctype = get(url + "metrics")
    assert status == 200 and ctype.startswith("text/plain")
    assert b"nefl_rounds_completed_total 1.0" in body and b'nefl_rejected_total{reason="stale_round"} 2.0' in body
    status, body, _ = get(url + "api/state")
    assert status == 200 and msgspec.json.decode(body, type=DashboardState).rounds_history[-1].round == 1
    status, body, ctype = get(url)
    assert status == 200 and ctype.startswith("text/html") and b'src="app.js"' in body
    for asset in ("app.js", "style.css"):
        assert get(url + asset)[0] == 200
    status, body, _ = get(url + "nope")
    assert status == 404 and "no route" in json.loads(body)["error"]
    assert get(url + "health")[0] == 200


def test_http_token(web):
    url = web("s3cret")
    assert get(url + "metrics")[0] == 401
    assert get(url + "api/state", {"Authorization": "Bearer wrong"})[0] == 401
    assert get(url + "api/state?token=s3cre")[0] == 401
    assert get(url + "metrics", {"Authorization": "Bearer s3cret"})[0] == 200
    assert get(url + "api/state?token=s3cret")[0] == 200
    assert get(url)[0] == 200  # the page itself holds no fleet data; it asks for the token


def test_non_loopback_needs_a_token():
    with pytest.raises(TokenRequired, match="--http-token"):
        start_http(scripted_round(), "0.0.0.0", 0)
    from aggregator.cli import app
    result = CliRunner().invoke(app, ["serve", "--http", "0.0.0.0:9100", "--checkpoint-dir", "/nonexistent/run"])
    assert result.exit_code == 2 and "--http-token" in result.output
    result = CliRunner().invoke(app, ["serve", "--http", "localhost:", "--checkpoint-dir", "/nonexistent/run"])
    assert result.exit_code == 2 and "HOST:PORT" in result.output
    from edge_client.cli import app as edge_app
    result = CliRunner().invoke(edge_app, ["join", "--broker", "mqtt://127.0.0.1:1", "--http", "99999"])
    assert result.exit_code == 2 and "HOST:PORT" in result.output


def test_parse_listen():
    assert parse_listen("9100") == ("127.0.0.1", 9100)
    assert parse_listen("0.0.0.0:80") == ("0.0.0.0", 80)
    assert parse_listen("[::1]:9100") == ("::1", 9100)
    assert parse_listen("edge.local:9100") == ("edge.local", 9100)
    for bad in ("", "host:", ":9100x", "99999", "a b:1"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_listen(bad)
    assert is_loopback("127.0.0.2") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1") and not is_loopback("edge.local")


# -- the device -----------------------------------------------------------------------------------
class FakeTransport:
    def __init__(self) -> None:
        self.sent: list[tuple[str, int]] = []

    def publish(self, topic, payload, qos=0, retain=False):
        self.sent.append((topic, len(payload)))

    def subscribe(self, topic, qos=0):
        pass

    def unsubscribe(self, topic):
        pass


class FakeDevice:
    samples = 64

    def summary(self):
        return DeviceSummary()

    def plan(self, layout, training, budget_s, cap, hold=None):
        return Selection(1, "submodel 2/3: memory binds: ...", "memory", 123 << 20, ())

    def train(self, layout, task, start, budget_s):
        return TrainResult({}, 64, 0.5, 0.8, 2.0, {"steps": 4, "budget_cut": 0})


class FakeTask:
    submodel = 1


class FakeProber:
    """Every reading a device can have (a Pi with a battery and a GPU, say)."""

    def snapshot(self) -> DeviceSnapshot:
        return DeviceSnapshot(time=0.0, cpu_count=4, memory_total=4 << 30, memory_available=1 << 30, process_rss=300 << 20,
                              cpu_percent=42.0, load_per_core=0.5, gpus=(GpuReading("gpu", 8 << 30, 2 << 30, 30.0),),
                              thermal=(ThermalReading("cpu-thermal", 61.5),), throttled=0, battery=BatteryReading(80.0, True))


def test_device_metrics_from_wrapped_ports():
    m = DeviceMetrics(FakeProber())
    transport = MeteredTransport(FakeTransport(), m, "nefl/t/client/c1/update")
    transport.publish("nefl/t/client/c1/update", b"x" * 700)
    transport.publish("nefl/t/client/c1/announce", b"y" * 50)  # not an upload
    device = MeteredDevice(FakeDevice(), m)
    assert device.samples == 64
    device.plan(None, None, 60.0, 5)
    device.train(None, FakeTask(), {}, 30.0)
    r = m.registry
    assert value(r, "nefl_device_upload_bytes_total") == 700
    assert value(r, "nefl_device_selected_submodel") == 2
    assert value(r, "nefl_device_selection_binding", nefl_device_selection_binding="memory") == 1
    assert value(r, "nefl_device_usable_memory_bytes") == 123 << 20
    assert value(r, "nefl_device_rounds_trained_total", submodel="2") == 1
    assert value(r, "nefl_device_step_seconds_sum") == 0.5 and value(r, "nefl_device_train_seconds_sum") == 2.0
    assert value(r, "nefl_device_last_loss") == 0.5
    # probe readings, taken at scrape time
    assert value(r, "nefl_device_memory_available_bytes") == 1 << 30 and value(r, "nefl_device_cpu_percent") == 42
    assert value(r, "nefl_device_temperature_celsius") == 61.5 and value(r, "nefl_device_battery_percent") == 80
    assert value(r, "nefl_device_gpu_utilization_percent") == 30 and value(r, "nefl_device_throttled") == 0
    assert value(DeviceMetrics().registry, "nefl_device_memory_total_bytes") > 0  # this machine's own probe


class FakeRuntime:
    """What result_json needs of the runtime: decode, predict (submodel 2 answers), class names."""

    class_names = ["a", "b"]
    submodels = [0, 1]

    def decode_image(self, data, max_pixels):
        return np.zeros((1, 1, 2, 2), np.float32)

    def predict(self, images):
        return Result([1], np.array([[0.2, 0.8]]), 1, 0.5, 1.5, 2.0, "load 10%")


def test_edge_serve_metrics():
    metrics = InferenceMetrics()
    server = make_server(FakeRuntime(), port=0, metrics=metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        for _ in range(3):
            req = urllib.request.Request(url + "predict", data=b"\x89PNG fake", method="POST")
            with urllib.request.urlopen(req, timeout=10) as resp:
                assert json.load(resp)["submodel"] == 2
        assert get(url + "nope")[0] == 404
        status, body, ctype = get(url + "metrics")
        assert status == 200 and ctype.startswith("text/plain")
        text = body.decode()
        assert 'nefl_inference_requests_total{submodel="2"} 3.0' in text
        assert 'nefl_inference_latency_seconds_count{submodel="2"} 3.0' in text
        assert 'nefl_inference_failed_total{status="404"} 1.0' in text
    finally:
        server.shutdown()
        server.server_close()


# -- logs ---------------------------------------------------------------------------------------------
@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_log_lines_carry_the_context(restore_logging, monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    setup_logging("info", "json", context={"client": "c1"})
    log = logging.getLogger("edge_client.agent")
    log.info("round 3: trained", extra={"round": 3, "submodel": 2})
    log.info("relayed", extra={"client": "c9", "reason": "stale_round"})
    first, second = (json.loads(line) for line in err.getvalue().splitlines())
    assert (first["client"], first["round"], first["submodel"]) == ("c1", 3, 2)
    assert (second["client"], second["reason"]) == ("c9", "stale_round")  # the event's own field wins
    err.truncate(0)
    err.seek(0)
    setup_logging("info", "plain", context={"client": "c1"})
    log.info("plain line")
    assert "client=" not in err.getvalue()  # people reading one stream need no id on every line


def test_torch_is_not_needed_for_serve_metrics():
    """edge-client serve runs on the small install: edge_client.metrics must not import torch."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "import edge_client.metrics, edge_client.http_api\nprint('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


def test_docs_and_grafana_name_only_real_metrics():
    """docs/operations.md's tables and the Grafana dashboard use the names the registries export."""
    obs = scripted_round()
    device, inference = DeviceMetrics(FakeProber()), InferenceMetrics()
    inference.answered(1, 0.01)
    inference.failed.labels("404").inc()
    device.rounds.labels("1").inc()
    exported = {s.name for reg in (obs.metrics.registry, device.registry, inference.registry)
                for family in reg.collect() for s in family.samples}
    docs = ROOT / "docs"
    grafana = json.loads((docs / "grafana-dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in grafana["panels"] for t in p["targets"])
    tables = "\n".join(line for line in (docs / "operations.md").read_text().splitlines() if line.startswith("| `nefl_"))
    for source, text in (("grafana-dashboard.json", exprs), ("operations.md", tables)):
        named = set(re.findall(r"\bnefl_[a-z_]+", text))
        unknown = {n for n in named if n not in exported and re.sub(r"_(bucket|sum|count)$", "", n) + "_count" not in exported
                   and n + "_total" not in exported and n + "_count" not in exported}
        assert not unknown, f"{source} names metrics nobody exports: {sorted(unknown)}"
    documented = set(re.findall(r"`(nefl_[a-z_]+)`", tables))
    families = {family.name for reg in (obs.metrics.registry, device.registry, inference.registry) for family in reg.collect()}
    undocumented = {f for f in families if f not in documented and f + "_total" not in documented}
    assert not undocumented, f"exported but not in docs/operations.md: {sorted(undocumented)}"


def test_a_taken_http_port_is_found_before_any_slow_work(tmp_path):
    import socket
    import time

    from aggregator.cli import app
    from edge_client.cli import app as edge_app
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        started = time.monotonic()
        result = CliRunner().invoke(app, ["serve", "--http", f"127.0.0.1:{port}", "--checkpoint-dir", str(tmp_path / "run"),
                                          "--key-dir", str(tmp_path / "keys")])
        assert result.exit_code == 2 and f"--http 127.0.0.1:{port}" in result.output and "pick another" in result.output
        assert time.monotonic() - started < 5 and not (tmp_path / "keys").exists() and not (tmp_path / "run").exists()
        result = CliRunner().invoke(edge_app, ["join", "--broker", "mqtt://127.0.0.1:1", "--http", str(port),
                                               "--data-root", str(tmp_path / "nodata")])
        assert result.exit_code == 2 and "pick another" in result.output and "loading" not in result.output
