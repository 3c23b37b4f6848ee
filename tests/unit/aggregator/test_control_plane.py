"""The server's control plane in process (no broker): who may speak for a worker, a device's status and
its upload notices, enrolment, and rounds that neither wait for refused updates nor lose one to a silent
subscriber. The same attacks run over real mosquitto in tests/e2e/test_control_attacks.py."""

from __future__ import annotations

import time
from unittest import mock

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from aggregator.enrolment import Enrolment, EnrolmentPolicy, Grant, Revoke, append
from aggregator.refusals import RefusalLimit
from aggregator.server import ServeConfig, Server, Start
from nefl.nested.profile import load_profile
from nefl.nested.state import GlobalState, Layout
from nefl.protocol.messages import Announce, AnnounceRefusal, ClientStatus, Receipt, ReceiptBatch, Sent, Task, WorkerStatus
from nefl.protocol.mqtt import parse_broker
from nefl.protocol.signing import Signer, parse_public_key, split_signed, verify
from nefl.protocol.tokens import new_token, parse_token, proof
from nefl.protocol.topics import Topics
from nefl.protocol.wire import Encoded, encode

PROFILE = "resnet8-fmnist-w"
T = Topics("t")


@pytest.fixture(scope="module")
def layout() -> Layout:
    return Layout.build(load_profile(PROFILE))


def key() -> Signer:
    return Signer(Ed25519PrivateKey.generate())


def server(tmp_path, layout, enrolment: Enrolment | None = None, **cfg) -> tuple[Server, list[tuple[str, bytes]]]:
    c = ServeConfig(**{**dict(profile=PROFILE, federation="t", checkpoint_dir=str(tmp_path / "run"), clients_per_round=3,
                              round_timeout=60, resend_after=0.5), **cfg})
    srv = Server(c, parse_broker("mqtt://127.0.0.1:1"), Start(layout.profile, layout, GlobalState.init(layout, 0), 1),
                 key(), enrolment, incarnation=7)
    sent: list[tuple[str, bytes]] = []
    srv.link.publish = lambda topic, payload, retain=False: sent.append((topic, payload))
    return srv, sent


def join(srv: Server, client: str, device: Signer, token: str = "") -> None:
    srv.handle(T.status(client), device.sign(ClientStatus(state="online", seq=1).to_json()))
    announce = Announce(client=client, samples=10, max_submodel=1, key=device.public_text, token=token)
    srv.handle(T.announce(client), device.sign(announce.to_json()))


def update(layout: Layout, client: str, device: Signer, value: float = 0.0, round: int = 1) -> Encoded:
    return encode({n: torch.full(s, value) for n, s in layout.upload_shapes(0).items()}, kind="update", federation="t",
                  round=round, submodel=0, client=client, samples=10, chunk_bytes=1 << 22, sign=device.sign)


def test_plain_serve_hears_no_worker_and_forged_worker_messages_are_counted(tmp_path, layout):
    srv, _ = server(tmp_path, layout)
    assert not any("/worker/" in t for t in srv._subscriptions())  # the forged-receipt attack has nobody to talk to
    forged = ReceiptBatch(receipts=[Receipt(run=srv.link.run_id, round=1, client="c1", outcome="update_norm")]).to_json()
    srv.handle(T.worker("w1", "receipt"), forged)
    assert srv.fed.rejected == {"unauthorised_worker": 1}
    w1, thief = key(), key()
    journal = tmp_path / "enrolment.jsonl"
    append(journal, Grant(client="w1", role="worker", created=time.time(), key=w1.public_text))
    srv2, _ = server(tmp_path / "2", layout, Enrolment("t", EnrolmentPolicy(), journal))
    assert T.worker("+", "receipt") in srv2._subscriptions()
    srv2.handle(T.worker("w1", "receipt"), forged)  # unsigned
    srv2.handle(T.worker("w1", "receipt"), thief.sign(forged))  # signed by someone else
    srv2.handle(T.worker("w1", "status"), w1.sign(WorkerStatus(state="online", seq=5).to_json()))
    srv2.handle(T.worker("w1", "status"), w1.sign(WorkerStatus(state="online", seq=4).to_json()))  # replayed
    assert srv2.rounds.pool.roles == {"w1": "worker"}
    srv2.handle(T.worker("w1", "status"), w1.sign(WorkerStatus(state="offline", seq=5).to_json()))  # its will
    assert srv2.rounds.pool.roles == {}
    assert srv2.fed.rejected == {"unsigned": 1, "bad_signature": 1, "replayed": 1}


def test_a_receipt_must_stay_within_the_bound_and_name_the_run(tmp_path, layout):
    w1, dev = key(), key()
    enrol = Enrolment("t")
    enrol.local_workers = {"w1": w1.public_text}
    srv, _ = server(tmp_path, layout, enrol, workers=1)
    join(srv, "c1", dev)
    srv.fed.open_round(1)
    srv.rounds.pool.open(srv.link.run_id, layout)
    bound, _ = srv.fed.guard.limit(0, srv.fed.weight_norm(0))
    for rc in (Receipt(run="old", round=1, client="c1", outcome="accepted", samples=10, norm=1.0),
               Receipt(run=srv.link.run_id, round=1, client="c1", outcome="accepted", samples=10, norm=bound * 2),
               Receipt(run=srv.link.run_id, round=1, client="c1", outcome="accepted", samples=10)):
        srv.handle(T.worker("w1", "receipt"), w1.sign(ReceiptBatch(receipts=[rc]).to_json()))
    assert srv.fed.rejected == {"wrong_run": 1, "bad_receipt": 2} and not srv.fed.round.received
    refused = Receipt(run=srv.link.run_id, round=1, client="c1", outcome="update_norm", attributed=True)
    srv.handle(T.worker("w1", "receipt"), w1.sign(ReceiptBatch(receipts=[refused]).to_json()))
    assert srv.fed.round.refused == {"c1": "update_norm"} and srv.fed.complete()  # nobody left to wait for


def test_a_pinned_devices_status_must_be_its_own_and_new(tmp_path, layout):
    srv, _ = server(tmp_path, layout)
    dev, thief = key(), key()
    join(srv, "c1", dev)
    assert srv.fed.available() == ["c1"]
    srv.handle(T.status("c1"), ClientStatus(state="offline").to_json())  # unsigned: a forged last will
    srv.handle(T.status("c1"), thief.sign(ClientStatus(state="offline", seq=9).to_json()))
    srv.handle(T.status("c1"), b"")  # a cleared retained status
    assert srv.fed.available() == ["c1"]
    srv.handle(T.status("c1"), dev.sign(ClientStatus(state="offline", seq=1).to_json()))  # the device's own will
    assert srv.fed.available() == []
    srv.handle(T.status("c1"), dev.sign(ClientStatus(state="online", seq=1).to_json()))  # that connection, replayed
    srv.handle(T.status("c1"), dev.sign(ClientStatus(state="online", seq=2).to_json()))  # a new connection
    assert srv.fed.available() == ["c1"]
    assert srv.fed.rejected == {"unsigned": 2, "bad_signature": 1, "replayed": 1}


def test_closed_enrolment_ignores_made_up_ids_and_admits_a_token(tmp_path, layout):
    journal = tmp_path / "enrolment.jsonl"
    token, verifier = new_token(key().public_text)
    append(journal, Grant(client="c1", created=time.time(), verifier=verifier, expires=time.time() + 60))
    srv, _ = server(tmp_path, layout, Enrolment("t", EnrolmentPolicy(), journal))
    dev = key()
    srv.handle(T.status("c1"), dev.sign(ClientStatus(state="online", seq=1).to_json()))  # before its enrolment
    for i in range(1200):  # a flood of made-up ids, more than the statuses kept for invited ids
        fake = f"fake{i}"
        srv.handle(T.status(fake), ClientStatus(state="online").to_json())
        srv.handle(T.announce(fake), Announce(client=fake, samples=10, max_submodel=1).to_json())
    assert srv.fed.clients == {} and srv.fed.rejected == {"not_enrolled": 2400}
    srv.handle(T.announce("c1"), dev.sign(Announce(client="c1", samples=10, max_submodel=1, key=dev.public_text,
                                                   token=proof(parse_token(token)[1], "t", "c1", dev.public_text)).to_json()))
    assert srv.fed.available() == ["c1"]  # its status, sent before it was enrolled, counted once it was


def test_a_participant_refused_for_its_own_update_stops_holding_the_round(tmp_path, layout):
    srv, _ = server(tmp_path, layout)
    a, b = key(), key()
    join(srv, "a", a)
    join(srv, "b", b)
    srv.fed.open_round(1)
    for m in update(layout, "a", a, 1e30).messages:  # its own, signed: refused by the norm bound
        srv.handle(T.update("a"), m)
    for m in update(layout, "b", a).messages:  # b's id, a's key: a forgery must not stop the round waiting for b
        srv.handle(T.update("b"), m)
    assert srv.fed.round.refused == {"a": "update_norm"} and srv.fed.waiting_for() == ["b"]
    genuine = update(layout, "b", b).messages
    forged = bytearray(genuine[0])
    forged[-1] ^= 0xFF  # b's signed header copied off the broker, other data: the chunk fails its Merkle proof
    srv.handle(T.update("b"), bytes(forged))
    assert srv.fed.rejected.get("digest_mismatch") == 1 and srv.fed.waiting_for() == ["b"]  # not held against b
    for m in genuine:
        srv.handle(T.update("b"), m)
    assert srv.fed.complete() and srv.fed.round.received == {"b"}


def test_an_update_noticed_but_never_received_is_asked_for_again(tmp_path, layout):
    srv, sent = server(tmp_path, layout)
    dev = key()
    join(srv, "c1", dev)
    r = srv.fed.open_round(1)
    srv.rounds._published = {0: encode({n: torch.zeros(s) for n, s in layout.sub_shapes[0].items()}, kind="model",
                                federation="t", round=1, submodel=0, client="server")}
    srv.rounds.resends.open_round()
    msgs, header = update(layout, "c1", dev)
    notice = Sent(client="c1", run=srv.link.run_id, round=1, submodel=0, digest=header.digest)
    srv.handle(T.sent("c1"), notice.to_json())  # unsigned, but c1 is pinned
    srv.handle(T.sent("c1"), dev.sign(notice.to_json()))
    assert srv.fed.rejected == {"unsigned": 1}
    time.sleep(0.6)
    srv._housekeeping()
    (topic, task), = [(t, p) for t, p in sent if t == T.task("c1")]
    task = Task.from_json(split_signed(task)[0])
    assert task.resend and (task.run, task.round, task.incarnation) == (srv.link.run_id, 1, 7)
    for m in msgs:
        srv.handle(T.resend("c1"), m)
    assert r.received == {"c1"} and srv.rounds.resends.facts() == {"lost_to_unknown": 1, "resend_requested": ["c1"]}


def test_a_notice_after_its_update_is_moot_and_not_even_verified(tmp_path, layout):
    """On one connection a device's update arrives before its notice that it is out: the notice can change
    nothing then, so the server spends no signature check on it (a forged one is not counted either)."""
    srv, _ = server(tmp_path, layout)
    dev = key()
    join(srv, "c1", dev)
    r = srv.fed.open_round(1)
    srv.rounds.resends.open_round()
    msgs, header = update(layout, "c1", dev)
    for m in msgs:
        srv.handle(T.update("c1"), m)
    assert r.received == {"c1"}
    notice = Sent(client="c1", run=srv.link.run_id, round=1, submodel=0, digest=header.digest)
    with mock.patch("aggregator.control_plane.verify", side_effect=AssertionError("verified a moot notice")):
        srv.handle(T.sent("c1"), dev.sign(notice.to_json()))
        srv.handle(T.sent("c1"), notice.to_json())  # unsigned, which is refused before its update
    assert srv.fed.rejected == {} and srv.rounds.resends.noticed == {}


def test_the_round_plan_waits_for_an_authorised_worker(tmp_path, layout):
    """Plain serve publishes no round plan (it names every participant's key, and no worker could use it); once
    the operator authorises a worker mid-round, the next housekeeping listens to workers and publishes the open
    round's plan, which the worker then checks updates against."""
    journal = tmp_path / "enrolment.jsonl"
    srv, _ = server(tmp_path, layout, Enrolment("t", EnrolmentPolicy(), journal))
    plans = []
    srv.rounds.pool.publish = lambda topic, payload, retain=False: plans.append(topic)
    srv._subscriptions()  # as on connect
    join(srv, "c1", key())
    srv.fed.open_round(1)
    srv.rounds.pool.open(srv.link.run_id, layout, announce=srv.rounds.listening_to_workers)
    assert plans == [] and srv.rounds.pool._plan is None
    append(journal, Grant(client="w1", role="worker", created=time.time(), key=key().public_text))
    srv.link.conn.connected = True
    srv._housekeeping()
    assert srv.rounds.listening_to_workers and plans == [T.workers_round]
    assert srv.rounds.pool._plan.round == 1 and srv.rounds.pool._plan.assignments == srv.fed.round.assignments


def test_a_refused_announce_is_answered_signed_on_the_devices_topic_within_the_rate_limit(tmp_path, layout):
    journal = tmp_path / "enrolment.jsonl"
    token, verifier = new_token(key().public_text)
    append(journal, Grant(client="c1", created=time.time() - 10, verifier=verifier, expires=time.time() + 60))
    srv, _ = server(tmp_path, layout, Enrolment("t", EnrolmentPolicy(), journal))
    told: list[tuple[str, bytes]] = []
    srv.link.tell = lambda topic, payload: told.append((topic, payload))
    dev, forger = key(), key()
    secret = parse_token(token)[1]
    join(srv, "c1", dev, proof(secret, "t", "c1", dev.public_text))
    assert srv.fed.available() == ["c1"] and not told
    append(journal, Revoke(client="c1", time=time.time()))
    srv.control.check_enrolment()  # the device is told at once, not at its next announce
    assert srv.observer.snapshot().clients_online == 0 and len(told) == 1
    for _ in range(3):  # the revoked device keeps announcing: one answer per reason and interval
        join(srv, "c1", dev, proof(secret, "t", "c1", dev.public_text))
    # an announce forged under c1's id, signed by another key: refused too, and the answer names that key
    guess = parse_token(new_token(key().public_text)[0])[1]  # the forger does not have c1's token
    join(srv, "c1", forger, proof(guess, "t", "c1", forger.public_text))
    assert [t for t, _ in told] == [T.refusal("c1")] * 2
    got = [AnnounceRefusal.from_json(verify(p, parse_public_key(srv.link.signer.public_text))) for _, p in told]
    assert [(r.reason, r.key, r.client, r.run) for r in got] == [("revoked", dev.public_text, "c1", srv.link.run_id),
                                                                ("bad_token", forger.public_text, "c1", srv.link.run_id)]
    assert "aggregator enroll c1" in got[0].hint and got[1].seq > got[0].seq
    assert srv.control.refusals.held == 3 and srv.fed.rejected["revoked"] == 3
    (row,) = [d for d in srv.observer.snapshot().devices if d.id == "c1"]
    assert (row.online, row.gone) == (False, "revoked")  # the dashboard shows it revoked, not online


def test_refusals_are_limited_per_client_and_reason_and_overall() -> None:
    now = [0.0]
    limit = RefusalLimit(every=10.0, cap=3, clock=lambda: now[0])
    assert limit.allow("a", "revoked") and not limit.allow("a", "revoked")
    assert limit.allow("a", "not_enrolled")  # another reason is another answer
    assert limit.allow("b", "revoked") and not limit.allow("c", "revoked")  # the global cap
    now[0] = 10.0
    assert limit.allow("a", "revoked") and limit.allow("c", "revoked")
    assert limit.held == 2
    many = RefusalLimit(every=10.0, cap=10**6, remembered=5, clock=lambda: now[0])
    assert all(many.allow(f"x{i}", "not_enrolled") for i in range(20)) and len(many._last) == 5  # bounded memory
