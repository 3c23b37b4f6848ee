"""AttenAssemble: the attention-based pointer-network actor that assembles a model module by module.

The state is a token sequence [CLS = local data feature, assembled modules..., candidates..., STOP];
a small Transformer encoder reads it, the CLS output is the query, and a scaled query-key product over
the candidate tokens (temperature tau) is the action distribution. Invalid candidates are masked out
of both the attention and the softmax, so any number of candidates works and a masked token cannot
move the probabilities of the valid ones. Trained with REINFORCE on the paper's terminal reward.

A module's token is its metadata (the paper's <source, position, type, d_in, d_out>, the source as a
binary code) plus what the client has observed of it (nefl.jigsaw.observations): two modules differ in
their tokens whenever they differ in source or position, so a policy can prefer one source's block over
another's of the same kind; with identical tokens it could only give them equal probability.

The head is a choice too: after STOP the policy points at one of the heads that fit the last block's output, its
own or a neighbour's (a step of its own, skipped when only one head fits), so clients can share a whole model.

Two ways to decode: sampling at a temperature (the policy phase explores) and greedy (temperature 0,
execution); `chain_log_prob` scores a given chain under the policy, for the switching rule.

Kept small on purpose (d_model 32, one encoder layer, about 14k parameters): the policy runs on the
device, on a CPU, beside local training.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from nefl.jigsaw.observations import OBS_FEATURES, ObservationLog
from nefl.jigsaw.zoo import TYPES, ModuleMeta, Zoo

SOURCE_BITS = 20  # ModuleMeta.source < 2**20: every possible source has its own code
META_FEATURES = len(TYPES) + 1 + 4 + 1 + 1 + SOURCE_BITS  # type, convs, log-dims, position, own flag, source code
TOKEN_FEATURES = META_FEATURES + OBS_FEATURES + 1  # + what the client observed + STOP flag

TokenFn = Callable[[ModuleMeta | None], list[float]]


def meta_features(meta: ModuleMeta, client: int) -> list[float]:
    """The module's metadata as numbers: type one-hot, conv count, log2 dims, position, own flag, source bits."""
    kind = [float(meta.kind == t) for t in TYPES]
    convs = int(meta.type.split("-")[1]) if meta.kind == "stage" else float(meta.kind == "conv")
    dims = [math.log2(meta.d_in[0]) / 10, math.log2(meta.d_in[1]) / 5, math.log2(meta.d_out[0]) / 10, math.log2(meta.d_out[1]) / 5]
    source = [float(meta.source >> b & 1) for b in range(SOURCE_BITS)]
    return kind + [convs / 4] + dims + [meta.position / 10, float(meta.source == client)] + source


def tokens_for(client: int, log: ObservationLog | None, round_index: int) -> TokenFn:
    """Client `client`'s token encoder at `round_index`: metadata, its observations, STOP flag (None is STOP)."""
    def token(meta: ModuleMeta | None) -> list[float]:
        if meta is None:
            return [0.0] * (TOKEN_FEATURES - 1) + [1.0]
        seen = log.features(meta.key, round_index) if log is not None else [0.0, 0.0, 0.0, 1.0]
        return meta_features(meta, client) + seen + [0.0]
    return token


class AttenAssemble(nn.Module):
    """pi(a | s) = softmax(q W_Q (K W_K)^T / (tau sqrt(d))) over the valid candidate tokens."""

    def __init__(self, data_dim: int, d_model: int = 32, heads: int = 2, layers: int = 1, tau: float = 1.0,
                 max_len: int = 16, prior: float | None = None) -> None:
        super().__init__()
        self.d_model, self.tau = d_model, tau
        self.data_enc = nn.Linear(data_dim, d_model)
        self.meta_enc = nn.Sequential(nn.Linear(TOKEN_FEATURES, d_model), nn.ReLU(), nn.Linear(d_model, d_model))
        self.segment = nn.Embedding(3, d_model)  # 0 CLS, 1 assembled state, 2 candidate
        self.order = nn.Embedding(max_len, d_model)  # position of a state token in the assembly
        layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=2 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.w_q = nn.Linear(d_model, d_model, bias=False)
        self.w_k = nn.Linear(d_model, d_model, bias=False)
        # the common-chain prior: a learnable logit bonus for the next step of the federation's common chain (its next
        # block, STOP once it is complete, its head), so clients start out choosing one chain that all of them train
        self.prior = nn.Parameter(torch.tensor(float(prior))) if prior is not None else None

    def logits(self, data: torch.Tensor, state: torch.Tensor, candidates: torch.Tensor, valid: torch.Tensor,
               common: torch.Tensor | None = None) -> torch.Tensor:
        """data [data_dim], state [N, F], candidates [K, F], valid [K] bool -> logits [K], -inf where invalid;
        `common` [K] bool marks the common chain's next step, which gets the prior's bonus."""
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
        if self.prior is not None and common is not None:
            raw = raw + self.prior * common.float()
        return raw.masked_fill(~valid, -math.inf)


@dataclass
class Step:
    """One decision, kept so REINFORCE can recompute its log-probability with gradients."""

    state: torch.Tensor  # tokens of the assembled prefix [N, F]
    candidates: torch.Tensor  # tokens of the valid blocks, then STOP [K + 1, F]
    valid: torch.Tensor
    action: int
    common: torch.Tensor | None = None  # the candidates that continue the common chain (with a prior)


@dataclass
class Episode:
    """One assembly: the decisions, the chosen modules (head last) and how long deciding took."""

    data: torch.Tensor
    steps: list[Step]
    metas: list[ModuleMeta]
    seconds: float = 0.0


def _decide(policy: AttenAssemble, zoo: Zoo, tokens: TokenFn, data: torch.Tensor, budget: float, client: int,
            chosen: Sequence[ModuleMeta]) -> tuple[list[ModuleMeta], Step, torch.Tensor]:
    """The valid next blocks after `chosen` (STOP is index len(blocks)), the step's inputs and its logits."""
    valid, stop = zoo.valid_actions(chosen, budget)
    if not valid and not stop:
        raise ValueError(f"client {client}: no model fits a budget of {budget / 2**20:.1f} MiB "
                         f"(the smallest needs {zoo.smallest_peak() / 2**20:.1f} MiB)")
    cands = [zoo.modules[i] for i in valid]
    state = torch.tensor([tokens(m) for m in chosen]).reshape(len(chosen), TOKEN_FEATURES)
    cand = torch.tensor([tokens(m) for m in cands] + [tokens(None)])
    mask = torch.tensor([True] * len(cands) + [stop])
    common = None
    if policy.prior is not None:
        blocks = [m for m in zoo.common if m.kind != "head"]
        on_track = list(chosen) == blocks[:len(chosen)]
        following = blocks[len(chosen)] if on_track and len(chosen) < len(blocks) else None
        common = torch.tensor([m == following for m in cands] + [on_track and len(chosen) == len(blocks)])
    step = Step(state, cand, mask, -1, common)
    return cands, step, policy.logits(data, state, cand, mask, common)


def _decide_head(policy: AttenAssemble, zoo: Zoo, tokens: TokenFn, data: torch.Tensor,
                 blocks: Sequence[ModuleMeta]) -> tuple[list[ModuleMeta], Step, torch.Tensor]:
    """The heads that fit after `blocks` (STOP's follow-up decision), the step's inputs and its logits."""
    heads = zoo.heads_for(blocks[-1].d_out)
    state = torch.tensor([tokens(m) for m in blocks]).reshape(len(blocks), TOKEN_FEATURES)
    cand = torch.tensor([tokens(m) for m in heads])
    mask = torch.ones(len(heads), dtype=torch.bool)
    common = torch.tensor([list(blocks) + [h] == list(zoo.common) for h in heads]) if policy.prior is not None else None
    return heads, Step(state, cand, mask, -1, common), policy.logits(data, state, cand, mask, common)


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    if temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial((logits / temperature).softmax(0), 1, generator=generator))


@torch.no_grad()
def assemble(policy: AttenAssemble, zoo: Zoo, tokens: TokenFn, data: torch.Tensor, budget: float, client: int,
             temperature: float = 1.0, generator: torch.Generator | None = None) -> Episode:
    """Run the policy until STOP, sampling at `temperature` (0: greedy); each step offers the zoo's valid
    blocks plus STOP (masked when an assembly could not end here); after STOP it picks the head among those
    that fit (a decision only when there are several)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    t0 = time.perf_counter()
    chosen: list[ModuleMeta] = []
    steps: list[Step] = []
    while True:
        cands, step, logits = _decide(policy, zoo, tokens, data, budget, client, chosen)
        step.action = _pick(logits, temperature, generator)
        steps.append(step)
        if step.action == len(cands):
            break
        chosen.append(cands[step.action])
    heads, step, logits = _decide_head(policy, zoo, tokens, data, chosen)
    if len(heads) > 1:
        step.action = _pick(logits, temperature, generator)
        steps.append(step)
    head = heads[step.action] if len(heads) > 1 else heads[0]
    return Episode(data, steps, chosen + [head], time.perf_counter() - t0)


@torch.no_grad()
def chain_log_prob(policy: AttenAssemble, zoo: Zoo, tokens: TokenFn, data: torch.Tensor, budget: float, client: int,
                   chain: Sequence[ModuleMeta]) -> float:
    """log pi of assembling `chain` (its blocks, STOP, then its head), -inf when the zoo's rule would not
    allow it under this budget."""
    blocks = [m for m in chain if m.kind != "head"]
    total = 0.0
    for t in range(len(blocks) + 1):
        try:
            cands, _, logits = _decide(policy, zoo, tokens, data, budget, client, blocks[:t])
        except ValueError:
            return -math.inf
        a = len(cands) if t == len(blocks) else next((i for i, m in enumerate(cands) if m == blocks[t]), None)
        if a is None:
            return -math.inf
        total += float(logits.log_softmax(0)[a])
    heads, _, logits = _decide_head(policy, zoo, tokens, data, blocks)
    if chain[-1] not in heads:
        return -math.inf
    return total + (float(logits.log_softmax(0)[heads.index(chain[-1])]) if len(heads) > 1 else 0.0)


def returns(reward: float, steps: int, gamma: float) -> list[float]:
    """The paper's Monte-Carlo returns r_t = gamma^(T-t) R for t = 1..T (sparse terminal reward)."""
    return [gamma ** (steps - t) * reward for t in range(1, steps + 1)]


def terminal_reward(accuracy: float, exp: float, cap: float, alpha: float, beta: float, share: float = 0.0) -> float:
    """The paper's R = alpha Acc + (1 - alpha) Exp + beta Cap, plus the co-training credit `share` (Exp and
    share are 0 without the server; nefl.jigsaw.coretune.co_training_credit)."""
    return alpha * accuracy + (1 - alpha) * exp + beta * cap + share


def log_probs(policy: AttenAssemble, episode: Episode) -> torch.Tensor:
    return torch.stack([policy.logits(episode.data, s.state, s.candidates, s.valid, s.common).log_softmax(0)[s.action]
                        for s in episode.steps])


class PolicyAgent:
    """A client's policy with its optimiser. The baseline of the advantage is the server critic's value
    when it sends one (CoRe-Tune, after its warm-up), else a running mean of the client's own rewards,
    which is kept up to date in both cases so it is warm when the server goes away."""

    def __init__(self, data_dim: int, lr: float = 1e-2, gamma: float = 0.95, tau: float = 1.0, seed: int = 0,
                 baseline_decay: float = 0.8, prior: float | None = None) -> None:
        torch.manual_seed(seed)
        self.policy = AttenAssemble(data_dim, tau=tau, prior=prior)
        self.opt = torch.optim.Adam(self.policy.parameters(), lr=lr)
        self.gamma = gamma
        self.baseline: float | None = None
        self.baseline_decay = baseline_decay

    def update(self, episode: Episode, reward: float, values: Sequence[float] | None = None) -> tuple[float, float]:
        """One REINFORCE step; returns (loss, mean advantage)."""
        ret = torch.tensor(returns(reward, len(episode.steps), self.gamma))
        if values is not None:
            base = torch.tensor(list(values), dtype=torch.float32)
        else:
            base = torch.full_like(ret, reward if self.baseline is None else self.baseline)
        decay = self.baseline_decay
        self.baseline = reward if self.baseline is None else decay * self.baseline + (1 - decay) * reward
        advantage = ret - base
        loss = -(log_probs(self.policy, episode) * advantage).sum()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return float(loss.detach()), float(advantage.mean())
