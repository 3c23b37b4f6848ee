"""The base of the rules that hold every update of a round until finalize (median, trimmed mean, Krum,
FLTrust): what a robust statistic needs, at the memory of the sum of the updates' sizes (`held_bytes`).
So they do not merge partials across processes: with aggregator workers only NeFedAvg runs, screened by
the centre check in each worker (a two-level scheme: each worker judges its share against the centre of
what it saw).

`CoordinateWise` takes a statistic per element over exactly the updates that cover it (per cell,
nefl/aggregation/coverage.py `coverage_cells`, and per submodel for the inconsistent tensors (BN, steps),
which only that submodel's updates carry). Where coverage is too thin for the statistic to be robust
(fewer than `min_cover` updates: a median of two is their mean), the step is bounded: each covering
update is clipped, on that cell, to `max_norm_ratio` times the per-element size of the robust step of
the same tensor (or of the round, when the tensor has no well-covered cell), then averaged. A round with
fewer than `min_cover` updates in all has no robust statistic anywhere and is the plain mean.
docs/security.md has what each rule costs and what still gets through.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

import torch

from nefl.aggregation.aggregate import RoundAggregate, RoundContext, Weighting, tensor_bytes, update_weight
from nefl.aggregation.config import AggregationConfig
from nefl.aggregation.coverage import Cell, coverage_cells
from nefl.aggregation.nefedavg import NeFedAvg
from nefl.nested.state import GlobalState, Layout
from nefl.nested.tensors import corner

if TYPE_CHECKING:
    from typing import Self


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

    @classmethod
    def begin(cls, ctx: RoundContext) -> Self:
        return cls(ctx.layout, ctx.weighting, ctx.cfg)

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

    @abstractmethod
    def _aggregate(self, state: GlobalState) -> GlobalState:
        """The new state from the held updates."""

    def _nefedavg(self, state: GlobalState, kept: Iterable[tuple[Held, float]]) -> GlobalState:
        """NeFedAvg over the updates a filter kept, each with its weight (its own under `samples` weighting
        times the filter's)."""
        agg = NeFedAvg(self.layout, self.weighting)
        for h, weight in kept:
            agg.add_weighted(h.k, h.delta, weight * update_weight(self.weighting, h.samples), owned=True)
        return agg.finalize(state)


class CoordinateWise(Buffered):
    """Median or trimmed mean per element over the updates covering it, with bounded steps where thin."""

    @abstractmethod
    def _stat(self, stack: torch.Tensor) -> torch.Tensor:
        """The statistic over dim 0 of the covering updates' slices of a cell."""

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
