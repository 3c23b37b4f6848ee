"""FedJigsaw's client step: observe, assemble, train, return the modules; and the policy's learning step.

A `JigsawClient` holds only what a device holds: its id, base architecture, memory budget, its own data
feature (the label histogram of its task data, never sent), its policy, its observation log and its
current chain. What it needs of other clients comes through a `ModuleExchange` (their announced metadata,
the parameters of the modules it fetches; trained copies go back the same way); what it needs of the server
during the policy phase comes as a `CriticAdvice`; its data come in as loaders. The simulator only
orchestrates, and a device can drive the same step over a broker.

Two phases, as the paper's schedule (Algorithm 2), both on the client's task data, the modules carried from one
into the other:
- policy (`explore=True`): sample a chain at temperature 1, train it on the task shard, score it on the held-out
  validation split (the reward), report to the server, learn.
- model training (`explore=False`): execution. The policy is frozen and decodes greedily (or at a low
  temperature). The client switches to the decoded chain only when the policy has preferred that same chain,
  under its observations of each round, by more than `switch_cost` nats for every round the current chain
  has been trained (log pi(new) - log pi(current) > switch_cost x (1 + rounds trained)) in `switch_patience`
  consecutive rounds, and never to a chain it has left in this phase. A module trained in one chain is worth
  most there, the more so the longer it was trained there; a round's preference can be noise (the accuracy
  the observations carry is scored on a few dozen validation images); and the observations of the modules a
  client stops using keep changing, so a frozen policy can come to prefer the old chain again.
A client without a policy (`assemble=False`) trains a fixed chain every round: its base model (local only) or the
chain it is given (the fixed-chain ablations).

The guard (`ClientSettings.guard`, given the base model's starting parameters): beside its chain the client trains
a private copy of its base model on its task data in every model-training round (its local path; never sent, so the
base model the neighbours borrow from stays the paper's passive repository): from the base model's start, on the
batches a local-only client trains on in the same model-training round, so it is local-only training bit for bit
and falling back costs nothing against training alone. The model it keeps is its chain as it trained it in the
round (from the modules as their sources averaged them the round before: `trained_model`, what Algorithm 2 scores)
when the chain scores better on the validation split by more than the split's noise (`clearly_better`), else its
local path; the modules keep being shared either way. Under label skew an average of
copies trained on other labels (a shared head above all) can score below what the client learns alone, and a short
policy phase can leave a chain worse than the base model: the paper's reward (validation accuracy) is what tells the
two apart, here applied to the deployed model.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from nefl.jigsaw.coretune import CriticAdvice, PolicyReport, observation
from nefl.jigsaw.observations import ObservationLog
from nefl.jigsaw.policy import PolicyAgent, Episode, TokenFn, assemble, chain_log_prob, terminal_reward, tokens_for
from nefl.jigsaw.symbio import MetadataBroadcast, ModuleExchange, ModuleFetch, ModuleReturn
from nefl.jigsaw.zoo import BaseArch, ModuleMeta, Zoo, build_model, fixed_bytes, peak_bytes
from nefl.nested.state import load_module_state
from nefl.nested.train import Batches, TrainConfig, evaluate, local_train, recompute_bn_stats


@dataclass(frozen=True)
class ClientSettings:
    """The knobs of a client's policy and schedule (the simulator fills them from its JigsawConfig)."""

    federation: str
    max_blocks: int
    batch_size: int
    alpha: float  # reward weight of Acc (1 - alpha: Exp)
    beta: float  # reward weight of Cap
    gamma: float  # discount of the Monte-Carlo returns
    tau: float  # pointer temperature
    policy_lr: float
    execution_temperature: float  # 0: greedy
    switch_cost: float  # nats per round trained the policy must prefer a new chain by before the client switches
    switch_patience: int  # consecutive rounds it must do so
    observation_decay: float
    guard: bool  # keep a local path beside the chain; deploy it unless the chain scores clearly better
    common_prior: float | None = None  # the policies' starting logit bonus for the common chain (AttenAssemble); None: off


GUARD_Z = 2.0  # the chain is kept when it beats the local path on validation by this many standard errors


@dataclass
class Loaders:
    """A client's data for one step: what it trains on and what it scores the trained chain on."""

    train: Batches
    val: Batches
    alone: Batches | None = None  # the guard's local path's batches (model training only: ClientShard.task)


@dataclass
class StepResult:
    round: int
    chain: list[ModuleMeta]
    changed: bool  # the chain differs from the one the client trained in its previous step
    accuracy: float  # on the validation loader, right after local training
    loss: float
    samples: int
    cap: float  # the chain's share of the client's memory budget (the paper's Cap)
    decision_seconds: float
    model: nn.Sequential  # the trained model, before its modules went back
    episode: Episode | None
    report: PolicyReport | None  # for the server, in the policy phase


@torch.no_grad()
def probe_feature(model: nn.Module, probe: torch.Tensor) -> torch.Tensor:
    """E_data: a task-trained model's mean class probabilities on the shared probe images. A model trained on
    skewed labels predicts its frequent classes more often, so clients with alike label skews get alike E_data."""
    return model.eval()(probe).softmax(1).mean(0)


@torch.no_grad()
def hits(model: nn.Module, batches: Batches) -> torch.Tensor:
    """Per image of `batches`, in order: whether the model classifies it right."""
    model.eval()
    return torch.cat([model(x).argmax(1) == y for x, y in batches])


def clearly_better(a: torch.Tensor, b: torch.Tensor, z: float) -> bool:
    """Whether hits `a` beat hits `b` on the same images by more than z standard errors of the paired difference
    (McNemar's: only the images exactly one of the two gets right count). On a 200-image split two models of equal
    accuracy differ by a few images by chance, and the guard must not trade its local path for that."""
    wins, losses = int((a & ~b).sum()), int((~a & b).sum())
    return wins - losses > z * math.sqrt(wins + losses)


def chain_keys(chain: list[ModuleMeta] | None) -> list[str]:
    return [m.key for m in chain] if chain else []


class JigsawClient:
    def __init__(self, client: int, base: BaseArch, budget: float, data_feature: torch.Tensor, settings: ClientSettings,
                 seed: int, assemble: bool = True, policy_seed: int | None = None,
                 chain: Sequence[ModuleMeta] | None = None, base_start: dict[str, dict[str, torch.Tensor]] | None = None) -> None:
        """`seed` drives the client's sampling; `policy_seed` (default `seed`) initialises its policy, so clients
        given the same one start from the same policy; `chain` is the fixed chain of a client without a policy;
        `base_start` (module key -> parameters) the base model's starting point, from which the guard's local path
        starts when `settings.guard` is on."""
        fixed = list(chain) if chain is not None else base.metas(client)
        if peak_bytes(base.metas(client), base.input, settings.batch_size) > budget:
            raise ValueError(f"client {client}: its base model {base.name} does not fit its budget of {budget / 2**20:.1f} MiB")
        if not assemble and peak_bytes(fixed, base.input, settings.batch_size) > budget:
            raise ValueError(f"client {client}: the fixed chain does not fit its budget of {budget / 2**20:.1f} MiB")
        self.client, self.base, self.budget, self.settings = client, base, budget, settings
        self.data_feature = data_feature.float()
        self.agent = PolicyAgent(len(data_feature), lr=settings.policy_lr, gamma=settings.gamma, tau=settings.tau,
                                 seed=seed if policy_seed is None else policy_seed, prior=settings.common_prior) \
            if assemble else None
        self.log = ObservationLog(settings.observation_decay)
        self.chain: list[ModuleMeta] | None = None if assemble else fixed
        self.prior_feature = torch.full((base.classes,), 1.0 / base.classes)  # E_data before this round (h_t's part)
        self.held = 0  # rounds the current chain has been trained
        self.left: set[tuple[str, ...]] = set()  # chains left in this phase: never taken again
        self.pending: tuple[tuple[str, ...], int] | None = None  # a chain the policy keeps preferring, for how many rounds
        self.zoo: Zoo | None = None
        self.generator = torch.Generator().manual_seed(seed)
        self.rejected = 0  # advice refused (not for this client, round or episode)
        self.local: dict[str, torch.Tensor] | None = None  # the guard's local path: the base model trained alone
        if settings.guard and base_start is not None:
            self.local = {f"{j}.{k}": v.clone() for j, m in enumerate(base.metas(client)) for k, v in base_start[m.key].items()}
        self.kept_local = False  # the last kept model was the local path
        self.trained: dict[str, torch.Tensor] | None = None  # the chain's parameters after the last round's local training

    # -- joining ------------------------------------------------------------------------------------

    def join(self, exchange: ModuleExchange) -> None:
        """Announce the base model's modules (metadata only)."""
        exchange.broadcast(MetadataBroadcast(federation=self.settings.federation, client=self.client,
                                             modules=self.base.metas(self.client)))

    def connect(self, exchange: ModuleExchange) -> None:
        """Build the candidate zoo from the own modules and what the neighbours announced."""
        own = self.base.metas(self.client)
        peers = [m for m in exchange.catalogue(self.client) if m.source != self.client]
        self.zoo = Zoo.build(own + peers, self.base.input, self.settings.batch_size, self.settings.max_blocks)

    def begin_model_training(self) -> None:
        """Start of the model-training phase: execution decodes a chain afresh; the modules and what the client
        observed of them carry over (Algorithm 2 trains them on the task in both phases)."""
        if self.agent is not None:
            self.chain, self.held, self.pending = None, 0, None
            self.left.clear()

    # -- the client step ----------------------------------------------------------------------------

    def _choose(self, r: int, explore: bool) -> tuple[list[ModuleMeta], Episode | None, float]:
        if self.agent is None:
            assert self.chain is not None
            return self.chain, None, 0.0
        if self.zoo is None:
            raise RuntimeError(f"client {self.client}: connect() to an exchange before stepping")
        t0 = time.perf_counter()
        tokens = tokens_for(self.client, self.log, r)
        temperature = 1.0 if explore else self.settings.execution_temperature
        ep = assemble(self.agent.policy, self.zoo, tokens, self.data_feature, self.budget, self.client, temperature,
                      self.generator)
        if explore or self.chain is None:
            return ep.metas, ep, time.perf_counter() - t0
        return self._switch_or_keep(ep.metas, tokens), ep, time.perf_counter() - t0

    def _switch_or_keep(self, candidate: list[ModuleMeta], tokens: TokenFn) -> list[ModuleMeta]:
        """The execution phase's switching rule (module docstring); `pending` counts the rounds in a row the
        same candidate has cleared the cost."""
        assert self.agent is not None and self.zoo is not None and self.chain is not None
        key = tuple(chain_keys(candidate))
        cost = self.settings.switch_cost * (1 + self.held)
        if (key == tuple(chain_keys(self.chain)) or key in self.left
                or self._score(candidate, tokens) - self._score(self.chain, tokens) <= cost):
            self.pending = None
            return self.chain
        rounds = self.pending[1] + 1 if self.pending is not None and self.pending[0] == key else 1
        if rounds < self.settings.switch_patience:
            self.pending = (key, rounds)
            return self.chain
        self.pending = None
        return candidate

    def _score(self, chain: list[ModuleMeta], tokens: TokenFn) -> float:
        assert self.agent is not None and self.zoo is not None
        return chain_log_prob(self.agent.policy, self.zoo, tokens, self.data_feature, self.budget, self.client, chain)

    def step(self, r: int, loaders: Loaders, exchange: ModuleExchange, train_cfg: TrainConfig, probe: torch.Tensor,
             explore: bool) -> StepResult:
        """Choose a chain, fetch its modules, train it, score it, return every module to its source."""
        s = self.settings
        chain, episode, decision_s = self._choose(r, explore)
        changed = self.chain is not None and chain_keys(chain) != chain_keys(self.chain)
        start: dict[str, torch.Tensor] = {}
        for j, m in enumerate(chain):
            got = exchange.fetch(ModuleFetch(federation=s.federation, client=self.client, source=m.source, round=r,
                                             position=m.position))
            start.update({f"{j}.{k}": v for k, v in got.items()})
        if loaders.alone is not None:
            self._train_local(loaders.alone, train_cfg)
        model = build_model(chain)
        res = local_train(model, start, loaders.train, train_cfg)
        trained = {k: start[k] + res.delta[k] for k in start}
        load_module_state(model, trained)
        accuracy = evaluate(model, loaders.val)[0]
        for j, m in enumerate(chain):
            part = {k.split(".", 1)[1]: v for k, v in trained.items() if k.split(".", 1)[0] == str(j)}
            exchange.give_back(ModuleReturn(federation=s.federation, client=self.client, source=m.source, round=r,
                                            position=m.position, samples=res.num_samples), part)
        self.log.record(chain_keys(chain), accuracy, r)
        if changed:
            self.left.add(tuple(chain_keys(self.chain)))
        self.held = 1 if changed or self.chain is None else self.held + 1
        self.chain, self.trained = chain, trained  # together: a step cut short leaves the last whole pair
        fixed = fixed_bytes(self.base.input, s.batch_size)
        cap = (peak_bytes(chain, self.base.input, s.batch_size) - fixed) / (self.budget - fixed)
        report = self._report(r, episode, accuracy, cap, res.num_samples, model, probe) \
            if explore and episode is not None else None
        return StepResult(r, chain, changed, accuracy, res.loss, res.num_samples, cap, decision_s, model, episode, report)

    def _train_local(self, batches: Batches, train_cfg: TrainConfig) -> None:
        """The guard's local path: one more round of the base model on the task data, alone."""
        if self.local is None:
            return
        res = local_train(build_model(self.base.metas(self.client)), self.local, batches, train_cfg)
        self.local = {k: v + res.delta[k] for k, v in self.local.items()}

    def local_model(self) -> nn.Sequential | None:
        """The guard's local path as a model, or None without the guard."""
        if self.local is None:
            return None
        model = build_model(self.base.metas(self.client))
        load_module_state(model, self.local)
        return model

    def trained_model(self) -> nn.Sequential:
        """The chain as this client trained it in its last round, from the modules as their sources averaged them
        the round before, on its own data: the model Algorithm 2 scores (lines 7-9), personalised, and what the
        client deploys. Its copies of the modules still go back to their sources to be averaged."""
        if self.chain is None or self.trained is None:
            raise RuntimeError(f"client {self.client}: no round trained yet")
        model = build_model(self.chain)
        load_module_state(model, self.trained)
        return model

    def keep(self, shared: nn.Sequential, val: Batches, own: Batches) -> nn.Sequential:
        """The model the client keeps after a round: `shared` (its chain, as `trained_model` gives it) where it is
        clearly better than the guard's local path on the validation split, else the local path.
        Both get their BatchNorm statistics recomputed on the client's own training data first, as deployed."""
        recompute_bn_stats(shared, own)
        local = self.local_model()
        self.kept_local = False
        if local is None:
            return shared
        recompute_bn_stats(local, own)
        self.kept_local = not clearly_better(hits(shared, val), hits(local, val), GUARD_Z)
        return local if self.kept_local else shared

    def _report(self, r: int, episode: Episode, accuracy: float, cap: float, samples: int, model: nn.Module,
                probe: torch.Tensor) -> PolicyReport:
        """For the server: the new E_data (for Exp) and h_t per decision, built from the E_data the client had
        before this round (the critic's baseline must not see what the actions led to)."""
        feature = probe_feature(model, probe)
        obs = [observation(self.prior_feature, st.state, self.settings.max_blocks).tolist() for st in episode.steps]
        self.prior_feature = feature
        return PolicyReport(federation=self.settings.federation, client=self.client, round=r, accuracy=accuracy,
                            cap=min(cap, 100.0), samples=samples, data_feature=feature.tolist(),
                            chain=[(m.source, m.position) for m in episode.metas], observations=obs)

    # -- the policy's learning step -----------------------------------------------------------------

    def learn(self, result: StepResult, advice: CriticAdvice | None) -> dict:
        """One REINFORCE step on the round's reward; the advice supplies Exp and the critic's values. Advice
        for another client, round or number of steps is refused and the client learns on its own baseline."""
        assert self.agent is not None and result.episode is not None
        steps = len(result.episode.steps)
        if advice is not None and (advice.client != self.client or advice.round != result.round
                                   or (advice.values is not None and len(advice.values) != steps)):
            self.rejected += 1
            advice = None
        exp, share = (advice.exp, advice.share) if advice is not None else (0.0, 0.0)
        values = advice.values if advice is not None else None
        reward = terminal_reward(result.accuracy, exp, result.cap, self.settings.alpha, self.settings.beta, share)
        loss, advantage = self.agent.update(result.episode, reward, values)
        return {"reward": reward, "exp": exp, "share": share, "actor_loss": loss, "advantage": advantage, "critic_values": values is not None}
