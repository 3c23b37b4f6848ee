"""A per-tensor bound on the committed step of the per-submodel tensors (batch norm, step sizes) and of
the shared tensors' thinly covered cells.

A submodel's inconsistent tensors are averaged over that submodel's updates only, so in a round of a
few devices on several submodels each copy is moved by a single update: no vote or statistic can judge
it, and the size clip bounds a whole update, where batch-norm statistics are most of the norm. An
update of -weights then moves gamma, running variances and step sizes by up to -1 x themselves.

So each copy's step (new - old of submodel k's tensor `name`) is measured per element, as its RMS, and
bounded by `k` x the median of a pool: the RMS steps of the same tensor's other copies this round (the
other submodels' batch norm of the same layer: peers of the same round, honest while most copies are)
and the tensor's history, one entry per earlier round that moved at least `peers` copies, that round's
median over its copies. A copy above the bound is scaled down to it. The history is never built from a
lone copy or a pair (which one update decides), so an attacker that is the only trainer of a submodel
cannot ratchet it; it moves only while it controls most copies of a round. Warm-up: no bound until the
pool holds `peers` sizes (round 1 already, when `peers` submodels trained). Honest steps are clipped when
one copy's step exceeds `k` x the median of its peers and history, e.g. a submodel trained for the first
time after the others settled; it then moves at most `k` x the typical step per round.

Running variances must stay positive: their steps are taken in log space (new / old), so the
committed value is old x exp(bounded step), positive and finite whatever the update said.

It runs where a round's candidate state is committed (aggregator/federation.py), with the centre check,
so `serve`, the coordinator of `--workers` and `simulate` all apply it, under any rule. Cost: one pass
over the per-submodel tensors at commit, no update held.

Consistent (shared, nested) tensors get the same rule per cell of the nesting: the ring of submodel k's
slice outside the next smaller slice is covered only by the round's updates of submodels whose slice
contains it, so in a round of three the largest submodel's outer ring is moved by one update. Each cell
covered by fewer than `peers` updates has its committed step's RMS bounded by `k` x the median of a pool:
the same tensor's cells this round covered by at least `WELL` updates (averages no lone update decides)
and the tensor's cell history, one entry per round that moved a well-covered cell, that round's median
over them. Cells covered by `peers` or more are left as the rule made them. Coverage counts the updates
the rule was given (`RoundAggregate.updates`): a rule that drops one counts it still, so a cell it left to
one update may count as two.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

import torch

from nefl.settings import AggregationConfig
from nefl.state import GlobalState, Layout
from nefl.tensors import ring

POSITIVE = ("running_var",)  # tensors a valid model keeps > 0: bounded in log space
_TINY = 1e-30  # a non-positive running variance counts as this before its log
WELL = 2  # a cell covered by at least this many updates is an average no lone update decides: it joins the pool

Box = tuple[slice, ...]


def positive(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in POSITIVE


def _step(name: str, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The step of one copy in float64: the difference, or the log ratio for a positive tensor."""
    old, new = old.double(), new.double()
    return new.clamp_min(_TINY).log() - old.log() if positive(name) else new - old


def _apply(name: str, old: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    out = old.double() * step.exp() if positive(name) else old.double() + step
    return out.to(old.dtype)


def rms(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t)) / math.sqrt(max(1, t.numel()))


def cells(layout: Layout, name: str) -> list[tuple[list[Box], list[int]]] | None:
    """Consistent tensor `name`'s cells of the nesting, largest first: each one's boxes (`ring` of one
    submodel slice outside the next smaller one) and the submodels whose slice contains it. None when the
    slices are not nested (a hand-written ladder): the tensor is then not bounded."""
    shapes = sorted({s[name] for s in layout.sub_shapes if name in s}, key=lambda s: s.numel(), reverse=True)
    if not all(all(i <= o for i, o in zip(inner, outer)) for outer, inner in zip(shapes, shapes[1:])):
        return None
    return [(ring(outer, shapes[i + 1] if i + 1 < len(shapes) else None),
             [k for k, s in enumerate(layout.sub_shapes) if name in s and all(a >= b for a, b in zip(s[name], outer))])
            for i, outer in enumerate(shapes)]


class StepBound:
    """The bound's history across rounds, one per inconsistent tensor name (all submodels' copies)."""

    def __init__(self, layout: Layout, cfg: AggregationConfig) -> None:
        self.names = sorted(layout.inconsistent - layout.local)
        self.k, self.peers, self.window = cfg.step_k, cfg.min_cover, cfg.step_window
        consistent = {n: cells(layout, n) for n in sorted(set(layout.global_shapes) - layout.inconsistent)}
        self.cells = {n: c for n, c in consistent.items() if c is not None}
        self.history: dict[str, deque[float]] = {n: deque(maxlen=self.window) for n in [*self.names, *self.cells]}
        self._pending: dict[str, float] = {}  # this round's medians, for the history once the round commits

    def limit(self, name: str, sizes: list[float]) -> float:
        """k x the median of this round's copies' sizes and the tensor's history; inf during warm-up."""
        pool = [*sizes, *self.history[name]]
        return self.k * statistics.median(pool) if len(pool) >= self.peers else math.inf

    def apply(self, old: GlobalState, new: GlobalState, updates: list[int]) -> dict[int, int]:
        """Bound every moved copy of `new` in place (the round's candidate), and every thinly covered cell of
        its consistent tensors (`updates`: the round's updates per submodel); returns how many tensors of
        each submodel were scaled down (a cell counts for the largest submodel covering it). A positive
        tensor's copy is also rebuilt from its log step when a value went non-positive or non-finite."""
        bounded: dict[int, int] = {}
        self._pending = {}
        for name, cells_ in self.cells.items():
            for k in self._bound_cells(name, cells_, old.consistent[name], new.consistent[name], updates):
                bounded[k] = bounded.get(k, 0) + 1
        for name in self.names:
            copies = []
            for k, (o, n) in enumerate(zip(old.inconsistent, new.inconsistent)):
                if name in o and not torch.equal(o[name], n[name]):
                    step = _step(name, o[name], n[name])
                    copies.append((k, step, rms(step)))
            if not copies:
                continue
            sizes = [s for _, _, s in copies if math.isfinite(s)]
            limit = self.limit(name, sizes)
            for k, step, size in copies:
                invalid = positive(name) and not bool((new.inconsistent[k][name] > 0).all())
                if size > limit or not math.isfinite(size) or invalid:
                    step = torch.nan_to_num(step, nan=0.0, posinf=0.0, neginf=0.0)
                    size = rms(step)
                    if size > limit:
                        step = step * (limit / size)
                        bounded[k] = bounded.get(k, 0) + 1
                    new.inconsistent[k][name] = _apply(name, old.inconsistent[k][name], step)
            if len(sizes) >= self.peers:
                self._pending[name] = statistics.median(sizes)
        return bounded

    def _bound_cells(self, name: str, cells_: list[tuple[list[Box], list[int]]], old: torch.Tensor,
                     new: torch.Tensor, updates: list[int]) -> list[int]:
        """Scale each thin cell's step in `new` (in place) to k x the median of the well-covered cells and
        history; returns the largest covering submodel of each cell scaled down."""
        moved = []
        for boxes, ks in cells_:
            cover = sum(updates[k] for k in ks)
            steps = [_step(name, old[b], new[b]) for b in boxes]
            size = math.sqrt(sum(float(torch.linalg.vector_norm(t)) ** 2 for t in steps) / max(1, sum(t.numel() for t in steps)))
            if cover > 0 and size > 0:
                moved.append((boxes, ks, cover, steps, size))
        sizes = [size for _, _, cover, _, size in moved if cover >= WELL and math.isfinite(size)]
        limit = self.limit(name, sizes)
        out = []
        for boxes, ks, cover, steps, size in moved:
            if cover < self.peers and size > limit:
                for b, step in zip(boxes, steps):
                    new[b] = _apply(name, old[b], torch.nan_to_num(step, nan=0.0, posinf=0.0, neginf=0.0) * (limit / size))
                out.append(max(ks))
        if sizes:
            self._pending[name] = statistics.median(sizes)
        return out

    def commit(self) -> None:
        """The round's state was committed: its medians (rounds with enough copies) join the history."""
        for name, size in self._pending.items():
            self.history[name].append(size)
        self._pending = {}

    def state_dict(self) -> dict[str, Any]:
        return {"history": {n: list(h) for n, h in self.history.items() if h}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resumed server keeps its bounds; refuses a history that is not finite sizes per known tensor."""
        history = state.get("history") if isinstance(state, dict) else None
        if not isinstance(history, dict) or not all(
                n in self.history and isinstance(h, list) and all(type(x) in (int, float) and math.isfinite(x) and x >= 0
                                                                  for x in h) for n, h in history.items()):
            raise ValueError("the checkpoint's step-bound history is not finite step sizes per per-submodel tensor: "
                             "resume with the profile the checkpoint was written with")
        for n, h in history.items():
            self.history[n] = deque((float(x) for x in h), maxlen=self.window)
