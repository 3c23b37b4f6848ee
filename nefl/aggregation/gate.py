"""A held-out gate at commit (issue 41; Fang et al. 2020's LFR/ERR, Zeno): the candidate state is judged by what it
does on a held-out gate set, per submodel, so every tensor is judged at once, whatever the attacker poisoned.

`paired_z`: the paired z statistic of per-image differences (candidate - reference), the same images for both.
Every state is scored on the whole gate set (held-out images the devices never see): per-image loss and 0/1 error
(`Scores`), and a committed state's scores are kept, so a round costs one scoring of its candidate. `Gate.baseline`:
for each submodel and measure the best of the current state and the last `window` committed ones (a ratchet, so a
slow poison cannot walk the model down a step a round). `Gate.judge`: submodel k trips when the candidate's mean
loss exceeds its reference's by more than `z` standard errors of the paired differences plus `margin` (nats), or
its error rate does so plus `error_margin`. Loss alone misses a push that makes every prediction one class while the
loss barely moves (near-uniform outputs early in training); error alone misses damage that has not flipped a
prediction yet. The data side (the images, the model) is the caller's: `evaluate(state, k) -> Scores`
(aggregator/gatedata.py).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Scores:
    """One state's per-image scores on the gate set, for one submodel (or pooled over submodels)."""

    loss: torch.Tensor
    wrong: torch.Tensor  # 0/1 per image


Evaluate = Callable[[object, int], Scores]  # (state, submodel) -> its scores on the gate set


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


def pooled(scores: Iterable[Scores]) -> Scores:
    """Per image, the mean over submodels of each measure."""
    scores = list(scores)
    return Scores(torch.stack([s.loss for s in scores]).mean(0), torch.stack([s.wrong for s in scores]).mean(0))


@dataclass(frozen=True)
class Trip:
    loss: float  # candidate - reference mean loss (nats)
    top1: float  # candidate - reference top-1 accuracy


@dataclass(frozen=True)
class Baseline:
    """Per submodel, the best reference's per-image scores on the gate set (each measure's own best)."""

    scores: dict[int, Scores]


@dataclass(frozen=True)
class Verdict:
    tripped: dict[int, Trip]  # submodel -> how far worse, for those that tripped
    z: dict[int, float]  # submodel -> the larger paired z (loss, error) against its reference
    excess: float = 0.0  # the candidate's mean loss above its references', summed over the submodels where above
    scores: dict[int, Scores] = field(default_factory=dict)  # the candidate's scores (kept if committed)

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
    error_margin: float = 0.03
    window: int = 3
    recent: deque = field(default_factory=deque)  # (state, its scores by submodel), the last committed first

    def worse_z(self, candidate: Scores, reference: Scores) -> float:
        """The larger paired z of the candidate's loss (less `margin`) and error (less `error_margin`) over the
        reference's."""
        return max(paired_z(candidate.loss - self.margin, reference.loss),
                   paired_z(candidate.wrong - self.error_margin, reference.wrong))

    def scores(self, state: object, submodels: Sequence[int]) -> dict[int, Scores]:
        """`state`'s scores by submodel: kept ones for a committed state, else scored now."""
        kept = next((scores for s, scores in self.recent if s is state), None)
        return kept if kept is not None else {k: self.evaluate(state, k) for k in submodels}

    def baseline(self, current: object, submodels: Sequence[int]) -> Baseline:
        refs = [self.scores(current, submodels), *[scores for s, scores in self.recent if s is not current]]
        best = {}
        for k in submodels:
            best[k] = Scores(min((r[k].loss for r in refs), key=lambda t: t.mean().item()),
                             min((r[k].wrong for r in refs), key=lambda t: t.mean().item()))
        return Baseline(best)

    def judge(self, candidate: object, base: Baseline) -> Verdict:
        tripped, zs, excess, scores = {}, {}, 0.0, {}
        for k, best in base.scores.items():
            scores[k] = cand = self.evaluate(candidate, k)
            zs[k], above = self.worse_z(cand, best), (cand.loss.mean() - best.loss.mean()).item()
            excess += max(0.0, above)
            if zs[k] > self.z:
                tripped[k] = Trip(above, (best.wrong.mean() - cand.wrong.mean()).item())
        return Verdict(tripped, zs, excess, scores)

    def committed(self, state: object, verdict: Verdict) -> None:
        self.recent.appendleft((state, verdict.scores))
        while len(self.recent) > self.window:
            self.recent.pop()
