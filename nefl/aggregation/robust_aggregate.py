"""Robust aggregation that respects nesting: median, trimmed mean, multi-Krum and FLTrust over exactly
the updates that cover each element, and a centre check that screens updates for any rule.

In a nested ladder each element of a global tensor is covered by a different subset of the round's
updates: the corner of submodel 1 by every update, the outer ring of the largest submodel by that
submodel's updates only. So a coordinate-wise statistic is taken per *cell*: the boxes between the
channel cuts of the covering submodels, each with its own covering set (`coverage_cells`), and per
submodel for the inconsistent tensors (BN, steps), which only that submodel's updates carry.

Where coverage is too thin for the statistic to be robust (fewer than `min_cover` updates: a median
of two is their mean), the step is bounded: each covering update is clipped, on that cell, to
`max_norm_ratio` times the per-element size of the robust step of the same tensor (or of the round,
when the tensor has no well-covered cell), then averaged. A round with fewer than `min_cover` updates
in all has no robust statistic anywhere and is the plain mean. docs/security.md has what each rule
costs and what still gets through.

These rules hold every update of the round (memory: the sum of the updates' sizes, `held_bytes`), so
they do not merge partials across processes: with aggregator workers only NeFedAvg runs, screened by
the centre check in each worker (a two-level scheme: each worker judges its share against the
centre of what it saw).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from nefl.aggregation.aggregate import NeFedAvg, RoundAggregate, Weighting, tensor_bytes, update_weight
from nefl.aggregation.robust import reference_norm, update_norm
from nefl.nested.state import GlobalState, Layout
from nefl.nested.tensors import Tiled, Tiling, corner
from nefl.support.settings import AggregationConfig

# the server's own delta of submodel k of round `index` from `state` on its root data (FLTrust's root update)
ReferenceUpdate = Callable[[GlobalState, int, int], dict[str, torch.Tensor]]
Cell = tuple[slice, ...]


def coverage_cells(global_shape: torch.Size, shapes: list[torch.Size]) -> list[tuple[Cell, list[int]]]:
    """The boxes of a global tensor that the same updates cover, each with the indices of the corners
    in `shapes` that contain it. Widths cut only the two channel dims; a box no corner reaches is left
    out (its elements keep their value)."""
    dims = min(2, len(global_shape))
    cuts = [sorted({0, *(s[d] for s in shapes)}) for d in range(dims)]
    rest = tuple(slice(0, n) for n in global_shape[dims:])
    cells = []
    for box in itertools.product(*(zip(c, c[1:]) for c in cuts)):
        covering = [i for i, s in enumerate(shapes) if all(s[d] >= hi for d, (_, hi) in enumerate(box))]
        if covering:
            cells.append((tuple(slice(lo, hi) for lo, hi in box) + rest, covering))
    return cells


def shared_core(layout: Layout, submodels: Iterable[int]) -> dict[str, Cell]:
    """The consistent tensors every one of these submodels uploads, each cut to the corner all of them
    hold: where their updates can be compared element by element."""
    ks = sorted(set(submodels))
    if not ks:
        return {}
    shapes = [layout.upload_shapes(k) for k in ks]
    names = set.intersection(*({n for n in s if n not in layout.inconsistent} for s in shapes))
    return {n: corner(tuple(min(s[n][d] for s in shapes) for d in range(len(shapes[0][n])))) for n in sorted(names)}


class Sketch:
    """A fixed random subset of the shared core's elements: cosines and distances between updates at a
    cost independent of the model's size (a few thousand elements estimate them to about 1/sqrt(n))."""

    def __init__(self, core: dict[str, Cell], size: int, seed: int) -> None:
        self.core = core
        total = sum(math.prod(s.stop for s in cell) for cell in core.values())
        gen = torch.Generator().manual_seed(seed)
        self.index = distinct_sample(total, size, gen) if total > size else None
        self.size = min(total, size)
        self._gathers: dict[tuple, np.ndarray] = {}  # by an update's tiling: where its sketch lies in its buffer

    def into(self, delta: dict[str, torch.Tensor], out: np.ndarray) -> None:
        """The sketch of `delta` written into `out` (a numpy view of a row of the round's sketches): one gather, no
        temporary, and for an update off the wire no torch call (dear to dispatch on a core that ran other
        processes since the last update)."""
        if isinstance(delta, Tiled) and self.core:
            np.take(delta.array(), self._gather(delta), out=out)
        else:
            out[:] = self(delta).numpy()

    def __call__(self, delta: dict[str, torch.Tensor]) -> torch.Tensor:
        if not self.core:
            return torch.zeros(0)
        if isinstance(delta, Tiled):  # decoded off the wire: one gather from its flat buffer
            return torch.from_numpy(delta.array()[self._gather(delta)])
        flat = torch.cat([delta[n][cell].reshape(-1).to(torch.float32) for n, cell in self.core.items()])
        return flat if self.index is None else flat[self.index]

    def _gather(self, delta: Tiled) -> np.ndarray:
        """Positions in `delta.flat` of the elements the slow path picks, computed once per tiling (names in
        buffer order and shapes: one per submodel from honest senders, a few kept)."""
        if delta.tiling not in self._gathers:
            if len(self._gathers) >= 16:
                self._gathers.clear()
            self._gathers[delta.tiling] = self._positions(delta.tiling)
        return self._gathers[delta.tiling]

    @functools.cached_property
    def _picked(self) -> tuple[np.ndarray, np.ndarray]:
        """Each picked element's cell (index into the core's names) and its coordinates in that cell, right-aligned
        to the deepest cell's dims: what every tiling shares, so worked out once per sketch (a round's), in
        O(sketch size + cells) (not O(model): a resnet18 update has 11 M elements)."""
        cells = [tuple(s.stop for s in cell) for cell in self.core.values()]
        dims = max(len(c) for c in cells)
        shape = np.array([(1,) * (dims - len(c)) + c for c in cells], dtype=np.int64).reshape(len(cells), dims)
        sizes = shape.prod(1)
        ends = np.cumsum(sizes)
        picked = np.arange(int(ends[-1])) if self.index is None else self.index.numpy()
        which = np.searchsorted(ends, picked, side="right")
        rest, coords = picked - (ends - sizes)[which], np.empty((len(picked), dims), dtype=np.int64)
        for d in reversed(range(dims)):
            rest, coords[:, d] = np.divmod(rest, shape[which, d])
        return which, coords

    def _positions(self, tiling: Tiling) -> np.ndarray:
        """The picked elements placed by their tensors' offsets and strides in a buffer tiled this way: one
        gather of the cells' placements and a product with the shared coordinates (the unravelling is done once
        a round, not again for each submodel's tiling)."""
        which, coords = self._picked
        offset, strides = tiling.placement(list(self.core))
        dims = coords.shape[1]
        stride = np.array([(0,) * (dims - len(st)) + st for st in strides], dtype=np.int64).reshape(len(strides), dims)
        return np.asarray(offset, dtype=np.int64)[which] + (coords * stride[which]).sum(1)


def distinct_sample(total: int, size: int, gen: torch.Generator) -> torch.Tensor:
    """`size` distinct indices below `total`, a uniformly random subset, sorted. Drawn with replacement until
    enough are distinct, then `size` of those at random: O(size log size), where `randperm(total)` is O(total)
    (a resnet18 ladder's core, each round in each worker). Given how many distinct values the draws hold, every
    subset of that many is equally likely, so a random `size` of them is too. Below 16 x `size` the permutation
    is cheap and keeps the small ladders' draws (simulations and tests) as they were."""
    if total < 16 * size:
        return torch.randperm(total, generator=gen)[:size].sort().values
    picked = torch.empty(0, dtype=torch.int64)
    while picked.numel() < size:
        picked = torch.unique(torch.cat([picked, torch.randint(total, (size + size // 4 + 16,), generator=gen)]))
    return picked[torch.randperm(picked.numel(), generator=gen)[:size]].sort().values


def _cosines(rows: np.ndarray, row_norms: np.ndarray, cols: np.ndarray, col_norms: np.ndarray) -> np.ndarray:
    """cos[r, c] of sketch rows with sketch cols (float32; 0 where either is zero), given their norms. numpy's BLAS
    (OpenBLAS) rather than torch's: torch's MKL runs this small product far slower on some hosts, and it is the
    centre check's largest single cost (one thread each: nefl/support/threads.py)."""
    norms = np.outer(row_norms, col_norms)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        cos = (rows @ cols.T) / np.maximum(norms, np.float32(1e-30))
    return np.where(norms > 0, cos, np.float32(0))


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    na, nb = float(torch.linalg.vector_norm(a)), float(torch.linalg.vector_norm(b))
    return float(torch.dot(a, b)) / (na * nb) if na > 0 and nb > 0 else 0.0


def coordinate_median(stack: torch.Tensor) -> torch.Tensor:
    """Element-wise median over dim 0, the mean of the two middle values for an even count."""
    s = stack.sort(dim=0).values
    n = s.shape[0]
    return (s[(n - 1) // 2] + s[n // 2]) / 2


def trimmed_mean(stack: torch.Tensor, trim: float) -> torch.Tensor:
    """Element-wise mean over dim 0 after cutting floor(trim * n) values at each end."""
    n = stack.shape[0]
    cut = min(int(trim * n), (n - 1) // 2)
    return stack.sort(dim=0).values[cut:n - cut].mean(0)


class Held(NamedTuple):
    client: str
    k: int
    delta: dict[str, torch.Tensor]
    samples: int


class Buffered(RoundAggregate):
    """Holds the round's updates (float32) until finalize: what every robust statistic needs."""

    def __init__(self, layout: Layout, weighting: Weighting, cfg: AggregationConfig) -> None:
        super().__init__(layout, weighting)
        self.cfg = cfg
        self.held: list[Held] = []

    def add_validated(self, k: int, delta: dict[str, torch.Tensor], num_samples: int = 1, *, client: str = "",
                      owned: bool = False) -> None:
        self._check_open()
        update_weight(self.weighting, num_samples)  # the same refusal of a bad count as NeFedAvg's
        kept = {n: t.to(torch.float32, copy=not owned) for n, t in delta.items()}
        self.held.append(Held(client, k, kept, num_samples))
        self.updates[k] += 1

    @property
    def held_bytes(self) -> int:
        return tensor_bytes(t for h in self.held for t in h.delta.values())

    def finalize(self, state: GlobalState) -> GlobalState:
        self._check_open()
        new = self._aggregate(state)
        self._finalized = True
        self.held = []
        return new

    def _aggregate(self, state: GlobalState) -> GlobalState:
        raise NotImplementedError

    def _nefedavg(self, state: GlobalState, kept: Iterable[tuple[Held, float]]) -> GlobalState:
        """NeFedAvg over the updates a filter kept, each with its weight (its own under `samples` weighting
        times the filter's)."""
        agg = NeFedAvg(self.layout, self.weighting)
        for h, weight in kept:
            agg.add_weighted(h.k, h.delta, weight * update_weight(self.weighting, h.samples), owned=True)
        return agg.finalize(state)


class CoordinateWise(Buffered):
    """Median or trimmed mean per element over the updates covering it, with bounded steps where thin."""

    def __init__(self, layout: Layout, weighting: Weighting, cfg: AggregationConfig, name: str,
                 stat: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__(layout, weighting, cfg)
        self.name = name
        self._stat = stat

    def _aggregate(self, state: GlobalState) -> GlobalState:
        robust = sum(self.updates) >= self.cfg.min_cover
        thin: list[tuple[torch.Tensor, Cell, list[torch.Tensor], str]] = []
        scale: dict[str, tuple[float, int]] = {}  # tensor -> (sum of squares, elements) of its robust steps
        consistent = {}
        for name, old in state.consistent.items():
            ups = [h.delta[name] for h in self.held if name in h.delta]
            consistent[name] = out = old.clone()
            for cell, covering in coverage_cells(old.shape, [u.shape for u in ups]):
                self._cell(out, cell, [ups[i][cell] for i in covering], name, robust, thin, scale)
        inconsistent = []
        for k, old_k in enumerate(state.inconsistent):
            own = {n: t.clone() for n, t in old_k.items()}
            inconsistent.append(own)
            mine = [h.delta for h in self.held if h.k == k]
            for name in old_k:
                if mine:
                    self._cell(own[name], corner(own[name].shape), [d[name] for d in mine], name, robust, thin, scale)
        self._bounded_steps(thin, scale)
        return GlobalState(consistent, inconsistent)

    def _cell(self, out: torch.Tensor, cell: Cell, slices: list[torch.Tensor], name: str, robust: bool,
              thin: list, scale: dict[str, tuple[float, int]]) -> None:
        if not robust:  # too few updates in the whole round: nothing can be robust, take their mean
            out[cell] += torch.stack(slices).mean(0).to(out.dtype)
        elif len(slices) < self.cfg.min_cover:
            thin.append((out, cell, slices, name))
        else:
            step = self._stat(torch.stack(slices))
            out[cell] += step.to(out.dtype)
            sq, n = scale.get(name, (0.0, 0))
            scale[name] = (sq + float(step.double().square().sum()), n + step.numel())

    def _bounded_steps(self, thin: list, scale: dict[str, tuple[float, int]]) -> None:
        """Thin cells: each covering update clipped to max_norm_ratio x the robust per-element step of its
        tensor (of the round, when the tensor has none), then averaged."""
        sq, n = (sum(v) for v in zip(*scale.values())) if scale else (0.0, 0)
        everywhere = math.sqrt(sq / n) if n else 0.0
        for out, cell, slices, name in thin:
            tsq, tn = scale.get(name, (0.0, 0))
            rms = math.sqrt(tsq / tn) if tn else everywhere
            limit = self.cfg.max_norm_ratio * rms * math.sqrt(slices[0].numel())
            clipped = [s * min(1.0, limit / norm) if (norm := float(torch.linalg.vector_norm(s))) > 0 else s
                       for s in slices]
            out[cell] += torch.stack(clipped).mean(0).to(out.dtype)


class MultiKrum(Buffered):
    """Multi-Krum (Blanchard et al. 2017) on the shared core: keep the n - f updates whose nearest
    n - f - 2 neighbours are closest, then NeFedAvg over them; f = krum_fraction of the round, capped at
    (n - 3) / 2, the most Krum can tell apart."""

    name = "krum"

    def __init__(self, layout: Layout, weighting: Weighting, cfg: AggregationConfig, seed: int) -> None:
        super().__init__(layout, weighting, cfg)
        self.seed = seed

    def _aggregate(self, state: GlobalState) -> GlobalState:
        n = len(self.held)
        f = min(int(self.cfg.krum_fraction * n), max(0, (n - 3) // 2))
        if f == 0:
            return self._nefedavg(state, ((h, 1.0) for h in self.held))
        sketch = Sketch(shared_core(self.layout, (h.k for h in self.held)), self.cfg.sketch, self.seed)
        points = torch.stack([sketch(h.delta) for h in self.held])
        dist = torch.cdist(points, points).square()
        scores = dist.sort(dim=1).values[:, 1:n - f - 1].sum(1)  # column 0 is the distance to itself
        keep = set(scores.argsort()[:n - f].tolist())
        self.dropped = {h.client: "krum" for i, h in enumerate(self.held) if i not in keep}
        return self._nefedavg(state, ((h, 1.0) for i, h in enumerate(self.held) if i in keep))


class FLTrust(Buffered):
    """FLTrust (Cao et al. 2021) per submodel: the server trains each submodel on its own small root set;
    an update's trust is ReLU(cosine to that root update of the same submodel), its norm is scaled to the
    root update's, and NeFedAvg weights it by its trust. Every update is judged on its whole submodel, so
    thin coverage does not weaken it; elements only zero-trust updates cover keep their value."""

    name = "fltrust"

    def __init__(self, layout: Layout, weighting: Weighting, cfg: AggregationConfig, reference: ReferenceUpdate,
                 index: int) -> None:
        super().__init__(layout, weighting, cfg)
        self.reference, self.index = reference, index
        self.trust: dict[str, float] = {}

    def _aggregate(self, state: GlobalState) -> GlobalState:
        kept = []
        for k in sorted({h.k for h in self.held}):
            root = self.reference(state, k, self.index)
            root_norm = update_norm(root)
            names = sorted(root)
            r = torch.cat([root[n].reshape(-1) for n in names])
            for h in (h for h in self.held if h.k == k):
                d = torch.cat([h.delta[n].reshape(-1) for n in names])
                trust = max(0.0, cosine(d, r))
                self.trust[h.client] = round(trust, 4)
                norm = float(torch.linalg.vector_norm(d))
                if trust <= 0 or norm == 0:
                    self.dropped[h.client] = "zero_trust"
                    continue
                scaled = {n: t.mul_(root_norm / norm) for n, t in h.delta.items()}
                kept.append((Held(h.client, k, scaled, h.samples), trust))
        return self._nefedavg(state, kept)

    def facts(self) -> dict[str, Any]:
        return {**super().facts(), **({"trust": dict(sorted(self.trust.items()))} if self.trust else {})}


class Screened(RoundAggregate):
    """The centre check in front of any rule: a majority vote on direction, and a bound on size.

    Each update is reduced to its relative norm (to its submodel's weight norm) and a sketch of the
    round's shared core. An update must point the same way as at least `min_agree` of the round's other
    updates, or it is dropped: with fewer than half of the updates hostile, an honest update agrees with
    the honest majority and a flipped or foreign one does not, whatever its size (a median centre of
    three sketches, one of them 9x the others, follows the large one where the two honest ones differ).
    Pointing the same way means a cosine above the margin, not merely above 0: an update unrelated to the
    others (-weights in a net with batch norm after every conv is near orthogonal to honest updates) has a
    cosine of either sign by chance, and a positive one with half of the others by a coin flip. The margin
    is `agree_z` / sqrt(sketch size), the spread of unrelated vectors' cosine, or `agree_of_strongest` x
    the round's strongest pairwise cosine where that is lower: honest updates of submodels far apart in
    size can align more weakly than the spread, and a hostile update raising the strongest cosine only
    brings the margin back to the spread's. Only updates within the size bound below vote (an outsized
    one is already an outlier). The vote acts only while `vote_quorum` of the voters reach `min_agree`:
    honest updates can point apart, and then no update is dropped for its direction. One larger than
    `max_norm_ratio` x the round's median relative norm is clipped to that if the vote confirmed it, and
    to the median itself if not (short of `min_agree` in a round where the vote abstained). The
    first `hold` updates are judged together, later ones each as of its arrival (the median, margin and
    others it had then) against the `compare` most recent (streaming: memory is `hold` updates plus one
    sketch per update). Later ones are judged in batches of up to `hold`, so that one product with the recent
    sketches scores a batch: reading 256 sketches (4 MiB) costs more than the arithmetic, and done per update
    it would be the largest single cost of a worker's update. With fewer than `min_cover` updates
    in the round there is no majority and nothing is screened."""

    compare = 256  # most recent sketches an arriving update is compared with: O(1) work per update

    def __init__(self, inner: RoundAggregate, cfg: AggregationConfig, weight_norm: Callable[[int], float],
                 assignments: Mapping[str, int], seed: int) -> None:
        super().__init__(inner.layout, inner.weighting)
        self.inner, self.cfg, self.weight_norm = inner, cfg, weight_norm
        self.name = inner.name
        self.mergeable = inner.mergeable
        self.hold = max(1, min(cfg.hold, len(assignments)))
        self.sketch = Sketch(shared_core(inner.layout, assignments.values()), cfg.sketch, seed)
        self.spread = cfg.agree_z / math.sqrt(max(1, self.sketch.size))  # agree_z x unrelated vectors' cosine spread
        self._strongest = 0.0  # the largest cosine between a sketch and one it was compared with on arrival
        # row i: update i's sketch, its norm and relative norm; rows grow by doubling, so a vote is one product with a
        # slice, not a stack, and nothing about an earlier update is recomputed
        rows = max(1, min(len(assignments), self.compare + 1))
        self.sketches = torch.empty(rows, self.sketch.size)
        self._sketch_rows = self.sketches.numpy()  # the same memory, for numpy's writes of each arrival's sketch
        self.norms = torch.empty(rows)
        self._norm_rows = self.norms.numpy()
        self.ratio_of = np.empty(rows)  # float64; numpy: a vote's few small operations cost less than torch's dispatch
        self._sorted: list[float] = []  # the relative norms so far, sorted: the median as each update arrives
        self.medians: dict[int, float] = {}  # sketch i (pending) -> the median relative norm as of its arrival
        self.count = 0  # sketches held
        self._normed = 0  # sketches whose norms are in `norms`
        self.scored = 0  # sketches whose arrival cosines are folded into the strongest
        # sketch i (pending) -> the first of the others it was compared with on arrival (they run to i - 1), those
        # cosines, and the strongest cosine of the round up to and including its arrival
        self.arrivals: dict[int, tuple[int, np.ndarray, float]] = {}
        self.streaming = False  # the first `hold` were judged: the rest are judged each as of its arrival
        self.pending: list[tuple[Held, int, float]] = []  # (update, index of its sketch, relative norm)
        self.clipped: dict[str, float] = {}  # client -> the factor its update was scaled by
        self.agreement: dict[str, float] = {}  # client -> the share of the others it points the same way as
        self.judged = self.agreed = 0  # voters judged, and those that reached `min_agree`

    def add_validated(self, k: int, delta: dict[str, torch.Tensor], num_samples: int = 1, *, client: str = "",
                      owned: bool = False) -> None:
        self._check_open()
        update_weight(self.weighting, num_samples)
        delta = delta if owned else {n: t.to(torch.float32, copy=True) for n, t in delta.items()}
        ratio = update_norm(delta) / max(self.weight_norm(k), 1e-12)
        i = self._row()
        self.sketch.into(delta, self._sketch_rows[i])
        self.ratio_of[i] = ratio
        bisect.insort(self._sorted, ratio)
        self.medians[i] = self.median_ratio()
        self.updates[k] += 1
        self.pending.append((Held(client, k, delta, num_samples), i, ratio))
        if self.count >= self.hold and (not self.streaming or len(self.pending) >= self.hold):
            self._judge_pending()

    @property
    def strongest(self) -> float:
        """The largest cosine between a sketch and one it was compared with on arrival."""
        self._score()
        return self._strongest

    @property
    def margin(self) -> float:
        """The least cosine that counts as pointing the same way."""
        return self._margin(self.strongest)

    def _margin(self, strongest: float) -> float:
        return max(0.0, min(self.spread, self.cfg.agree_of_strongest * strongest))

    def _score(self) -> None:
        """The arrival cosines of the sketches added since the last call, in one product of the recent rows with
        theirs: sketch i was compared on arrival with the `compare` before it."""
        first, n = self.scored, self.count
        if first == n:
            return
        lo = max(0, first - self.compare)
        sketches, norms = self._sketch_rows, self._norms()
        cos = _cosines(sketches[lo:n], norms[lo:n], sketches[first:n], norms[first:n])
        for b, i in enumerate(range(first, n)):
            a = max(0, i - self.compare)
            mine = cos[a - lo:i - lo, b]
            if len(mine):
                self._strongest = max(self._strongest, float(mine.max()))
            self.arrivals[i] = (a, mine, self._strongest)
        self.scored = n

    def _norms(self) -> np.ndarray:
        """The sketches' norms, those of the sketches added since the last call in one batched call (a call per
        arrival would cost as much in dispatch as its norm's arithmetic)."""
        if self._normed < self.count:
            torch.linalg.vector_norm(self.sketches[self._normed:self.count], dim=1, out=self.norms[self._normed:self.count])
            self._normed = self.count
        return self._norm_rows

    def _others(self, i: int) -> torch.Tensor:
        """The indices of the sketches sketch i is compared with: the `compare` most recent, not itself."""
        n = self.count
        lo = max(0, n - self.compare - 1)
        lo += i < lo  # i is not among the most recent: the `compare` before the newest
        others = torch.arange(lo, n)
        return others[others != i]

    def _row(self) -> int:
        """The index of a new sketch's row, the rows doubled when full."""
        if self.count == len(self.ratio_of):  # numpy's len: torch's is a Python-level call
            grow = max(1, self.count)
            self.sketches = torch.cat([self.sketches, torch.empty_like(self.sketches[:grow])])
            self._sketch_rows = self.sketches.numpy()
            self.norms = torch.cat([self.norms, torch.empty_like(self.norms[:grow])])
            self._norm_rows = self.norms.numpy()
            self.ratio_of = np.concatenate([self.ratio_of, np.empty(grow)])
        self.count += 1
        return self.count - 1

    def cosines(self, i: int, others: torch.Tensor) -> np.ndarray:
        """Sketch i's cosines with `others` (ascending: a run of recent rows, less at most one): one product with
        the rows' span, a view (gathering 256 rows first copied 4 MiB per update, more than the product)."""
        if not len(others):
            return np.empty(0, dtype=np.float32)
        lo, hi = int(others[0]), int(others[-1]) + 1
        sketches, norms = self._sketch_rows, self._norms()
        return _cosines(sketches[lo:hi], norms[lo:hi], sketches[i:i + 1], norms[i:i + 1])[(others - lo).numpy(), 0]

    def compared(self, i: int) -> tuple[torch.Tensor, np.ndarray]:
        """The others sketch i is compared with now and its cosines with them: those of its arrival while it is the
        newest (one product, not two)."""
        if i == self.count - 1 and i in self.arrivals:
            a, cos, _ = self.arrivals[i]
            return torch.arange(a, i), cos
        others = self._others(i)
        return others, self.cosines(i, others)

    def voter_limit(self) -> float:
        """The relative norm above which an update is outsized: it is clipped, and it does not vote."""
        return self.cfg.max_norm_ratio * self.median_ratio()

    def agrees(self, i: int, limit: float | None = None) -> float:
        """The share of the voters among the others sketch i is compared with whose cosine with it exceeds the
        margin. Voters are the updates within the size bound (`voter_limit`, given when judging many at once): one
        above it is already an outlier, and a large flip's chance cosine with one of two weakly aligned honest
        updates must not outvote the other (docs/security.md, "Robust aggregation over nested submodels")."""
        others, cos = self.compared(i)
        return self._share(self.ratio_of[others.numpy()], cos, self.voter_limit() if limit is None else limit, self.margin)

    @staticmethod
    def _share(ratios: np.ndarray, cos: np.ndarray, limit: float, margin: float) -> float:
        """The share of the voters (relative norms `ratios` within `limit`) whose cosine `cos` exceeds `margin`
        (compared in float32, as the cosines are)."""
        voting = ratios <= limit
        return np.count_nonzero(cos[voting] > np.float32(margin)) / max(1, np.count_nonzero(voting))

    @property
    def ratios(self) -> list[float]:
        """The round's relative norms, in arrival order."""
        return self.ratio_of[:self.count].tolist()

    def median_ratio(self) -> float:
        """The median of the round's relative norms, the lower of the middle two for an even count (the median one
        is not clipped), infinite while there are too few for a centre."""
        n = len(self._sorted)
        return self._sorted[(n - 1) // 2] if n >= self.cfg.min_cover else math.inf

    def _short(self, pending: list[tuple[Held, int, float]], limit: float, n: int,
               share_of: Callable[[int, float], float]) -> tuple[set[int], bool]:
        """Sketch indices short of `min_agree`, and whether the vote drops them: only while at least `vote_quorum`
        of the round's voters (updates within the size bound `limit`) reach it. Honest updates can point apart
        (non-IID shards, submodels of different size compared on their shared core); then nobody has a majority,
        the vote has nothing to go by, and the size bound alone applies, at the median for the outsized updates it
        could not confirm. Outsized updates count for the quorum no more than they vote: else a few large flips
        among the first `hold` could keep the quorum short and the vote from acting on them (docs/security.md,
        "Robust aggregation over nested submodels")."""
        if n < self.cfg.min_cover or not self.sketch.size:
            return set(), False
        short = set()
        for h, i, ratio in pending:
            share = self.agreement[h.client] = round(share_of(i, limit), 4)
            if share < self.cfg.min_agree:
                short.add(i)
            if ratio <= limit:
                self.judged += 1
                self.agreed += share >= self.cfg.min_agree
        return short, self.agreed >= self.cfg.vote_quorum * self.judged - 1e-9

    def _judge_pending(self) -> None:
        """The held updates: the first `hold` together, each against all the others, with the round as it stands;
        later ones each as of its arrival."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        self._score()
        if not self.streaming:
            self.streaming = self.count >= self.hold
            self._judge(pending, self.count, self.median_ratio(), self.agrees)
            return
        for entry in pending:
            i = entry[1]
            a, cos, strongest = self.arrivals[i]
            self._judge([entry], i + 1, self.medians[i],
                        lambda _, limit: self._share(self.ratio_of[a:i], cos, limit, self._margin(strongest)))

    def _judge(self, pending: list[tuple[Held, int, float]], n: int, median_ratio: float,
               share_of: Callable[[int, float], float]) -> None:
        """Drop, clip or keep each of `pending`, with the round as it stood at its first `n` updates (median
        relative norm `median_ratio`)."""
        limit = self.cfg.max_norm_ratio * median_ratio
        short, vote = self._short(pending, limit, n, share_of)
        for h, i, ratio in pending:
            self.arrivals.pop(i, None)
            self.medians.pop(i, None)
            if vote and i in short:
                self.dropped[h.client] = "against_centre"
                continue
            delta, bound = h.delta, limit
            if ratio > bound and i in short:  # outsized and unconfirmed: nothing speaks for more than the median
                bound = median_ratio
            if ratio > bound:
                self.clipped[h.client] = factor = bound / ratio
                delta = {name: t.mul_(factor) for name, t in delta.items()}
            self.inner.add_validated(h.k, delta, h.samples, client=h.client, owned=True)

    def merge(self, other: RoundAggregate) -> None:
        self._judge_pending()
        self.inner.merge(other.inner if isinstance(other, Screened) else other)
        self.updates = [a + b for a, b in zip(self.updates, other.updates)]

    def add_noise(self, std: float, generator: torch.Generator) -> None:
        self._judge_pending()
        self.inner.add_noise(std, generator)

    def partial(self) -> NeFedAvg:
        """Judge what is still held, then the inner rule's sums (a worker ships them)."""
        self._judge_pending()
        return self.inner.partial()

    @property
    def held_bytes(self) -> int:
        return (self.inner.held_bytes + tensor_bytes(t for h, _, _ in self.pending for t in h.delta.values())
                + tensor_bytes([self.sketches[:self.count]]))

    def finalize(self, state: GlobalState) -> GlobalState:
        self._check_open()
        self._judge_pending()
        new = self.inner.finalize(state)
        self.dropped = {**self.dropped, **self.inner.dropped}
        self._finalized = True
        return new

    def facts(self) -> dict[str, Any]:
        clipped = {c: round(f, 4) for c, f in sorted(self.clipped.items())}
        return {**self.inner.facts(), **super().facts(), **({"clipped_to_centre": clipped} if clipped else {}),
                **({"agreement": dict(sorted(self.agreement.items()))} if self.agreement else {})}


@dataclass(frozen=True)
class AggregationRule:
    """The Aggregator (nefl/aggregation/aggregate.py) of a config: begins each round's aggregate, screened when asked."""

    layout: Layout
    cfg: AggregationConfig
    weighting: Weighting = "uniform"
    reference: ReferenceUpdate | None = None  # FLTrust's root updates
    seed: int = 0

    def __post_init__(self) -> None:
        if self.cfg.rule == "fltrust" and self.reference is None:
            raise ValueError("--aggregator fltrust needs root data on the server: give --root-data DATASET "
                             "(or --eval-dataset, whose test split it uses by default)")

    @property
    def name(self) -> str:
        return self.cfg.rule

    @property
    def mergeable(self) -> bool:
        return self.cfg.mergeable

    def begin_round(self, state: GlobalState, assignments: Mapping[str, int], index: int = 0,
                    weight_norm: Callable[[int], float] | None = None) -> RoundAggregate:
        seed = self.seed * 1_000_003 + index
        inner = self._rule(seed, index)
        if not self.cfg.centre_check:
            return inner
        weight_norm = weight_norm or functools.cache(lambda k: reference_norm(state, self.layout, k))  # once a round
        return Screened(inner, self.cfg, weight_norm, assignments, seed)

    def _rule(self, seed: int, index: int) -> RoundAggregate:
        c, layout, w = self.cfg, self.layout, self.weighting
        if c.rule == "nefedavg":
            return NeFedAvg(layout, w)
        if c.rule == "median":
            return CoordinateWise(layout, w, c, "median", coordinate_median)
        if c.rule == "trimmed-mean":
            return CoordinateWise(layout, w, c, "trimmed-mean", lambda x: trimmed_mean(x, c.trim))
        if c.rule == "krum":
            return MultiKrum(layout, w, c, seed)
        return FLTrust(layout, w, c, self.reference, index)
