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
at most the honest spread per element. Nesting concentrates attackers: the outer columns of the classifier's weight
are covered only by the updates of the wider submodels, where an attacker on one of them is a larger share than 20%
(or the only other copy). So, as an option (`coordinate_rows`, off by default: it slows honest learning of those
columns, docs/security.md), an element fewer copies cover than the tensor's best covered ones (all of the round's
updates that carry it) has its step, trimmed or the rule's average where fewer than `min_cover` cover it, clamped to
the range of the best covered steps of its row (a class's row of the classifier: the same class, the features the
smaller submodels share), widened by sqrt of how many more copies those average (a mean of fewer honest copies
spreads wider); a nested model's submodels share structure, so a push on one class's row is held near that class's
honest steps. A row with none of the best covered (the stem conv's outer output channels) keeps its steps.

The merge has a cost: under label skew the few honest copies that push a class hardest are the ones it cuts (the
clients that hold that class), about 1.6 points of average accuracy at Dirichlet(0.5) (docs/security.md). Where the
server holds labelled images of its own (its running statistics', nefl/aggregation/pipeline.py), it can see that. So
`AggregationConfig.classifier_rows` takes back, class by class, the rule's average of that class's classifier row and
bias where it lowers the server's loss (`choose_rows`): a push that hurts clean images never lowers it.

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


def trimmed(copies: list[torch.Tensor], shape: torch.Size, trim: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per element of a tensor of `shape`, the mean of the copies covering it (each in its leading corner) after
    max(1, floor(`trim` x count)) are cut at each end, and how many copies cover it."""
    stack = torch.full((len(copies), *shape), math.nan, dtype=torch.float64)
    for i, c in enumerate(copies):
        stack[i][corner(c.shape)] = c.double()
    count = (~stack.isnan()).sum(0)
    cut = torch.floor(trim * count).long().clamp_min(1)
    ordered = stack.sort(0).values  # NaN last
    rank = torch.arange(len(copies)).view(-1, *([1] * len(shape)))
    keep = (rank >= cut) & (rank < count - cut)
    return torch.where(keep, ordered, 0.0).sum(0) / (count - 2 * cut).clamp_min(1), count


def averaged(count: torch.Tensor, trim: float, least: int) -> torch.Tensor:
    """Per element, how many copies its step averages: those left by `trimmed` where `least` cover it, else all."""
    cut = torch.floor(trim * count).long().clamp_min(1)
    return torch.where(count >= least, count - 2 * cut, count)


def within_rows(step: torch.Tensor, count: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """`step` with each element that fewer copies cover than the tensor's best covered, in a row (dim 0) that holds
    some of those, clamped to the range of that row's best covered steps, its ends scaled away from 0 by sqrt(copies
    averaged there / copies averaged here) (`kept`, per element: an honest mean of fewer copies spreads that much wider). A row with
    none of them keeps its steps."""
    core = count == count.max()
    if bool(core.all()):
        return step
    rows, mask = step.reshape(len(step), -1), core.reshape(len(step), -1)
    inf = torch.tensor(math.inf, dtype=step.dtype)
    lo, hi = torch.where(mask, rows, inf).amin(1, keepdim=True), torch.where(mask, rows, -inf).amax(1, keepdim=True)
    widen = (kept[core].max() / kept.clamp_min(1)).sqrt().reshape(rows.shape)
    clamped = torch.minimum(torch.maximum(rows, torch.minimum(lo, lo * widen)), torch.maximum(hi, hi * widen))
    clamped = clamped.reshape(step.shape)
    return torch.where(core | ~mask.any(1).reshape(-1, *([1] * (step.dim() - 1))), step, clamped)


def head_loss(weight: torch.Tensor, bias: torch.Tensor, features: list[torch.Tensor], labels: torch.Tensor) -> float:
    """The classifier's cross-entropy summed over the images and the submodels: each submodel's penultimate features
    (`features`, one (images x its width) tensor each) read by the leading columns of `weight` (its nested corner)."""
    return sum(float(torch.nn.functional.cross_entropy(x @ weight[:, :x.shape[1]].T + bias, labels, reduction="sum"))
               for x in features)


def choose_rows(merged: tuple[torch.Tensor, torch.Tensor], average: tuple[torch.Tensor, torch.Tensor],
                features: list[torch.Tensor], labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The classifier (weight, bias) with each class's row and bias taken from `average` (the rule's plain average)
    in place of `merged` (the per-element merge) where that lowers `head_loss` on the server's images, class by class
    in order, each against the rows chosen before it (greedy); and the classes taken. Never above `merged`'s loss."""
    weight, bias = merged[0].double().clone(), merged[1].double().clone()
    features = [x.double() for x in features]
    best, taken = head_loss(weight, bias, features, labels), []
    for c in range(len(bias)):
        w, b = weight.clone(), bias.clone()
        w[c], b[c] = average[0][c].double(), average[1][c].double()
        loss = head_loss(w, b, features, labels)
        if loss < best:
            weight, bias, best = w, b, loss
            taken.append(c)
    return weight.to(merged[0].dtype), bias.to(merged[1].dtype), taken


class Copies:
    """The kept updates' copies of the small tensors of one round."""

    def __init__(self, names: frozenset[str], trim: float, least: int, rows: bool = False) -> None:
        self.names, self.trim, self.least, self.rows = names, trim, least, rows
        self.by_name: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        self.complete = True  # False once partials without copies were merged in
        self.average: dict[str, torch.Tensor] = {}  # the rule's average of each tensor `apply` merged, before it did
        self.from_average: list[int] = []  # classes whose classifier row the server took back from `average`

    def add(self, delta: Mapping[str, torch.Tensor]) -> None:
        """A kept update's small tensors, as the rule receives them (after the clips)."""
        for name in self.names & delta.keys():
            self.by_name[name].append(delta[name].detach().to(torch.float32, copy=True))

    @property
    def held(self) -> list[torch.Tensor]:
        """Every copy held (for the aggregate's held bytes)."""
        return [c for copies in self.by_name.values() for c in copies]

    def apply(self, old: GlobalState, new: GlobalState) -> int:
        """`new`'s small tensors' steps replaced by the trimmed mean where `least` copies cover an element, and those of
        elements fewer copies cover than the best covered ones, with `rows`, held to the range of their row's best
        covered steps (`within_rows`); the elements whose step changed."""
        if not self.complete:
            return 0
        changed = 0
        for name, copies in self.by_name.items():
            if len(copies) < self.least:
                continue
            base = old.consistent[name].double()
            self.average[name] = new.consistent[name]
            mean, count = trimmed(copies, base.shape, self.trim)
            step = torch.where(count >= self.least, mean, new.consistent[name].double() - base)
            if self.rows:
                step = within_rows(step, count, averaged(count, self.trim, self.least))
            stepped = (base + step).to(old.consistent[name].dtype)
            changed += int((stepped != new.consistent[name]).sum())
            new.consistent[name] = stepped
        return changed
