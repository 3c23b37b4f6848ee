"""CoRe-Tune: the server's step during the policy phase: the centralized critic V(h, Z) and the Exp term.

During the phase each client sends the server a `PolicyReport`: its chain, its accuracy and capacity
terms, how many images it trained on, its data feature E_data (the task-trained model's mean output on the
shared probe images: it reflects the client's label skew, never its labels or data) and its observation per
decision step h_t (the E_data of its model before this round, the tokens of what it had assembled, the prefix
length: only what existed before the action, so the critic's baseline cannot depend on the actions it judges).
The server computes every client's Exp (the paper's formula over all reports) and co-training credit (below),
trains the critic on the clients' Monte-Carlo returns and answers each client with a `CriticAdvice`: its Exp,
its credit and, once the critic has had
`warmup_rounds` of training, the critic's values for its steps, so the advantage is r_t - V. Before that
the values of an untrained critic would turn REINFORCE into reinforcing whatever was sampled, so the
clients keep their own running-mean baseline. After the phase the server is gone (decentralized execution).

The co-training credit is not the paper's. Exp rewards clients with similar data for using different modules,
which works against Eq. 2 ever averaging more than one copy; a client with a few dozen images gains most from
modules (and a head) that others train too. So the server adds, per client, `share_weight` x min(1,
`scarce_samples` / its training images) x the mean architectural overlap cos(E_arch_i, E_arch_j) with the
other clients: the less data a client holds, the more a shared chain is worth to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from nefl.jigsaw.policy import TOKEN_FEATURES, returns, terminal_reward
from nefl.jigsaw.symbio import ClientIndex
from nefl.protocol.messages import Message, Name, Round

MAX_REPORT_BYTES = 256 * 1024
Unit = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Feature = Annotated[float, msgspec.Meta(ge=-1e6, le=1e6)]
Vector = Annotated[list[Feature], msgspec.Meta(max_length=4096)]
ModuleKey = tuple[Annotated[int, msgspec.Meta(ge=0, le=1 << 20)], Annotated[int, msgspec.Meta(ge=0, le=1024)]]


class PolicyReport(Message, frozen=True, tag="jigsaw_report", tag_field="type"):
    """Client -> server, policy phase: what the critic and Exp need of one client's round."""

    federation: Name
    client: ClientIndex
    round: Round
    accuracy: Unit
    cap: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)]
    samples: Annotated[int, msgspec.Meta(ge=1, le=10**9)]  # images it trained on (as a ModuleReturn carries)
    data_feature: Vector  # E_data: the trained model's mean output on the shared probe
    chain: Annotated[list[ModuleKey], msgspec.Meta(max_length=64)]  # (source, position) of each module, head last
    observations: Annotated[list[Vector], msgspec.Meta(min_length=1, max_length=64)]  # h_t per decision step, pre-action


class CriticAdvice(Message, frozen=True, tag="jigsaw_advice", tag_field="type"):
    """Server -> one client: its Exp term and (after the critic's warm-up) the critic's value per step."""

    federation: Name
    client: ClientIndex
    round: Round
    exp: Annotated[float, msgspec.Meta(ge=-1.0, le=1.0)]
    share: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0  # the co-training credit (module docstring)
    values: Annotated[list[Feature], msgspec.Meta(max_length=64)] | None = None


def observation(data_feature: torch.Tensor, state: torch.Tensor, max_blocks: int) -> torch.Tensor:
    """h_t of one client: its E_data from before the round, the mean token of the assembled prefix, prefix length."""
    pooled = state.mean(0) if state.shape[0] else torch.zeros(TOKEN_FEATURES)
    return torch.cat([data_feature.float(), pooled, torch.tensor([state.shape[0] / max_blocks])])


class Critic(nn.Module):
    """V(h_i, Z): client i's embedded observation attends over every client's observation at that step."""

    def __init__(self, obs_dim: int, d_model: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(obs_dim, d_model), nn.ReLU())
        self.attn = nn.MultiheadAttention(d_model, heads, batch_first=True)
        self.value = nn.Sequential(nn.Linear(2 * d_model, d_model), nn.ReLU(), nn.Linear(d_model, 1))

    def forward(self, own: torch.Tensor, everyone: torch.Tensor) -> torch.Tensor:
        """own [B, obs], everyone [B, N, obs] -> values [B]."""
        e_own, e_all = self.embed(own), self.embed(everyone)
        ctx, _ = self.attn(e_own.unsqueeze(1), e_all, e_all)
        return self.value(torch.cat([e_own, ctx.squeeze(1)], -1)).squeeze(-1)


def joint_observations(per_client: Sequence[torch.Tensor]) -> torch.Tensor:
    """Z: per client [T_i, obs] -> [max T, N, obs]; a client that stopped earlier repeats its last observation."""
    steps = max(o.shape[0] for o in per_client)
    padded = [torch.cat([o, o[-1:].expand(steps - o.shape[0], -1)]) for o in per_client]
    return torch.stack(padded, 1)


class ServerCritic:
    """The critic with its optimiser: `values` for the advantages, `update` on the observed returns."""

    def __init__(self, obs_dim: int, lr: float = 1e-3, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.critic = Critic(obs_dim)
        self.opt = torch.optim.Adam(self.critic.parameters(), lr=lr)

    def _batch(self, per_client: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        z = joint_observations(per_client)
        own = torch.cat([o for o in per_client])
        everyone = torch.cat([z[: o.shape[0]] for o in per_client])
        return own, everyone

    @torch.no_grad()
    def values(self, per_client: Sequence[torch.Tensor]) -> list[list[float]]:
        own, everyone = self._batch(per_client)
        flat = self.critic(own, everyone).tolist()
        out, i = [], 0
        for o in per_client:
            out.append(flat[i:i + o.shape[0]])
            i += o.shape[0]
        return out

    def update(self, per_client: Sequence[torch.Tensor], targets: Sequence[Sequence[float]]) -> float:
        own, everyone = self._batch(per_client)
        target = torch.tensor([r for t in targets for r in t], dtype=torch.float32)
        loss = F.mse_loss(self.critic(own, everyone), target)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return float(loss.detach())


def arch_features(chains: Sequence[Sequence[tuple[int, int]]]) -> list[torch.Tensor]:
    """E_arch per chain: which modules (by source and position) it uses, multi-hot over the modules any of
    the chains uses, so two clients' architectures are similar exactly when they share modules."""
    keys = sorted({k for chain in chains for k in chain})
    return [torch.tensor([float(k in set(chain)) for k in keys]) for chain in chains]


def exploration_bonus(data_features: Sequence[torch.Tensor], arch_features: Sequence[torch.Tensor]) -> list[float]:
    """The paper's Exp^(i) = mean over j != i of cos(E_data^i, E_data^j) * (1 - cos(E_arch^i, E_arch^j))."""
    n = len(data_features)
    if n < 2:
        return [0.0] * n
    d = F.normalize(torch.stack([f.float() for f in data_features]), dim=1)
    a = F.normalize(torch.stack([f.float() for f in arch_features]), dim=1)
    pair = (d @ d.T) * (1 - a @ a.T)
    pair.fill_diagonal_(0)
    return (pair.sum(1) / (n - 1)).clamp(-1.0, 1.0).tolist()


def co_training_credit(arch_features: Sequence[torch.Tensor], samples: Sequence[int], weight: float,
                       scarce_samples: int) -> list[float]:
    """Per client weight x min(1, scarce_samples / samples_i) x mean over j != i of cos(E_arch^i, E_arch^j)."""
    n = len(arch_features)
    if n < 2 or weight == 0:
        return [0.0] * n
    a = F.normalize(torch.stack([f.float() for f in arch_features]), dim=1)
    overlap = a @ a.T
    overlap.fill_diagonal_(0)
    mean = (overlap.sum(1) / (n - 1)).tolist()
    return [min(1.0, weight * min(1.0, scarce_samples / k) * o) for o, k in zip(mean, samples)]


class CoReTune:
    """The server's step: reports of one round in, one advice per client out, the critic trained on the way."""

    def __init__(self, federation: str, obs_dim: int, alpha: float, beta: float, gamma: float, warmup_rounds: int,
                 share_weight: float = 0.0, scarce_samples: int = 1, lr: float = 1e-3, seed: int = 0) -> None:
        self.federation, self.alpha, self.beta, self.gamma = federation, alpha, beta, gamma
        self.share_weight, self.scarce_samples = share_weight, scarce_samples
        self.warmup_rounds = warmup_rounds
        self.critic = ServerCritic(obs_dim, lr=lr, seed=seed)
        self.rounds_trained = 0

    def step(self, reports: Sequence[PolicyReport]) -> tuple[list[CriticAdvice], dict]:
        """Exp and the co-training credit for every client, the critic's values (once warm), one critic update on
        this round's returns."""
        archs = arch_features([r.chain for r in reports])
        exp = exploration_bonus([torch.tensor(r.data_feature) for r in reports], archs)
        share = co_training_credit(archs, [r.samples for r in reports], self.share_weight, self.scarce_samples)
        obs = [torch.tensor(r.observations, dtype=torch.float32) for r in reports]
        targets = [returns(terminal_reward(r.accuracy, e, r.cap, self.alpha, self.beta, c), len(r.observations), self.gamma)
                   for r, e, c in zip(reports, exp, share)]
        warm = self.rounds_trained >= self.warmup_rounds
        values = self.critic.values(obs)
        loss = self.critic.update(obs, targets)
        self.rounds_trained += 1
        advice = [CriticAdvice(federation=self.federation, client=r.client, round=r.round, exp=e, share=c,
                               values=v if warm else None) for r, e, c, v in zip(reports, exp, share, values)]
        flat_v, flat_t = [x for v in values for x in v], [x for t in targets for x in t]
        stats = {"critic_loss": loss, "critic_warm": warm, "critic_value": sum(flat_v) / len(flat_v),
                 "critic_return": sum(flat_t) / len(flat_t),
                 "critic_abs_error": sum(abs(v - t) for v, t in zip(flat_v, flat_t)) / len(flat_t)}
        return advice, stats
