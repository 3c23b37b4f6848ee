"""Multi-Krum on the updates' shared core (nefl/aggregation/coverage.py), then NeFedAvg over those kept."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nefl.aggregation.aggregate import RoundContext, Weighting
from nefl.aggregation.buffered import Buffered
from nefl.aggregation.config import AggregationConfig
from nefl.aggregation.coverage import Sketch, shared_core
from nefl.nested.state import GlobalState, Layout

if TYPE_CHECKING:
    from typing import Self


class MultiKrum(Buffered):
    """Multi-Krum (Blanchard et al. 2017) on the shared core: keep the n - f updates whose nearest
    n - f - 2 neighbours are closest, then NeFedAvg over them; f = krum_fraction of the round, capped at
    (n - 3) / 2, the most Krum can tell apart."""

    name = "krum"

    def __init__(self, layout: Layout, weighting: Weighting, cfg: AggregationConfig, seed: int) -> None:
        super().__init__(layout, weighting, cfg)
        self.seed = seed

    @classmethod
    def begin(cls, ctx: RoundContext) -> Self:
        return cls(ctx.layout, ctx.weighting, ctx.cfg, ctx.seed)

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
