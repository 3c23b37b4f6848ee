"""Every inbound handler, on the server and on the device, driven with hostile bytes: nothing escapes.

The handlers are the real ones (`Server.handle`, `Agent.dispatch`) on objects built without a broker;
hypothesis throws random bytes, random JSON (NaN/Infinity literals, deep nesting, huge integers),
mutated valid messages and validly signed but hostile bodies at every topic. A bug would surface as
an `internal_error` rejection (the boundary's last resort), so the tests also assert there is none.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aggregator.server import ServeConfig, Server, Start
from edge_client.agent import Agent
from aggregator.enrolment import Enrolment
from nefl.protocol.messages import FINAL_REFUSALS, VERSION, Announce, ClientStatus, Control, Decline, Receipt, ReceiptBatch
from nefl.protocol.mqtt import parse_broker
from nefl.nested.profile import load_profile
from nefl.protocol.signing import Signer, split_signed
from nefl.protocol.tokens import new_token, parse_token, proof
from nefl.nested.state import GlobalState, Layout
from nefl.protocol.topics import Topics
from nefl.protocol.wire import encode
from tests.harness.agent_fakes import FakeServer, make_agent
from tests.harness.hostile import HOSTILE, hostile_payload, mutate

PROFILE = "resnet8-fmnist-w"
T = Topics("t")
fuzz = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
KILLERS = [  # each ended the aggregator or a client before the strict loader
    b'{"v":2,"samples":1,"max_submodel":Infinity}',
    b"[" * 2000 + b"]" * 2000,
    b'{"v":2,"type":"announce","client":"raw","samples":1,"max_submodel":' + b"9" * 5000 + b"}",
    b'{"v":2,"state":' + b"[" * 2000 + b"]" * 2000 + b"}",
    b"NEFL\x00\x00\x0f\xa0" + b"[" * 2000 + b"]" * 2000,
    b"",
    b"\x00" * 70000,
]


# -- server -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def layout() -> Layout:
    return Layout.build(load_profile(PROFILE))


@pytest.fixture
def server(tmp_path, layout) -> Server:
    """A server with one (unsigned, open-enrolment) participant "raw" and one authorised worker, "w1"."""
    cfg = ServeConfig(profile=PROFILE, federation="t", checkpoint_dir=str(tmp_path), clients_per_round=3, round_timeout=60)
    enrol = Enrolment("t")
    enrol.local_workers = {"w1": WORKER.public_text}
    srv = Server(cfg, parse_broker("mqtt://127.0.0.1:1"), Start(layout.profile, layout, GlobalState.init(layout, 0), 1),
                 Signer.load_or_create(tmp_path), enrol)
    srv.link.publish = lambda topic, payload, retain=False: None
    srv.handle(T.status("raw"), ClientStatus(state="online").to_json())
    srv.handle(T.announce("raw"), Announce(client="raw", samples=10, max_submodel=1).to_json())
    srv.fed.open_round(1)
    srv.rounds.pool.open(srv.link.run_id, layout)
    return srv


WORKER = Signer(Ed25519PrivateKey.generate())


def update(layout: Layout, scale: float = 0.0, **kw) -> bytes:
    args = dict(kind="update", federation="t", round=1, submodel=0, client="raw", samples=10, chunk_bytes=1 << 22)
    return encode({n: torch.full(s, scale) for n, s in layout.upload_shapes(0).items()}, **{**args, **kw}).messages[0]


def test_killer_messages_are_counted_rejections(server):
    for payload in KILLERS:
        for kind in ("announce", "status", "update"):
            server.handle(f"nefl/t/{kind}/raw", payload)
    assert "internal_error" not in server.fed.rejected
    assert sum(server.fed.rejected.values()) >= 2 * len(KILLERS)  # empty payloads clear, they are no rejection
    server.handle(T.update("raw"), update(server.fed.layout))  # and the honest path still works
    assert server.fed.round.received == {"raw"}


def test_a_batch_of_receipts_is_judged_receipt_by_receipt(server):
    """A worker's receipts come in signed batches: a bad one is counted on its own, the others stand."""
    rcs = [Receipt(run="other-run", round=1, client="raw", outcome="accepted", samples=10, norm=1.0),  # wrong run
           Receipt(run=server.link.run_id, round=1, client="nobody", outcome="accepted", samples=10, norm=1.0),  # not assigned
           Receipt(run=server.link.run_id, round=1, client="raw", outcome="accepted", samples=10, norm=1.0, nbytes=7),
           Receipt(run=server.link.run_id, round=1, client="raw", outcome="accepted", samples=10, norm=1.0)]  # twice
    server.handle(T.worker("w1", "receipt"), WORKER.sign(ReceiptBatch(receipts=rcs).to_json()))
    assert server.fed.rejected == {"wrong_run": 1, "stale_receipt": 1, "duplicate_update": 1}
    assert server.fed.round.received == {"raw"} and server.rounds.pool.held["raw"].worker == "w1"
    server.handle(T.worker("w1", "receipt"), WORKER.sign(rcs[2].to_json()))  # a lone receipt is not a batch
    server.handle(T.worker("w1", "receipt"), WORKER.sign(b'{"v":%d,"type":"receipts","receipts":[]}' % VERSION))
    assert server.fed.rejected["invalid_receipts"] == 2


def _signed_server(tmp_path, layout) -> tuple[Server, Signer]:
    """A server with one participant, "dev", that signs with its device key."""
    cfg = ServeConfig(profile=PROFILE, federation="t", checkpoint_dir=str(tmp_path), clients_per_round=3, round_timeout=60)
    srv = Server(cfg, parse_broker("mqtt://127.0.0.1:1"), Start(layout.profile, layout, GlobalState.init(layout, 0), 1),
                 Signer.load_or_create(tmp_path))
    device = Signer.load_or_create(tmp_path / "dev", "dev.key")
    srv.handle(T.status("dev"), ClientStatus(state="online").to_json())
    srv.handle(T.announce("dev"), device.sign(Announce(client="dev", samples=10, max_submodel=1, key=device.public_text).to_json()))
    srv.fed.open_round(1)
    return srv, device


def test_a_device_key_is_pinned_on_first_announce(tmp_path, layout):
    srv, device = _signed_server(tmp_path, layout)
    assert srv.control.enrol.key("dev") == device.public_text and srv.fed.round.assignments == {"dev": 0}
    impostor = Signer.load_or_create(tmp_path / "imp", "dev.key")
    srv.handle(T.announce("dev"), impostor.sign(Announce(client="dev", samples=10, max_submodel=5,
                                                         key=impostor.public_text).to_json()))
    srv.handle(T.announce("dev"), Announce(client="dev", samples=10, max_submodel=5).to_json())  # unsigned
    forged = device.sign(Announce(client="dev", samples=10, max_submodel=1, key=device.public_text).to_json())
    srv.handle(T.announce("dev"), forged.replace(b'"max_submodel":1', b'"max_submodel":5'))
    assert srv.fed.rejected == {"key_mismatch": 1, "unsigned": 1, "bad_signature": 1}
    assert srv.fed.clients["dev"].max_submodel == 0  # none of them changed what the server believes


def test_updates_under_a_pinned_id_must_carry_its_signature(tmp_path, layout):
    srv, device = _signed_server(tmp_path, layout)
    srv.handle(T.update("dev"), update(layout, client="dev"))  # unsigned
    replayed = update(layout, client="dev", round=7, sign=device.sign)  # a signed header of another round...
    srv.handle(T.update("dev"), replayed.replace(b'"round":7', b'"round":1'))  # ...re-wrapped into this one
    imp = Signer.load_or_create(tmp_path / "imp", "dev.key")
    srv.handle(T.update("dev"), update(layout, client="dev", sign=imp.sign))
    assert srv.fed.rejected == {"unsigned": 1, "bad_signature": 2} and not srv.fed.round.received
    srv.handle(T.update("dev"), update(layout, client="dev", sign=device.sign))
    assert srv.fed.round.received == {"dev"}


@fuzz
@given(data=st.data())
def test_server_handle_never_raises(server, data):
    topic = data.draw(st.sampled_from([T.announce("raw"), T.status("raw"), T.update("raw"), T.announce("other"),
                                       T.update("intruder"), "nefl/t/announce/a/b", "nefl/t/update/", "x/y",
                                       T.sent("raw"), T.resend("raw"), T.decline("raw"), *(T.worker(w, k) for w in ("w1", "w2")
                                                                        for k in ("status", "receipt", "summary", "partial"))]))
    kind = data.draw(st.sampled_from([*HOSTILE, "announce", "status", "update", "receipt", "decline"]))
    if kind in HOSTILE:  # signed-json: by the authorised worker
        payload = hostile_payload(data, kind, WORKER.sign)
    elif kind == "receipt":
        rc = Receipt(run=server.link.run_id, round=1, client="raw", outcome="accepted", samples=10, norm=1.0)
        body = ReceiptBatch(receipts=[rc] * data.draw(st.integers(1, 3))).to_json()
        payload = WORKER.sign(mutate(data, body[:-1]) + b"}")  # only a JSON object's bytes are signed
    elif kind == "decline":
        payload = mutate(data, Decline(client="raw", federation="t", run=server.link.run_id, round=1, submodel=0).to_json())
    elif kind == "announce":
        payload = mutate(data, Announce(client="raw", samples=10, max_submodel=2).to_json())
    elif kind == "status":
        payload = mutate(data, ClientStatus(state="online").to_json())
    else:
        payload = mutate(data, update(server.fed.layout))
    server.handle(topic, payload)
    assert "internal_error" not in server.fed.rejected


# -- device ------------------------------------------------------------------------------------------

@pytest.fixture
def server_side(tmp_path) -> FakeServer:
    return FakeServer(tmp_path / "server")


@pytest.fixture
def agent(tmp_path, server_side) -> Agent:
    a, _, _ = make_agent(tmp_path, server_side)
    assert a.layout is not None and a.run_id == "run1"
    return a


def test_a_pinned_key_refuses_another(agent, server_side, tmp_path):
    impostor = FakeServer(tmp_path / "impostor", run="evil", incarnation=9)
    agent.dispatch(T.server_status, impostor.status())
    assert agent.run_id == "run1" and agent.dropped["bad_signature"] == 1


def test_unsigned_forged_and_replayed_server_messages_are_dropped(agent, server_side, tmp_path):
    signer = server_side.signer
    take_a_task(agent, server_side)
    agent.dispatch(T.control, Control(federation="t", run="run1", event="end").to_json())  # unsigned
    impostor = FakeServer(tmp_path / "impostor").signer
    agent.dispatch(T.control, impostor.sign(Control(federation="t", run="run1", event="end", incarnation=1).to_json()))
    agent.dispatch(T.control, signer.sign(Control(federation="t", run="old-run", event="end", incarnation=1).to_json()))
    agent.dispatch(T.control, server_side.end(incarnation=0))  # the same run id under an older incarnation
    assert not agent.ended
    assert agent.dropped["unsigned"] == 1 and agent.dropped["bad_signature"] == 1 and agent.dropped["wrong_run"] == 1
    assert agent.dropped["stale_run"] == 1
    agent.dispatch(T.server_status, server_side.status(seq=0))  # an older status replayed
    assert agent.dropped["replayed"] == 1
    agent.dispatch(T.control, server_side.end())
    assert agent.ended


def take_a_task(agent, server, round: int = 1) -> None:
    agent.dispatch(T.task("c1"), server.task(round=round))
    for m in server.weights(round=round):
        agent.dispatch(T.model_chunk(0, 0), m)
    agent.tick()


def test_hostile_tasks_are_dropped(agent, server_side):
    signer = server_side.signer
    good = json.loads(server_side.task_msg().to_json())
    agent.dispatch(T.task("c1"), signer.sign(json.dumps({**good, "batch_size": 0}).encode()))
    agent.dispatch(T.task("c1"), signer.sign(json.dumps({**good, "epochs": 10**6}).encode()))
    agent.dispatch(T.task("c1"), server_side.task(model_bytes=1 << 33))  # would buffer 8 GiB
    agent.dispatch(T.task("c1"), json.dumps(good).encode())  # unsigned
    assert agent.task is None
    assert agent.dropped["invalid_task"] == 2 and agent.dropped["bad_task"] == 1 and agent.dropped["unsigned"] == 1


def test_weights_must_match_the_signed_task(agent, server_side):
    agent.dispatch(T.task("c1"), server_side.task())
    assert agent.task is not None
    for m in server_side.weights(scale=1e30):  # a forged retained model
        agent.dispatch(T.model_chunk(0, 0), m)
    assert agent.weights is None and agent.dropped["model_mismatch"] == 1
    for m in server_side.weights():
        agent.dispatch(T.model_chunk(0, 0), m)
    assert agent.weights is not None and float(next(iter(agent.weights.values())).abs().sum()) == 0.0


def test_tasks_before_the_status_wait_for_it(tmp_path, server_side):
    a, _, _ = make_agent(tmp_path)
    a.dispatch(T.task("c1"), server_side.task())
    assert a.task is None  # no key pinned yet: held, not trusted
    a.dispatch(T.server_status, server_side.status())
    assert a.task is not None and a.cfg.pin_file.read_text().strip() == server_side.signer.public_text


# -- which key, which run ----------------------------------------------------------------------------

def test_first_use_trusts_the_run_that_sends_a_task_not_the_first_status(tmp_path, server_side):
    """An attacker's own signed status (or a replayed finished one) comes first: nothing is pinned until a
    run sends this device a task, and the key of that run is pinned (and logged with its fingerprint)."""
    a, _, _ = make_agent(tmp_path)
    evil = FakeServer(tmp_path / "evil", run="evil")
    a.dispatch(T.server_status, evil.status())
    a.dispatch(T.server_status, server_side.status(state="finished"))  # not a running federation: no candidate
    a.dispatch(T.server_status, server_side.status())
    assert a.pin.key is None and len(a.candidates) == 2 and a.dropped["not_live"] == 1
    a.dispatch(T.control, evil.end())  # a candidate's end pins nothing and ends nothing
    take_a_task(a, server_side)
    assert a.pin.text == server_side.signer.public_text and a.cfg.pin_file.read_text().strip() == a.pin.text
    a.dispatch(T.server_status, evil.status())
    assert a.dropped["bad_signature"] == 1 and a.run_id == "run1" and not a.ended


def test_a_join_token_names_the_server_key(tmp_path, server_side, caplog):
    token, _ = new_token(server_side.signer.public_text)
    a, transport, _ = make_agent(tmp_path, join_token=token)
    a.dispatch(T.server_status, FakeServer(tmp_path / "evil").status())
    assert a.pin.key is None and a.dropped["wrong_server_key"] == 1
    with caplog.at_level(logging.INFO, logger="edge_client.agent"):
        a.dispatch(T.server_status, server_side.status())
    assert a.pin.text == server_side.signer.public_text and a.run_id == "run1"
    assert "the join token names it" in caplog.text and "on first use" not in caplog.text  # no trust-on-first-use warning
    announce = Announce.from_json(split_signed(transport.on(T.announce("c1"))[-1])[0])
    _, secret = parse_token(token)
    assert announce.token == proof(secret, "t", "c1", announce.key)  # the proof, never the token itself
    assert token not in json.dumps([p.decode("latin1") for _, p, _ in transport.published])


def test_an_earlier_runs_end_replayed_does_not_end_a_fresh_device(tmp_path):
    """A resumed federation (same key): the old run's finished status and end, replayed to a device that
    never took part, leave it waiting; the new incarnation takes over, and the old one is refused for good
    (also after a restart: the device remembers the newest incarnation per server key)."""
    old = FakeServer(tmp_path / "s", run="old", incarnation=1)
    finished, end = old.status(state="finished"), old.end()
    new = FakeServer(tmp_path / "s", run="new", incarnation=2)
    a, _, _ = make_agent(tmp_path, new)  # adopted the new run's status...
    a2, _, _ = make_agent(tmp_path / "fresh", pinned=False, server_key=new.signer.public_text)
    a2.dispatch(T.server_status, finished)  # ...a fresh one sees only the replay first
    a2.dispatch(T.control, end)
    assert not a2.ended and a2.run_id == "old"
    a2.dispatch(T.server_status, new.status())
    a2.dispatch(T.control, end)
    assert not a2.ended and a2.run_id == "new" and a2.dropped["stale_run"] == 1
    a.dispatch(T.server_status, finished)
    assert a.dropped["stale_run"] == 1 and a.run_id == "new"
    a3, _, _ = make_agent(tmp_path / "early", pinned=False, server_key=new.signer.public_text)
    a3.dispatch(T.server_status, finished)  # the replay first, then the new run's task before its status
    a3.dispatch(T.task("c1"), new.task())
    assert a3.task is None and not a3.dropped
    a3.dispatch(T.server_status, new.status())
    assert a3.run_id == "new" and a3.task is not None and not a3.dropped
    restarted, _, _ = make_agent(tmp_path, None, server_key=new.signer.public_text)  # the same run file
    restarted.dispatch(T.server_status, finished)
    assert restarted.dropped["stale_run"] == 1 and restarted.run_id is None


@fuzz
@given(data=st.data())
def test_agent_dispatch_never_raises(agent, server_side, data):
    topic = data.draw(st.sampled_from([T.control, T.server_status, T.task("c1"), T.model_chunk(0, 0), T.task("c2"), "x"]))
    kind = data.draw(st.sampled_from([*HOSTILE, "task", "status", "model"]))
    if kind in HOSTILE:  # signed-json: by the pinned key
        payload = hostile_payload(data, kind, server_side.signer.sign)
    elif kind == "task":
        payload = mutate(data, server_side.task(seq=50))
    elif kind == "status":
        payload = mutate(data, server_side.status(seq=5000))
    else:
        payload = mutate(data, server_side.weights()[0])
    agent.dispatch(topic, payload)
    agent.tick()
    assert "internal_error" not in agent.dropped
    assert not agent.ended


@fuzz
@given(data=st.data())
def test_the_refusal_handler_never_raises_and_stops_only_on_a_final_refusal_of_our_key(agent, server_side, data):
    mine = agent.cfg.device_key.public_text
    agent.refused = None  # the agent lives across examples
    kind = data.draw(st.sampled_from([*HOSTILE, "mutated", "signed-refusal"]))
    if kind in HOSTILE:  # signed-json: by the pinned key, as a refusal
        payload = hostile_payload(data, kind, server_side.signer.sign, type="announce_refusal")
    elif kind == "mutated":
        payload = mutate(data, server_side.refusal("revoked", key=mine, seq=50))
    else:  # validly signed, any reason, key and hint
        reason = data.draw(st.sampled_from(sorted(FINAL_REFUSALS) + ["not_enrolled", "new_reason"]) | st.text(max_size=64))
        payload = server_side.refusal(reason, key=data.draw(st.sampled_from([mine, "", "x" * 64])),
                                      hint=data.draw(st.text(max_size=300)), seq=50)
    agent.dispatch(T.refusal("c1"), payload)
    assert "internal_error" not in agent.dropped
    if agent.refused is not None:
        assert kind in ("mutated", "signed-refusal") and agent.refused in FINAL_REFUSALS
