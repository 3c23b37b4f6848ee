"""Where updates of a nested round can be compared element by element.

In a nested ladder each element of a global tensor is covered by a different subset of the round's
updates: the corner of submodel 1 by every update, the outer ring of the largest submodel by that
submodel's updates only. So a coordinate-wise statistic is taken per *cell*: the boxes between the
channel cuts of the covering submodels, each with its own covering set (`coverage_cells`). Whole
updates are compared on their shared core (`shared_core`), through a fixed random subset of it
(`Sketch`): what the centre check (nefl/aggregation/centre_check.py) and Krum (nefl/aggregation/krum.py)
measure cosines and distances on.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable

import numpy as np
import torch

from nefl.nested.state import Layout
from nefl.nested.tensors import Tiled, Tiling, corner

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


def pairwise_cosines(rows: np.ndarray, row_norms: np.ndarray, cols: np.ndarray, col_norms: np.ndarray) -> np.ndarray:
    """cos[r, c] of sketch rows with sketch cols (float32; 0 where either is zero), given their norms. numpy's BLAS
    (OpenBLAS) rather than torch's: torch's MKL runs this small product far slower on some hosts, and it is the
    centre check's largest single cost (one thread each: nefl/support/threads.py)."""
    norms = np.outer(row_norms, col_norms)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        cos = (rows @ cols.T) / np.maximum(norms, np.float32(1e-30))
    return np.where(norms > 0, cos, np.float32(0))

