"""In-process research simulator: the paper's client tiers on a real dataset.

The simulator is the server minus the transport: the same `Federation` picks participants, assigns
submodels with the same policy code, guards and folds the updates and commits the round; every
client trains a physically smaller submodel with the same `local_train` a device runs; the same
`Evaluator` scores the submodels. That keeps simulated accuracy an honest preview of a real federation.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from aggregator.assignment import PAPER_WINDOW, Assignment
from aggregator.evaluation import Evaluator
from aggregator.federation import Federation, Rejected
from nefl.checkpoint import UPDATES_TOTAL_KEY, save_checkpoint
from nefl.data import ArrayDataset, BatchLoader, load_dataset, partition_dirichlet, partition_iid
from nefl.messages import Announce
from nefl.methods import Method
from nefl.profile import load_profile
from nefl.state import GlobalState, Layout
from nefl.train import TrainConfig, local_train

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
    eval_every: int = 5
    eval_samples: int = 2000  # test images for intermediate evaluations
    final_eval_samples: int | None = None  # test images for the last evaluation (None: all)
    bn_calibration_samples: int = 2000  # training images for static-BN statistics (HeteroFL)
    max_samples_per_client: int | None = None
    data_root: str | None = None
    out: str | None = None  # directory for metrics.jsonl and the final checkpoint
    device: str = "cpu"  # torch device for training and evaluation, e.g. "cuda" for the paper's protocol
    assignment: Assignment = "paper"  # the paper's tiers; "coverage" / "largest" as the server can
    lr_schedule: str = "step"  # nefl.train.Schedule
    warmup_rounds: int = 0


@dataclass
class SimResult:
    accuracy: list[float]
    worst: float
    avg: float
    seconds: float
    rounds: list[dict] = field(default_factory=list)


def tier_of(client: int, num_clients: int, num_tiers: int) -> int:
    """The paper's equal tiers by client index, tier 0 the most constrained."""
    return client * num_tiers // num_clients


def tier_bound(tier: int, num_submodels: int) -> int:
    """The largest submodel (0-based) a client of `tier` can train: the top of its paper window."""
    return min(tier + PAPER_WINDOW, num_submodels - 1)


def client_ids(num_clients: int) -> list[str]:
    """Zero-padded, so the ids sort in index order and the seeded sampling and the paper's draws
    replay the simulator's runs from before it drove a Federation."""
    width = len(str(num_clients - 1))
    return [f"c{c:0{width}d}" for c in range(num_clients)]


def simulated_federation(layout: Layout, cfg: SimConfig, samples: Sequence[int]) -> Federation:
    """The server's round state with every client online and announcing its tier's bound once, as
    a device does over MQTT; `samples` is each client's partition size."""
    k = layout.num_submodels
    ids = client_ids(cfg.clients)
    tiers = {cid: tier_of(c, cfg.clients, k) for c, cid in enumerate(ids)}
    fed = Federation(layout, GlobalState.init(layout, seed=cfg.seed), FEDERATION, cfg.per_round, 1, math.inf,
                     cfg.weighting, cfg.seed, assignment=cfg.assignment, tiers=tiers)
    for cid, n in zip(ids, samples):
        fed.set_online(cid, True, now=0.0)
        fed.announce(cid, Announce(client=cid, samples=max(1, n), max_submodel=tier_bound(tiers[cid], k) + 1), now=0.0)
    return fed


def _partitions(train: ArrayDataset, cfg: SimConfig) -> list[torch.Tensor]:
    if cfg.non_iid is None:
        parts = partition_iid(len(train), cfg.clients, cfg.seed)
    else:
        parts = partition_dirichlet(train.labels, cfg.clients, cfg.non_iid, cfg.seed)
    if cfg.max_samples_per_client:
        parts = [p[: cfg.max_samples_per_client] for p in parts]
    return parts


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


class Simulator:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.device = str(check_device(cfg.device))
        profile = load_profile(cfg.profile)
        self.layout = Layout.build(profile, cfg.method)
        dataset = cfg.dataset or profile.dataset
        self.train = load_dataset(dataset, cfg.data_root, train=True)
        self.test = load_dataset(dataset, cfg.data_root, train=False)
        if tuple(self.train.images.shape[1:]) != profile.input_shape:
            raise ValueError(
                f"{dataset} images are {tuple(self.train.images.shape[1:])}, profile {profile.name} expects "
                f"{profile.input_shape}; pick a profile made for this dataset"
            )
        self.parts = _partitions(self.train, cfg)
        self.train_cfg = TrainConfig(lr=cfg.lr, batch_size=cfg.batch_size, local_epochs=cfg.local_epochs,
                                     schedule=cfg.lr_schedule, warmup_rounds=cfg.warmup_rounds)
        self.modules = [self.layout.module(k).to(self.device) for k in range(self.layout.num_submodels)]
        self.client_index = {cid: c for c, cid in enumerate(client_ids(cfg.clients))}
        self.fed = simulated_federation(self.layout, cfg, [len(p) for p in self.parts])
        self.evaluator = Evaluator(self.layout, self.test, self.train, calibration_samples=cfg.bn_calibration_samples,
                                   seed=cfg.seed, device=self.device)

    @property
    def state(self) -> GlobalState:
        return self.fed.state

    def run_round(self, r: int) -> dict:
        cfg, layout, fed = self.cfg, self.layout, self.fed
        t0 = time.perf_counter()
        train_cfg = self.train_cfg.for_round(r, cfg.rounds)
        rejected: dict[str, int] = {}
        losses = []
        for cid, k in sorted(fed.open_round(r, now=0.0).assignments.items()):
            c = self.client_index[cid]
            loader = BatchLoader(self.train, self.parts[c], cfg.batch_size, shuffle=True, augment=True,
                                 seed=cfg.seed * 1_000_003 + r * 1009 + c)
            res = local_train(self.modules[k], fed.state.extract(layout, k), loader, train_cfg,
                              upload=layout.upload_shapes(k), device=self.device)
            header = {"kind": "update", "federation": FEDERATION, "client": cid, "round": r, "submodel": k,
                      "samples": res.num_samples,
                      "metrics": {"loss": res.loss, "train_acc": res.accuracy, "train_s": res.seconds}}
            try:
                fed.accept(cid, header, res.delta, sum(t.numel() * t.element_size() for t in res.delta.values()))
            except Rejected as e:  # the server's guard applies to simulated updates too
                fed.reject(e.reason)
                rejected[e.reason] = rejected.get(e.reason, 0) + 1
            losses.append(res.loss)
        facts = fed.close_round()
        participants = [[self.client_index[cid], k - 1] for cid, k in facts["assigned"].items()]
        return {"round": r, "lr": train_cfg.lr, "participants": participants,
                "updates_per_submodel": facts["updates_per_submodel"], "committed": facts["committed"],
                "rejected": rejected, "train_loss": sum(losses) / len(losses), "train_seconds": time.perf_counter() - t0}

    def evaluate(self, max_samples: int) -> list[float]:
        return self.evaluator.accuracy(self.fed.state, max_samples)

    def run(self, on_round: Callable[[dict], None] | None = None) -> SimResult:
        cfg = self.cfg
        out = Path(cfg.out) if cfg.out else None
        metrics_file = None
        if out:
            out.mkdir(parents=True, exist_ok=True)
            metrics_file = (out / "metrics.jsonl").open("w")
            (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
        t0 = time.perf_counter()
        rows, accs = [], []
        try:
            for r in range(cfg.rounds):
                row = self.run_round(r)
                last = r == cfg.rounds - 1
                if last or (cfg.eval_every and (r + 1) % cfg.eval_every == 0):
                    n = min(cfg.final_eval_samples or len(self.test), len(self.test)) if last else cfg.eval_samples
                    accs = self.evaluate(n)
                    row.update(accuracy=accs, worst=min(accs), avg=sum(accs) / len(accs), eval_samples=n)
                row["seconds"] = time.perf_counter() - t0
                rows.append(row)
                if metrics_file:
                    metrics_file.write(json.dumps(row) + "\n")
                    metrics_file.flush()
                if on_round:
                    on_round(row)
        finally:
            if metrics_file:
                metrics_file.close()
        if out:
            save_checkpoint(out / "checkpoint", self.fed.state, self.layout,
                            {"round": cfg.rounds - 1, "accuracy": accs, "dataset": cfg.dataset or self.layout.profile.dataset,
                             UPDATES_TOTAL_KEY: self.fed.trained_updates})
        return SimResult(accs, min(accs), sum(accs) / len(accs), time.perf_counter() - t0, rows)
