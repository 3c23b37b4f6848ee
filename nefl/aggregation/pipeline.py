"""A config's Aggregator: the rule it names, screened by the centre check when asked."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from nefl.aggregation.aggregate import RoundAggregate, Weighting
from nefl.aggregation.centre_check import Screened
from nefl.aggregation.fltrust import FLTrust, ReferenceUpdate
from nefl.aggregation.krum import MultiKrum
from nefl.aggregation.median import Median
from nefl.aggregation.nefedavg import NeFedAvg
from nefl.aggregation.robust import reference_norm
from nefl.aggregation.trimmed_mean import TrimmedMean
from nefl.nested.state import GlobalState, Layout
from nefl.support.settings import AggregationConfig


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
            return Median(layout, w, c)
        if c.rule == "trimmed-mean":
            return TrimmedMean(layout, w, c)
        if c.rule == "krum":
            return MultiKrum(layout, w, c, seed)
        return FLTrust(layout, w, c, self.reference, index)
