"""The device agent's logic without a broker: task handling, decline and re-plan, upload, resend."""

from __future__ import annotations

from types import SimpleNamespace

from edge_client.agent import Agent, AgentConfig
from edge_client.join import _no_server
from edge_client.select import Fit, Selection
from nefl.protocol.messages import Announce, ClientStatus, Decline, Sent
from nefl.protocol.mqtt import BrokerSettings
from nefl.protocol.signing import Signer, parse_public_key, split_signed, status_message, verify
from nefl.protocol.wire import Reassembler, parse_chunk, split_chunk
from tests.harness.agent_fakes import FakeDevice, FakeServer, FakeTransport, T, make_agent


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def signed(transport, topic: str, cls):
    """The agent's messages on `topic`, each checked to be signed by the key it names (the device key)."""
    out = []
    for p in transport.on(topic):
        msg = cls.from_json(split_signed(p)[0])
        verify(p, parse_public_key(msg.key))
        out.append(msg)
    return out


def announces(transport) -> list[Announce]:
    return signed(transport, T.announce("c1"), Announce)


def declines(transport) -> list[Decline]:
    return signed(transport, T.decline("c1"), Decline)


def test_connect_subscribes_and_says_online(tmp_path):
    agent, transport, _ = make_agent(tmp_path)
    agent.on_connected()
    assert set(transport.subscribed) == {T.task("c1"), T.refusal("c1"), T.control, T.server_status}
    assert ClientStatus.from_json(split_signed(transport.on(T.status("c1"))[-1])[0]).state == "online"
    assert not announces(transport)  # nothing to say before the profile is known


def test_profile_from_the_status_is_planned_and_announced(tmp_path):
    agent, transport, _ = make_agent(tmp_path, FakeServer(tmp_path / "s"), FakeDevice(can=3, samples=77))
    (a,) = announces(transport)
    assert (a.max_submodel, a.samples, a.client) == (3, 77, "c1") and "fake device" in a.selection
    agent.on_connected()  # a reconnect re-announces, so a restarted server hears of the device
    assert len(announces(transport)) == 2


def test_task_weights_train_upload(tmp_path):
    server, clock = FakeServer(tmp_path / "s"), Clock()
    agent, transport, device = make_agent(tmp_path, server, clock=clock)
    agent.dispatch(T.task("c1"), server.task(k=1))
    assert transport.subscribed[-1] == T.model_all(1)
    agent.tick()
    assert device.trained == []  # no weights yet
    for m in server.weights(k=1):
        agent.dispatch(T.model_chunk(1, 0), m)
    clock.now += 10
    agent.tick()
    ((rnd, k, budget),) = device.trained
    assert (rnd, k) == (1, 1) and 0 < budget <= 50 * 0.8  # the time left, less the upload's share
    updates = transport.on(T.update("c1"))
    done = None
    r = Reassembler()
    for m in updates:
        done = r.feed(m) or done
    assert done.header.client == "c1" and done.header.round == 1 and done.header.submodel == 1
    assert done.header.metrics["steps"] == 4 and set(done.tensors) == set(server.layout.upload_shapes(1))
    device_key = parse_public_key(announces(transport)[0].key)
    for m in updates:  # every chunk header carries the device's signature
        verify(split_chunk(m)[0], device_key)


def test_a_task_too_big_for_the_device_is_declined_and_the_server_told(tmp_path):
    server = FakeServer(tmp_path / "s")
    agent, transport, device = make_agent(tmp_path, server, FakeDevice(can=2))
    agent.dispatch(T.task("c1"), server.task(k=3))
    assert agent.task is None and T.model_all(3) not in transport.subscribed
    (d,) = declines(transport)
    assert (d.federation, d.run, d.round, d.submodel, d.client) == ("t", "run1", 1, 3, "c1")
    assert "submodel 4 does not fit now" in d.reason
    agent.dispatch(T.task("c1"), server.task(k=3))  # the retained copy again: not declined twice
    assert len(declines(transport)) == 1 and device.trained == []


def test_the_device_that_changed_re_announces_on_the_next_task(tmp_path):
    server = FakeServer(tmp_path / "s")
    device = FakeDevice(can=5)
    agent, transport, _ = make_agent(tmp_path, server, device)
    device.can = 1  # memory got tight
    agent.dispatch(T.task("c1"), server.task(k=4))
    assert announces(transport)[-1].max_submodel == 1 and agent.task is None
    assert [(d.round, d.submodel) for d in declines(transport)] == [(1, 4)]


def test_a_device_that_announced_skip_still_trains_a_task_that_fits_when_it_arrives(tmp_path):
    """The stale-announce race, device side: its "skip" went out before the server opened the round;
    by the time the task arrives the device can train it, so it does, and declines nothing."""
    server = FakeServer(tmp_path / "s")
    device = FakeDevice(can=0)
    agent, transport, _ = make_agent(tmp_path, server, device)
    assert announces(transport)[-1].max_submodel == 0
    device.can = 2
    agent.dispatch(T.task("c1"), server.task(k=1))
    for m in server.weights(k=1):
        agent.dispatch(T.model_chunk(1, 0), m)
    agent.tick()
    assert [(r, k) for r, k, _ in device.trained] == [(1, 1)] and declines(transport) == []


def test_an_idle_device_re_probes_and_re_announces_only_when_its_choice_changes(tmp_path):
    server, clock = FakeServer(tmp_path / "s"), Clock()
    device = FakeDevice(can=0)
    agent, transport, _ = make_agent(tmp_path, server, device, clock=clock)
    agent.tick()
    assert len(announces(transport)) == 1  # not yet time to look again
    clock.now += agent.cfg.replan_s
    agent.tick()
    assert len(announces(transport)) == 1  # looked again: nothing changed, nothing said
    device.can = 3  # its own training, or someone else's, has ended
    clock.now += agent.cfg.replan_s
    agent.tick()
    first, second = announces(transport)
    assert (first.max_submodel, second.max_submodel) == (0, 3)
    assert first.session == second.session and (first.seq, second.seq) == (1, 2)


def test_a_step_that_cannot_fit_the_time_left_declines_instead_of_training(tmp_path):
    server, clock = FakeServer(tmp_path / "s"), Clock()
    device = FakeDevice(out_of_time=True)
    agent, transport, _ = make_agent(tmp_path, server, device, clock=clock)
    agent.dispatch(T.task("c1"), server.task())
    for m in server.weights():
        agent.dispatch(T.model_chunk(0, 0), m)
    agent.tick()
    (d,) = declines(transport)
    assert "not even one step fits" in d.reason and transport.on(T.update("c1")) == []


def test_redelivered_task_after_upload_resends_the_same_update(tmp_path):
    server = FakeServer(tmp_path / "s")
    agent, transport, _ = make_agent(tmp_path, server)
    agent.dispatch(T.task("c1"), server.task())
    for m in server.weights():
        agent.dispatch(T.model_chunk(0, 0), m)
    agent.tick()
    first = transport.on(T.update("c1"))
    agent.dispatch(T.task("c1"), server.task())  # the broker restarted and redelivered the retained task
    assert transport.on(T.update("c1")) == first + first


def test_weights_that_never_come_give_up_at_the_deadline(tmp_path):
    server, clock = FakeServer(tmp_path / "s"), Clock()
    agent, _, device = make_agent(tmp_path, server, clock=clock)
    agent.dispatch(T.task("c1"), server.task())
    clock.now += 61
    agent.tick()
    assert agent.task is None and agent.last_task == ("run1", 1)
    for m in server.weights():  # too late: no task holds them
        agent.dispatch(T.model_chunk(0, 0), m)
    agent.tick()
    assert device.trained == []


def test_a_new_server_run_restarts_the_rounds(tmp_path):
    server = FakeServer(tmp_path / "s")
    agent, _, device = make_agent(tmp_path, server)
    agent.dispatch(T.task("c1"), server.task(round=3))
    for m in server.weights(round=3):
        agent.dispatch(T.model_chunk(0, 0), m)
    agent.tick()
    restarted = FakeServer(tmp_path / "s", run="run2")  # same key (same directory), new run
    agent.dispatch(T.server_status, restarted.status(time=2000.0))
    agent.dispatch(T.task("c1"), restarted.task(round=1))
    for m in restarted.weights(round=1):
        agent.dispatch(T.model_chunk(0, 0), m)
    agent.tick()
    assert [(r, k) for r, k, _ in device.trained] == [(3, 0), (1, 0)]


def _pinned_agent(tmp_path, server_key=None):
    cfg = AgentConfig("c1", federation="t", server_key=server_key, pin_file=tmp_path / "pins" / "t.pub",
                      device_key=Signer.load_or_create(tmp_path / "device-keys", "c1.key"))
    return Agent(cfg, FakeTransport(), FakeDevice())


def test_a_status_signed_by_another_key_than_the_given_one_names_both_and_the_fix(tmp_path, caplog):
    server, impostor = FakeServer(tmp_path / "s"), FakeServer(tmp_path / "other")
    agent = _pinned_agent(tmp_path, server_key=server.signer.public_text)
    agent.dispatch(T.server_status, impostor.status())
    assert not agent.server_seen and agent.dropped["bad_signature"] == 1
    assert agent.foreign_key == impostor.signer.public_text
    text = caplog.text
    assert impostor.signer.public_text in text and server.signer.public_text in text and "--server-key" in text
    assert "aggregator key" in text and "delete" not in text  # no pin file to delete: the key came from the command line
    warning = _no_server(agent, SimpleNamespace(connected=True), BrokerSettings("broker", 1883))
    assert "an aggregator answers" in warning and "is `aggregator serve" not in warning


def test_a_status_signed_by_another_key_than_the_remembered_one_names_the_pin_file(tmp_path, caplog):
    server, replaced = FakeServer(tmp_path / "s"), FakeServer(tmp_path / "new")
    (tmp_path / "pins").mkdir()
    (tmp_path / "pins" / "t.pub").write_text(server.signer.public_text + "\n")  # pinned on first use, earlier
    agent = _pinned_agent(tmp_path)
    agent.dispatch(T.server_status, replaced.status())
    assert not agent.server_seen and "delete the file" in caplog.text and str(tmp_path / "pins" / "t.pub") in caplog.text


def test_an_upload_is_announced_and_resent_on_request_where_no_worker_listens(tmp_path):
    """After its update the device says so on `sent/` (signed); when the server asks (a task with resend), it
    publishes the same chunks on `resend/`, which the coordinator reads itself."""
    server = FakeServer(tmp_path / "s")
    agent, transport, _ = make_agent(tmp_path, server)
    agent.dispatch(T.task("c1"), server.task())
    for m in server.weights():
        agent.dispatch(T.model_chunk(0, 0), m)
    agent.tick()
    first = transport.on(T.update("c1"))
    (notice,) = transport.on(T.sent("c1"))
    key = parse_public_key(announces(transport)[0].key)
    sent = Sent.from_json(verify(notice, key))
    done = Reassembler().feed(first[0])
    assert (sent.run, sent.round, sent.submodel, sent.digest) == ("run1", 1, 0, done.header.digest)
    agent.dispatch(T.task("c1"), server.task(resend=True))
    assert transport.on(T.resend("c1")) == first and transport.on(T.update("c1")) == first
    other = FakeServer(tmp_path / "s")  # a resend request for a round this device did not upload: nothing happens
    agent.dispatch(T.task("c1"), other.task(round=2, resend=True))
    assert agent.task is None and transport.on(T.resend("c1")) == first


def test_statuses_are_signed_and_stamped_by_the_connection(tmp_path):
    agent, transport, _ = make_agent(tmp_path)
    agent.on_connected(seq=1234)
    key = agent.cfg.device_key
    status = ClientStatus.from_json(verify(transport.on(T.status("c1"))[-1], parse_public_key(key.public_text)))
    assert (status.state, status.seq) == ("online", 1234)
    will = status_message(key, "offline", 1235)
    assert ClientStatus.from_json(verify(will, parse_public_key(key.public_text))).seq == 1235


class RowsDevice(FakeDevice):
    """A device whose selection has per-submodel rows: `slow` submodels miss the deadline, `tight` miss memory."""

    def __init__(self, slow: set[int] = frozenset(), tight: set[int] = frozenset()) -> None:
        super().__init__(can=5)
        self.slow, self.tight = set(slow), set(tight)

    def plan(self, layout, training, budget_s, cap, hold=None):
        rows = tuple(Fit(k, 1 << 20, True, k not in self.tight, 9.0 if k in self.slow else 1.0, k not in self.slow, False,
                         budget_s) for k in range(layout.num_submodels))
        ok = [f.index for f in rows if f.fits]
        return Selection(max(ok) if ok else None, "rows", "none", None, rows)


def test_the_announced_bound_is_one_every_submodel_under_it_fits(tmp_path):
    """Per-submodel fits need not be a prefix (submodel 5 predicted to fit, 2 not): the device promises only
    what it can keep, so the server never assigns a submodel it would decline (the two-busy-joins livelock)."""
    server = FakeServer(tmp_path / "s")
    agent, transport, _ = make_agent(tmp_path, server, RowsDevice(slow={1}))
    assert agent.selection.submodel == 5 and announces(transport)[-1].max_submodel == 1


def test_a_task_at_or_below_the_announced_bound_is_trained_even_when_time_looks_short(tmp_path):
    server = FakeServer(tmp_path / "s")
    device = RowsDevice()
    agent, transport, _ = make_agent(tmp_path, server, device)
    assert announces(transport)[-1].max_submodel == 5
    device.slow = {0, 1, 2, 3}  # the load rose after the announce: the prediction now misses the deadline
    agent.dispatch(T.task("c1"), server.task(k=1))
    for m in server.weights(k=1):
        agent.dispatch(T.model_chunk(1, 0), m)
    agent.tick()
    assert [(r, k) for r, k, _ in device.trained] == [(1, 1)] and declines(transport) == []
    assert announces(transport)[-1].max_submodel == 0  # and it says so for the rounds to come


def test_a_promised_task_that_no_longer_fits_memory_is_declined_after_a_re_announce(tmp_path):
    server = FakeServer(tmp_path / "s")
    device = RowsDevice()
    agent, transport, _ = make_agent(tmp_path, server, device)
    device.tight = {2, 3, 4}
    agent.dispatch(T.task("c1"), server.task(k=3))
    assert announces(transport)[-1].max_submodel == 2
    assert [(d.round, d.submodel) for d in declines(transport)] == [(1, 3)] and device.trained == []


def test_a_promised_task_is_trained_even_when_the_deadline_binds_for_every_submodel(tmp_path):
    """Beside busy loops the prediction may say even submodel 1 misses the deadline; the device trains what the
    time allows (and declines only if not even one step fits), it does not decline what it promised."""
    server = FakeServer(tmp_path / "s")
    device = RowsDevice()
    agent, transport, _ = make_agent(tmp_path, server, device)
    device.slow = {0, 1, 2, 3, 4}
    agent.dispatch(T.task("c1"), server.task(k=0))
    for m in server.weights(k=0):
        agent.dispatch(T.model_chunk(0, 0), m)
    agent.tick()
    assert [(r, k) for r, k, _ in device.trained] == [(1, 0)] and declines(transport) == []


def test_a_buffered_task_trains_from_the_version_it_names_within_the_devices_own_budget(tmp_path):
    server, clock = FakeServer(tmp_path / "s"), Clock()
    agent, transport, device = make_agent(tmp_path, server, clock=clock, task_budget_s=20.0)
    agent.dispatch(T.task("c1"), server.task(k=1, round=42, mode="buffered", version=5))
    for m in server.weights(k=1, round=4):  # the version before: not what the signed task names
        agent.dispatch(T.model_chunk(1, 0), m)
    assert agent.dropped["model_mismatch"] == 1
    for m in server.weights(k=1, round=5):
        agent.dispatch(T.model_chunk(1, 0), m)
    agent.tick()
    ((number, k, budget),) = device.trained
    assert (number, k) == (42, 1) and 0 < budget <= 20 * 0.8  # its own 20 s, not the server's 60 s bound
    header = parse_chunk(transport.on(T.update("c1"))[0]).header
    assert (header.round, header.submodel) == (42, 1)  # the update names its task; the server knows its version


def test_a_buffered_task_beyond_the_devices_budget_waits_no_longer_than_it(tmp_path):
    server, clock = FakeServer(tmp_path / "s"), Clock()
    agent, _, device = make_agent(tmp_path, server, clock=clock, task_budget_s=20.0)
    agent.dispatch(T.task("c1"), server.task(k=0, round=3, mode="buffered", version=1))
    clock.now += 21
    agent.tick()
    assert agent.task is None and device.trained == []


def test_an_update_refusal_is_heard_and_counted_not_obeyed_beyond_that(tmp_path, caplog):
    server = FakeServer(tmp_path / "s")
    agent, _, _ = make_agent(tmp_path, server)
    agent.dispatch(T.refusal("c1"), server.update_refusal("stale"))
    agent.dispatch(T.refusal("c1"), server.update_refusal("stale"))
    assert agent.updates_refused == {"stale": 2} and agent.refused is None
    assert "stale; trained from version 1, the newest is 20" in caplog.text
    agent.dispatch(T.refusal("c1"), server.update_refusal("stale", client="c2"))
    assert agent.dropped["client_mismatch"] == 1
    other = FakeServer(tmp_path / "other")  # a refusal not signed by the pinned key is dropped
    agent.dispatch(T.refusal("c1"), other.update_refusal("stale"))
    assert agent.updates_refused == {"stale": 2} and sum(agent.dropped.values()) == 2
