"""In-process research simulator: the paper's client tiers on a real dataset.

Every client trains a physically smaller submodel with the same code a device runs, and the
server side is the same streaming NeFedAvg the MQTT aggregator uses; only the transport is
missing. That keeps simulated accuracy an honest preview of a real federation.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from nefl.aggregate import NeFedAvg
from nefl.checkpoint import save_checkpoint
from nefl.data import ArrayDataset, BatchLoader, load_dataset, partition_dirichlet, partition_iid
from nefl.methods import Method
from nefl.profile import load_profile
from nefl.state import GlobalState, Layout, load_module_state, module_state
from nefl.train import TrainConfig, evaluate, local_train, recompute_bn_stats


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


@dataclass
class SimResult:
    accuracy: list[float]
    worst: float
    avg: float
    seconds: float
    rounds: list[dict] = field(default_factory=list)


def tier_choices(client: int, num_clients: int, num_submodels: int) -> list[int]:
    """The paper's dynamic setting: equal tiers, tier t picks among submodels t-2..t+2 (clipped)."""
    tier = client * num_submodels // num_clients
    return list(range(max(0, tier - 2), min(num_submodels - 1, tier + 2) + 1))


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
        self.train_cfg = TrainConfig(lr=cfg.lr, batch_size=cfg.batch_size, local_epochs=cfg.local_epochs)
        self.state = GlobalState.init(self.layout, seed=cfg.seed)
        self.modules = [self.layout.module(k).to(self.device) for k in range(self.layout.num_submodels)]
        self.rng = random.Random(cfg.seed)

    def run_round(self, r: int) -> dict:
        cfg, layout = self.cfg, self.layout
        t0 = time.perf_counter()
        lr = self.train_cfg.lr_at(r, cfg.rounds)
        agg = NeFedAvg(layout, cfg.weighting)
        participants = sorted(self.rng.sample(range(cfg.clients), cfg.per_round))
        assigned, losses = [], []
        for c in participants:
            k = self.rng.choice(tier_choices(c, cfg.clients, layout.num_submodels))
            loader = BatchLoader(self.train, self.parts[c], cfg.batch_size, shuffle=True, augment=True,
                                 seed=cfg.seed * 1_000_003 + r * 1009 + c)
            res = local_train(self.modules[k], self.state.extract(layout, k), loader, cfg.local_epochs, lr,
                              self.train_cfg, upload=layout.upload_shapes(k), device=self.device)
            agg.add(k, res.delta, res.num_samples)
            assigned.append([c, k])
            losses.append(res.loss)
        self.state = agg.finalize(self.state)
        return {"round": r, "lr": lr, "participants": assigned, "updates_per_submodel": agg.updates,
                "train_loss": sum(losses) / len(losses), "train_seconds": time.perf_counter() - t0}

    def evaluate(self, max_samples: int) -> list[float]:
        """Each submodel with its own BN and steps (static BN statistics recomputed first)."""
        cfg, layout = self.cfg, self.layout
        n = min(max_samples, len(self.test))
        calib = torch.randperm(len(self.train), generator=torch.Generator().manual_seed(cfg.seed))
        accs = []
        for k, model in enumerate(self.modules):
            load_module_state(model, self.state.extract(layout, k))
            if layout.method.static_bn:
                recompute_bn_stats(model, BatchLoader(self.train, calib[: cfg.bn_calibration_samples], 256, False, False, 0),
                                   self.device)
                trained = module_state(model)
                for name in layout.local:
                    if name in self.state.inconsistent[k]:
                        self.state.inconsistent[k][name] = trained[name].detach().cpu().clone()
            acc, _ = evaluate(model, BatchLoader(self.test, torch.arange(n), 500, False, False, 0), self.device)
            accs.append(acc)
        return accs

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
            save_checkpoint(out / "checkpoint", self.state, self.layout,
                            {"round": cfg.rounds - 1, "accuracy": accs, "dataset": cfg.dataset or self.layout.profile.dataset})
        return SimResult(accs, min(accs), sum(accs) / len(accs), time.perf_counter() - t0, rows)
