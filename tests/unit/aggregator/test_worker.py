"""Scale-out in process (docs/scale.md): partial aggregates merge exactly, in any order (the property the design
stands on), and an aggregator worker (aggregator/worker.py) owns, judges and answers a round's close with its partial.
The end-to-end runs (workers, relays, the load generator as processes) are tests/e2e/test_scale.py's.
"""

from __future__ import annotations

import random

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator.federation import state_digest
from aggregator.loadtest import device_delta
from aggregator.partials import Held, check_partial, plan_bound, plan_screen
from aggregator.worker import Worker, WorkerConfig, owner_of
from nefl.aggregation.nefedavg import NeFedAvg
from nefl.protocol.messages import MessageError, PartialSummary, ReceiptBatch, RoundClose, WorkerRound
from nefl.protocol.mqtt import BrokerSettings
from nefl.nested.profile import load_profile
from nefl.aggregation.robust import NormBound, update_norm
from nefl.aggregation.config import AggregationConfig
from nefl.protocol.signing import Signer, parse_public_key, verify
from nefl.nested.state import GlobalState, Layout
from nefl.protocol.topics import Topics
from nefl.protocol.wire import Reassembler, encode, split_chunk
from tests.harness.helpers import random_ladder

PROFILE = "resnet8-fmnist-w"


# -- partials: exact, order-free merge ------------------------------------------------------------------
def dyadic_delta(layout: Layout, k: int, rng: random.Random) -> dict[str, torch.Tensor]:
    """Multiples of 1/16 in [-4, 4]: every float32 sum of a few of them is exact, so any summation
    order gives the same bits and the test can demand equality, not closeness."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    return {n: torch.randint(-64, 65, s, generator=g).float() / 16 for n, s in layout.upload_shapes(k).items()}


def through_the_wire(layout: Layout, part: NeFedAvg, held: dict[str, Held], worker: str) -> NeFedAvg:
    """A partial as a worker publishes it and the coordinator reads it back (chunked safetensors + summary),
    checked against the receipts `held`."""
    msgs = encode(part.partial_tensors(), kind="partial", federation="t", round=1, submodel=0, client=worker,
                  chunk_bytes=64 * 1024).messages
    reasm = Reassembler(max_bytes=64 << 20)
    done = [d for m in msgs if (d := reasm.feed(m)) is not None][0]
    summary = PartialSummary(run="r", round=1, weights=[float(w) for w in part.weights], updates=list(part.updates),
                             clients=sorted(c for c, h in held.items() if h.worker == worker), digest=done.header.digest)
    return check_partial(layout, PartialSummary.from_json(summary.to_json()), done.tensors, held, worker)[0]


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), parts=st.integers(1, 4), updates=st.integers(1, 9))
def test_merging_partials_in_any_order_gives_the_single_process_state(seed, parts, updates):
    rng = random.Random(seed)
    layout = Layout.build(random_ladder(rng))
    state = GlobalState.init(layout, seed)
    single = NeFedAvg(layout)
    workers = [NeFedAvg(layout) for _ in range(parts)]
    held: dict[str, Held] = {}
    for i in range(updates):
        k = rng.randrange(layout.num_submodels)
        delta = dyadic_delta(layout, k, rng)
        single.add(k, delta)
        w = rng.randrange(parts)  # the broker's choice of worker
        workers[w].add(k, delta)
        held[f"c{i}"] = Held(f"w{w}", k, 1.0, update_norm(delta))
    expected = state_digest(single.finalize(state))
    for _ in range(3):
        order = rng.sample(range(parts), parts)
        coordinator = NeFedAvg(layout)
        for w in order:
            coordinator.merge(through_the_wire(layout, workers[w], held, f"w{w}"))
        assert coordinator.updates == single.updates
        assert torch.equal(coordinator.weights, single.weights)
        assert state_digest(coordinator.finalize(state)) == expected


def test_owners_of_multi_chunk_updates_are_stable_and_spread():
    owners = ["w1", "w2", "w3"]
    picks = [owner_of(f"c{i}", owners) for i in range(300)]
    assert picks == [owner_of(f"c{i}", list(owners)) for i in range(300)]  # every worker computes the same owner
    assert all(60 < picks.count(w) < 140 for w in owners)
    assert owner_of("c1", []) is None


def test_worker_topics_and_messages_are_strict():
    t = Topics("fed")
    assert t.update_shared("g") == "$share/g/nefl/fed/update/+"
    assert t.worker_of("nefl/fed/worker/w1/receipt") == ("w1", "receipt")
    assert t.worker_of("nefl/fed/worker/w+/receipt") is None and t.worker_of("nefl/fed/worker/w1/other") is None
    with pytest.raises(ValueError):
        t.update_shared("a/b")
    plan = WorkerRound(federation="fed", run="r1", round=3, profile={}, profile_hash="h", assignments={"c1": 2},
                       references=[1.0, 2.0], norms=[[], [0.5]], deadline_s=10, max_update_bytes=1 << 20,
                       chunk_bytes=1 << 16, bound=plan_bound(NormBound()), screen=plan_screen(AggregationConfig()))
    assert WorkerRound.from_json(plan.to_json(), 1 << 20) == plan
    for bad in (plan.to_json().replace(b'"c1":2', b'"c1":-2'), plan.to_json().replace(b'"references":[1.0', b'"references":[-1.0')):
        with pytest.raises(MessageError):
            WorkerRound.from_json(bad, 1 << 20)
    with pytest.raises(MessageError, match="oversized"):
        WorkerRound.from_json(plan.to_json(), 100)


def test_a_worker_judges_every_update_and_answers_the_close_with_its_partial():
    """In process, the broker replaced by a list: the worker's trust boundary and its partial."""
    profile = load_profile(PROFILE)
    layout = Layout.build(profile)
    signer, mine = Signer(Ed25519PrivateKey.generate()), Signer(Ed25519PrivateKey.generate())
    w = Worker(WorkerConfig("t", "w1", server_key=signer.public_text), BrokerSettings("127.0.0.1", 1), mine)
    own = parse_public_key(mine.public_text)
    sent: list[tuple[str, bytes]] = []
    w.publish_up = lambda topic, payload, retain=False: sent.append((topic, payload))
    t = Topics("t")
    plan = WorkerRound(federation="t", run="r1", round=1, profile=profile.to_dict(), profile_hash=layout.profile.hash,
                       assignments={"a": 0, "b": 1}, references=[10.0] * 5, norms=[[]] * 5, deadline_s=30,
                       max_update_bytes=1 << 24, chunk_bytes=1 << 20, bound=plan_bound(NormBound()),
                       screen=plan_screen(AggregationConfig()))

    def update(client: str, k: int, topic_client: str | None = None) -> tuple[str, bytes]:
        msg = encode(device_delta(layout, k, client, 1), kind="update", federation="t", round=1, submodel=k, client=client,
                     samples=5, chunk_bytes=1 << 20).messages
        return t.update(topic_client or client), msg[0]

    w.route(w.up, t.workers_round, plan.to_json())  # not signed by the coordinator
    w.route(w.up, t.workers_round, signer.sign(plan.to_json()))
    for topic, payload in [update("a", 0), update("a", 0),  # the second is a QoS 1 redelivery: dropped
                           (t.update("b"), b"NEFL\x02\x00\x00\x05\x00\x00\x00\x00{oops"), update("c", 0), update("a", 1, "b"),
                           update("b", 0)]:
        w.route(w.up, topic, payload)
    w.route(w.up, t.workers_close, signer.sign(RoundClose(federation="t", run="r1", round=1).to_json()))
    w.route(w.up, *update("b", 1))  # after the close: late, and held until the linger ends
    assert [r.outcome for r in w.receipts] == ["stale_round"]
    w.send_receipts()
    batches = [ReceiptBatch.from_json(verify(p, own), 1 << 20) for topic, p in sent if topic == t.worker("w1", "receipt")]
    assert len(batches) == 2  # one sent before the partial, one after the close
    receipts = [r for b in batches for r in b.receipts]
    assert [(r.client, r.outcome) for r in receipts] == [
        (None, "unsigned"), ("a", "accepted"), ("b", "malformed_header"), ("c", "unassigned"), ("b", "client_mismatch"),
        ("b", "submodel_mismatch"), ("b", "stale_round")]
    accepted = receipts[1]
    # the worker norms the decoded update as one flat buffer: the same norm up to float rounding
    assert accepted.run == "r1" and accepted.samples == 5
    assert accepted.norm == pytest.approx(update_norm(device_delta(layout, 0, "a", 1)), rel=1e-6)
    summary = PartialSummary.from_json(verify(next(p for topic, p in sent if topic == t.worker("w1", "summary")), own),
                                       1 << 20)
    assert summary.clients == ["a"] and summary.updates == [1, 0, 0, 0, 0] and summary.run == "r1"
    reasm = Reassembler(max_bytes=64 << 20)
    chunks = [p for topic, p in sent if topic == t.worker("w1", "partial")]
    for p in chunks:  # every chunk header of the partial carries the worker's signature
        verify(split_chunk(p)[0], own)
    done = [d for p in chunks if (d := reasm.feed(p)) is not None][0]
    got, norms = check_partial(layout, summary, done.tensors, {"a": Held("w1", 0, 1.0, accepted.norm)}, "w1")
    assert norms == {"a": pytest.approx(accepted.norm, rel=1e-6)}
    want = NeFedAvg(layout)
    want.add(0, device_delta(layout, 0, "a", 1))
    assert all(torch.equal(got.groups[0][n], want.groups[0][n]) for n in want.groups[0])
