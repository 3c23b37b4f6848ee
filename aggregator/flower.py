"""NeFL as a Flower strategy: the kit's round engine behind Flower's message API.

`NeFLStrategy` is a `flwr.serverapp.strategy.Strategy` whose rounds are the kit's own: a `Federation`
(aggregator/federation.py) picks the participants, gives each a submodel with the kit's assignment
policy from what its node reported of itself (`FlowerHello`: the announce an MQTT device sends, and a
simulated node's paper tier), bounds and screens the updates and merges them through the aggregation
seam (NeFedAvg by default; any `AggregationConfig` rule, robust ones included); the `RoundDriver`
(aggregator/rounds.py) evaluates, checkpoints and writes the metrics line. Only the transport is
Flower's: `configure_train` sends each participant exactly its submodel's arrays, `aggregate_train`
feeds the replies to the Federation in client order (as `aggregator simulate` does) and closes the
round. So a Flower run and `aggregator simulate` with the same settings are the same run
(tests/test_flower.py, docs/flower.md).

Run config `mode = "buffered"` runs versions instead of rounds: aggregator/flower_buffered.py; the ServerApp
that picks the strategy is aggregator/flower_app.py.

The strategy lives in aggregator/ because it is the server: nefl/ may not import the Federation.
Nodes run edge_client/flower.py; what travels between them is nefl/protocol/flower.py.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import statistics
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from aggregator.assignment import Candidate, assign_coverage
from aggregator.evaluation import Evaluator
from aggregator.federation import Federation, Rejected, Robustness, Update
from aggregator.fleet import FleetMode
from aggregator.rounds import OpenRound, RoundDriver, RoundHooks, RunPlan
from aggregator.simulate import ServerSide, SimConfig, check_device, new_federation
from nefl.aggregation.config import AggregationConfig
from nefl.aggregation.staleness import StalenessConfig
from nefl.nested.train import TrainConfig
from nefl.protocol.flower import read_arrays, read_message, read_state, records, state_arrays, tensor_arrays
from nefl.protocol.messages import FlowerHello, FlowerJoin, FlowerResult, FlowerTask, MessageError, TrainingSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FlowerSettings:
    """What only the Flower path has: Flower's waits, its federated evaluation, and the mode."""

    fraction_evaluate: float = 0.0  # share of the nodes that score a submodel on their own test shard each round
    round_timeout: float = 3600.0  # seconds a round (buffered: a task) waits for its replies
    min_nodes: int = 1  # nodes to wait for before the first round (a deployment: its fleet); later ones join later rounds
    mode: FleetMode = "sync"  # "buffered": versions instead of rounds (aggregator/flower_buffered.py)
    staleness: StalenessConfig = StalenessConfig()  # buffered mode's buffer size, staleness weight and bound

    def __post_init__(self) -> None:
        if self.mode not in ("sync", "buffered"):
            raise ValueError(f"mode is 'sync' or 'buffered', got {self.mode!r}")
        if not 0 <= self.fraction_evaluate <= 1:
            raise ValueError(f"fraction-evaluate must be in [0, 1], got {self.fraction_evaluate}")
        if not self.round_timeout > 0 or self.min_nodes < 1:
            raise ValueError("round-timeout must be > 0 and min-nodes >= 1")


class NeFLStrategy(Strategy, RoundHooks):
    """A Flower strategy over the kit's Federation and RoundDriver (module docstring)."""

    def __init__(self, fed: Federation, join: FlowerJoin, train: TrainConfig, plan: RunPlan,
                 evaluator: Evaluator | None = None, out: str | Path | None = None,
                 settings: FlowerSettings = FlowerSettings(), seed: int = 0) -> None:
        if fed.layout.profile.hash != join.profile_hash:
            raise ValueError("the join message names another profile than the federation's")
        self.fed, self.join, self.train, self.plan, self.settings = fed, join, train, plan, settings
        out = Path(out) if out else None
        self.driver = RoundDriver(fed, self, plan, evaluator, out and out / "checkpoint", out)
        self.nodes: dict[int, str] = {}  # Flower node id -> the client id it announced
        self.node_of: dict[str, int] = {}
        self.history: list[dict[str, Any]] = []  # every round's facts, as its metrics line
        self._eval_rng = random.Random(seed + 1)  # federated evaluation's draws leave the Federation's alone
        self._arrays: ArrayRecord | None = None  # what aggregate_train returned last: the state, no need to read it back
        self._open: OpenRound | None = None
        self._round: dict[str, Any] = {}
        self._started = False

    @classmethod
    def for_run(cls, cfg: SimConfig, settings: FlowerSettings = FlowerSettings()) -> NeFLStrategy:
        """The strategy of a run `aggregator simulate` could make from `cfg`: same profile, method, seeds,
        data cuts, rule and evaluation; the nodes (edge_client/flower.py) are its clients."""
        device = str(check_device(cfg.device))
        server = ServerSide.build(cfg, device)
        layout = server.layout
        fed = new_federation(layout, cfg, server.reference, tiers={}, gate=server.gate, statistics=server.statistics)
        join = FlowerJoin(profile=layout.profile.name, method=layout.method.name, profile_hash=layout.profile.hash,
                          dataset=cfg.dataset or layout.profile.dataset, seed=cfg.seed, non_iid=cfg.non_iid,
                          max_samples=cfg.max_samples_per_client,
                          training=TrainingSettings(batch_size=cfg.batch_size, local_epochs=cfg.local_epochs,
                                                    round_timeout=min(settings.round_timeout, 7 * 86400)))
        plan = RunPlan(cfg.rounds, cfg.eval_every, cfg.eval_samples, cfg.final_eval_samples)
        return cls(fed, join, server.train_cfg, plan, server.evaluator(server.test, device), cfg.out, settings, cfg.seed)

    def initial_arrays(self) -> ArrayRecord:
        self._arrays = state_arrays(self.fed.state)
        return self._arrays

    def summary(self) -> None:
        layout = self.fed.layout
        log.info(f"NeFL strategy: {layout.profile.name} ({layout.method.name}, {layout.num_submodels} submodels), "
                 f"{self.fed.clients_per_round} clients a round, assignment {self.fed.assignment}, "
                 f"aggregator {self.fed.aggregator.name}")

    # -- nodes --------------------------------------------------------------------------------
    def admit_nodes(self, grid: Grid) -> None:
        """Ask every node not heard from yet what it can train (a query message: FlowerJoin -> FlowerHello);
        nodes that left go offline in the Federation."""
        wanted = self.settings.min_nodes
        deadline = time.monotonic() + self.settings.round_timeout
        while len(ids := set(grid.get_node_ids())) < wanted and time.monotonic() < deadline and not self._started:
            time.sleep(1.0)
        for node in sorted(set(self.nodes) - ids):
            cid = self.nodes.pop(node)
            del self.node_of[cid]
            self.fed.set_online(cid, False)
        new = sorted(ids - set(self.nodes))
        if not new:
            return
        asks = [Message(content=records(self.join), dst_node_id=n, message_type=MessageType.QUERY) for n in new]
        for reply in grid.send_and_receive(asks, timeout=self.settings.round_timeout):
            self._guarded(self._hello, reply)
        log.info(f"{len(self.nodes)} nodes joined: {len(self.fed.available())} can train")

    def _guarded(self, handle: Any, reply: Message) -> Any:
        """A reply's handling: anything wrong with it is counted under its reason, never raised."""
        try:
            refuse_error(reply)
            return handle(reply)
        except (Rejected, MessageError) as e:
            self.fed.reject(e.reason)
            log.info(f"refused a reply from node {reply.metadata.src_node_id}: {e}")
            return None

    def _hello(self, reply: Message) -> None:
        self._register(reply.metadata.src_node_id, read_message(reply.content, FlowerHello))

    def _register(self, node: int, hello: FlowerHello) -> None:
        """A node's announce, as the MQTT server takes a device's; one node per client id."""
        cid = hello.announce.client
        if self.node_of.get(cid, node) != node or self.nodes.get(node, cid) != cid:
            raise Rejected("client_mismatch", f"node {node} announces {cid!r}, taken by another node or not its own")
        self.fed.set_online(cid, True)
        self.fed.announce(cid, hello.announce)
        if hello.tier is not None:
            self.fed.tiers[cid] = min(hello.tier, self.fed.layout.num_submodels - 1)
        self.nodes[node], self.node_of[cid] = cid, node

    # -- training -----------------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Open the round (participants and their submodels, by the Federation) and send each participant
        exactly its submodel's weights. `arrays` is the global state as Flower carries it; read only
        when it is not what this strategy returned last (a wrapper changed it, or a run resumes)."""
        if arrays is not self._arrays:
            self.fed.state = read_state(arrays, self.fed.layout)
        self.admit_nodes(grid)
        if not self._started:
            self._started = True
            self.driver.evaluate_start()
        self._open = self.driver.open_round(server_round)
        lr = self.train.lr_at(server_round - 1, self.plan.rounds)
        return self._tasks("train", server_round, self.fed.round.assignments, lr, MessageType.TRAIN)

    def _tasks(self, kind: str, server_round: int, assignments: Mapping[str, int], lr: float,
               message_type: str) -> list[Message]:
        """One message per client; each submodel's arrays are built once and shared (Flower's fan-out)."""
        arrays: dict[int, ArrayRecord] = {}
        out = []
        for cid, k in sorted(assignments.items()):
            if k not in arrays:
                arrays[k] = tensor_arrays(self.fed.state.extract(self.fed.layout, k))
            out.append(Message(content=records(self._flower_task(kind, server_round, k, lr), arrays[k]),
                               dst_node_id=self.node_of[cid], message_type=message_type))
        return out

    def _flower_task(self, kind: str, number: int, k: int, lr: float, version: int | None = None) -> FlowerTask:
        return FlowerTask(kind=kind, round=number, submodel=k, lr=lr, epochs=self.train.local_epochs,
                          batch_size=self.train.batch_size, profile_hash=self.join.profile_hash, version=version)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Every valid update into the round's aggregate in client order, then the round closes: the
        committed state goes back to Flower as the new arrays (None when the round did not commit)."""
        t0 = time.perf_counter()
        before = Counter(self.fed.rejected)
        decoded = [d for d in (self._guarded(self._update, r) for r in replies) if d is not None]
        for update, node, hello in sorted(decoded, key=lambda d: d[0].client):
            try:
                self.fed.accept(update)
            except Rejected as e:
                self.fed.reject(e.reason)
        for update, node, hello in decoded:  # after the updates: a lower bound must not void a delivered task
            self._reannounce(update.client, node, hello)
        losses = [u.metrics["loss"] for u, _, _ in decoded]
        self._round = {"lr": self.train.lr_at(server_round - 1, self.plan.rounds),
                       "rejected": dict(Counter(self.fed.rejected) - before),
                       "train_s": round(max((u.metrics["train_s"] for u, _, _ in decoded), default=0.0), 3),
                       "train_loss": statistics.fmean(losses) if losses else None, "decode_s": round(time.perf_counter() - t0, 3)}
        facts = self.driver.close_round(self._open)
        self._open = None
        self.history.append(facts)
        self._arrays = state_arrays(self.fed.state) if facts["committed"] else self._arrays
        return (self._arrays if facts["committed"] else None), round_metrics(facts)

    def _reannounce(self, cid: str, node: int, hello: FlowerHello | None) -> None:
        """A train reply's fresh announce, taken when the node's bound or sample count changed."""
        info = self.fed.clients.get(cid)
        if hello is not None and info is not None and (hello.announce.max_submodel - 1, hello.announce.samples) \
                != (info.max_submodel, info.samples):
            try:
                self._register(node, hello)
            except Rejected as e:
                self.fed.reject(e.reason)

    def _assigned(self, cid: str, task: int) -> int | None:
        """The submodel of `cid`'s task `task` (a round's: its number is the round's), None: no such task."""
        return self.fed.round.assignments.get(cid)

    def _update(self, reply: Message) -> tuple[Update, int, FlowerHello | None]:
        """A train reply as the Federation takes an update: from the node its task went to, for that task."""
        node = reply.metadata.src_node_id
        cid = self.nodes.get(node)
        if cid is None:
            raise Rejected("unknown_node", f"node {node} never joined")
        res = read_message(reply.content, FlowerResult)
        if res.client != cid:
            raise Rejected("client_mismatch", f"node {node} is {cid!r}, its reply says {res.client!r}")
        k = self._assigned(cid, res.round)
        if k is None or res.submodel != k:
            raise Rejected("submodel_mismatch", f"{cid} reports submodel {res.submodel + 1}, assigned "
                                                f"{None if k is None else k + 1}")
        delta = read_arrays(reply.content, self.fed.layout.upload_shapes(k))
        nbytes = sum(t.numel() * t.element_size() for t in delta.values())
        metrics = {"loss": res.loss, "train_acc": res.accuracy, "train_s": res.seconds}
        return Update(cid, res.round, k, res.samples, delta, nbytes, metrics), node, res.hello

    def round_facts(self, facts: dict[str, Any]) -> dict[str, Any]:
        return self._round

    # -- federated evaluation -----------------------------------------------------------------
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """A share of the nodes score one submodel each on their own test shard: every submodel gets a
        node when there are enough (the coverage policy), the first one in turn when there are fewer."""
        pool = [c for c in self.fed.available() if c in self.node_of]
        n = min(len(pool), math.ceil(self.settings.fraction_evaluate * len(pool)))
        if n == 0:
            return []
        chosen = sorted(self._eval_rng.sample(pool, n))
        bounds = [Candidate(c, self.fed.clients[c].max_submodel, self.fed.clients[c].max_submodel) for c in chosen]
        k = self.fed.layout.num_submodels
        plan = assign_coverage(bounds, [(server_round + i) % k for i in range(k)], self._eval_rng)
        return self._tasks("evaluate", server_round, plan, self.train.lr, MessageType.EVALUATE)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Per submodel, the accuracy over all the test images its nodes scored."""
        scored: dict[int, list[FlowerResult]] = {}
        for res in (self._guarded(lambda r: read_message(r.content, FlowerResult), r) for r in replies):
            if res is not None and 0 <= res.submodel < self.fed.layout.num_submodels:
                scored.setdefault(res.submodel, []).append(res)
        if not scored:
            return None
        acc = {k: sum(r.accuracy * r.samples for r in rs) / sum(r.samples for r in rs) for k, rs in sorted(scored.items())}
        out = MetricRecord({f"accuracy-{k + 1}": round(a, 4) for k, a in acc.items()})
        out["worst"], out["avg"] = round(min(acc.values()), 4), round(statistics.fmean(acc.values()), 4)
        out["samples"] = sum(r.samples for rs in scored.values() for r in rs)
        log.info(f"round {server_round} federated evaluation: {dict(out)}")
        return out


def refuse_error(reply: Message) -> None:
    """A node's error reply, as a refusal with its reason code."""
    if reply.has_error():
        raise Rejected("node_error", f"node {reply.metadata.src_node_id}: {reply.error.reason[:200]}")


def round_metrics(facts: Mapping[str, Any]) -> MetricRecord:
    """The numbers of a round's metrics line that Flower's Result keeps."""
    out = MetricRecord({"committed": int(facts["committed"]), "updates": sum(facts["updates_per_submodel"]),
                        "updates-per-submodel": list(facts["updates_per_submodel"])})
    if "accuracy" in facts:
        out.update({"accuracy": [float(a) for a in facts["accuracy"]], "worst": float(facts["worst"]),
                    "avg": float(facts["avg"])})
    return out


# -- the run config -> the settings (aggregator/flower_app.py makes the ServerApp) ----------------------
# batch_clients and bf16 are the in-process simulator's: Flower's nodes train one client each
_SIM_KEYS = {f.name for f in dataclasses.fields(SimConfig)} - {"robustness", "attack", "attackers", "batch_clients", "bf16"}
_FLOWER_KEYS = {f.name for f in dataclasses.fields(FlowerSettings)} - {"staleness"}
_AGGREGATION_KEYS = {"aggregator": "rule", "centre_check": "centre_check"}
# buffered mode's StalenessConfig, its exponent named as serve's --staleness-exponent
_STALENESS_KEYS = {("staleness_exponent" if f.name == "exponent" else f.name): f.name
                   for f in dataclasses.fields(StalenessConfig)}


def run_settings(run_config: Mapping[str, Any]) -> tuple[SimConfig, FlowerSettings]:
    """A Flower app's run config (`[tool.flwr.app.config]`, `flwr run -c`) as the simulator's settings,
    keys in kebab case (`per-round`, `non-iid`); a key left out, or "" (TOML has no null), keeps its
    default."""
    sim, flower, aggregation, staleness = {}, {}, {}, {}
    keys = _SIM_KEYS | _FLOWER_KEYS | set(_AGGREGATION_KEYS) | set(_STALENESS_KEYS)
    for key, value in run_config.items():
        name = key.replace("-", "_")
        if value == "" and name in keys:
            continue
        if name in _SIM_KEYS:
            sim[name] = value
        elif name in _FLOWER_KEYS:
            flower[name] = value
        elif name in _AGGREGATION_KEYS:
            aggregation[_AGGREGATION_KEYS[name]] = value
        elif name in _STALENESS_KEYS:
            staleness[_STALENESS_KEYS[name]] = value
        else:
            known = sorted(k.replace("_", "-") for k in keys)
            raise ValueError(f"unknown run-config key {key!r}; the NeFL app takes {', '.join(known)}")
    if "profile" not in sim:
        raise ValueError("the run config names no profile: add profile = \"NAME\" (`nefl profile list`)")
    if flower.get("mode") == "buffered":  # as serve's buffered mode: the centre check is off unless asked for
        aggregation.setdefault("centre_check", False)
    if aggregation:
        sim["robustness"] = Robustness(aggregation=AggregationConfig(**aggregation))
    return SimConfig(**sim), FlowerSettings(**flower, staleness=StalenessConfig(**staleness))
