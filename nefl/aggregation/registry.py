"""The aggregation rules by name: what `--aggregator` accepts and says, and where each rule lives.

Torch-free: the config (nefl/aggregation/config.py AggregationConfig) checks a rule's name against it and the
command lines build their help from it without loading torch; a rule's module is imported on its first round.
A new rule is one module (a RoundAggregate subclass, begun from a RoundContext by its `begin`) and one line here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    name: str
    description: str  # what `--aggregator`'s help says of it, after its name
    factory: str  # "module:Class": the RoundAggregate subclass whose `begin` makes a round's aggregate
    mergeable: bool = False  # its aggregates are Mergeable: partials of workers and relays merge exactly, DP noise
    root_data: bool = False  # it compares updates with the server's own root updates (--root-data)

    def load(self) -> type:
        """The rule's RoundAggregate subclass (nefl/aggregation/aggregate.py, which this torch-free module does not import)."""
        module, _, attr = self.factory.partition(":")
        return getattr(importlib.import_module(module), attr)


RULES: dict[str, Rule] = {r.name: r for r in (
    Rule("nefedavg", "streaming, exact; the only one with --workers", "nefl.aggregation.nefedavg:NeFedAvg", mergeable=True),
    Rule("median", "coordinate-wise", "nefl.aggregation.median:Median"),
    Rule("trimmed-mean", "coordinate-wise, --trim cut at each end", "nefl.aggregation.trimmed_mean:TrimmedMean"),
    Rule("krum", "multi-Krum on the parts all updates share", "nefl.aggregation.krum:MultiKrum"),
    Rule("fltrust", "root data on the server", "nefl.aggregation.fltrust:FLTrust", root_data=True),
)}


def rule(name: str) -> Rule:
    """The registered rule `name`; a ValueError that lists the names for any other."""
    if name not in RULES:
        raise ValueError(f"aggregator must be one of {', '.join(map(repr, RULES))}, got {name!r}")
    return RULES[name]


def help_text() -> str:
    """`--aggregator`'s help: every registered rule with its description."""
    rules = [f"{r.name} ({r.description})" for r in RULES.values()]
    return (f"How a round's updates merge: {', '.join(rules[:-1])} or {rules[-1]}; each over exactly the updates that "
            "cover an element (docs/security.md).")
