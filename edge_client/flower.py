"""NeFL on a Flower node: the ClientApp that joins a NeFLStrategy's run (aggregator/flower.py).

The node answers three messages. query (FlowerJoin): which run, which ladder; it answers what it can
train now (FlowerHello, with the announce an MQTT device sends). train (FlowerTask + its submodel's
weights): it trains that physically smaller submodel with the kit's `local_train` and sends back the
delta. evaluate: it scores the submodel on its own test images. Two kinds of node:

  SimulatedNode  client `partition-id` of `num-partitions` of `aggregator simulate`'s population
                 (nefl/nested/population.py): its data shard, its paper tier, its seeds, so a run on Flower's
                 simulation engine replays the simulator's run
  DeviceNode     this machine as an edge device (edge_client/device.py): the device probe and cost
                 model pick the largest submodel that fits now, as `edge-client join` does

Flower gives a node its place with `node_config` (the simulation engine sets partition-id and
num-partitions; a SuperNode takes `--node-config "partition-id=0 num-partitions=2"`). A node object
lives once per process and node; what it joined is kept in Flower's node state (`context.state`), so any
worker process of the simulation engine can serve the node's next message.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Protocol

import torch
from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from edge_client.device import DataConfig, DeviceConfig, LocalDevice
from nefl.nested.data import ArrayDataset, BatchLoader, load_dataset, partition_iid
from nefl.nested.population import client_batches, client_id, partitions, tier_bound, tier_of, train_seed
from nefl.nested.profile import load_profile
from nefl.nested.state import Layout, load_module_state
from nefl.nested.train import TrainConfig, TrainResult, evaluate, local_train, recompute_bn_stats
from nefl.protocol.flower import read_arrays, read_message, records, tensor_arrays
from nefl.protocol.messages import Announce, FlowerHello, FlowerJoin, FlowerResult, FlowerTask, MessageError

log = logging.getLogger(__name__)
REFUSED = 4000  # the Flower error code of a message this node refuses (the reason says why)
STATE_KEY = "nefl"  # the node state's ConfigRecord that keeps the join
EVAL_BATCH = 500
CALIBRATION_SAMPLES = 2000  # static-BN statistics (HeteroFL) before a node scores a submodel


class Node(Protocol):
    """What the ClientApp needs of a node."""

    @property
    def layout(self) -> Layout: ...
    @property
    def client(self) -> str:
        """The client id it announces."""
        ...

    def hello(self) -> FlowerHello: ...

    def train(self, task: FlowerTask, start: dict[str, torch.Tensor]) -> TrainResult: ...

    def test_batches(self) -> BatchLoader: ...

    def calibration_batches(self) -> BatchLoader: ...


NodeFactory = Callable[[FlowerJoin, Layout, int, int], Node]  # (join, layout, partition id, partitions)


@functools.lru_cache(maxsize=4)
def _split(dataset: str, train: bool) -> ArrayDataset:
    """One copy of a split per process, whichever nodes it serves."""
    return load_dataset(dataset, None, train=train)


@functools.lru_cache(maxsize=4)
def _shards(dataset: str, clients: int, non_iid: float | None, seed: int, max_samples: int | None) -> list[torch.Tensor]:
    return partitions(_split(dataset, True), clients, non_iid, seed, max_samples)


@functools.lru_cache(maxsize=8)
def _layout(profile: str, method: str) -> Layout:
    return Layout.build(load_profile(profile), method)


@functools.lru_cache(maxsize=32)
def _module(profile: str, method: str, k: int) -> torch.nn.Module:
    """Submodel k's physically smaller module, built once per process (training loads every weight)."""
    return _layout(profile, method).module(k)


def test_shard(dataset: str, index: int, parts: int, seed: int) -> BatchLoader:
    """Node `index` of `parts`' share of the dataset's test split."""
    test = _split(dataset, False)
    return BatchLoader(test, partition_iid(len(test), parts, seed)[index], EVAL_BATCH, False, False, 0)


class SimulatedNode:
    """Client `index` of `parts` exactly as `aggregator simulate` trains it."""

    def __init__(self, join: FlowerJoin, layout: Layout, index: int, parts: int) -> None:
        self.join, self.layout, self.index, self.parts = join, layout, index, parts
        self.client = client_id(index, parts)
        self.shard = _shards(join.dataset, parts, join.non_iid, join.seed, join.max_samples)[index]
        self.tier = tier_of(index, parts, layout.num_submodels)

    def hello(self) -> FlowerHello:
        bound = tier_bound(self.tier, self.layout.num_submodels)
        announce = Announce(client=self.client, samples=max(1, len(self.shard)),
                            max_submodel=bound + 1, selection=f"simulated tier {self.tier + 1}", dataset=self.join.dataset)
        return FlowerHello(announce=announce, tier=self.tier)

    def train(self, task: FlowerTask, start: dict[str, torch.Tensor]) -> TrainResult:
        k = task.submodel
        batches = client_batches(_split(self.join.dataset, True), self.shard, task.batch_size,
                                 train_seed(self.join.seed, task.round, self.index))
        config = TrainConfig(lr=task.lr, batch_size=task.batch_size, local_epochs=task.epochs)
        return local_train(_module(self.join.profile, self.join.method, k), start, batches, config,
                           upload=self.layout.upload_shapes(k))

    def test_batches(self) -> BatchLoader:
        return test_shard(self.join.dataset, self.index, self.parts, self.join.seed)

    def calibration_batches(self) -> BatchLoader:
        return BatchLoader(_split(self.join.dataset, True), self.shard[:CALIBRATION_SAMPLES], EVAL_BATCH, False, False, 0)


class DeviceNode:
    """This machine as an edge device: its shard of the dataset, and the probe and cost model that say
    which submodel fits now (edge_client/device.py, as `edge-client join` uses it)."""

    def __init__(self, join: FlowerJoin, layout: Layout, index: int, parts: int,
                 cfg: DeviceConfig = DeviceConfig()) -> None:
        self.join, self.layout, self.index, self.parts = join, layout, index, parts
        self.client = client_id(index, parts)
        self.device = LocalDevice(DataConfig(dataset=join.dataset, partition=f"{index + 1}/{parts}",
                                             max_samples=join.max_samples), cfg)

    def hello(self) -> FlowerHello:
        t = self.join.training
        sel = self.device.plan(self.layout, t, t.round_timeout, self.layout.num_submodels)
        announce = Announce(client=self.client, samples=max(1, self.device.samples),
                            max_submodel=0 if sel.submodel is None else sel.submodel + 1, selection=sel.reason[:300],
                            device=self.device.summary(), dataset=self.join.dataset)
        return FlowerHello(announce=announce)

    def train(self, task: FlowerTask, start: dict[str, torch.Tensor]) -> TrainResult:
        return self.device.train(self.layout, task, start, self.join.training.round_timeout)

    def test_batches(self) -> BatchLoader:
        return test_shard(self.join.dataset, self.index, self.parts, self.join.seed)

    def calibration_batches(self) -> BatchLoader:
        return BatchLoader(self.device.train_set, self.device.indices[:CALIBRATION_SAMPLES], EVAL_BATCH, False, False, 0)


def _place(context: Context) -> tuple[int, int]:
    """(partition id, partitions) from Flower's node config."""
    try:
        index, parts = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    except (KeyError, TypeError, ValueError):
        raise MessageError("no_partition", "the node needs partition-id and num-partitions in its node config "
                                           "(flower-supernode --node-config 'partition-id=0 num-partitions=2')") from None
    if not 0 <= index < parts:
        raise MessageError("no_partition", f"partition-id {index} is not in 0..{parts - 1}")
    return index, parts


class NodeApp:
    """The handlers of the ClientApp; one node object per (run, node) in this process."""

    def __init__(self, factory: NodeFactory) -> None:
        self.factory = factory
        self.nodes: dict[tuple[int, int, bytes], Node] = {}

    def node(self, context: Context, join: FlowerJoin | None = None) -> Node:
        """The node `join` makes (and keeps in the node state), or the one the node state remembers."""
        if join is None:
            kept = context.state.config_records.get(STATE_KEY)
            if kept is None or not isinstance(kept.get("join"), bytes):
                raise MessageError("not_joined", "a task before the node joined the run (no query message yet)")
            join = FlowerJoin.from_json(kept["join"])
        else:
            context.state[STATE_KEY] = ConfigRecord({"join": join.to_json()})
        key = (context.run_id, context.node_id, join.to_json())
        if key not in self.nodes:
            layout = _profile_layout(join)
            self.nodes[key] = self.factory(join, layout, *_place(context))
        return self.nodes[key]

    def query(self, msg: Message, context: Context) -> RecordDict:
        return records(self.node(context, read_message(msg.content, FlowerJoin)).hello())

    def train(self, msg: Message, context: Context) -> RecordDict:
        node = self.node(context)
        task, start = _task(msg, node.layout, "train")
        res = node.train(task, start)
        out = records(_result(node, task, res.num_samples, res.loss, res.accuracy, res.seconds, node.hello()),
                      tensor_arrays(res.delta))
        out["metrics"] = MetricRecord({"num-examples": res.num_samples, "train-loss": res.loss})
        return out

    def evaluate(self, msg: Message, context: Context) -> RecordDict:
        node = self.node(context)
        task, weights = _task(msg, node.layout, "evaluate")
        model = _module(node.layout.profile.name, node.layout.method.name, task.submodel)
        load_module_state(model, weights)
        if node.layout.method.static_bn:
            recompute_bn_stats(model, node.calibration_batches())
        batches = node.test_batches()
        acc, loss = evaluate(model, batches)
        out = records(_result(node, task, batches.num_samples, loss, acc, 0.0))
        out["metrics"] = MetricRecord({"num-examples": batches.num_samples, "accuracy": acc})
        return out


def _profile_layout(join: FlowerJoin) -> Layout:
    try:
        layout = _layout(join.profile, join.method)
    except (ValueError, OSError) as e:  # unknown profile or method on this node
        raise MessageError("unknown_profile", str(e)[:200]) from None
    if layout.profile.hash != join.profile_hash:
        raise MessageError("profile_mismatch", f"{join.profile} here hashes to {layout.profile.hash}, the run's to "
                                               f"{join.profile_hash}: install the server's nefl-edge version")
    return layout


def _task(msg: Message, layout: Layout, kind: str) -> tuple[FlowerTask, dict[str, torch.Tensor]]:
    task = read_message(msg.content, FlowerTask)
    if task.kind != kind or task.profile_hash != layout.profile.hash or task.submodel >= layout.num_submodels:
        raise MessageError("bad_task", f"a {task.kind} task for submodel {task.submodel + 1} of profile "
                                       f"{task.profile_hash} in a {kind} message; this node runs {layout.profile.hash}")
    return task, read_arrays(msg.content, layout.sub_shapes[task.submodel])


def _result(node: Node, task: FlowerTask, samples: int, loss: float, acc: float, seconds: float,
            hello: FlowerHello | None = None) -> FlowerResult:
    return FlowerResult(client=node.client, round=task.round, submodel=task.submodel, samples=max(1, samples), loss=loss, accuracy=acc,
                        seconds=seconds, hello=hello)


def _answered(handler: Callable[[Message, Context], RecordDict]) -> Callable[[Message, Context], Message]:
    """A handler whose refusals (a message it cannot take) go back as Flower error replies with the reason."""

    @functools.wraps(handler)
    def answer(msg: Message, context: Context) -> Message:
        try:
            return Message(content=handler(msg, context), reply_to=msg)
        except MessageError as e:
            log.warning(f"refused a {msg.metadata.message_type} message: {e}")
            return Message(error=Error(code=REFUSED, reason=str(e)[:300]), reply_to=msg)

    return answer


def client_app(factory: NodeFactory = SimulatedNode) -> ClientApp:
    """A ClientApp whose node is made by `factory` (SimulatedNode, DeviceNode, or your own `Node`)."""
    app, nodes = ClientApp(), NodeApp(factory)
    app.query()(_answered(nodes.query))
    app.train()(_answered(nodes.train))
    app.evaluate()(_answered(nodes.evaluate))
    return app
