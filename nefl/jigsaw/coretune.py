"""CoRe-Tune: the server's centralized critic V(h, Z) for the policy-training phase, and the Exp term.

During the (optional) phase each client sends the server its observation per decision step: its data
feature on the task-agnostic proxy set (never its label histogram or data) and the metadata of what it
has assembled so far. The critic embeds each observation, attends from client i's observation over all
clients' observations of the same step (Z_t), and predicts the Monte-Carlo return; the clients' advantage
is return - V. After the phase the server is gone and every client falls back to its own running-mean
baseline (decentralized execution).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from nefl.jigsaw.policy import META_FEATURES, meta_features
from nefl.jigsaw.zoo import ModuleMeta


def observation(proxy_feature: torch.Tensor, assembled: Sequence[ModuleMeta], client: int, max_blocks: int) -> torch.Tensor:
    """h_t of one client: proxy-set data feature, mean metadata features of the prefix, prefix length."""
    feats = torch.tensor([meta_features(m, client) for m in assembled]).reshape(len(assembled), META_FEATURES)
    pooled = feats.mean(0) if len(assembled) else torch.zeros(META_FEATURES)
    return torch.cat([proxy_feature.float(), pooled, torch.tensor([len(assembled) / max_blocks])])


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


def arch_feature(metas: Sequence[ModuleMeta], all_keys: Sequence[str]) -> torch.Tensor:
    """E_arch: which modules (by source and position) an assembled model uses, as a multi-hot vector,
    so two clients' architectures are similar exactly when they share modules."""
    chosen = {m.key for m in metas}
    return torch.tensor([float(k in chosen) for k in all_keys])


def exploration_bonus(data_features: Sequence[torch.Tensor], arch_features: Sequence[torch.Tensor]) -> list[float]:
    """The paper's Exp^(i) = mean over j != i of cos(E_data^i, E_data^j) * (1 - cos(E_arch^i, E_arch^j))."""
    n = len(data_features)
    if n < 2:
        return [0.0] * n
    d = F.normalize(torch.stack([f.float() for f in data_features]), dim=1)
    a = F.normalize(torch.stack([f.float() for f in arch_features]), dim=1)
    pair = (d @ d.T) * (1 - a @ a.T)
    pair.fill_diagonal_(0)
    return (pair.sum(1) / (n - 1)).tolist()
