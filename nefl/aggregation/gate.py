"""A held-out gate at commit (issue 41; Fang et al. 2020's LFR/ERR, Zeno): the candidate state is judged by what it
does on a held-out gate set, per submodel, so every tensor is judged at once, whatever the attacker poisoned.

`paired_z`: the paired z statistic of per-image loss differences (candidate - reference), the same images for both.
Every state is scored on the whole gate set (held-out images the devices never see), and a committed state's
scores are kept, so a round costs one scoring of its candidate. `Gate.baseline`: for each submodel the best of the
current state and the last `window` committed ones (a ratchet, so a slow poison cannot walk the model down a step a
round). `Gate.judge`: submodel k trips when the candidate's mean loss exceeds its reference's by more than `z`
standard errors of the paired differences plus `margin` (nats). The data side (the images, the loss) is the
caller's: `evaluate(state, k) -> per-image losses` (aggregator/gatedata.py).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

Evaluate = Callable[[object, int], torch.Tensor]  # (state, submodel) -> per-image loss on the gate set


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


@dataclass(frozen=True)
class Baseline:
    """Per submodel, the best reference's per-image losses on the gate set."""

    losses: dict[int, torch.Tensor]


@dataclass(frozen=True)
class Verdict:
    tripped: dict[int, float]  # submodel -> (candidate - reference) mean loss, for those that tripped
    z: dict[int, float]  # submodel -> paired z against its reference
    excess: float = 0.0  # the candidate's mean loss above its references', summed over the submodels where above
    losses: dict[int, torch.Tensor] = field(default_factory=dict)  # the candidate's per-image losses (kept if committed)

    @property
    def rank(self) -> tuple[float, float]:
        """How far the candidate is from passing: its largest z, then its excess loss (z is infinite where the
        differences do not vary); attribution leaves out what brings this lowest."""
        return max(self.z.values(), default=0.0), self.excess


@dataclass
class Gate:
    evaluate: Evaluate
    z: float = 3.0
    margin: float = 0.02
    window: int = 3
    recent: deque = field(default_factory=deque)  # (state, its per-image losses by submodel), the last committed first

    def scores(self, state: object, submodels: Sequence[int]) -> dict[int, torch.Tensor]:
        """`state`'s per-image losses by submodel: kept ones for a committed state, else scored now."""
        kept = next((losses for s, losses in self.recent if s is state), None)
        return kept if kept is not None else {k: self.evaluate(state, k) for k in submodels}

    def baseline(self, current: object, submodels: Sequence[int]) -> Baseline:
        refs = [self.scores(current, submodels), *[losses for s, losses in self.recent if s is not current]]
        return Baseline({k: min((r[k] for r in refs), key=lambda t: t.mean().item()) for k in submodels})

    def judge(self, candidate: object, base: Baseline) -> Verdict:
        tripped, zs, excess, losses = {}, {}, 0.0, {}
        for k, best in base.losses.items():
            losses[k] = cand = self.evaluate(candidate, k)
            zs[k], above = paired_z(cand - self.margin, best), (cand.mean() - best.mean()).item()
            excess += max(0.0, above)
            if zs[k] > self.z:
                tripped[k] = above
        return Verdict(tripped, zs, excess, losses)

    def committed(self, state: object, verdict: Verdict) -> None:
        self.recent.appendleft((state, verdict.losses))
        while len(self.recent) > self.window:
            self.recent.pop()
