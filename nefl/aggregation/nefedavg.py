"""NeFedAvg, the paper's rule, streaming: each update is summed into its submodel's group, a contiguous
buffer of exactly the update's shapes, so add() is one dense add per tensor (no strided writes into
corners of the global tensors) and memory is O(sum of submodel sizes), at most K models, however many
clients report. finalize() folds the K groups into the global tensors once per round (`_Fold`, the
fast special case of nefl/aggregation/aggregate.py `coverage_mean` for leading corners). Two partial
aggregates merge exactly (group sums and weights add), which is what hierarchical / multi-site
aggregation needs.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import torch

from nefl.aggregation.aggregate import RoundAggregate, UpdateError, Weighting, tensor_bytes, update_weight
from nefl.nested.state import GlobalState, Layout, corner
from nefl.nested.tensors import Tiled, Tiling, first_non_finite

PARTIAL_SEP = "/"  # partial tensor names: "{submodel}/{tensor name}"


def _count_shape(shape: torch.Size) -> tuple[int, ...]:
    """Coverage only varies along the output/input channel dims; kernels are never sliced."""
    return tuple(shape[:2]) + (1,) * max(0, len(shape) - 2)


def _cells(extent: tuple[int, ...],
           corners: list[tuple[int, tuple[int, ...]]]) -> Iterator[tuple[tuple[slice, ...], tuple[int, ...]]]:
    """The boxes that the corners (submodel, corner) cut `extent` into, each with the submodels whose corner
    holds it: every corner's edge is a cut, so a box lies wholly inside or wholly outside each corner."""
    cuts = [sorted({0, size, *(c[j] for _, c in corners)}) for j, size in enumerate(extent)]
    for box in itertools.product(*(list(itertools.pairwise(c)) for c in cuts)):
        yield tuple(slice(a, b) for a, b in box), tuple(k for k, c in corners if all(a < e for (a, _), e in zip(box, c)))


def _corner_view(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """t[:d0, :d1, ...] for `shape`: one as_strided, a fraction of the cost of slicing dim by dim."""
    return t.as_strided(shape, t.stride(), t.storage_offset())


class _Fold:
    """NeFedAvg's consistent tensors for one layout, worked out once, so that a round's finalize is a few
    foreach calls instead of a score of small slicing ops per tensor.

    Corners cut a tensor's rows (dim 0) into bands; within a band every row is covered alike, by the
    submodels whose corner holds the band, along the rest of the row as far as each corner reaches. So a
    tensor is divided band by band, each by one row of divisors broadcast over the band's rows: long
    contiguous inner loops (a divisor per (out, in) position broadcast over a 3x3 kernel runs a 9-element
    loop, which is slow). Tensors of one kind (same global shape, same corners in the
    same submodels) share those rows, kept as pattern ids: a pattern is a set of submodels, its coverage
    the sum of their weights (a handful of patterns), so a round's divisors are one gather, for any corners,
    nested or not."""

    def __init__(self, layout: Layout) -> None:
        num = layout.num_submodels
        self.shapes = {n: s for n, s in layout.global_shapes.items() if n not in layout.inconsistent}
        # per tensor: (submodel, its corner) for each submodel that has it
        self.corners = {n: [(k, layout.sub_shapes[k][n]) for k in range(num) if n in layout.sub_shapes[k]]
                        for n in self.shapes}
        kinds: dict[tuple, tuple[int, list[int]]] = {}  # (shape, corners) -> (its first divisor row, rows per band)
        patterns: dict[tuple[int, ...], int] = {}
        rows: list[torch.Tensor] = []  # one per band of each kind: the pattern of each element of its rows
        self.bands = {}  # per tensor: ((rows, row length), rows per band, its divisor rows as a range)
        for n, shape in self.shapes.items():
            key = (shape, tuple(self.corners[n]))
            if key not in kinds:
                height = math.prod(shape[:1])  # a 0-dim tensor is one row of one
                cuts = sorted({0, height, *(math.prod(c[:1]) for _, c in self.corners[n])})
                kinds[key] = (len(rows), [b - a for a, b in itertools.pairwise(cuts)])
                for a in cuts[:-1]:
                    row = torch.empty(shape[1:], dtype=torch.int32)
                    inside = [(k, tuple(c[1:])) for k, c in self.corners[n] if a < math.prod(c[:1])]
                    for box, who in _cells(tuple(shape[1:]), inside):
                        row[box] = patterns.setdefault(who, len(patterns))
                    rows.append(row.reshape(-1))
            first, heights = kinds[key]
            self.bands[n] = ((math.prod(shape[:1]), math.prod(shape[1:])), heights, slice(first, first + len(heights)))
        self.row_ids = torch.cat(rows)  # every divisor row end to end, as pattern ids
        self.row_lengths = [r.numel() for r in rows]
        self.patterns = list(patterns)  # by id: the submodels that cover an element
        self._rounds: dict[tuple[bool, ...], _RoundFold] = {}

    def fold(self, groups: list[dict[str, torch.Tensor]], weights: torch.Tensor,
             old: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The new consistent tensors, old + (sum of the groups that cover an element) / (their weight);
        the group sums become them in place (see _RoundFold)."""
        held = tuple(bool(g) for g in groups)
        plan = self._rounds.get(held) or self._rounds.setdefault(held, _RoundFold(self, held))
        fresh = plan.fresh.views(torch.full((plan.fresh.numel,), -0.0)) if plan.fresh else {}
        new = {n: fresh[n] if k is None else groups[k][n].contiguous() for n, k in plan.base.items()}
        if plan.adds:
            torch._foreach_add_([_corner_view(new[n], c) for n, _, c in plan.adds], [groups[k][n] for n, k, _ in plan.adds])
        w = weights.tolist()
        cover = [sum(w[k] for k in who if held[k]) or 1.0 for who in self.patterns]  # 1: none covers it, its sum is -0.0
        by_row = torch.tensor(cover, dtype=torch.float32).index_select(0, self.row_ids).split_with_sizes(self.row_lengths)
        bands, divisors = [], []
        for n, t in new.items():
            grid, heights, at = self.bands[n]
            bands += t.view(grid).split_with_sizes(heights)
            divisors += by_row[at]
        torch._foreach_div_(bands, divisors)
        same = [n for n, t in old.items() if t.dtype == new[n].dtype]
        if same:
            torch._foreach_add_([new[n] for n in same], [old[n] for n in same])
        # another dtype: the sum in the wider one, which holds -0.0 + old exactly, cast back
        return {n: new[n] if t.dtype == new[n].dtype else (new[n] + t).to(t.dtype) for n, t in old.items()}


class _RoundFold:
    """A _Fold's work for one set of submodels with updates. A tensor's groups are summed largest corner
    first, ties in submodel order (the order NeFedAvg has always summed in: with whole-number weights, a
    run makes the same states bit for bit as before), in the largest group's sum when it has the tensor
    whole (no new memory; nested ladders: the full model). Otherwise the sum starts from a new buffer at
    -0.0, the additive identity (+0.0 is not: -0.0 + 0.0 = +0.0), so an element no group covers ends as
    -0.0 / 1 + old = old bit for bit, -0.0 included, with no select. The order depends only on the layout
    and the submodels present: a group adopted off the wire and one summed tensor by tensor give the same bits."""

    def __init__(self, fold: _Fold, held: tuple[bool, ...]) -> None:
        self.base: dict[str, int | None] = {}
        self.adds: list[tuple[str, int, torch.Size]] = []  # (tensor, submodel, its corner) for every group sum added
        for n, shape in fold.shapes.items():
            order = sorted(((k, c) for k, c in fold.corners[n] if held[k]), key=lambda kc: -math.prod(kc[1]))
            self.base[n] = order[0][0] if order and order[0][1] == shape else None
            self.adds += [(n, k, c) for k, c in order if k != self.base[n]]
        fresh = [n for n, k in self.base.items() if k is None]
        self.fresh = Tiling(tuple(fresh), tuple(fold.shapes[n] for n in fresh)) if fresh else None


_FOLDS: dict[int, tuple[weakref.ref, _Fold]] = {}


def _fold_of(layout: Layout) -> _Fold:
    """The layout's _Fold, made on its first finalize. Keyed by identity (a Layout compares by value and has
    no hash); the entry goes when its layout does."""
    key = id(layout)
    hit = _FOLDS.get(key)
    if hit is not None and hit[0]() is layout:
        return hit[1]
    fold = _Fold(layout)
    _FOLDS[key] = (weakref.ref(layout, lambda _, key=key: _FOLDS.pop(key, None)), fold)
    return fold


@runtime_checkable
class Mergeable(Protocol):
    """A round aggregate that is a sum per element and a weight: partial aggregates of several processes
    merge into one exactly (workers and relays ship `partial`), and DP noise on the sums is calibrated to
    one client's clipped update. NeFedAvg, and the centre check in front of it."""

    def merge(self, other: Mergeable) -> None:
        """Fold another partial aggregate (same layout and weighting) into this one."""
        ...

    def partial(self) -> NeFedAvg:
        """The exact sums a worker ships to its coordinator."""
        ...

    def add_noise(self, std: float, generator: torch.Generator) -> None:
        """DP-FedAvg's N(0, std^2) on the sums; once, after the last add or merge, before finalize."""
        ...


def as_mergeable(agg: RoundAggregate) -> Mergeable:
    """`agg` where partials or DP noise need a Mergeable; a ValueError that says why for any other rule."""
    unwrap = getattr(agg, "mergeable_inner", None)  # the gate's recording wrapper (nefl/aggregation/attribution.py)
    agg = unwrap() if unwrap is not None else agg
    if not isinstance(agg, Mergeable):
        raise ValueError(f"the {agg.name} aggregator holds every update of a round in one process: it cannot ship or "
                         "merge partial aggregates (run it without --workers and relays) nor take DP noise, which is "
                         "calibrated to NeFedAvg's sums (use --aggregator nefedavg)")
    return agg


class NeFedAvg(RoundAggregate):
    """The paper's NeFedAvg, streaming: per submodel, the weighted sum of its updates and their weight."""

    name = "nefedavg"

    def __init__(self, layout: Layout, weighting: Weighting = "uniform") -> None:
        super().__init__(layout, weighting)
        # per submodel: weighted sum of its updates (every tensor it uploads) and the total weight
        self.groups: list[dict[str, torch.Tensor]] = [{} for _ in range(layout.num_submodels)]
        # a group adopted from an update decoded off the wire: its tensors are views tiling this buffer
        self._flat: list[torch.Tensor | None] = [None] * layout.num_submodels
        self._tiling: list[Tiling | None] = [None] * layout.num_submodels
        self.weights = torch.zeros(layout.num_submodels, dtype=torch.float64)
        self._weights_np = (self.weights, self.weights.numpy())  # `weights` and its numpy view, remade if it is replaced

    def add_validated(self, k: int, delta: dict[str, torch.Tensor], num_samples: int = 1, *, client: str = "",
                      owned: bool = False) -> None:
        """The server validates before bounding the norm, and a clipped delta is the validated one scaled,
        so the finite checks are not repeated here. An owned update's tensors become its submodel's group
        sum in place (no copy) when it is the first; later ones are summed into."""
        self.add_weighted(k, delta, update_weight(self.weighting, num_samples), owned=owned)

    def add_weighted(self, k: int, delta: dict[str, torch.Tensor], w: float, *, owned: bool = False) -> None:
        """A validated update counted with weight `w` > 0 (its sample count, or a robust rule's trust)."""
        self._check_open()
        group, flat = self.groups[k], self._flat[k]
        if flat is not None and isinstance(delta, Tiled) and delta.tiling == self._tiling[k]:
            flat.add_(delta.flat, alpha=w)  # the same names, shapes and order as the group's buffer
        elif group:
            names = list(group)
            torch._foreach_add_([group[n] for n in names], [delta[n].to(torch.float32) for n in names], alpha=w)
        else:
            if owned and isinstance(delta, Tiled):
                group.update(delta)
                self._flat[k], self._tiling[k] = delta.flat, delta.tiling
            elif owned and all(t.dtype == torch.float32 for t in delta.values()):
                group.update(delta)
            else:
                group.update((n, t.to(torch.float32, copy=True)) for n, t in delta.items())
            if w != 1.0:
                torch._foreach_mul_(list(group.values()), w)
        if self._weights_np[0] is not self.weights:
            self._weights_np = (self.weights, self.weights.numpy())
        self._weights_np[1][k] += w  # numpy's scalar add through a kept view: a torch call per update is dear on a cold core
        self.updates[k] += 1

    def merge(self, other: Mergeable) -> None:
        """Fold another partial aggregate (same layout) into this one."""
        self._check_open()
        other._check_open()
        if not isinstance(other, NeFedAvg) or other.layout.global_shapes != self.layout.global_shapes \
                or other.weighting != self.weighting:
            raise ValueError("cannot merge aggregates of different rules, profiles or weightings")
        for group, theirs in zip(self.groups, other.groups):
            for n, t in theirs.items():
                if n in group:
                    group[n] += t
                else:
                    group[n] = t.clone()
        self.weights += other.weights
        self.updates = [a + b for a, b in zip(self.updates, other.updates)]

    def partial(self) -> NeFedAvg:
        return self

    def partial_tensors(self) -> dict[str, torch.Tensor]:
        """Every group sum, keyed "{k}/{name}": what a worker ships to its coordinator."""
        return {f"{k}{PARTIAL_SEP}{n}": t for k, group in enumerate(self.groups) for n, t in group.items()}

    @classmethod
    def from_partial(cls, layout: Layout, weights: list[float], updates: list[int],
                     tensors: dict[str, torch.Tensor], weighting: Weighting = "uniform") -> NeFedAvg:
        """A partial aggregate back from `partial_tensors` and its weights and counts, refusing anything
        a NeFedAvg of `layout` could not hold (UpdateError): group names and shapes, counts that agree
        with the weights, finite sums."""
        num = layout.num_submodels
        if len(weights) != num or len(updates) != num:
            raise UpdateError(f"{len(weights)} weights and {len(updates)} counts for {num} submodels")
        agg = cls(layout, weighting)
        for name, t in tensors.items():
            k, _, n = name.partition(PARTIAL_SEP)
            if not k.isdigit() or int(k) >= num:
                raise UpdateError(f"tensor {name!r} names no submodel")
            agg.groups[int(k)][n] = t
        for k in range(num):
            have, want = agg.groups[k], layout.upload_shapes(k) if updates[k] else {}
            if set(have) != set(want) or any(have[n].shape != want[n] for n in want):
                raise UpdateError(f"submodel {k + 1}: partial tensors do not match its upload shapes")
            if (updates[k] > 0) != (weights[k] > 0) or not (math.isfinite(weights[k]) and weights[k] >= 0):
                raise UpdateError(f"submodel {k + 1}: {updates[k]} updates of weight {weights[k]}")
            bad = first_non_finite(have)
            if bad is not None:
                raise UpdateError(f"submodel {k + 1}: {bad}: non-finite sums")
        agg.weights = torch.tensor(weights, dtype=torch.float64)
        agg.updates = list(updates)
        return agg

    def add_noise(self, std: float, generator: torch.Generator) -> None:
        """DP-FedAvg: N(0, std^2) on every element of every group sum that has updates (std = noise
        multiplier x clip norm; one client changes one group by at most the clip norm). finalize
        divides by coverage, so an element's noise ends up std * sqrt(groups covering it) / coverage.
        Call once per round, after the last add or merge and before finalize."""
        if self.weighting != "uniform":
            raise ValueError("DP noise needs weighting='uniform': 'samples' scales a client's influence by its sample count")
        if not (math.isfinite(std) and std >= 0):
            raise ValueError(f"noise std must be a finite number >= 0, got {std!r}")
        for k, group in enumerate(self.groups):
            if self.updates[k] == 0:
                continue
            for n in sorted(group):  # fixed order: the same generator seed gives the same noise
                t = group[n]
                t.add_(torch.randn(t.shape, generator=generator, dtype=t.dtype), alpha=std)

    @property
    def held_bytes(self) -> int:
        return tensor_bytes(t for g in self.groups for t in g.values())

    def coverage(self, name: str) -> torch.Tensor:
        """Per element of consistent tensor `name`: the total weight of the updates that contain it.
        Shaped (out, in, 1, 1...): coverage varies only along the channel dims, kernels are never sliced."""
        shape = self.layout.global_shapes[name]
        cover = torch.zeros(_count_shape(shape), dtype=torch.float32)
        for k, group in enumerate(self.groups):
            if name in group:
                cover[corner(_count_shape(group[name].shape))] += float(self.weights[k])
        return cover

    def finalize(self, state: GlobalState) -> GlobalState:
        """New global state; `state` (the one the deltas were computed from) is not modified. The group
        sums become the new tensors in place, so an aggregate is finalized once; a new round takes a
        new NeFedAvg."""
        self._check_open()
        consistent = _fold_of(self.layout).fold(self.groups, self.weights, state.consistent)
        inconsistent = []
        for k, old_k in enumerate(state.inconsistent):
            w, group = float(self.weights[k]), self.groups[k]
            moved = [n for n in old_k if n in group] if w > 0 else []
            if moved:  # one call each over a submodel's hundred-odd tensors, not three per tensor
                sums = [group[n] for n in moved]
                torch._foreach_div_(sums, w)
                torch._foreach_add_(sums, [old_k[n] for n in moved])
            inconsistent.append({n: group[n].to(old.dtype) if w > 0 and n in group else old.clone() for n, old in old_k.items()})
        self._finalized = True
        return GlobalState(consistent, inconsistent)
