"""FedJigsaw in simulation, with its ablations, local training and the partial-training baselines on the same data.

The simulator stands in for the devices and the broker, and only orchestrates: the client step and the
server step are nefl.jigsaw's (client.JigsawClient, coretune.CoReTune, baselines.train_window), fed with
explicit loaders and an in-process ModuleExchange.

Every client gets a memory budget (spread evenly between the smallest base architecture's training peak and
`budget_headroom` x the largest one's, shuffled by the seed), the base architecture that the kit's cost model
fits in it, and its shard of the data (nefl/jigsaw/shards.py, which a device of `edge-client jigsaw` computes
alike, so an MQTT run reproduces this one).

The schedule is Algorithm 2's, scaled: methods with a policy first run `policy_rounds` rounds that assemble by
sampling, train on the task shard, score on the held-out validation split (the reward), return the modules,
CoRe-Tune's server step and REINFORCE; then every method trains `rounds` more rounds on its task shard, the
modules carried over, the policies frozen and executed greedily with a switching cost. Evaluations score every client's current model on its local test set (BN
statistics recomputed on its own task shard first, for every method alike) and report mean and std across clients.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from nefl.aggregation.robust import update_norm
from nefl.aggregation.rolling import aggregate_windows, extract_state
from nefl.jigsaw.baselines import scaled_metas, submodel_windows, train_window, width_for_budget
from nefl.jigsaw.client import ClientSettings, JigsawClient, Loaders, StepResult, chain_keys
from nefl.jigsaw.coretune import MAX_REPORT_BYTES, CoReTune, CriticAdvice, PolicyReport
from nefl.jigsaw.methods import JigsawMethod, get_method
from nefl.jigsaw.policy import TOKEN_FEATURES
from nefl.jigsaw.shards import ClientShard, ShardSpec, client_data, device_budgets, initial_modules, module_seed
from nefl.jigsaw.screen import ReturnScreen
from nefl.jigsaw.symbio import InProcessExchange, MetadataBroadcast, ModuleFetch, ModuleReturn, neighbours, state_bytes
from nefl.jigsaw.zoo import ModuleMeta, Zoo, base_for_budget, build_model, common_chain, load_base, peak_bytes, random_chain
from nefl.nested.checkpoint import META_FILE, STATE_FILE, append_metrics
from nefl.nested.data import get_dataset_info, load_dataset
from nefl.nested.state import load_module_state, module_state
from nefl.nested.train import TrainConfig, evaluate
from nefl.support.fsio import atomic_write, atomic_write_text

FEDERATION = "jigsaw-simulation"
POLICY_FILE = "policies.safetensors"  # beside the checkpoint's state: every client's policy and the critic


@dataclass
class JigsawConfig:
    method: str = "fedjigsaw"
    dataset: str = "fashion-mnist"
    archs: tuple[str, ...] = ("cnn-2", "cnn-3", "cnn-4", "cnn-6")  # the base architectures devices can get
    clients: int = 10
    rounds: int = 40  # model-training rounds, every method
    policy_rounds: int = 20  # policy phase before them (methods with a policy), on the task shards too
    critic_warmup: int = 6  # policy-phase rounds the critic trains before its values drive the advantage
    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.05
    milestones: tuple[float, ...] = ()  # lr x0.1 at these fractions of the model-training rounds; none, as the paper
    non_iid: float = 0.1  # Dirichlet alpha of the label skew
    seed: int = 0
    max_samples_per_client: int | None = None  # cap on each client's training images
    val_samples: int = 200  # held-out validation images per client: the reward (sampling noise <= 0.035 at 200)
    test_per_client: int = 500
    probe_samples: int = 256  # shared unlabelled images set aside for E_data (the Exp term)
    topology: str = "full"
    neighbours_k: int = 2
    budget_headroom: float = 1.25  # budgets reach this x the largest base model's share of the peak estimate
    alpha: float | None = None  # reward weight of Acc; default as the paper: 0.9 high non-IID, 0.7 low
    beta: float = 0.1  # weight of the Cap (memory use) bonus
    share_weight: float = 0.5  # weight of the co-training credit (nefl.jigsaw.coretune), full below scarce_samples
    scarce_samples: int = 100  # training images under which a client gets the full co-training credit
    gamma: float = 0.95  # discount of the Monte-Carlo returns
    tau: float = 1.0  # pointer temperature
    policy_lr: float = 0.05  # Adam
    # the policies' starting logit bonus for each step of the common chain (the smallest base model, head included),
    # learnable; 0: off (the policies start without a preferred chain; docs/fedjigsaw.md, "The common chain")
    common_prior: float = 3.0
    execution_temperature: float = 0.0  # model-training phase: 0 decodes greedily
    switch_cost: float = 1.0  # nats per round held a new chain must gain under the policy before a client switches to it
    switch_patience: int = 3  # consecutive rounds the policy must prefer the same new chain so
    observation_decay: float = 0.5  # weight of the past in a module's recent accuracy
    norm_bound: float = 5.0  # a returned module may differ from its source's copy by this x its norm (honest ones stay far below)
    local_guard: bool = True  # sharing methods: each client also trains its base model alone and keeps it unless the chain validates clearly better
    screen_returns: bool = True  # sources judge each module's returns together (nefl.jigsaw.screen); off: the norm bound alone
    attack: str | None = None  # the first `attackers` clients return poisoned copies in model training: flip, scale or layer
    attackers: int = 0
    fetch_timeout_s: float = 30.0  # over MQTT: a peer that does not send a module in this is masked for the round
    round_timeout_s: float = 600.0  # over MQTT: the coordinator closes a round without the devices not done by then
    eval_every: int = 5  # model-training rounds between evaluations (always after the last)
    data_root: str | None = None
    out: str | None = None

    def reward_alpha(self) -> float:
        return self.alpha if self.alpha is not None else (0.9 if self.non_iid <= 0.5 else 0.7)

    def shards(self) -> ShardSpec:
        return ShardSpec(clients=self.clients, seed=self.seed, non_iid=self.non_iid,
                         max_samples_per_client=self.max_samples_per_client, val_samples=self.val_samples,
                         test_per_client=self.test_per_client, probe_samples=self.probe_samples,
                         batch_size=self.batch_size)

    def settings(self, max_blocks: int) -> ClientSettings:
        return ClientSettings(FEDERATION, max_blocks, self.batch_size, self.reward_alpha(), self.beta, self.gamma, self.tau,
                              self.policy_lr, self.execution_temperature, self.switch_cost, self.switch_patience,
                              self.observation_decay, self.local_guard and get_method(self.method).share,
                              self.common_prior or None)

    def coretune(self, federation: str, classes: int) -> CoReTune:
        """CoRe-Tune's server step for this configuration (the simulator's and jigsaw-serve's alike)."""
        return CoReTune(federation, classes + TOKEN_FEATURES + 1, self.reward_alpha(), self.beta, self.gamma,
                        self.critic_warmup, self.share_weight, self.scarce_samples, seed=self.seed)


@dataclass
class JigsawResult:
    accuracy: list[float]  # per client, last evaluation
    mean: float
    std: float
    seconds: float
    rounds: list[dict] = field(default_factory=list)
    architectures: list[list[str]] = field(default_factory=list)


def _wire(msg, cls, max_bytes: int = MAX_REPORT_BYTES):
    """A message as its receiver gets it: encoded and decoded by the strict loader."""
    return cls.from_json(msg.to_json(), max_bytes)


# -- a poisoning borrower (benchmarks) ----------------------------------------------------------------

ATTACKS = ("flip", "scale", "layer")


def poison(attack: str, sent: dict[str, torch.Tensor], trained: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A lying borrower's return of a module it was sent as `sent`, each under the old 5 x norm bound:
    flip: -3.5 x its trained copy; scale: its change stretched to 4.5 x the module's norm; layer: the largest
    tensor flipped (-3.5 x), the others honest."""
    if attack == "flip":
        return {k: -3.5 * v for k, v in trained.items()}
    if attack == "scale":
        delta = {k: trained[k] - sent[k] for k in sent}
        stretch = 4.5 * update_norm(sent) / max(update_norm(delta), 1e-12)
        return {k: sent[k] + stretch * d for k, d in delta.items()}
    if attack == "layer":
        big = max(trained, key=lambda k: trained[k].numel())
        return {k: -3.5 * v if k == big else v for k, v in trained.items()}
    raise ValueError(f"unknown attack {attack!r}: use one of {', '.join(ATTACKS)}")


class PoisoningExchange:
    """An attacker's view of the exchange: everything passes, except that the copies of other sources'
    modules it returns are poisoned (its own modules it returns honestly)."""

    def __init__(self, inner: InProcessExchange, attack: str) -> None:
        self.inner, self.attack = inner, attack
        self.sent: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    def broadcast(self, msg: MetadataBroadcast) -> None:
        self.inner.broadcast(msg)

    def catalogue(self, client: int) -> list[ModuleMeta]:
        return self.inner.catalogue(client)

    def fetch(self, req: ModuleFetch) -> dict[str, torch.Tensor]:
        got = self.inner.fetch(req)
        self.sent[(req.source, req.position)] = {k: v.clone() for k, v in got.items()}
        return got

    def give_back(self, msg: ModuleReturn, state: dict[str, torch.Tensor]) -> None:
        if msg.client != msg.source:
            state = poison(self.attack, self.sent[(msg.source, msg.position)], state)
        self.inner.give_back(msg, state)


# -- the two families ---------------------------------------------------------------------------------

class ModuleFederation:
    """Clients that train chains of modules (FedJigsaw, its ablations, local only) around an in-process
    exchange, with CoRe-Tune's server step in the policy phase when the method has it."""

    def __init__(self, sim: "JigsawSimulator", method: JigsawMethod) -> None:
        cfg = self.cfg = sim.cfg
        self.sim, self.method = sim, method
        self.max_blocks = max(load_base(a).blocks for a in cfg.archs)
        settings = cfg.settings(self.max_blocks)
        self.links = neighbours(cfg.clients, cfg.topology, cfg.neighbours_k, cfg.seed) if method.share \
            else [[] for _ in range(cfg.clients)]
        self.clients = [JigsawClient(c, sim.bases[c], sim.budgets[c], sim.data[c].histogram, settings,
                                     seed=cfg.seed * 1000 + c, assemble=method.assemble, policy_seed=cfg.seed,
                                     chain=None if method.assemble else self._fixed_chain(c),
                                     base_start=self._initial(c)) for c in range(cfg.clients)]
        self.exchange = self._initial_exchange()
        self.server = cfg.coretune(FEDERATION, sim.train.info.num_classes) if method.coretune else None

    def _initial(self, c: int) -> dict[str, dict[str, torch.Tensor]]:
        """Client c's modules at their (seeded) initial parameters, as its device starts them."""
        return initial_modules(self.sim.bases[c].metas(c), module_seed(self.cfg.seed, c))

    def _fixed_chain(self, c: int) -> list[ModuleMeta]:
        """Client c's chain under a method without a policy (JigsawMethod.fixed)."""
        bases, cfg = self.sim.bases, self.cfg
        if self.method.fixed in ("shared", "shared-body"):
            common = common_chain([m for j in range(cfg.clients) for m in bases[j].metas(j)], self.sim.input, cfg.batch_size)
            if self.method.fixed == "shared":
                return common
            # the common blocks under the client's own head where it reads their output (the CNN family's all do)
            own = [m for m in bases[c].metas(c) if m.kind == "head" and m.d_in == common[-1].d_in]
            return common[:-1] + own[:1] if own else common
        if self.method.fixed == "random":
            visible = bases[c].metas(c) + [m for j in self.links[c] for m in bases[j].metas(j)]
            zoo = Zoo.build(visible, self.sim.input, cfg.batch_size, self.max_blocks)
            return random_chain(zoo, self.sim.budgets[c], torch.Generator().manual_seed(cfg.seed * 1000 + c))
        return bases[c].metas(c)

    def _initial_exchange(self) -> InProcessExchange:
        """Every source's modules at their (seeded) initial parameters; every client announces and connects."""
        store = {k: v for c in range(self.cfg.clients) for k, v in self._initial(c).items()}
        exchange = InProcessExchange(FEDERATION, store, self.links, self.cfg.norm_bound,
                                     ReturnScreen() if self.cfg.screen_returns else None)
        self._seen = dict.fromkeys(exchange.bytes, 0)  # traffic already reported (announcements go with the next round)
        for client in self.clients:
            client.join(exchange)
        for client in self.clients:
            client.connect(exchange)
        return exchange

    def exchange_of(self, c: int) -> InProcessExchange | PoisoningExchange:
        """The exchange as client c uses it in the model-training phase: poisoned returns for the first
        `attackers` clients under an attack."""
        if self.cfg.attack and c < self.cfg.attackers:
            return PoisoningExchange(self.exchange, self.cfg.attack)
        return self.exchange

    def begin_model_training(self) -> None:
        """The policies freeze; the modules, trained on the task in the policy phase, carry over."""
        for client in self.clients:
            client.begin_model_training()

    def _round_row(self, results: list[StepResult]) -> dict:
        moved = {k: v - self._seen[k] for k, v in self.exchange.bytes.items()}
        self._seen = dict(self.exchange.bytes)
        borrowed = self.exchange.aggregate()
        whole = 2 * sum(state_bytes(self.exchange.store[m.key]) for c, b in enumerate(self.sim.bases) for m in b.metas(c))
        return {"train_loss": statistics.fmean(r.loss for r in results), "val_accuracy": [r.accuracy for r in results],
                "chain_changes": statistics.fmean(float(r.changed) for r in results),
                "chains": [chain_keys(r.chain) for r in results],
                "decision_seconds": [r.decision_seconds for r in results],
                "peak_mib": [peak_bytes(r.chain, self.sim.input, self.cfg.batch_size) / 2**20 for r in results],
                "cap": [r.cap for r in results], "modules_returned": len(borrowed),
                "trainers_per_module": statistics.fmean(borrowed.values()) if borrowed else 0.0,
                "modules_co_trained": sum(n > 1 for n in borrowed.values()),
                "bytes": {**moved, "whole_models": whole}, "rejected": dict(self.exchange.rejected)}

    def policy_round(self, r: int, train_cfg: TrainConfig) -> dict:
        sim = self.sim
        results = [client.step(r, sim.task_loaders(c, r), self.exchange, train_cfg, sim.probe, explore=True)
                   for c, client in enumerate(self.clients)]
        row = self._round_row(results)
        advice: list[CriticAdvice | None] = [None] * len(results)
        if self.server is not None:
            t0 = time.perf_counter()
            reports = [_wire(res.report, PolicyReport) for res in results]
            sent, stats = self.server.step(reports)
            advice = [_wire(a, CriticAdvice) for a in sent]
            row.update(stats, critic_seconds=time.perf_counter() - t0)
        t0 = time.perf_counter()
        learned = [client.learn(res, adv) for client, res, adv in zip(self.clients, results, advice)]
        row["policy_update_seconds"] = (time.perf_counter() - t0) / len(results)
        row.update({k: [x[k] for x in learned] for k in ("reward", "exp", "share")},
                   actor_loss=statistics.fmean(x["actor_loss"] for x in learned),
                   advantage=statistics.fmean(x["advantage"] for x in learned),
                   advantage_abs=statistics.fmean(abs(x["advantage"]) for x in learned))
        return row

    def train_round(self, r: int, t: int, train_cfg: TrainConfig, score: Callable[[int, nn.Module], None]) -> dict:
        """Model-training round r (the t-th of the phase): execute, train on the task, aggregate."""
        sim = self.sim
        results = [client.step(r, sim.task_loaders(c, r, t), self.exchange_of(c), train_cfg, sim.probe, explore=False)
                   for c, client in enumerate(self.clients)]
        for c, res in enumerate(results):
            score(c, res.model)
        return self._round_row(results)

    def chain(self, c: int) -> list:
        chain = self.clients[c].chain
        assert chain is not None
        return chain

    def model(self, c: int) -> nn.Sequential:
        """The model client c keeps after this round: its chain as it trained it this round (Algorithm 2's scored
        model, JigsawClient.trained_model), or its local path where the guard prefers it (JigsawClient.keep)."""
        client, shard = self.clients[c], self.sim.shards[c]
        return client.keep(client.trained_model(), shard.val(), shard.own_train())

    def describe(self, c: int) -> list[str]:
        """A chain as module names: c3.m1 = client 3's module 1 (with its type and output channels)."""
        return [f"{m.key}:{m.type}>{m.d_out[0]}" for m in self.chain(c)]

    def state(self) -> dict[str, torch.Tensor]:
        return {f"{key}/{k}": v for key, st in self.exchange.store.items() for k, v in st.items()}

    def policies(self) -> dict[str, torch.Tensor]:
        """Every client's policy (`c{i}/...`) and CoRe-Tune's critic (`critic/...`), for the checkpoint."""
        flat = {f"c{c}/{k}": v for c, client in enumerate(self.clients) if client.agent
                for k, v in client.agent.policy.state_dict().items()}
        if self.server is not None:
            flat.update({f"critic/{k}": v for k, v in self.server.critic.critic.state_dict().items()})
        return flat

    def policy_parameters(self) -> tuple[int, int]:
        agent = self.clients[0].agent
        actor = sum(p.numel() for p in agent.policy.parameters()) if agent else 0
        critic = sum(p.numel() for p in self.server.critic.critic.parameters()) if self.server else 0
        return actor, critic


class WidthFederation:
    """The partial-training baselines: every client trains the widest window of the largest base model that
    fits its budget, at the prefix (HeteroFL) or rolling by one index per round (FedRolex)."""

    def __init__(self, sim: "JigsawSimulator", method: JigsawMethod) -> None:
        self.sim, self.method, cfg = sim, method, sim.cfg
        self.global_base = max(sim.bases_available, key=lambda b: peak_bytes(b.metas(0), b.input, cfg.batch_size))
        torch.manual_seed(cfg.seed)
        self.global_state = module_state(build_model(self.global_base.metas(0)))
        t0 = time.perf_counter()
        self.widths = [width_for_budget(self.global_base, b, cfg.batch_size) for b in sim.budgets]
        self.width_seconds = (time.perf_counter() - t0) / cfg.clients
        self.offset = 0

    def train_round(self, r: int, t: int, train_cfg: TrainConfig, score: Callable[[int, nn.Module], None]) -> dict:
        sim, cfg = self.sim, self.sim.cfg
        self.offset = t if self.method.rolling else 0
        steps = [train_window(self.global_state, self.global_base, g, self.offset, sim.task_loaders(c, r).train, train_cfg)
                 for c, g in enumerate(self.widths)]
        for c, st in enumerate(steps):
            score(c, st.model)
        self.global_state = aggregate_windows(self.global_state, [(st.values, st.windows) for st in steps])
        sent = sum(state_bytes(st.values) for st in steps)
        return {"train_loss": statistics.fmean(st.result.loss for st in steps), "widths": self.widths,
                "decision_seconds": [self.width_seconds + st.cut_seconds for st in steps],
                "peak_mib": [peak_bytes(scaled_metas(self.global_base, g), sim.input, cfg.batch_size) / 2**20 for g in self.widths],
                "bytes": {"down": sent, "up": sent, "whole_models": 2 * state_bytes(self.global_state) * cfg.clients}}

    def model(self, c: int) -> nn.Sequential:
        model = build_model(scaled_metas(self.global_base, self.widths[c]))
        load_module_state(model, extract_state(self.global_state, submodel_windows(self.global_base, self.widths[c], self.offset)))
        return model

    def describe(self, c: int) -> list[str]:
        metas = scaled_metas(self.global_base, self.widths[c])
        return [f"{self.global_base.name}x{self.widths[c]}:{m.type}>{m.d_out[0]}" for m in metas]

    def state(self) -> dict[str, torch.Tensor]:
        return self.global_state

    def policies(self) -> dict[str, torch.Tensor]:
        return {}

    def policy_parameters(self) -> tuple[int, int]:
        return 0, 0


def _save_tensors(path: Path, flat: dict[str, torch.Tensor]) -> None:
    atomic_write(path, lambda tmp: save_file({k: v.contiguous() for k, v in flat.items()}, tmp))


# -- the simulator ------------------------------------------------------------------------------------

class JigsawSimulator:
    """One federation of `cfg.clients` clients running `cfg.method`: policy phase (if any), then `cfg.rounds`."""

    def __init__(self, cfg: JigsawConfig) -> None:
        self.method = get_method(cfg.method)
        self.cfg = cfg
        self.bases_available = [load_base(a) for a in cfg.archs]
        shapes, shape = {b.input for b in self.bases_available}, tuple(get_dataset_info(cfg.dataset).shape)
        if shapes != {shape}:  # checked before loading any data
            raise ValueError(f"{cfg.dataset} images are {shape} but the architectures "
                             f"expect {sorted(shapes)}: use cnn-* for 28x28 and vgg-* for 32x32 datasets")
        self.input = self.bases_available[0].input
        self.budgets = device_budgets(self.bases_available, cfg.clients, cfg.batch_size, cfg.budget_headroom, cfg.seed)
        self.bases = [base_for_budget(self.bases_available, b, cfg.batch_size) for b in self.budgets]
        self.train = load_dataset(cfg.dataset, cfg.data_root, train=True)
        self.test = load_dataset(cfg.dataset, cfg.data_root, train=False)
        self.data, self.probe = client_data(self.train, self.test, cfg.shards())
        self.shards = [ClientShard(c, d, self.train, self.test, cfg.shards()) for c, d in enumerate(self.data)]
        self.train_cfg = TrainConfig(lr=cfg.lr, batch_size=cfg.batch_size, local_epochs=cfg.local_epochs,
                                     milestones=tuple(cfg.milestones))
        self.fed: ModuleFederation | WidthFederation = (ModuleFederation(self, self.method) if self.method.family == "modules"
                                                        else WidthFederation(self, self.method))

    @property
    def policy_rounds(self) -> int:
        return self.cfg.policy_rounds if self.method.assemble else 0

    def task_loaders(self, c: int, r: int, t: int | None = None) -> Loaders:
        return self.shards[c].task(r, t)

    def evaluate(self) -> list[float]:
        return [shard.score(self.fed.model(c)) for c, shard in enumerate(self.shards)]

    def _rounds(self) -> Iterator[dict]:
        """Every round's metrics row, policy phase first."""
        cfg, fed = self.cfg, self.fed
        for r in range(self.policy_rounds):
            assert isinstance(fed, ModuleFederation)
            yield {"round": r, "phase": "policy", **fed.policy_round(r, self.train_cfg)}
        if isinstance(fed, ModuleFederation) and self.policy_rounds:
            fed.begin_model_training()
        for t in range(cfg.rounds):
            r = self.policy_rounds + t
            scoring = t == cfg.rounds - 1 or bool(cfg.eval_every and (t + 1) % cfg.eval_every == 0)
            trained: list[float] = []

            def score(c: int, model: nn.Module) -> None:
                if scoring:
                    trained.append(evaluate(model, self.shards[c].local_test())[0])

            train_cfg = self.train_cfg.for_round(t, cfg.rounds)
            row = {"round": r, "phase": "train", "train_round": t, "lr": train_cfg.lr}
            row.update(fed.train_round(r, t, train_cfg, score))
            if scoring:
                accs = self.evaluate()
                row.update(trained_accuracy=trained, trained_mean=statistics.fmean(trained), trained_std=statistics.pstdev(trained),
                           accuracy=accs, mean=statistics.fmean(accs), std=statistics.pstdev(accs),
                           architectures=[fed.describe(c) for c in range(cfg.clients)])
                if isinstance(fed, ModuleFederation):
                    row["kept_local"] = [client.kept_local for client in fed.clients]
            yield row

    def run(self, on_round: Callable[[dict], None] | None = None) -> JigsawResult:
        cfg = self.cfg
        out = Path(cfg.out) if cfg.out else None
        if out:
            out.mkdir(parents=True, exist_ok=True)
            (out / "metrics.jsonl").unlink(missing_ok=True)
            atomic_write_text(out / "config.json", json.dumps(asdict(cfg), indent=2))
        t0 = time.perf_counter()
        rows: list[dict] = []
        accs: list[float] = []
        for row in self._rounds():
            t1 = time.perf_counter()
            row.update(method=cfg.method, seconds=t1 - t0)
            accs = row.get("accuracy", accs)
            rows.append(row)
            if out:
                append_metrics(out, row)
            if on_round:
                on_round(row)
        if out:
            self.save(out / "checkpoint", accs)
        return JigsawResult(accs, statistics.fmean(accs), statistics.pstdev(accs), time.perf_counter() - t0, rows,
                            [self.fed.describe(c) for c in range(cfg.clients)])

    def save(self, directory: Path, accs: list[float]) -> None:
        """The checkpoint layout of `aggregator simulate` (state.safetensors + meta.json), plus the methods with a
        policy's policies and critic (policies.safetensors), each written atomically."""
        directory.mkdir(parents=True, exist_ok=True)
        _save_tensors(directory / STATE_FILE, self.fed.state())
        if policies := self.fed.policies():
            _save_tensors(directory / POLICY_FILE, policies)
        meta = {"round": self.policy_rounds + self.cfg.rounds - 1, "method": self.cfg.method, "accuracy": accs,
                "architectures": [self.fed.describe(c) for c in range(self.cfg.clients)],
                "bases": [b.name for b in self.bases], "budgets_mib": [b / 2**20 for b in self.budgets]}
        atomic_write_text(directory / META_FILE, json.dumps(meta, indent=2))
