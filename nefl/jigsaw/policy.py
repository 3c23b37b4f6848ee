"""AttenAssemble: the attention-based pointer-network actor that assembles a model module by module.

The state is a token sequence [CLS = local data feature, assembled modules..., candidates..., STOP];
a small Transformer encoder reads it, the CLS output is the query, and a scaled query-key product over
the candidate tokens (temperature tau) is the action distribution. Invalid candidates are masked out
of both the attention and the softmax, so any number of candidates works and a masked token cannot
move the probabilities of the valid ones. Trained with REINFORCE on the paper's terminal reward.

Kept small on purpose (d_model 32, one encoder layer, about 13k parameters): the policy runs on the
device, on a CPU, beside local training.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from nefl.jigsaw.zoo import TYPES, ModuleMeta, Zoo

META_FEATURES = 12  # type one-hot (4), convs, log-dims in/out (4), position, own-module flag, STOP flag


def meta_features(meta: ModuleMeta | None, client: int) -> list[float]:
    """What the policy sees of a module: its metadata only (never parameters). None is STOP."""
    if meta is None:
        return [0.0] * (META_FEATURES - 1) + [1.0]
    kind = [float(meta.kind == t) for t in TYPES]
    convs = int(meta.type.split("-")[1]) if meta.kind == "stage" else float(meta.kind == "conv")
    dims = [math.log2(meta.d_in[0]) / 10, math.log2(meta.d_in[1]) / 5, math.log2(meta.d_out[0]) / 10, math.log2(meta.d_out[1]) / 5]
    return kind + [convs / 4] + dims + [meta.position / 10, float(meta.source == client), 0.0]


class AttenAssemble(nn.Module):
    """pi(a | s) = softmax(q W_Q (K W_K)^T / (tau sqrt(d))) over the valid candidate tokens."""

    def __init__(self, data_dim: int, d_model: int = 32, heads: int = 2, layers: int = 1, tau: float = 1.0,
                 max_len: int = 16) -> None:
        super().__init__()
        self.d_model, self.tau = d_model, tau
        self.data_enc = nn.Linear(data_dim, d_model)
        self.meta_enc = nn.Sequential(nn.Linear(META_FEATURES, d_model), nn.ReLU(), nn.Linear(d_model, d_model))
        self.segment = nn.Embedding(3, d_model)  # 0 CLS, 1 assembled state, 2 candidate
        self.order = nn.Embedding(max_len, d_model)  # position of a state token in the assembly
        layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=2 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.w_q = nn.Linear(d_model, d_model, bias=False)
        self.w_k = nn.Linear(d_model, d_model, bias=False)

    def logits(self, data: torch.Tensor, state: torch.Tensor, candidates: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """data [data_dim], state [N, F], candidates [K, F], valid [K] bool -> logits [K], -inf where invalid."""
        if not bool(valid.any()):
            raise ValueError("no valid action: the zoo's valid-action rule should never allow this")
        n = state.shape[0]
        cls = self.data_enc(data).unsqueeze(0) + self.segment.weight[0]
        st = self.meta_enc(state) + self.segment.weight[1] + self.order(torch.arange(n)) if n else state.new_zeros(0, self.d_model)
        cand = self.meta_enc(candidates) + self.segment.weight[2]
        seq = torch.cat([cls, st, cand]).unsqueeze(0)
        ignore = torch.cat([torch.zeros(1 + n, dtype=torch.bool), ~valid]).unsqueeze(0)
        h = self.encoder(seq, src_key_padding_mask=ignore)[0]
        q, keys = self.w_q(h[0]), self.w_k(h[1 + n:])
        raw = keys @ q / (self.tau * math.sqrt(self.d_model))
        return raw.masked_fill(~valid, -math.inf)


@dataclass
class Step:
    """One decision, kept so REINFORCE can recompute its log-probability with gradients."""

    state: torch.Tensor
    candidates: torch.Tensor
    valid: torch.Tensor
    action: int


@dataclass
class Episode:
    """One assembly: the decisions, the chosen modules (head last) and how long deciding took."""

    data: torch.Tensor
    steps: list[Step]
    metas: list[ModuleMeta]
    seconds: float = 0.0
    history: list[list[ModuleMeta]] = field(default_factory=list)  # the assembled prefix before each step


@torch.no_grad()
def assemble(policy: AttenAssemble, zoo: Zoo, client: int, data: torch.Tensor, budget: float,
             generator: torch.Generator | None = None) -> Episode:
    """Run the policy until STOP: each step offers the zoo's valid blocks plus STOP (masked when an
    assembly could not end here); the client's head (or a compatible one) is appended on STOP."""
    t0 = time.perf_counter()
    chosen: list[ModuleMeta] = []
    steps: list[Step] = []
    history: list[list[ModuleMeta]] = []
    while True:
        valid, stop = zoo.valid_actions(chosen, budget)
        if not valid and not stop:
            raise ValueError(f"client {client}: no model fits a budget of {budget / 2**20:.1f} MiB "
                             f"(the smallest needs {zoo.smallest_peak() / 2**20:.1f} MiB)")
        cands = [zoo.modules[i] for i in valid]
        state = torch.tensor([meta_features(m, client) for m in chosen]).reshape(len(chosen), META_FEATURES)
        cand = torch.tensor([meta_features(m, client) for m in cands] + [meta_features(None, client)])
        mask = torch.tensor([True] * len(cands) + [stop])
        logits = policy.logits(data, state, cand, mask)
        a = int(torch.multinomial(logits.softmax(0), 1, generator=generator))
        steps.append(Step(state, cand, mask, a))
        history.append(list(chosen))
        if a == len(cands):
            break
        chosen.append(cands[a])
    head = zoo.head_for(chosen[-1].d_out, client)
    assert head is not None  # STOP is only valid where a head fits
    return Episode(data, steps, chosen + [head], time.perf_counter() - t0, history)


def returns(reward: float, steps: int, gamma: float) -> list[float]:
    """The paper's Monte-Carlo returns r_t = gamma^(T-t) R for t = 1..T (sparse terminal reward)."""
    return [gamma ** (steps - t) * reward for t in range(1, steps + 1)]


def log_probs(policy: AttenAssemble, episode: Episode) -> torch.Tensor:
    return torch.stack([policy.logits(episode.data, s.state, s.candidates, s.valid).log_softmax(0)[s.action]
                        for s in episode.steps])


class Agent:
    """A client's policy with its optimiser. Without a critic the baseline is a running mean of the
    client's own rewards (decentralized); with CoRe-Tune the server's critic values are passed in."""

    def __init__(self, data_dim: int, lr: float = 1e-2, gamma: float = 0.95, tau: float = 1.0, seed: int = 0,
                 baseline_decay: float = 0.8) -> None:
        torch.manual_seed(seed)
        self.policy = AttenAssemble(data_dim, tau=tau)
        self.opt = torch.optim.Adam(self.policy.parameters(), lr=lr)
        self.gamma = gamma
        self.baseline: float | None = None
        self.baseline_decay = baseline_decay

    def update(self, episode: Episode, reward: float, values: Sequence[float] | None = None) -> float:
        """One REINFORCE step; advantage = return - baseline (critic value or running mean). Returns the loss."""
        ret = torch.tensor(returns(reward, len(episode.steps), self.gamma))
        if values is not None:
            base = torch.tensor(list(values), dtype=torch.float32)
        else:
            base = torch.full_like(ret, reward if self.baseline is None else self.baseline)
            self.baseline = reward if self.baseline is None else self.baseline_decay * self.baseline + (1 - self.baseline_decay) * reward
        loss = -(log_probs(self.policy, episode) * (ret - base)).sum()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return float(loss.detach())
