"""The aggregation seam: the one place where submodel updates become the new global state.

A round's aggregate is a `RoundAggregate` (begun by the federation's aggregation Pipeline,
nefl/aggregation/pipeline.py; then add, finalize); the round engine, the workers and the simulator hold
one without knowing which rule it is. The rules are named in nefl/aggregation/registry.py, one module
each. NeFedAvg (nefl/aggregation/nefedavg.py) is the default and `Mergeable` (there): its partial
aggregates merge exactly (workers, relays) and DP noise is calibrated to its sums; the robust rules
(nefl/aggregation/buffered.py and the rules built on it) hold the round's updates.

Consistent tensors: each element is averaged over exactly the updates whose submodel contains it
(width prefix and block present); an element nobody covered keeps its value. Inconsistent tensors:
FedAvg within each submodel, untouched when nobody trained it. Updates are deltas (trained -
received), so averaging deltas equals the paper's averaging of weights. `coverage_mean` is that rule
written once, for any windows; NeFedAvg's fold of leading corners is its fast special case, and
FedRolex's rolling windows (nefl/aggregation/rolling.py) and FedJigsaw's source averaging
(nefl/jigsaw/symbio.py) call it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from nefl.aggregation.config import AggregationConfig
from nefl.aggregation.update_check import UpdateError, check_update
from nefl.nested.state import GlobalState, Layout
from nefl.support.choices import check_choice
from nefl.support.settings import Weighting

if TYPE_CHECKING:
    from typing import Self

# the server's own delta of submodel k of round `index` from `state` on its root data (FLTrust's root update)
ReferenceUpdate = Callable[[GlobalState, int, int], dict[str, torch.Tensor]]
# per dimension of a global tensor: the indices a part covers (a slice, an index tensor, or None = all)
Window = tuple[slice | torch.Tensor | None, ...]


def _indices(size: int, w: slice | torch.Tensor | None) -> torch.Tensor:
    if w is None:
        return torch.arange(size)
    if isinstance(w, slice):
        return torch.arange(size)[w]
    return w


def coverage_mean(old: torch.Tensor, parts: Iterable[tuple[Window, torch.Tensor, float]]) -> torch.Tensor:
    """The coverage-average rule: every element of `old` moves by the sum of the delta sums that cover
    it divided by their total weight; an element no part covers is `old`'s element bit for bit.
    `parts`: (window of `old`, weighted sum of deltas shaped like old[window], total weight of that sum).
    Sums in float64, so the order of parts does not matter to float32 precision."""
    total = torch.zeros(old.shape, dtype=torch.float64)
    cover = torch.zeros(old.shape, dtype=torch.float64)
    for window, delta_sum, weight in parts:
        if len(window) != old.dim():
            raise ValueError(f"a window for {len(window)} dims on a {old.dim()}-dim tensor")
        grid = torch.meshgrid(*(_indices(n, w) for n, w in zip(old.shape, window)), indexing="ij") if old.dim() else ()
        total.index_put_(grid, delta_sum.to(torch.float64), accumulate=True)
        cover.index_put_(grid, torch.full(delta_sum.shape, float(weight), dtype=torch.float64), accumulate=True)
    new = (old.to(torch.float64) + total / cover.clamp_min(1e-300)).to(old.dtype)
    return torch.where(cover > 0, new, old)


def update_weight(weighting: Weighting, samples: int) -> float:
    """What one update counts for under `weighting`."""
    w = float(samples) if weighting == "samples" else 1.0
    if w <= 0:
        raise UpdateError(f"sample count must be positive, got {samples}")
    return w


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class RoundContext:
    """What a rule's aggregate of one round is begun from (`RoundAggregate.begin`)."""

    layout: Layout
    cfg: AggregationConfig
    weighting: Weighting = "uniform"
    index: int = 0  # the round
    seed: int = 0  # the round's seed: the federation's, mixed with the round index
    reference: ReferenceUpdate | None = None  # the server's root updates, for a rule whose registry entry needs them


class RoundAggregate(ABC):
    """One round's aggregate under some rule. Updates reach it validated (names, shapes, finite values)
    and bounded; finalize makes the new global state once."""

    name: ClassVar[str]

    def __init__(self, layout: Layout, weighting: Weighting = "uniform") -> None:
        check_choice(Weighting, weighting, "aggregation weighting")
        self.layout = layout
        self.weighting = weighting
        self.updates = [0] * layout.num_submodels  # updates added per submodel
        # client -> why the rule left its update out of the new state (filtered, zero trust); finalize fills it
        self.dropped: dict[str, str] = {}
        self._finalized = False

    @classmethod
    def begin(cls, ctx: RoundContext) -> Self:
        """The rule's aggregate of a round (what nefl/aggregation/registry.py's factory names is asked for)."""
        return cls(ctx.layout, ctx.weighting)

    def add(self, k: int, delta: dict[str, torch.Tensor], num_samples: int = 1, *, client: str = "",
            owned: bool = False) -> None:
        """An update from a caller without an intake (tests, an attack's search): intake's check, then the rule."""
        self._check_open()
        check_update(self.layout, k, delta)
        self.add_validated(k, delta, num_samples, client=client, owned=owned)

    @abstractmethod
    def add_validated(self, k: int, delta: dict[str, torch.Tensor], num_samples: int = 1, *, client: str = "",
                      owned: bool = False) -> None:
        """An update intake checked (nefl/aggregation/update_check.py). owned=True hands the tensors over (an update
        just decoded off the wire, dropped after this call): the aggregate may keep or sum into them."""

    @abstractmethod
    def finalize(self, state: GlobalState) -> GlobalState:
        """New global state; `state` (the one the deltas were computed from) is not modified. Once."""

    @property
    @abstractmethod
    def held_bytes(self) -> int:
        """Tensor memory this aggregate holds now: what a round costs beside the model."""

    @property
    def total_updates(self) -> int:
        return sum(self.updates)

    def facts(self) -> dict[str, Any]:
        """What the rule decided about the round's updates, for the metrics line (empty: all kept as sent)."""
        return {"dropped": dict(sorted(self.dropped.items()))} if self.dropped else {}

    def _check_open(self) -> None:
        if self._finalized:
            raise RuntimeError(f"this {self.name} aggregate was finalized (its sums became the new state): start a new one")


