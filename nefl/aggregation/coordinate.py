"""Small, high-leverage shared tensors merged per element by a trimmed mean of the round's kept copies.

The classifier's bias and weight (and a stem convolution) are a few hundred elements, and an attacker who pushes them
toward one class moves every submodel's output while the rest of its update stays honest: the size clips
(nefl/aggregation/tensor_screen.py) leave it up to `tensor_clip` x the round's median per tensor, and a mean passes
every clipped push on. Under non-IID data honest copies of these tensors point apart (their per-tensor cosines sit
near zero), so no direction vote can judge them. So each consistent tensor of at most `coordinate_max` elements is
merged per element: of the c kept updates that cover an element, max(1, floor(`coordinate_trim` x c)) are cut at each
end and the rest averaged (unweighted), in place of the rule's average, wherever c >= `min_cover`: in a round of three
(`serve` with few devices) the element's median, so one attacker of three moves it no further than the honest edge.
An attacker who knows the rule can still place its value at the edge of the honest values it cannot see, a bias of
at most the honest spread per element; where fewer than `min_cover` updates cover an element (a wide submodel's outer
columns) nothing is cut and the rule's average stands, left to the step bound at commit.

Nested coverage: a copy of submodel k covers the leading corner of its shape, so each element's pool is the copies
whose corner holds it (NaN elsewhere, sorted last). Cost: a copy of these tensors per kept update (a few KiB) and one
sort per tensor at finalize; partials shipped by workers carry no copies, so a merged aggregate keeps the rule's
average (`Copies.complete`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from nefl.nested.state import GlobalState, Layout
from nefl.nested.tensors import corner


def small_tensors(layout: Layout, most: int) -> frozenset[str]:
    """The consistent tensors of at most `most` elements: merged per element."""
    return frozenset(n for n, s in layout.global_shapes.items()
                     if n not in layout.inconsistent and n not in layout.local and 0 < s.numel() <= most)


def trimmed(copies: list[torch.Tensor], shape: torch.Size, trim: float, least: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per element of a tensor of `shape`, the mean of the copies covering it (each in its leading corner) after
    max(1, floor(`trim` x count)) are cut at each end, and where that applies: where `least` (>= 3) copies cover it."""
    stack = torch.full((len(copies), *shape), math.nan, dtype=torch.float64)
    for i, c in enumerate(copies):
        stack[i][corner(c.shape)] = c.double()
    count = (~stack.isnan()).sum(0)
    cut = torch.floor(trim * count).long().clamp_min(1)
    ordered = stack.sort(0).values  # NaN last
    rank = torch.arange(len(copies)).view(-1, *([1] * len(shape)))
    keep = (rank >= cut) & (rank < count - cut)
    mean = torch.where(keep, ordered, 0.0).sum(0) / (count - 2 * cut).clamp_min(1)
    return mean, count >= least


class Copies:
    """The kept updates' copies of the small tensors of one round."""

    def __init__(self, names: frozenset[str], trim: float, least: int) -> None:
        self.names, self.trim, self.least = names, trim, least
        self.by_name: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        self.complete = True  # False once partials without copies were merged in

    def add(self, delta: Mapping[str, torch.Tensor]) -> None:
        """A kept update's small tensors, as the rule receives them (after the clips)."""
        for name in self.names & delta.keys():
            self.by_name[name].append(delta[name].detach().to(torch.float32, copy=True))

    @property
    def held(self) -> list[torch.Tensor]:
        """Every copy held (for the aggregate's held bytes)."""
        return [c for copies in self.by_name.values() for c in copies]

    def apply(self, old: GlobalState, new: GlobalState) -> int:
        """`new`'s small tensors replaced, where trimming applies, by `old` + the trimmed mean; the elements replaced."""
        if not self.complete:
            return 0
        replaced = 0
        for name, copies in self.by_name.items():
            if len(copies) < self.least:
                continue
            base = old.consistent[name]
            mean, where = trimmed(copies, base.shape, self.trim, self.least)
            new.consistent[name] = torch.where(where, (base.double() + mean).to(base.dtype), new.consistent[name])
            replaced += int(where.sum())
        return replaced
