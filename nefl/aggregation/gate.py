"""A held-out gate at commit (issue 41; Fang et al. 2020's LFR/ERR, Zeno): the candidate state is judged by what it
does on a held-out gate set, per submodel, so every tensor is judged at once, whatever the attacker poisoned.

`paired_z`: the paired z statistic of per-image loss differences (candidate - reference), the same images for both.
`Gate.judge`: submodel k trips when its candidate's mean loss exceeds the reference's (the best of the last `window`
committed states on the same images: a ratchet, so a slow poison cannot walk the model down a step a round) by more
than `z` standard errors of the paired differences plus `margin` (nats). The data side (the images, the loss) is
the caller's: `evaluate(state, k, indices) -> per-image losses`. `draw`: the round's gate images from the round's
seed (the server's secret mixed with the round, Pipeline.round_seed), not a fixed slice an attacker can read.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

Evaluate = Callable[[object, int, torch.Tensor], torch.Tensor]  # (state, submodel, image indices) -> per-image loss


def paired_z(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    """(mean of d) / (its standard error), d = candidate - reference per image; 0 where d is constant zero."""
    d = candidate.double() - reference.double()
    n = d.numel()
    if n < 2:
        return 0.0
    se = d.std(unbiased=True).item() / math.sqrt(n)
    mean = d.mean().item()
    if se == 0.0:
        return 0.0 if mean == 0.0 else math.copysign(math.inf, mean)
    return mean / se


def draw(total: int, size: int, seed: int) -> torch.Tensor:
    """The round's gate images: `size` of `total` held-out indices, drawn from `seed`."""
    g = torch.Generator().manual_seed(seed & ((1 << 63) - 1))
    return torch.randperm(total, generator=g)[:min(size, total)]


@dataclass
class Verdict:
    tripped: dict[int, float]  # submodel -> (candidate - reference) mean loss, for those that tripped
    z: dict[int, float]  # submodel -> paired z against its reference


@dataclass
class Gate:
    evaluate: Evaluate
    total: int  # held-out images available
    size: int = 256
    z: float = 3.0
    margin: float = 0.02
    window: int = 3
    recent: deque = field(default_factory=deque)  # the last committed states (ratchet references)

    def judge(self, candidate: object, current: object, submodels: Sequence[int], seed: int) -> Verdict:
        idx = draw(self.total, self.size, seed)
        refs = [current, *[s for s in self.recent if s is not current]]
        tripped, zs = {}, {}
        for k in submodels:
            cand = self.evaluate(candidate, k, idx)
            best = min((self.evaluate(r, k, idx) for r in refs), key=lambda t: t.mean().item())
            z = paired_z(cand - self.margin, best)
            zs[k] = z
            if z > self.z:
                tripped[k] = (cand.mean() - best.mean()).item()
        return Verdict(tripped, zs)

    def committed(self, state: object) -> None:
        self.recent.appendleft(state)
        while len(self.recent) > self.window:
            self.recent.pop()
