"""FLTrust per submodel: trust from the cosine to the server's own root update of the same submodel."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from nefl.aggregation.aggregate import ReferenceUpdate, RoundContext, Weighting
from nefl.aggregation.buffered import Buffered, Held
from nefl.aggregation.config import AggregationConfig
from nefl.aggregation.robust import update_norm
from nefl.nested.state import GlobalState, Layout

if TYPE_CHECKING:
    from typing import Self


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    na, nb = float(torch.linalg.vector_norm(a)), float(torch.linalg.vector_norm(b))
    return float(torch.dot(a, b)) / (na * nb) if na > 0 and nb > 0 else 0.0


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

    @classmethod
    def begin(cls, ctx: RoundContext) -> Self:
        if ctx.reference is None:  # the registry's root_data: the Pipeline refuses to start without it
            raise ValueError("fltrust needs the server's root updates")
        return cls(ctx.layout, ctx.weighting, ctx.cfg, ctx.reference, ctx.index)

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
