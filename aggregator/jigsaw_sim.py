"""FedJigsaw in simulation, with HeteroFL and FedRolex on the same partitions.

Every client keeps a base architecture (round-robin over `archs`), a memory budget from the kit's cost
model, a Dirichlet label-skewed training shard (nefl.data, as `aggregator simulate`), a validation split
for the reward and a local test set drawn from the test images with its own label distribution. Per
round, FedJigsaw clients assemble a model with their AttenAssemble policy, fetch the chosen modules from
their sources, train with the kit's `local_train`, return every module to its source (Eq. 2) and update
their policy with REINFORCE; during the CoRe-Tune phase the server's critic gives the advantages. The
baselines train width-scaled windows of the largest architecture (prefix: HeteroFL, rolling: FedRolex).
Each evaluation scores every client's current model on its local test set (BN statistics recomputed on
its own training data first, for every method alike) and reports mean and std across clients.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from nefl.checkpoint import META_FILE, STATE_FILE, append_metrics
from nefl.data import ArrayDataset, BatchLoader, get_dataset_info, load_dataset, partition_dirichlet
from nefl.fsio import atomic_write, atomic_write_text
from nefl.jigsaw.baselines import scaled_metas, submodel_windows, width_for_budget
from nefl.jigsaw.coretune import ServerCritic, arch_feature, exploration_bonus, observation
from nefl.jigsaw.policy import Agent, Episode, assemble, returns
from nefl.jigsaw.symbio import InProcessExchange, MetadataBroadcast, ModuleFetch, ModuleReturn, neighbours, state_bytes
from nefl.jigsaw.zoo import BaseArch, ModuleMeta, Zoo, build_model, build_module, fixed_bytes, load_base, peak_bytes
from nefl.rolling import aggregate_windows, extract_state
from nefl.state import load_module_state, module_state
from nefl.train import TrainConfig, evaluate, local_train, recompute_bn_stats

FEDERATION = "jigsaw-simulation"
METHODS: tuple[str, ...] = ("fedjigsaw", "no-coretune", "no-symbio", "heterofl", "fedrolex")
METHOD_TITLES = {"fedjigsaw": "FedJigsaw", "no-coretune": "W/O CoRe-Tune", "no-symbio": "W/O SymbioArchitect",
                 "heterofl": "HeteroFL", "fedrolex": "FedRolex"}


@dataclass
class JigsawConfig:
    method: str = "fedjigsaw"
    dataset: str = "fashion-mnist"
    archs: tuple[str, ...] = ("cnn-2", "cnn-3", "cnn-4", "cnn-6")
    clients: int = 10
    rounds: int = 20
    policy_rounds: int | None = None  # CoRe-Tune phase (server critic present); default: the first half
    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.05
    milestones: tuple[float, ...] = ()  # lr x0.1 at these fractions of the rounds; none, as the FedJigsaw paper
    non_iid: float = 0.1  # Dirichlet alpha of the label skew
    seed: int = 0
    max_samples_per_client: int | None = None
    val_fraction: float = 0.1
    test_per_client: int = 500
    topology: str = "full"
    neighbours_k: int = 2
    budget_scale: float = 1.5  # budget = fixed part + scale x the base model's share of the peak estimate
    alpha: float | None = None  # reward weight of Acc; default as the paper: 0.9 high non-IID, 0.7 low
    beta: float = 0.1  # weight of the Cap (memory use) bonus
    gamma: float = 0.95  # discount of the Monte-Carlo returns
    tau: float = 1.0  # pointer temperature
    policy_lr: float = 0.05  # Adam; 0.01 learned too slowly for a 12-round probe (docs/fedjigsaw.md)
    proxy_samples: int = 64
    eval_every: int = 5
    data_root: str | None = None
    out: str | None = None

    def reward_alpha(self) -> float:
        return self.alpha if self.alpha is not None else (0.9 if self.non_iid <= 0.5 else 0.7)

    def coretune_rounds(self) -> int:
        if self.method != "fedjigsaw":
            return 0
        return self.rounds // 2 if self.policy_rounds is None else min(self.policy_rounds, self.rounds)


@dataclass
class JigsawResult:
    accuracy: list[float]  # per client, last evaluation
    mean: float
    std: float
    seconds: float
    rounds: list[dict] = field(default_factory=list)
    architectures: list[list[str]] = field(default_factory=list)


def local_test_indices(test: ArrayDataset, train_labels: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """`n` test images drawn with the client's own label distribution (its training shard's)."""
    classes = test.info.num_classes
    share = torch.bincount(train_labels, minlength=classes).double()
    counts = torch.floor(share / share.sum() * n).long()
    gen = torch.Generator().manual_seed(seed)
    picked = []
    for k in range(classes):
        pool = torch.nonzero(test.labels == k).flatten()
        picked.append(pool[torch.randperm(pool.numel(), generator=gen)[: min(int(counts[k]), pool.numel())]])
    return torch.cat(picked).sort().values


@dataclass
class ClientData:
    train: torch.Tensor
    val: torch.Tensor
    test: torch.Tensor
    histogram: torch.Tensor  # label distribution of the training shard: the policy's CLS input, never sent


def client_data(train: ArrayDataset, test: ArrayDataset, cfg: JigsawConfig) -> list[ClientData]:
    parts = partition_dirichlet(train.labels, cfg.clients, cfg.non_iid, cfg.seed)
    out = []
    for c, part in enumerate(parts):
        gen = torch.Generator().manual_seed(cfg.seed * 7919 + c)
        part = part[torch.randperm(part.numel(), generator=gen)]
        if cfg.max_samples_per_client:
            part = part[: cfg.max_samples_per_client]
        n_val = max(1, int(part.numel() * cfg.val_fraction))
        labels = train.labels[part]
        hist = torch.bincount(labels, minlength=train.info.num_classes).float()
        out.append(ClientData(part[n_val:].sort().values, part[:n_val].sort().values,
                              local_test_indices(test, labels, cfg.test_per_client, cfg.seed * 104729 + c), hist / hist.sum()))
    return out


class JigsawSimulator:
    """One federation of `cfg.clients` clients running `cfg.method` for `cfg.rounds` rounds."""

    def __init__(self, cfg: JigsawConfig) -> None:
        if cfg.method not in METHODS:
            raise ValueError(f"unknown method {cfg.method!r}: use one of {', '.join(METHODS)}")
        self.cfg = cfg
        self.bases: list[BaseArch] = [load_base(cfg.archs[c % len(cfg.archs)]) for c in range(cfg.clients)]
        shapes, shape = {b.input for b in self.bases}, tuple(get_dataset_info(cfg.dataset).shape)
        if shapes != {shape}:  # checked before loading any data
            raise ValueError(f"{cfg.dataset} images are {shape} but the architectures "
                             f"expect {sorted(shapes)}: use cnn-* for 28x28 and vgg-* for 32x32 datasets")
        self.train = load_dataset(cfg.dataset, cfg.data_root, train=True)
        self.test = load_dataset(cfg.dataset, cfg.data_root, train=False)
        self.data = client_data(self.train, self.test, cfg)
        self.train_cfg = TrainConfig(lr=cfg.lr, batch_size=cfg.batch_size, local_epochs=cfg.local_epochs,
                                     milestones=tuple(cfg.milestones))
        self.input = self.bases[0].input
        fixed = fixed_bytes(self.input, cfg.batch_size)
        self.budgets = [fixed + (peak_bytes(b.metas(c), b.input, cfg.batch_size) - fixed) * cfg.budget_scale
                        for c, b in enumerate(self.bases)]
        self.architectures: list[list[ModuleMeta]] = [b.metas(c) for c, b in enumerate(self.bases)]
        if cfg.method in ("heterofl", "fedrolex"):
            self._init_baseline()
        else:
            self._init_jigsaw()

    # -- setup ---------------------------------------------------------------------------------------

    def _init_jigsaw(self) -> None:
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        store = {}
        for c, base in enumerate(self.bases):
            for meta in base.metas(c):
                store[meta.key] = module_state(build_module(meta))
        self.exchange = InProcessExchange(FEDERATION, store)
        shared = cfg.method != "no-symbio"
        self.links = neighbours(cfg.clients, cfg.topology, cfg.neighbours_k, cfg.seed) if shared else [[] for _ in self.bases]
        for c, base in enumerate(self.bases):
            self.exchange.broadcast(MetadataBroadcast(federation=FEDERATION, client=c, modules=base.metas(c)),
                                    fan_out=len(self.links[c]))
        max_blocks = max(b.blocks for b in self.bases)
        self.zoos = [Zoo.build(self.exchange.metadata[c] + [m for j in self.links[c] for m in self.exchange.metadata[j]],
                               self.input, cfg.batch_size, max_blocks) for c in range(cfg.clients)]
        self.all_keys = sorted(store)
        classes = self.train.info.num_classes
        self.agents = [Agent(classes, lr=cfg.policy_lr, gamma=cfg.gamma, tau=cfg.tau, seed=cfg.seed * 1000 + c)
                       for c in range(cfg.clients)]
        self.max_blocks = max_blocks
        self.critic = ServerCritic(classes + 12 + 1, seed=cfg.seed) if cfg.coretune_rounds() else None
        gen = torch.Generator().manual_seed(10_007 + cfg.seed)
        self.proxy = torch.randn(cfg.proxy_samples, *self.input, generator=gen)  # task-agnostic proxy set: noise images
        self.proxy_features = [torch.full((classes,), 1.0 / classes) for _ in self.bases]
        self.policy_gen = torch.Generator().manual_seed(cfg.seed + 1)

    def _init_baseline(self) -> None:
        cfg = self.cfg
        self.global_base = max(self.bases, key=lambda b: peak_bytes(b.metas(0), b.input, cfg.batch_size))
        torch.manual_seed(cfg.seed)
        self.global_state = module_state(build_model(self.global_base.metas(0)))
        self.widths = [width_for_budget(self.global_base, b, cfg.batch_size) for b in self.budgets]
        self.architectures = [scaled_metas(self.global_base, g) for g in self.widths]
        self._offset = 0  # the window offset of the last round (FedRolex rolls it by one per round)

    # -- rounds --------------------------------------------------------------------------------------

    def _loader(self, c: int, r: int) -> BatchLoader:
        return BatchLoader(self.train, self.data[c].train, self.cfg.batch_size, shuffle=True, augment=True,
                           seed=self.cfg.seed * 1_000_003 + r * 1009 + c)

    def _plain(self, dataset: ArrayDataset, idx: torch.Tensor) -> BatchLoader:
        return BatchLoader(dataset, idx, 256, shuffle=False, augment=False, seed=0)

    def run_round(self, r: int, score: bool = False) -> dict:
        """One round; with `score`, each client's freshly trained model (before aggregation: the model it
        holds after local training) is also scored on its local test set, as `trained_accuracy`."""
        t0 = time.perf_counter()
        self._trained_accs: list[float] | None = [] if score else None
        row = self._baseline_round(r) if self.cfg.method in ("heterofl", "fedrolex") else self._jigsaw_round(r)
        row.update(round=r, method=self.cfg.method, train_seconds=time.perf_counter() - t0)
        if score:
            accs = self._trained_accs
            row.update(trained_accuracy=accs, trained_mean=statistics.fmean(accs), trained_std=statistics.pstdev(accs))
        return row

    def _score_trained(self, c: int, model: nn.Module) -> None:
        if self._trained_accs is not None:
            self._trained_accs.append(evaluate(model, self._plain(self.test, self.data[c].test))[0])

    def _baseline_round(self, r: int) -> dict:
        cfg = self.cfg
        train_cfg = self.train_cfg.for_round(r, cfg.rounds)
        offset = r if cfg.method == "fedrolex" else 0
        updates, losses = [], []
        for c, g in enumerate(self.widths):
            windows = submodel_windows(self.global_base, g, offset)
            start = extract_state(self.global_state, windows)
            model = build_model(self.architectures[c])
            res = local_train(model, start, self._loader(c, r), train_cfg)
            updates.append(({k: start[k] + res.delta[k] for k in start}, windows))
            self._score_trained(c, model)
            losses.append(res.loss)
        self.global_state = aggregate_windows(self.global_state, updates)
        self._offset = offset
        full = state_bytes(self.global_state)
        sent = sum(state_bytes(u) for u, _ in updates)
        return {"lr": train_cfg.lr, "train_loss": statistics.fmean(losses), "widths": self.widths,
                "bytes": {"down": sent, "up": sent, "whole_models": 2 * full * cfg.clients}}

    def _jigsaw_round(self, r: int) -> dict:
        cfg = self.cfg
        train_cfg = self.train_cfg.for_round(r, cfg.rounds)
        before = dict(self.exchange.bytes)
        episodes: list[Episode] = []
        accs, losses = [], []
        for c in range(cfg.clients):
            ep = assemble(self.agents[c].policy, self.zoos[c], c, self.data[c].histogram, self.budgets[c], generator=self.policy_gen)
            start = {}
            for j, m in enumerate(ep.metas):
                fetched = self.exchange.fetch(ModuleFetch(federation=FEDERATION, client=c, source=m.source, round=r, position=m.position))
                start.update({f"{j}.{k}": v for k, v in fetched.items()})
            model = build_model(ep.metas)
            res = local_train(model, start, self._loader(c, r), train_cfg)
            trained = {k: start[k] + res.delta[k] for k in start}
            load_module_state(model, trained)
            accs.append(evaluate(model, self._plain(self.train, self.data[c].val))[0])
            self._score_trained(c, model)
            losses.append(res.loss)
            with torch.no_grad():
                self.proxy_features[c] = model.eval()(self.proxy).softmax(1).mean(0)
            for j, m in enumerate(ep.metas):
                part = {k.split(".", 1)[1]: v for k, v in trained.items() if k.split(".", 1)[0] == str(j)}
                self.exchange.give_back(ModuleReturn(federation=FEDERATION, client=c, source=m.source, round=r,
                                                     position=m.position, samples=res.num_samples), part)
            episodes.append(ep)
            self.architectures[c] = ep.metas
        borrowed = self.exchange.aggregate()
        policy = self._update_policies(r, episodes, accs)
        moved = {k: self.exchange.bytes[k] - before[k] for k in before}
        whole = 2 * sum(state_bytes(self.exchange.store[m.key]) for c, base in enumerate(self.bases) for m in base.metas(c))
        return {"lr": train_cfg.lr, "train_loss": statistics.fmean(losses), "val_accuracy": accs,
                "modules_returned": len(borrowed), "bytes": {**moved, "whole_models": whole},
                "rejected": dict(self.exchange.rejected), **policy}

    def _update_policies(self, r: int, episodes: list[Episode], accs: list[float]) -> dict:
        """Rewards R = alpha Acc + (1 - alpha) Exp + beta Cap, then one REINFORCE step per client;
        with the server's critic during the CoRe-Tune phase, alone afterwards (Exp needs the server)."""
        cfg = self.cfg
        alpha, fixed = cfg.reward_alpha(), fixed_bytes(self.input, cfg.batch_size)
        caps = [(peak_bytes(ep.metas, self.input, cfg.batch_size) - fixed) / (self.budgets[c] - fixed)
                for c, ep in enumerate(episodes)]
        central = self.critic is not None and r < cfg.coretune_rounds()
        exp = [0.0] * len(episodes)
        critic_s = critic_loss = 0.0
        values: list[list[float]] | None = None
        if central:
            t0 = time.perf_counter()
            exp = exploration_bonus(self.proxy_features, [arch_feature(ep.metas, self.all_keys) for ep in episodes])
            obs = [torch.stack([observation(self.proxy_features[c], h, c, self.max_blocks) for h in ep.history])
                   for c, ep in enumerate(episodes)]
            values = self.critic.values(obs)
            rewards = [alpha * a + (1 - alpha) * e + cfg.beta * k for a, e, k in zip(accs, exp, caps)]
            critic_loss = self.critic.update(obs, [returns(R, len(ep.steps), cfg.gamma) for R, ep in zip(rewards, episodes)])
            critic_s = time.perf_counter() - t0
        else:
            rewards = [alpha * a + cfg.beta * k for a, k in zip(accs, caps)]
        t0 = time.perf_counter()
        losses = [agent.update(ep, R, values[c] if values else None) for c, (agent, ep, R) in enumerate(zip(self.agents, episodes, rewards))]
        update_s = (time.perf_counter() - t0) / len(episodes)
        return {"reward": rewards, "exp": exp, "cap": caps, "coretune": central, "critic_loss": critic_loss,
                "critic_seconds": critic_s, "actor_loss": statistics.fmean(losses),
                "decision_seconds": [ep.seconds for ep in episodes], "policy_update_seconds": update_s}

    # -- evaluation ----------------------------------------------------------------------------------

    def client_model(self, c: int) -> nn.Sequential:
        """Client c's current model with the current parameters (after this round's aggregation)."""
        metas = self.architectures[c]
        model = build_model(metas)
        if self.cfg.method in ("heterofl", "fedrolex"):
            windows = submodel_windows(self.global_base, self.widths[c], self._offset)
            load_module_state(model, extract_state(self.global_state, windows))
        else:
            load_module_state(model, {f"{j}.{k}": v for j, m in enumerate(metas) for k, v in self.exchange.store[m.key].items()})
        return model

    def evaluate(self) -> list[float]:
        accs = []
        for c in range(self.cfg.clients):
            model = self.client_model(c)
            recompute_bn_stats(model, self._plain(self.train, self.data[c].train))
            accs.append(evaluate(model, self._plain(self.test, self.data[c].test))[0])
        return accs

    def describe(self, c: int) -> list[str]:
        """An architecture as module names: c3.m1 = client 3's module 1 (with its type and output)."""
        return [f"{m.key}:{m.type}>{m.d_out[0]}" for m in self.architectures[c]]

    def run(self, on_round: Callable[[dict], None] | None = None) -> JigsawResult:
        cfg = self.cfg
        out = Path(cfg.out) if cfg.out else None
        if out:
            out.mkdir(parents=True, exist_ok=True)
            (out / "metrics.jsonl").unlink(missing_ok=True)
            atomic_write_text(out / "config.json", json.dumps(asdict(cfg), indent=2))
        t0 = time.perf_counter()
        rows, accs = [], []
        for r in range(cfg.rounds):
            scoring = r == cfg.rounds - 1 or bool(cfg.eval_every and (r + 1) % cfg.eval_every == 0)
            row = self.run_round(r, score=scoring)
            if scoring:
                accs = self.evaluate()
                row.update(accuracy=accs, mean=statistics.fmean(accs), std=statistics.pstdev(accs),
                           architectures=[self.describe(c) for c in range(cfg.clients)])
            row["seconds"] = time.perf_counter() - t0
            rows.append(row)
            if out:
                append_metrics(out, row)
            if on_round:
                on_round(row)
        if out:
            self.save(out / "checkpoint", accs)
        return JigsawResult(accs, statistics.fmean(accs), statistics.pstdev(accs), time.perf_counter() - t0, rows,
                            [self.describe(c) for c in range(cfg.clients)])

    def save(self, directory: Path, accs: list[float]) -> None:
        """The checkpoint layout of `aggregator simulate`: state.safetensors + meta.json, written atomically."""
        directory.mkdir(parents=True, exist_ok=True)
        if self.cfg.method in ("heterofl", "fedrolex"):
            flat = self.global_state
        else:
            flat = {f"{key}/{k}": v for key, st in self.exchange.store.items() for k, v in st.items()}
        atomic_write(directory / STATE_FILE, lambda tmp: save_file({k: v.contiguous() for k, v in flat.items()}, tmp))
        meta = {"round": self.cfg.rounds - 1, "method": self.cfg.method, "accuracy": accs,
                "architectures": [self.describe(c) for c in range(self.cfg.clients)],
                "budgets_mib": [b / 2**20 for b in self.budgets]}
        atomic_write_text(directory / META_FILE, json.dumps(meta, indent=2))


def policy_parameters(sim: JigsawSimulator) -> tuple[int, int]:
    """Parameter counts of one client's policy and of the server's critic (0 without CoRe-Tune)."""
    actor = sum(p.numel() for p in sim.agents[0].policy.parameters()) if hasattr(sim, "agents") else 0
    critic = sum(p.numel() for p in sim.critic.critic.parameters()) if getattr(sim, "critic", None) else 0
    return actor, critic
