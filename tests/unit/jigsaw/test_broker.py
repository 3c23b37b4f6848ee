"""The FedJigsaw module exchange over a broker (nefl/jigsaw/broker.py), the coordinator and the device, without
processes: an in-memory bus with MQTT's topic matching and retained messages stands in for mosquitto.

The exchange must move exactly what the in-process one moves (Eq. 2 at the source, in the simulator's order),
refuse what a hostile peer sends (another key, a poisoned copy, a copy of a round that is closed) without
harming the source, never wait on a silent peer past its deadline, and never raise on any inbound bytes
(hypothesis fuzzing of every handler).
"""

from __future__ import annotations

import threading
from collections import defaultdict

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nefl.jigsaw.broker import BrokerExchange, Peer, PeerUnavailable, largest_module_bytes
from nefl.jigsaw.coordination import JigsawHello
from nefl.jigsaw.coordinator import Coordinator
from nefl.jigsaw.device import DeviceSettings, JigsawDevice
from nefl.jigsaw.shards import initial_modules
from nefl.jigsaw.sim import JigsawConfig
from nefl.jigsaw.screen import ReturnScreen
from nefl.jigsaw.symbio import InProcessExchange, MetadataBroadcast, ModuleFetch, ModuleReturn, source_average
from nefl.jigsaw.zoo import load_base
from nefl.protocol.signing import KeyPin, Signer, parse_public_key
from nefl.protocol.topics import Topics
from nefl.protocol.wire import encode

FED = "fed"
BASE = load_base("cnn-2")
fuzz = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow])


def matches(pattern: str, topic: str) -> bool:
    p, t = pattern.split("/"), topic.split("/")
    return len(p) == len(t) and all(a in ("+", b) for a, b in zip(p, t))


class Bus:
    """Synchronous MQTT: a publish is delivered to every matching subscriber before it returns."""

    def __init__(self) -> None:
        self.subs: dict[str, list] = defaultdict(list)
        self.retained: dict[str, bytes] = {}
        self.log: list[tuple[str, bytes]] = []

    def port(self, handle):
        bus = self

        class Port:
            def publish(self, topic, payload, qos=0, retain=False):
                bus.log.append((topic, bytes(payload)))
                if retain:
                    bus.retained[topic] = bytes(payload)
                for pattern, handlers in list(bus.subs.items()):
                    if matches(pattern, topic):
                        for h in handlers:
                            h(topic, bytes(payload))

            def subscribe(self, topic, qos=0):
                bus.subs[topic].append(handle)
                for t, p in list(bus.retained.items()):
                    if matches(topic, t):
                        handle(t, p)

            def unsubscribe(self, topic):
                pass

        return Port()


def signer() -> Signer:
    return Signer(Ed25519PrivateKey.generate())


def federation(n: int = 3, norm_bound: float = 5.0, timeout: float = 2.0, screen: bool = False):
    """n exchanges (each owning cnn-2 modules) wired through one bus, fully connected, round 0 open."""
    bus, signers = Bus(), [signer() for _ in range(n)]
    peers = {i: Peer(i, f"d{i}", parse_public_key(s_.public_text)) for i, s_ in enumerate(signers)}
    links = [[j for j in range(n) if j != i] for i in range(n)]
    exchanges = []
    for i in range(n):
        holder: list[BrokerExchange] = []
        port = bus.port(lambda t, p, h=holder: h[0].handle(t, p))
        ex = BrokerExchange(Topics(FED), i, peers, links, signers[i], port, initial_modules(BASE.metas(i), 100 + i),
                            64 * 1024, timeout, norm_bound, largest_module_bytes([BASE]), screen=ReturnScreen() if screen else None)
        holder.append(ex)
        exchanges.append(ex)
    for ex in exchanges:
        for topic in ex.subscriptions():
            ex.transport.subscribe(topic)
        ex.broadcast(MetadataBroadcast(federation=FED, client=ex.me, modules=BASE.metas(ex.me)))
        ex.begin_round(0, set(range(n)), 0, 0.0)
    return bus, signers, exchanges


def fetch(ex: BrokerExchange, source: int, position: int, r: int = 0) -> dict[str, torch.Tensor]:
    return ex.fetch(ModuleFetch(federation=FED, client=ex.me, source=source, round=r, position=position))


def give_back(ex: BrokerExchange, source: int, position: int, state, r: int = 0) -> None:
    ex.give_back(ModuleReturn(federation=FED, client=ex.me, source=source, round=r, position=position, samples=10), state)


def test_a_fetched_module_is_the_sources_and_copies_average_at_the_source_in_client_order() -> None:
    _, _, (a, b, c) = federation()
    assert [m.key for m in a.catalogue(0)] == [m.key for m in BASE.metas(1) + BASE.metas(2)]
    got = fetch(a, 2, 1)
    own = c.store["c2.m1"]
    assert set(got) == set(own) and all(torch.equal(got[k], own[k]) for k in own)
    copies = {i: {k: v + 0.01 * (i + 1) for k, v in own.items()} for i in range(3)}
    give_back(c, 2, 1, copies[2])  # the source's own copy, then the peers' in another order
    give_back(b, 2, 1, copies[1])
    give_back(a, 2, 1, copies[0])
    assert c.heard == 2 and a.sent_back == [2]
    counts = c.begin_round(1, {0, 1, 2}, 2, 1.0)
    assert counts == {"c2.m1": 3}
    want = source_average([copies[0], copies[1], copies[2]])  # the simulator's order: by borrower
    assert all(torch.equal(c.store["c2.m1"][k], want[k]) for k in want)
    assert c.take_counters()[0] == {}


def test_a_poisoned_copy_is_refused_counted_and_the_source_keeps_the_honest_average() -> None:
    _, _, (a, b, c) = federation()
    own = {k: v.clone() for k, v in c.store["c2.m0"].items()}
    honest = {k: v + 0.01 for k, v in own.items()}
    give_back(a, 2, 0, {k: v * 1000 for k, v in own.items()})
    give_back(b, 2, 0, honest)
    give_back(a, 2, 0, {k: torch.full_like(v, float("nan")) for k, v in own.items()})
    c.begin_round(1, {0, 1, 2}, 3, 1.0)
    rejected, _ = c.take_counters()
    assert rejected == {"norm_bound": 1, "non_finite": 1}
    assert all(torch.equal(c.store["c2.m0"][k], honest[k]) for k in own)


def test_a_copy_signed_by_another_key_or_for_a_closed_round_is_refused() -> None:
    bus, _, (a, b, c) = federation()
    own = c.store["c2.m0"]
    forged = encode({k: v * 0 for k, v in own.items()}, kind="return", federation=FED, round=0, submodel=0, client="d0",
                    samples=1, sign=signer().sign).messages  # d0's name, another key
    for chunk in forged:
        c.handle(Topics(FED).jigsaw("return", "d2"), chunk)
    c.begin_round(1, {0, 1, 2}, 0, 0.0)
    late = encode(dict(own), kind="return", federation=FED, round=0, submodel=0, client="d1", samples=1, sign=b.signer.sign).messages
    for chunk in late:
        c.handle(Topics(FED).jigsaw("return", "d2"), chunk)
    assert c.take_counters()[0] == {"bad_signature": 1, "stale_round": 1}
    assert all(torch.equal(c.store["c2.m0"][k], own[k]) for k in own)


def test_a_silent_peer_is_given_up_on_at_the_deadline_and_a_fetch_ahead_of_the_source_waits_for_its_round() -> None:
    _, _, (a, b, c) = federation(timeout=0.3)
    b.handle = lambda topic, payload: None  # b went silent
    with pytest.raises(PeerUnavailable) as e:
        fetch(a, 1, 0)
    assert e.value.source == 1
    a.active.discard(2)
    with pytest.raises(PeerUnavailable):  # an inactive peer is not even asked
        fetch(a, 2, 0)
    a.active.add(2)
    a.begin_round(1, {0, 1, 2}, 0, 0.0)  # a is in round 1, c still in round 0: the fetch is held, then answered
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(fetch(a, 2, 0, r=1)))
    a.fetch_timeout_s = 5.0
    t.start()
    c.begin_round(1, {0, 1, 2}, 0, 0.0)
    t.join(5)
    assert set(result) == set(c.store["c2.m0"])


@pytest.fixture(scope="module")
def shared():
    """One federation for every example (building one costs more than the example), with a fixed list of the
    valid messages it exchanged while forming: what the mutations start from."""
    bus, signers, exchanges = federation()
    fetch(exchanges[0], 1, 0)
    return [p for _, p in bus.log], exchanges


@fuzz
@given(data=st.data())
def test_no_inbound_bytes_make_the_exchange_raise(shared, data) -> None:
    valid, (a, b, c) = shared
    topic = data.draw(st.sampled_from(a.subscriptions() + [Topics(FED).jigsaw("meta", "d1"), "nefl/fed/jigsaw/module/x"]))
    topic = topic.replace("+", data.draw(st.sampled_from(["d1", "d2", "zz"])))
    base = data.draw(st.sampled_from(valid))
    payload = data.draw(st.one_of(st.binary(max_size=300), st.just(base),
                                  st.builds(lambda i, x: base[:i] + bytes([x]) + base[i + 1:],
                                            st.integers(0, max(0, len(base) - 1)), st.integers(0, 255))))
    a.handle(topic, payload)
    assert a.metadata[1] == BASE.metas(1) and a.metadata[2] == BASE.metas(2)  # nothing forged took hold
    assert set(fetch(a, 2, 3)) == set(c.store["c2.m3"])  # and the exchange still works


def device_and_coordinator():
    bus = Bus()
    cfg = JigsawConfig(archs=("cnn-2",), rounds=1, policy_rounds=0)
    coord_signer = signer()
    coordinator = Coordinator(cfg, FED, 2, coord_signer, bus.port(lambda t, p: coordinator.handle(t, p)))
    for t in coordinator.subscriptions():
        coordinator.transport.subscribe(t)
    dev_signer = signer()
    device = JigsawDevice(DeviceSettings("d0", FED, 10**9, 64 * 1024), dev_signer, KeyPin(None, None),
                          bus.port(lambda t, p: device.handle(t, p)))
    device.on_connected()
    other = signer()
    hello = JigsawHello(federation=FED, client_id="d1", key=other.public_text, budget=10**9)
    coordinator.transport.publish(Topics(FED).jigsaw("hello", "d1"), other.sign(hello.to_json()), retain=True)
    coordinator.admit(1.0)
    return bus, coordinator, device


def test_the_device_trusts_the_first_plan_that_lists_it_and_the_coordinator_numbers_devices_by_id() -> None:
    _, coordinator, device = device_and_coordinator()
    assert device.plan is not None and device.plan.run == coordinator.run_id
    assert [p.client_id for p in device.plan.participants] == ["d0", "d1"]
    assert device.pin.text == coordinator.signer.public_text


@fuzz
@given(data=st.data())
def test_no_inbound_bytes_make_the_device_or_the_coordinator_raise(data) -> None:
    bus, coordinator, device = device_and_coordinator()
    valid = [p for _, p in bus.log]
    topics = Topics(FED)
    topic = data.draw(st.sampled_from([topics.jigsaw("plan"), topics.jigsaw("round"), topics.jigsaw("advice", "d0"),
                                       topics.jigsaw("hello", "d1"), topics.jigsaw("done", "d0"),
                                       topics.jigsaw("report", "d1"), f"{topics.root}/status/d0"]))
    base = data.draw(st.sampled_from(valid))
    payload = data.draw(st.one_of(st.binary(max_size=300), st.just(base),
                                  st.builds(lambda i, x: base[:i] + bytes([x]) + base[i + 1:],
                                            st.integers(0, max(0, len(base) - 1)), st.integers(0, 255))))
    device.handle(topic, payload)
    coordinator.handle(topic, payload)
    assert device.plan is not None and device.plan.run == coordinator.run_id


def test_the_commands_refuse_bad_options_with_one_line(tmp_path) -> None:
    from typer.testing import CliRunner

    from aggregator.cli import app as aggregator
    from edge_client.cli import app as edge_client

    runner = CliRunner()
    serve = ["jigsaw-serve", "--devices", "2", "--broker", "mqtt://127.0.0.1:1", "--key-dir", str(tmp_path)]
    res = runner.invoke(aggregator, [*serve, "--method", "pt-heterofl"])
    assert res.exit_code == 2 and "use fedjigsaw, no-coretune, no-symbio or local-only" in res.output
    res = runner.invoke(aggregator, [*serve, "--topology", "star"])
    assert res.exit_code == 2 and "use full, ring or random" in res.output
    res = runner.invoke(aggregator, [*serve, "--archs", "cnn-99"])
    assert res.exit_code == 2 and "no base architecture 'cnn-99'" in res.output
    res = runner.invoke(edge_client, ["jigsaw", "--broker", "mqtt://127.0.0.1:1", "--client-id", "a/b"])
    assert res.exit_code == 2 and "invalid client id" in res.output


def test_a_round_row_reaches_the_prometheus_metrics() -> None:
    from aggregator.metrics import JigsawMetrics

    m = JigsawMetrics()
    row = {"round": 3, "trained": 2, "bytes": {"module_out": 1000, "return_in": 900}, "bytes_per_device": 950.0,
           "whole_model_bytes_per_device": 4000.0, "modules_borrowed": 5, "chain_changes": 1, "masked": [2],
           "rejected": {"norm_bound": 2}}
    m.record(row)
    m.record({**row, "round": 4})
    value = m.registry.get_sample_value
    assert value("nefl_jigsaw_rounds_completed_total") == 2 and value("nefl_jigsaw_round") == 4
    assert value("nefl_jigsaw_module_bytes_total", {"kind": "module_out"}) == 2000
    assert value("nefl_jigsaw_rejected_total", {"reason": "norm_bound"}) == 4
    assert value("nefl_jigsaw_modules_borrowed_total") == 10 and value("nefl_jigsaw_chain_changes_total") == 2
    assert value("nefl_jigsaw_masked_peers") == 1 and value("nefl_jigsaw_whole_model_bytes_per_device") == 4000


def test_the_broker_screens_returns_as_the_in_process_exchange_does() -> None:
    """A sign-flipped copy under the old 5 x bound: both exchanges refuse it at the round's close and average
    the same copies, bit for bit."""
    _, _, (a, b, c) = federation(screen=True)
    own = {k: v.clone() for k, v in c.store["c2.m1"].items()}
    honest = {i: {k: v * (1 + 0.01 * (i + 1)) + 0.001 * i for k, v in own.items()} for i in range(3)}
    flipped = {k: -3.5 * v for k, v in honest[0].items()}
    give_back(c, 2, 1, honest[2])
    give_back(b, 2, 1, honest[1])
    give_back(a, 2, 1, flipped)
    c.begin_round(1, {0, 1, 2}, 2, 1.0)
    assert c.take_counters()[0] == {"sign_flip": 1}
    store = {"c2.m1": {k: v.clone() for k, v in own.items()}}
    twin = InProcessExchange(FED, store, [[1, 2], [0, 2], [0, 1]], 5.0, ReturnScreen())
    for client, state in ((0, flipped), (1, honest[1]), (2, honest[2])):
        twin.give_back(ModuleReturn(federation=FED, client=client, source=2, round=0, position=1, samples=10), state)
    twin.aggregate()
    assert dict(twin.rejected) == {"sign_flip": 1}
    assert all(torch.equal(c.store["c2.m1"][k], store["c2.m1"][k]) for k in own)
