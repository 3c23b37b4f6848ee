"""Judging the copies a source gets back for one module, like a federation judges updates.

A return is judged by its change from the copy the source sent out (delta = return - sent), per tensor:

- sign flip: a tensor whose returned values point away from the sent ones (<return, sent> < 0) is refused when
  the sent tensor is larger than its size bound (below): an honest change within the bound cannot flip it. A
  small tensor (a bias near zero) can cross zero honestly; its change is only clipped.
- direction: with at least `min_peers` returns, a tensor whose delta has cosine below `opposite` with the
  coordinate-wise median of the round's deltas is refused (opposite to the majority).
- size: a tensor's delta norm above its bound is clipped to it. The bound is `margin` x the median delta norm
  of the round's returns when there are at least `min_peers`; with fewer, `margin` x the median of that
  tensor's accepted, unclipped delta norms in earlier rounds (the honest scale of this module, large early in
  training and shrinking later; a clipped change says nothing of that scale, and counting it at its bound would
  let a lone liar raise its own bound round after round); with no history, `floor` x the larger of the sent
  tensor's norm and its share of the module's norm.
- batch-norm running statistics (running_*) are estimates of the activations, not trained weights: judged by
  size alone, their scale with no peers or history one unit per element (they start at 0 and 1 and honestly
  move by that much in a first round).
- a return from the source itself is never refused or clipped (it is the module's own training) and its
  delta counts in the round's statistics.

After the average, a module whose change is above `jump` x the median of its earlier accepted changes keeps
its previous value (the federation's recovery rule). Everything is deterministic: no draws, no seed.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from nefl.aggregation.aggregate import coverage_mean

@dataclass
class ScreenConfig:
    margin: float = 3.0  # a delta may reach this x the honest (median) delta norm of its tensor
    floor: float = 0.5  # with no peers and no history: this x the tensor's share of the module's norm
    opposite: float = -0.3  # refused below this cosine with the round's median delta
    min_peers: int = 3  # returns needed for round statistics (median size, majority direction)
    jump: float = 4.0  # an averaged change above this x the module's median change keeps the old value
    history: int = 8  # rounds of accepted norms kept per tensor and per module


@dataclass
class Verdict:
    states: list[dict[str, torch.Tensor]]  # the accepted returns, clipped where they were too large
    refused: dict[str, int] = field(default_factory=dict)  # reason -> returns
    clipped: int = 0  # tensors clipped


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t.float()))


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def source_average(copies: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Eq. 2: the element-wise mean of the copies a source received back for one module."""
    if not copies:
        raise ValueError("nothing to average: a module nobody borrowed keeps its parameters")
    first = copies[0]
    return {name: coverage_mean(first[name], [((None,) * first[name].dim(), c[name] - first[name], 1.0) for c in copies])
            for name in first}


def _statistic(name: str) -> bool:
    return name.rsplit(".", 1)[-1].startswith("running_")


class ReturnScreen:
    """A source's judge of the returned copies of its modules, with each module's history of accepted changes."""

    def __init__(self, cfg: ScreenConfig | None = None) -> None:
        self.cfg = cfg or ScreenConfig()
        self.tensor_norms: dict[tuple[str, str], deque[float]] = defaultdict(lambda: deque(maxlen=self.cfg.history))
        self.changes: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=self.cfg.history))

    def _bound(self, key: str, name: str, sent: dict[str, torch.Tensor], peer_norms: list[float]) -> float:
        cfg = self.cfg
        if len(peer_norms) >= cfg.min_peers:
            return cfg.margin * _median(peer_norms)
        past = self.tensor_norms[(key, name)]
        if past:
            return cfg.margin * _median(list(past))
        total = math.sqrt(sum(t.numel() for t in sent.values()))
        module = _norm(torch.cat([t.flatten().float() for t in sent.values()]))
        scale = max(_norm(sent[name]), module * math.sqrt(sent[name].numel()) / total)
        return cfg.floor * (max(scale, math.sqrt(sent[name].numel())) if _statistic(name) else scale)

    def judge(self, key: str, sent: dict[str, torch.Tensor], returns: Sequence[tuple[bool, dict[str, torch.Tensor]]]) -> Verdict:
        """The returns (own?, state) of module `key`, sent out as `sent`: which count, clipped where needed."""
        cfg = self.cfg
        deltas = [{k: st[k].float() - sent[k].float() for k in sent} for _, st in returns]
        enough = len(returns) >= cfg.min_peers
        verdict = Verdict([])
        accepted: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], set[str]]] = []  # state, delta, clipped
        bounds, majority = {}, {}
        for name in sent:
            bounds[name] = self._bound(key, name, sent, [_norm(d[name]) for d in deltas])
            if enough:
                majority[name] = torch.stack([d[name] for d in deltas]).median(dim=0).values
        for (own, state), delta in zip(returns, deltas):
            if own:
                accepted.append((state, delta, set()))
                continue
            reason = None
            for name, d in delta.items():
                if _statistic(name):
                    continue
                ref = sent[name].float()
                if _norm(ref) > bounds[name] and float((ref + d).flatten() @ ref.flatten()) < 0:
                    reason = "sign_flip"
                    break
                if enough and name in majority:
                    m, dn = majority[name], _norm(d)
                    if dn > 1e-12 and _norm(m) > 1e-12 and float(d.flatten() @ m.flatten()) / (dn * _norm(m)) < cfg.opposite:
                        reason = "opposite"
                        break
            if reason is not None:
                verdict.refused[reason] = verdict.refused.get(reason, 0) + 1
                continue
            over = {name for name, d in delta.items() if _norm(d) > bounds[name]}
            if over:
                verdict.clipped += len(over)
                delta = {k: d * (bounds[k] / _norm(d)) if k in over else d for k, d in delta.items()}
                state = {k: (sent[k].float() + delta[k]).to(sent[k].dtype) if k in over else state[k] for k in sent}
            accepted.append((state, delta, over))
        for _, delta, over in accepted:
            for name, d in delta.items():
                if name not in over:
                    self.tensor_norms[(key, name)].append(_norm(d))
        verdict.states = [state for state, _, _ in accepted]
        return verdict

    def aggregate(self, key: str, sent: dict[str, torch.Tensor],
                  returns: Sequence[tuple[bool, dict[str, torch.Tensor]]]) -> tuple[dict[str, torch.Tensor], Verdict]:
        """Eq. 2 over the accepted returns; the sent copy when none is accepted or the average would jump."""
        verdict = self.judge(key, sent, returns)
        if not verdict.states:
            return sent, verdict
        new = source_average(verdict.states)
        change = _norm(torch.cat([(new[k].float() - sent[k].float()).flatten() for k in sent]))
        past = self.changes[key]
        if len(past) >= 2 and change > self.cfg.jump * _median(list(past)):
            verdict.refused["jump"] = verdict.refused.get("jump", 0) + 1
            return sent, verdict
        past.append(change)
        return new, verdict
