"""NeFL on Flower (aggregator/flower.py, edge_client/flower.py, nefl/protocol/flower.py, docs/flower.md).

Flower pins typer<0.21, which the broker's amqtt cannot share: these tests run in .venv-flower
(`make env-flower`); `make test` runs this file there after the main suite.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest

flwr = pytest.importorskip("flwr", reason="Flower is not installed here: `make test` runs this file in .venv-flower")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from aggregator.federation import state_digest  # noqa: E402
from aggregator.flower import FlowerSettings, NeFLStrategy, run_settings  # noqa: E402
from aggregator.flower_buffered import BufferedStrategy  # noqa: E402
from nefl.aggregation.staleness import StalenessConfig  # noqa: E402
from aggregator.simulate import SimConfig, Simulator  # noqa: E402
from edge_client.device import DeviceConfig  # noqa: E402
from edge_client.flower import DeviceNode, SimulatedNode, client_app  # noqa: E402
from nefl.aggregation.config import AggregationConfig  # noqa: E402
from nefl.nested.profile import load_profile  # noqa: E402
from nefl.nested.state import GlobalState, Layout  # noqa: E402
from nefl.protocol.flower import read_arrays, read_message, read_state, records, state_arrays, tensor_arrays  # noqa: E402
from nefl.protocol.messages import FlowerResult, FlowerTask, MessageError  # noqa: E402
from tests.harness.flower_helpers import flwr_run  # noqa: E402

PROFILE = "resnet8-fmnist-w"
# a few rounds over 6 clients, 4 a round: seconds of training; every submodel scored after the last round
TINY = dict(clients=6, per_round=4, rounds=3, max_samples_per_client=64, eval_every=3, eval_samples=500)


@pytest.fixture(scope="module")
def layout() -> Layout:
    return Layout.build(load_profile(PROFILE))


@pytest.fixture(autouse=True)
def task_identity():
    """Flower stamps every message with the running task's identity; a test is task 1 of run 1."""
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


@pytest.fixture
def one_thread():
    """Both sides of an equivalence train with one torch thread, as each simulated node does."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


class LocalGrid:
    """The strategy's Grid, answered in this process by the client app's nodes (Flower's message
    handling, without its engine); `tamper` may rewrite a node's reply on the way back."""

    def __init__(self, nodes: int, tamper=None, factory=SimulatedNode) -> None:
        self.app = client_app(factory)
        self.contexts = {100 + i: Context(run_id=1, node_id=100 + i, state=RecordDict(), run_config={},
                                          node_config={"partition-id": i, "num-partitions": nodes}) for i in range(nodes)}
        self.tamper = tamper or (lambda reply: reply)

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def send_and_receive(self, messages, timeout=None) -> list[Message]:
        return [self.tamper(self.app(m, self.contexts[m.metadata.dst_node_id])) for m in messages]

    def push_messages(self, messages) -> list[str]:
        """Each message answered at once; its reply waits for `pull_messages` (buffered mode's loop)."""
        self.replies = getattr(self, "replies", {})
        ids = []
        for m in messages:
            m.metadata.__dict__["_message_id"] = mid = f"m{len(self.replies) + len(ids)}-{id(m)}"
            self.replies[mid] = self.tamper(self.app(m, self.contexts[m.metadata.dst_node_id]))
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids) -> list[Message]:
        """The replies there are (one `tamper` made None never comes)."""
        return [r for r in (self.replies.pop(mid, None) for mid in list(message_ids)) if r is not None]


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(sim: list[dict], flower: list[dict]) -> None:
    """Same participants, submodels and updates every round, and the same global state at the start of
    every round (one torch thread per trainer on both sides: bit for bit); the last round's accuracies
    equal up to float-order noise (one test image in 500 is 0.002)."""
    assert [r["round"] for r in sim] == [r["round"] for r in flower] and sim[-1]["round"] == TINY["rounds"]
    for a, b in zip(sim, flower):
        assert a.get("assigned") == b.get("assigned") and a.get("updates_per_submodel") == b.get("updates_per_submodel")
        assert a.get("start_sha256") == b.get("start_sha256"), a["round"]
    final_sim, final_flower = sim[-1]["accuracy"], flower[-1]["accuracy"]
    assert len(final_sim) == 5 and np.allclose(final_sim, final_flower, atol=0.01), (final_sim, final_flower)


def simulate(tmp: Path, **kw) -> list[dict]:
    Simulator(SimConfig(PROFILE, out=str(tmp / "sim"), **{**TINY, **kw})).run()
    return rows(tmp / "sim")


# -- the wire: kit messages and tensors in Flower records ----------------------------------------

def test_messages_and_arrays_round_trip(layout):
    task = FlowerTask(kind="train", round=3, submodel=2, lr=0.1, epochs=1, batch_size=32, profile_hash=layout.profile.hash)
    state = GlobalState.init(layout, seed=1)
    weights = state.extract(layout, 2)
    content = records(task, tensor_arrays(weights))
    assert read_message(content, FlowerTask) == task
    got = read_arrays(content, layout.sub_shapes[2])
    assert all(torch.equal(got[n], weights[n]) for n in weights)
    assert state_digest(read_state(state_arrays(state), layout)) == state_digest(state)


def _with_array(content: RecordDict, name: str, array: Array) -> RecordDict:
    arrays = content.array_records["arrays"]
    arrays[name] = array
    return content


def test_hostile_arrays_are_refused_with_a_reason(layout):
    shapes = layout.sub_shapes[0]
    good = GlobalState.init(layout).extract(layout, 0)
    name = next(iter(good))
    fresh = lambda: records(FlowerResult(client="c0", round=1, submodel=0, samples=1, loss=1, accuracy=0.5, seconds=1),  # noqa: E731
                            tensor_arrays(good))
    nan = good[name].clone().view(-1)
    nan[0] = float("nan")
    npy = Array(good[name].numpy()).data
    cases = {
        "tensor_mismatch": [_with_array(fresh(), "extra", Array(np.zeros(1, np.float32))),
                            _with_array(fresh(), name, Array(good[name].double().numpy())),
                            _with_array(fresh(), name, Array(good[name].numpy().reshape(-1))),
                            _with_array(fresh(), name, Array(dtype="float32", shape=tuple(good[name].shape),
                                                             stype="numpy.ndarray", data=npy[:len(npy) // 2]))],
        "bad_array": [_with_array(fresh(), name, Array(dtype="float32", shape=tuple(good[name].shape),
                                                       stype="numpy.ndarray", data=b"\0" * len(npy))),
                      _with_array(fresh(), name, Array(dtype="float32", shape=tuple(good[name].shape),
                                                       stype="numpy.ndarray", data=npy[:-4]))],
        "non_finite": [_with_array(fresh(), name, Array(nan.view(good[name].shape).numpy()))],
        "no_arrays": [records(FlowerTask(kind="train", round=1, submodel=0, lr=0.1, epochs=1, batch_size=1,
                                         profile_hash="x"))],
    }
    for reason, contents in cases.items():
        for content in contents:
            with pytest.raises(MessageError) as e:
                read_arrays(content, shapes)
            assert e.value.reason == reason


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=st.one_of(st.binary(max_size=300), st.from_regex(rb'\{"v":1,"type":"flower_[a-z]+".{0,80}\}')),
       dtype=st.sampled_from(["float32", "float64", "object", "int8", ""]), data=st.binary(max_size=2048),
       shape=st.lists(st.integers(0, 40), max_size=4))
def test_fuzzed_records_only_ever_raise_message_errors(layout, payload, dtype, data, shape):
    """Whatever a peer puts in a Flower message, decoding it ends in a MessageError, never anything else."""
    shapes = layout.sub_shapes[0]
    name = next(iter(shapes))
    content = RecordDict({"config": ConfigRecord({"nefl": payload}),
                          "arrays": ArrayRecord({n: Array(dtype=dtype, shape=tuple(shape), stype="numpy.ndarray",
                                                          data=data) for n in (name, *list(shapes)[1:])})})
    for cls in (FlowerTask, FlowerResult):
        with pytest.raises(MessageError):
            read_message(content, cls)
    with pytest.raises(MessageError):
        read_arrays(content, shapes)


def test_run_config_maps_onto_the_simulators_settings():
    cfg, flower = run_settings({"profile": PROFILE, "per-round": 7, "non-iid": 0.5, "out": "", "aggregator": "median",
                                "centre-check": False, "fraction-evaluate": 0.25})
    assert (cfg.per_round, cfg.non_iid, cfg.out, flower.fraction_evaluate) == (7, 0.5, None, 0.25)
    assert cfg.robustness.aggregation.rule == "median" and not cfg.robustness.aggregation.centre_check
    with pytest.raises(ValueError, match="unknown run-config key 'per_round_x'.*per-round"):
        run_settings({"per_round_x": 1})
    with pytest.raises(ValueError, match="fraction-evaluate"):
        run_settings({"profile": PROFILE, "fraction-evaluate": 2.0})
    with pytest.raises(ValueError, match="names no profile"):
        run_settings({"rounds": 2})


# -- the strategy with the client app's nodes, in this process -----------------------------------

def test_strategy_replays_aggregator_simulate(tmp_path, one_thread):
    """The strategy and the client app over Flower messages (the engine left out: LocalGrid) make the
    simulator's run bit for bit: same draws, same updates, same states."""
    sim = simulate(tmp_path)
    strategy = NeFLStrategy.for_run(SimConfig(PROFILE, out=str(tmp_path / "flower"), **TINY),
                                    FlowerSettings(fraction_evaluate=0.5))
    result = strategy.start(LocalGrid(TINY["clients"]), strategy.initial_arrays(), TINY["rounds"])
    flower = rows(tmp_path / "flower")
    assert_same_run(sim, flower)
    assert state_digest(read_state(result.arrays, strategy.fed.layout)) == state_digest(strategy.fed.state)
    scored = result.evaluate_metrics_clientapp[TINY["rounds"]]  # federated evaluation: 3 nodes, 3 submodels
    assert 3 * 1666 <= scored["samples"] <= 3 * 1667 and 0 <= scored["worst"] <= scored["avg"] <= 1


def test_hostile_replies_are_counted_and_the_round_goes_on(tmp_path, layout):
    """A node that lies about who it is, sends NaN or garbage, or fails: its reply is refused with a
    reason, the others' updates make the round."""
    victims = {"c0": "garbage", "c1": "impostor", "c2": "nan", "c3": "error"}

    def tamper(reply: Message) -> Message:
        if reply.metadata.message_type != MessageType.TRAIN or reply.has_error():
            return reply
        res = read_message(reply.content, FlowerResult)
        how = victims.get(res.client)
        if how == "garbage":
            reply.content["config"] = ConfigRecord({"nefl": b'{"v":1,"type":"flower_result","client":'})
        elif how == "impostor":
            reply.content["config"] = ConfigRecord({"nefl": FlowerResult(**{
                **{f: getattr(res, f) for f in res.__struct_fields__}, "client": "c5"}).to_json()})
        elif how == "nan":
            arrays = reply.content.array_records["arrays"]
            name = next(iter(arrays))
            bad = arrays[name].numpy().copy()
            bad.reshape(-1)[0] = np.inf
            arrays[name] = Array(bad)
        elif how == "error":
            ask = Message(content=RecordDict(), dst_node_id=reply.metadata.src_node_id, message_type=MessageType.TRAIN)
            return Message(error=flwr.app.Error(code=1, reason="out of memory"), reply_to=ask)
        return reply

    strategy = NeFLStrategy.for_run(SimConfig(PROFILE, **{**TINY, "per_round": 6, "rounds": 1, "eval_every": 0}))
    strategy.start(LocalGrid(6, tamper), strategy.initial_arrays(), 1)
    facts = strategy.history[0]
    assert facts["committed"] and sorted(facts["reported"]) == ["c4", "c5"]
    assert facts["rejected"] == {"malformed_json": 1, "client_mismatch": 1, "non_finite": 1, "node_error": 1}


def test_device_nodes_announce_what_their_probe_allows(tmp_path):
    """DeviceNode: the node's bound comes from the device probe and cost model, its summary rides along."""
    def device(join, layout, index, parts):
        return DeviceNode(join, layout, index, parts, DeviceConfig(calibrate=False, cache_dir=tmp_path))

    strategy = NeFLStrategy.for_run(SimConfig(PROFILE, **{**TINY, "per_round": 2, "rounds": 1, "eval_every": 0}))
    strategy.start(LocalGrid(2, factory=device), strategy.initial_arrays(), 1)
    facts = strategy.history[0]
    assert facts["committed"] and len(facts["reported"]) == 2
    for cid in facts["reported"]:
        info = strategy.fed.clients[cid]
        assert info.device.cpus and info.device.torch_threads and "submodel" in info.selection


# -- Flower's own engine: `flwr run` on the example app ------------------------------------------

@pytest.mark.slow
def test_flwr_run_of_the_example_is_aggregator_simulate(tmp_path, one_thread):
    """`flwr run examples/flower-nefl` on Flower's simulation engine (a local SuperLink, Ray workers in
    two processes) with the same profile, seeds, shards and method as `aggregator simulate`: the
    same states every round and the same accuracies at the end."""
    overrides = (f"rounds={TINY['rounds']} per-round={TINY['per_round']} assignment='paper' "
                 f"max-samples-per-client={TINY['max_samples_per_client']} "
                 f"eval-every={TINY['eval_every']} eval-samples={TINY['eval_samples']} fraction-evaluate=0.0 out='{tmp_path / 'flower'}'")
    federation = f"num-supernodes={TINY['clients']} client-resources-num-cpus=1 init-args-num-cpus=2"
    run, _ = flwr_run(tmp_path / "flwr-home", overrides, federation, timeout=420)
    assert run.returncode == 0 and (tmp_path / "flower" / "metrics.jsonl").exists(), run.stdout[-3000:] + run.stderr[-3000:]
    assert_same_run(simulate(tmp_path, assignment="paper"), rows(tmp_path / "flower"))


# -- buffered mode: versions instead of rounds (aggregator/flower_buffered.py) ---------------------

BUFFERED = dict(TINY, assignment="coverage", rounds=4, eval_every=2, eval_samples=200)


def buffered(nodes: int, staleness: StalenessConfig, out: Path | None = None, **kw) -> BufferedStrategy:
    cfg = SimConfig(PROFILE, **{**BUFFERED, "clients": nodes, "out": str(out) if out else None, **kw})
    cfg = dataclasses.replace(cfg, robustness=dataclasses.replace(cfg.robustness, aggregation=AggregationConfig(centre_check=False)))
    return BufferedStrategy.for_run(cfg, FlowerSettings(mode="buffered", staleness=staleness))


def test_buffered_run_commits_versions_from_every_node(tmp_path):
    """Three nodes of different bounds, K = 2: the requested versions are committed, each with the staleness of
    every update in it, each node contributes, and the checkpoint and metrics line name versions."""
    strategy = buffered(3, StalenessConfig(buffer_size=2), tmp_path / "out")
    result = strategy.start(LocalGrid(3), strategy.initial_arrays(), BUFFERED["rounds"])
    facts = strategy.history
    assert [f["version"] for f in facts] == [1, 2, 3, 4] and all(f["committed"] for f in facts)
    assert all(len(f["staleness"]) == 2 == sum(f["updates_per_submodel"]) for f in facts)
    assert {c for f in facts for c in f["reported"]} == {"c0", "c1", "c2"}
    assert len({strategy.fed.clients[c].max_submodel for c in ("c0", "c1", "c2")}) > 1  # different bounds
    assert all(m["staleness"] == s for f in facts for m, s in zip(f["clients"].values(), f["staleness"]))
    lines = rows(tmp_path / "out")
    assert [r["round"] for r in lines] == [0, 1, 2, 3, 4] and len(lines[-1]["accuracy"]) == 5 and "accuracy" in lines[2]
    assert sorted(result.train_metrics_clientapp) == [1, 2, 3, 4]
    assert state_digest(read_state(result.arrays, strategy.fed.layout)) == state_digest(strategy.fed.state)


def test_buffered_refuses_an_update_older_than_the_bound(layout):
    """K = 1 and no staleness allowed: of two tasks from version 0 answered together, the first commits
    version 1 and the second, one version old, is refused "stale"; its node trains again on the newest."""
    strategy = buffered(2, StalenessConfig(buffer_size=1, max_staleness=0), rounds=2, eval_every=0)
    strategy.start(LocalGrid(2), strategy.initial_arrays(), 2)
    first, second = strategy.history
    assert first["staleness"] == [0] and first["rejected"] == {}
    assert second["rejected"] == {"stale": 1} and second["staleness"] == [0]
    assert strategy.fed.rejected["stale"] == 1 and not strategy.versions.refusals


def test_buffered_counts_hostile_replies_and_goes_on(layout):
    """A node that sends garbage or fails is counted under its reason every time and gets its next task, a silent node's
    task is given up after the timeout; the honest nodes' updates make the versions."""
    def tamper(reply: Message) -> Message | None:
        if reply.has_error() or reply.metadata.message_type != MessageType.TRAIN:
            return reply
        res = read_message(reply.content, FlowerResult)
        if res.client == "c0":
            reply.content["config"] = ConfigRecord({"nefl": b'{"v":1,"type":"flower_result","client":'})
        elif res.client == "c1":
            reply.content["arrays"] = ArrayRecord({"x": Array(np.zeros(3, np.float32))})
        elif res.client == "c3":
            ask = Message(content=RecordDict(), dst_node_id=reply.metadata.src_node_id, message_type=MessageType.TRAIN)
            ask.metadata.__dict__["_message_id"] = reply.metadata.reply_to_message_id
            return Message(error=flwr.app.Error(code=1, reason="out of memory"), reply_to=ask)
        return None if res.client == "c2" else reply

    strategy = buffered(6, StalenessConfig(buffer_size=2), rounds=2, eval_every=0)
    strategy.start(LocalGrid(6, tamper), strategy.initial_arrays(), 2)
    assert [f["committed"] for f in strategy.history] == [True, True]
    assert {c for f in strategy.history for c in f["reported"]} == {"c4", "c5"}
    rejected = strategy.fed.rejected
    assert rejected["malformed_json"] >= 2 and rejected["tensor_mismatch"] >= 2 and rejected["node_error"] >= 2
    assert [s.task.client for s in strategy.sent.values()] == ["c2"]  # still waited for
    strategy._expire(time.monotonic() + strategy.settings.round_timeout + 1)
    assert strategy.fed.rejected["timeout"] == 1 and not strategy.sent and not strategy.versions.open["c2"]


def test_buffered_run_config_and_refusals():
    """mode = "buffered" with the StalenessConfig keys; what buffered mode refuses, each in one line."""
    cfg, flower = run_settings({"profile": PROFILE, "mode": "buffered", "buffer-size": 3, "max-staleness": "",
                                "staleness-exponent": 0.0})
    assert flower.mode == "buffered" and flower.staleness == StalenessConfig(buffer_size=3, exponent=0.0)
    assert not cfg.robustness.aggregation.centre_check  # off unless asked for, as serve's buffered mode
    with pytest.raises(ValueError, match="mode is 'sync' or 'buffered'"):
        run_settings({"profile": PROFILE, "mode": "async"})
    base = dict(assignment="coverage", clients=2, max_samples_per_client=64)
    refused = {"fraction-evaluate": (dict(base), FlowerSettings(mode="buffered", fraction_evaluate=0.5)),
               "--aggregator median": (dict(base, robustness=run_settings({"profile": PROFILE, "aggregator": "median"})[0].robustness),
                                       FlowerSettings(mode="buffered")),
               "centre check": (dict(base), FlowerSettings(mode="buffered")),
               "--assignment paper": (dict(base, assignment="paper", robustness=cfg.robustness), FlowerSettings(mode="buffered"))}
    for why, (kw, flower_settings) in refused.items():
        with pytest.raises(ValueError, match=f"mode buffered refuses this: .*{why}"):
            BufferedStrategy.for_run(SimConfig(PROFILE, **kw), flower_settings)


@pytest.mark.slow
def test_flwr_run_buffered_on_the_simulation_engine(tmp_path):
    """`flwr run` of the example with mode = "buffered" on Flower's simulation engine: 3 nodes of different
    tiers, K = 2, 3 versions, every node in some version, the staleness of every update in the metrics."""
    overrides = (f"mode='buffered' buffer-size=2 rounds=3 assignment='coverage' max-samples-per-client=64 "
                 f"eval-every=0 eval-samples=200 fraction-evaluate=0.0 out='{tmp_path / 'out'}'")
    run, _ = flwr_run(tmp_path / "flwr-home", overrides, "num-supernodes=3 client-resources-num-cpus=1 init-args-num-cpus=2",
                      timeout=240)
    assert run.returncode == 0 and (tmp_path / "out" / "metrics.jsonl").exists(), run.stdout[-3000:] + run.stderr[-3000:]
    lines = [r for r in rows(tmp_path / "out") if r.get("mode") == "buffered"]
    assert [r["version"] for r in lines] == [1, 2, 3] and all(len(r["staleness"]) == 2 for r in lines)
    assert {c for r in lines for c in r["reported"]} == {"c0", "c1", "c2"} and len(lines[-1]["accuracy"]) == 5
