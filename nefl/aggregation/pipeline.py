"""A config's Aggregator: the rule it names in nefl/aggregation/registry.py, screened by the centre check when asked."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from nefl.aggregation.aggregate import ReferenceUpdate, RoundAggregate, RoundContext, Weighting
from nefl.aggregation.centre_check import screened
from nefl.aggregation.robust import reference_norm
from nefl.nested.state import GlobalState, Layout
from nefl.support.settings import AggregationConfig


@dataclass(frozen=True)
class AggregationRule:
    """The Aggregator (nefl/aggregation/aggregate.py) of a config: begins each round's aggregate, screened when asked."""

    layout: Layout
    cfg: AggregationConfig
    weighting: Weighting = "uniform"
    reference: ReferenceUpdate | None = None  # the server's root updates (rules with root_data: FLTrust)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.cfg.spec.root_data and self.reference is None:
            raise ValueError(f"--aggregator {self.name} needs root data on the server: give --root-data DATASET "
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
        inner = self.cfg.spec.load().begin(RoundContext(self.layout, self.cfg, self.weighting, index, seed, self.reference))
        if not self.cfg.centre_check:
            return inner
        weight_norm = weight_norm or functools.cache(lambda k: reference_norm(state, self.layout, k))  # once a round
        return screened(inner, self.cfg, weight_norm, assignments, seed)
