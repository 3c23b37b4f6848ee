"""In-process research simulator: the paper's client tiers on a real dataset.

The simulator is the server minus MQTT: the same round driver (aggregator/rounds.py) opens, closes,
evaluates and checkpoints every round; the same `Federation` picks participants, assigns submodels,
bounds and screens the updates and merges them with the configured rule; every client trains a
physically smaller submodel with the same `local_train` a device runs. Only the transport differs:
clients train here, one after the other. That keeps simulated accuracy an honest preview of a real
federation, and lets the attack suite (`--attack`, nefl/aggregation/attacks.py) run against every server option.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from aggregator.assignment import Assignment
from aggregator.evaluation import Evaluator
from aggregator.federation import Federation, Rejected, Robustness, Update
from aggregator.statsdata import ServerStatistics
from aggregator.rootdata import DEFAULT_ROOT_SAMPLES, RootUpdates, held_out, split_root
from aggregator.rounds import RoundDriver, RunPlan, RoundTransport
from nefl.aggregation.attack_oracle import PipelineOracle
from nefl.aggregation.gate import Gate
from nefl.aggregation.attacks import Attack, Knowledge, craft, poison_dataset, triggered_test
from nefl.aggregation.pipeline import Pipeline
from nefl.nested.data import ArrayDataset, BatchLoader, load_dataset
from nefl.nested.methods import Method
from nefl.nested.population import client_batches, client_ids, partitions, tier_bound, tier_of, train_seed
from nefl.nested.profile import load_profile
from nefl.nested.state import GlobalState, Layout
from nefl.nested.batched import batched_train
from nefl.nested.train import TrainConfig, TrainResult, local_train
from nefl.protocol.messages import Announce

FEDERATION = "simulation"


@dataclass
class SimConfig:
    profile: str
    method: str | Method | None = None  # a preset name or a Method (e.g. an ablation); default: the profile's
    dataset: str | None = None  # default: the profile's
    clients: int = 20
    per_round: int = 5
    rounds: int = 30
    local_epochs: int = 1
    non_iid: float | None = None  # Dirichlet alpha; None = IID
    seed: int = 0
    batch_size: int = 32
    lr: float = 0.1
    weighting: str = "uniform"
    eval_every: int = 5  # 0: evaluate only after the last round (and not the initial state)
    eval_samples: int = 2000  # test images for intermediate evaluations
    final_eval_samples: int | None = None  # test images for the last evaluation (None: all)
    bn_calibration_samples: int = 2000  # training images for static-BN statistics (HeteroFL)
    max_samples_per_client: int | None = None
    data_root: str | None = None
    out: str | None = None  # directory for metrics.jsonl and the checkpoint (out/checkpoint, every round)
    device: str = "cpu"  # torch device for training and evaluation, e.g. "cuda" for the paper's protocol
    assignment: Assignment = "paper"  # the paper's tiers; "coverage" / "largest" as the server can
    lr_schedule: str = "step"  # nefl.nested.train.Schedule
    warmup_rounds: int = 0
    robustness: Robustness = Robustness()  # the server's bounds, clipping, DP and aggregation rule
    root_samples: int = DEFAULT_ROOT_SAMPLES  # FLTrust's root set: the last test images (left out of evaluation)
    attack: Attack | None = None  # what the hostile clients do
    attackers: float = 0.0  # the share of clients that are hostile (a seeded draw)
    batch_clients: bool = False  # clients of one submodel and sample count trained together (nefl/nested/batched.py)
    bf16: bool = False  # bfloat16 autocast for local training


@dataclass
class SimResult:
    accuracy: list[float]
    worst: float
    avg: float
    seconds: float
    rounds: list[dict] = field(default_factory=list)
    backdoor: list[float] | None = None  # per submodel: triggered test images classified as the target


def attacker_ids(cfg: SimConfig) -> set[str]:
    """round(attackers x clients) clients, drawn with the run's seed (spread over the tiers)."""
    n = round(cfg.attackers * cfg.clients) if cfg.attack is not None else 0
    order = torch.randperm(cfg.clients, generator=torch.Generator().manual_seed(cfg.seed + 104729))
    ids = client_ids(cfg.clients)
    return {ids[int(c)] for c in order[:n]}


def new_federation(layout: Layout, cfg: SimConfig, reference: RootUpdates | None = None,
                   tiers: dict[str, int] | None = None, gate: Gate | None = None,
                   statistics: ServerStatistics | None = None) -> Federation:
    """The server's round state of a simulated run, from the seeded initial weights, no client known yet."""
    return Federation(layout, GlobalState.init(layout, seed=cfg.seed), FEDERATION, cfg.per_round, 1, math.inf,
                      cfg.weighting, cfg.seed, robustness=cfg.robustness, assignment=cfg.assignment, tiers=tiers,
                      reference=reference, gate=gate, statistics=statistics)


def simulated_federation(layout: Layout, cfg: SimConfig, samples: Sequence[int], reference: RootUpdates | None = None,
                         gate: Gate | None = None, statistics: ServerStatistics | None = None) -> Federation:
    """The server's round state with every client online and announcing its tier's bound once, as
    a device does over MQTT; `samples` is each client's partition size."""
    k = layout.num_submodels
    ids = client_ids(cfg.clients)
    tiers = {cid: tier_of(c, cfg.clients, k) for c, cid in enumerate(ids)}
    fed = new_federation(layout, cfg, reference, tiers, gate, statistics)
    for cid, n in zip(ids, samples):
        fed.set_online(cid, True, now=0.0)
        fed.announce(cid, Announce(client=cid, samples=max(1, n), max_submodel=tier_bound(tiers[cid], k) + 1), now=0.0)
    return fed


def check_device(name: str) -> torch.device:
    """Fail before loading any data when the requested device cannot run."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}: use cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but torch sees no CUDA GPU: install a CUDA build of torch or use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {name!r} requested but only {torch.cuda.device_count()} CUDA GPU(s) are visible")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {name!r} requested but MPS is not available on this machine: use --device cpu")
    return device


@dataclass
class ServerSide:
    """What the server of a simulated run holds, from its SimConfig alone: the ladder, the training
    settings, the data (the test images it evaluates on, FLTrust's root set held out of them) and the
    root updates of a rule that needs them. The simulator trains the clients beside it; the Flower strategy
    (aggregator/flower.py) has nodes train them."""

    layout: Layout
    train_cfg: TrainConfig
    train: ArrayDataset
    test: ArrayDataset
    reference: RootUpdates | None  # the root updates of a rule that needs root data
    cfg: SimConfig
    gate: Gate | None = None  # the held-out gate (--gate): its images held out of the evaluation too
    statistics: ServerStatistics | None = None  # the server's running statistics: their images held out too

    @classmethod
    def build(cls, cfg: SimConfig, device: str) -> ServerSide:
        profile = load_profile(cfg.profile)
        layout = Layout.build(profile, cfg.method)
        dataset = cfg.dataset or profile.dataset
        train = load_dataset(dataset, cfg.data_root, train=True)
        test = load_dataset(dataset, cfg.data_root, train=False)
        if tuple(train.images.shape[1:]) != profile.input_shape:
            raise ValueError(
                f"{dataset} images are {tuple(train.images.shape[1:])}, profile {profile.name} expects "
                f"{profile.input_shape}; pick a profile made for this dataset"
            )
        train_cfg = TrainConfig(lr=cfg.lr, batch_size=cfg.batch_size, local_epochs=cfg.local_epochs,
                                schedule=cfg.lr_schedule, warmup_rounds=cfg.warmup_rounds)
        agg = cfg.robustness.aggregation
        root = None
        if agg.spec.root_data:  # the root set is held out of the evaluation, as on the server
            test, root_set = split_root(test, cfg.root_samples)
            root = RootUpdates(layout, root_set, train_cfg, cfg.rounds, cfg.root_samples, cfg.seed, device)
        test, gate, statistics = held_out(test, layout, agg, device)  # after the root set's, as on the server
        return cls(layout, train_cfg, train, test, root, cfg, gate, statistics)

    def evaluator(self, test: ArrayDataset, device: str) -> Evaluator:
        """Every submodel scored on `test` (the test images, or a triggered copy of them)."""
        return Evaluator(self.layout, test, self.train, calibration_samples=self.cfg.bn_calibration_samples,
                         seed=self.cfg.seed, device=device)


class Simulator(RoundTransport):
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.device = str(check_device(cfg.device))
        server = ServerSide.build(cfg, self.device)
        self.layout, self.train, self.test = server.layout, server.train, server.test
        self.train_cfg = server.train_cfg
        self.parts = partitions(self.train, cfg.clients, cfg.non_iid, cfg.seed, cfg.max_samples_per_client)
        self.modules = [self.layout.module(k).to(self.device) for k in range(self.layout.num_submodels)]
        self.client_index = {cid: c for c, cid in enumerate(client_ids(cfg.clients))}
        self.attackers = attacker_ids(cfg)
        self.fed = simulated_federation(self.layout, cfg, [len(p) for p in self.parts], server.reference, server.gate,
                                        server.statistics)
        self.evaluator = server.evaluator(self.test, self.device)
        self.backdoor = None
        if cfg.attack is not None and cfg.attack.backdoor:
            self.backdoor = server.evaluator(triggered_test(self.test, cfg.attack.target), self.device)
        self._round: dict[str, Any] = {}

    @property
    def state(self) -> GlobalState:
        return self.fed.state

    # -- the transport: every participant trains here ------------------------------------------
    def collect(self, fed: Federation, index: int) -> None:
        """Train every participant, turn the attackers' into attacks (the omniscient ones see the honest updates), and hand all of them to the Federation in id order."""
        t0 = time.perf_counter()
        train_cfg = self.train_cfg.for_round(index - 1, self.cfg.rounds)
        trained = self._train_all(fed.round.assignments, index, train_cfg)
        # every attack crafted before any update is accepted: the aggregate may scale what it was given in place
        uploads = {cid: self._attack(cid, k, res.delta, trained) if cid in self.attackers else res.delta
                   for cid, (k, res) in sorted(trained.items())}
        rejected: Counter[str] = Counter()
        for cid, (k, res) in sorted(trained.items()):
            delta = uploads[cid]
            update = Update(cid, index, k, res.num_samples, delta, sum(t.numel() * t.element_size() for t in delta.values()),
                            {"loss": res.loss, "train_acc": res.accuracy, "train_s": res.seconds})
            try:
                fed.accept(update)
            except Rejected as e:  # the server's guard applies to simulated updates too
                fed.reject(e.reason)
                rejected[e.reason] += 1
        self._round = {"lr": train_cfg.lr, "rejected": dict(rejected), "train_s": round(time.perf_counter() - t0, 3),
                       "train_loss": statistics.fmean(res.loss for _, res in trained.values()),
                       "attackers": sorted(self.attackers & set(trained))}

    def _train_all(self, assignments: dict[str, int], index: int,
                   train_cfg: TrainConfig) -> dict[str, tuple[int, TrainResult]]:
        """Every participant's (submodel, training result), in id order: one after the other, or with
        `batch_clients` the clients of one submodel and sample count together (their batches have one size)."""
        loaders = {cid: self._loader(cid, index) for cid in assignments}
        groups: dict[object, list[str]] = defaultdict(list)
        for cid, k in sorted(assignments.items()):
            groups[(k, loaders[cid].num_samples) if self.cfg.batch_clients else cid].append(cid)
        trained: dict[str, tuple[int, TrainResult]] = {}
        autocast = torch.bfloat16 if self.cfg.bf16 else None
        for cids in groups.values():
            k = assignments[cids[0]]
            start, upload = self.fed.state.extract(self.layout, k), self.layout.upload_shapes(k)
            if len(cids) == 1:
                results = [local_train(self.modules[k], start, loaders[cids[0]], train_cfg, upload=upload,
                                       device=self.device, autocast=autocast)]
            else:
                results = batched_train(self.modules[k], start, [loaders[c] for c in cids], train_cfg, upload=list(upload),
                                        device=self.device, autocast=autocast)
            trained.update((c, (k, r)) for c, r in zip(cids, results))
        return dict(sorted(trained.items()))

    def _loader(self, cid: str, index: int) -> BatchLoader:
        """The client's batches of round `index` (its poisoned copy of them when it attacks the data)."""
        c = self.client_index[cid]
        attack = self.cfg.attack
        seed = train_seed(self.cfg.seed, index, c)
        if cid in self.attackers and attack.on_data:
            data = poison_dataset(self.train, self.parts[c], attack, self.layout.profile.num_classes, seed)
            return client_batches(data, None, self.cfg.batch_size, seed)
        return client_batches(self.train, self.parts[c], self.cfg.batch_size, seed)

    def _attack(self, cid: str, k: int, delta: dict[str, torch.Tensor], trained: dict) -> dict[str, torch.Tensor]:
        honest = [res.delta for c, (kk, res) in sorted(trained.items()) if kk == k and c not in self.attackers]
        weights = self.fed.state.extract(self.layout, k)
        gen = torch.Generator().manual_seed(self.cfg.seed * 7_000_003 + self.client_index[cid] + 131 * len(trained))
        known = Knowledge(honest, len(trained), len(self.attackers & set(trained)), frozenset(self.layout.inconsistent),
                          self._oracle(k, trained) if self.cfg.attack.kind == "adaptive" else None, gen)
        return craft(self.cfg.attack, delta, weights, known)

    def _oracle(self, k: int, trained: dict) -> PipelineOracle:
        """The adaptive attacker's oracle: the federation's own rule and seed (the simulator's draws are public) over
        this round's honest updates, all submodels."""
        p = self.fed.aggregator
        honest = [(kk, res.delta) for c, (kk, res) in sorted(trained.items()) if c not in self.attackers]
        return PipelineOracle(Pipeline(p.layout, p.robustness, p.weighting, p.reference, p.seed, p.secret), self.fed.state,
                              honest, k, self.fed.round.index)

    def round_facts(self, facts: dict[str, Any]) -> dict[str, Any]:
        return self._round

    def scores(self, state: GlobalState, samples: int | None) -> dict[str, Any]:
        """Under a backdoor attack: per submodel, the share of triggered test images it calls the target."""
        return {"backdoor": self.backdoor.accuracy(state, samples)} if self.backdoor is not None else {}

    # -- runs ----------------------------------------------------------------------------------
    def evaluate(self, max_samples: int) -> list[float]:
        return self.evaluator.accuracy(self.fed.state, max_samples)

    def run(self, on_round: Callable[[dict], None] | None = None) -> SimResult:
        cfg = self.cfg
        out = Path(cfg.out) if cfg.out else None
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2, default=str))
            (out / "metrics.jsonl").unlink(missing_ok=True)
        plan = RunPlan(cfg.rounds, cfg.eval_every, cfg.eval_samples, cfg.final_eval_samples)
        driver = RoundDriver(self.fed, self, plan, self.evaluator, out and out / "checkpoint", out,
                             meta=lambda: {"dataset": cfg.dataset or self.layout.profile.dataset})
        t0 = time.perf_counter()
        rows = []
        driver.evaluate_start()
        for r in range(1, cfg.rounds + 1):
            row = driver.run_round(r)
            row["seconds"] = round(time.perf_counter() - t0, 3)
            rows.append(row)
            if on_round:
                on_round(row)
        accs = driver.accuracy
        return SimResult(accs, min(accs), sum(accs) / len(accs), time.perf_counter() - t0, rows,
                         rows[-1].get("backdoor"))
