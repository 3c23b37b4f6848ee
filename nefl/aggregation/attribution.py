"""Which updates made a round worse, for the held-out gate (nefl/aggregation/gate.py): a refused round no longer
stalls training when one device poisons every round.

`Recorded` is a round's aggregate that keeps a copy of each update it is given (up to `cap`) beside the rule's own
aggregate, so that Pipeline.commit can re-aggregate the round without some of them (its leave-one-out screen). When
the gate still trips, `leave_out` searches greedily: each step re-aggregates the round without each remaining
update in turn and leaves out the one whose absence brings the candidate closest to passing (Verdict.rank), until
the candidate passes or `max_out` updates are out; the round then commits without them (each named in the round's
`dropped`, reason "gate"). A partial merged in (workers, relays) carries no updates, and
neither does a round beyond `cap`: such a round is judged whole and refused when it trips.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nefl.aggregation.aggregate import RoundAggregate, tensor_bytes
from nefl.aggregation.gate import Verdict
from nefl.nested.state import GlobalState


@dataclass(frozen=True)
class Part:
    """One update as the round received it (after intake and the update bound)."""

    client: str
    k: int
    delta: dict[str, torch.Tensor]
    samples: int


class Recorded(RoundAggregate):
    """The rule's aggregate of a round (`inner`) plus a copy of each update it was given, up to `cap`. After
    `Pipeline.commit`, `chosen` is the aggregate the committed state came from (the round without the updates the
    gate left out, or `inner`); `dropped` and `facts` report it."""

    def __init__(self, inner: RoundAggregate, cap: int, index: int, weight_norm: Callable[[int], float] | None) -> None:
        self.inner = self.chosen = inner
        self.layout, self.weighting, self.name = inner.layout, inner.weighting, inner.name
        self.cap, self.index, self.weight_norm = cap, index, weight_norm
        self.parts: list[Part] = []
        self.attributable = True
        self.gate_facts: dict[str, Any] = {}
        self.gate_dropped: dict[str, str] = {}
        self._finalized = False

    def __getattr__(self, name: str) -> Any:  # the rule's own attributes (groups, weights, sizes, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def add_validated(self, k: int, delta: dict[str, torch.Tensor], num_samples: int = 1, *, client: str = "",
                      owned: bool = False) -> None:
        if self.attributable and len(self.parts) < self.cap:
            self.parts.append(Part(client, k, {n: t.detach().clone() for n, t in delta.items()}, num_samples))
        else:
            self.attributable = False
        self.inner.add_validated(k, delta, num_samples, client=client, owned=owned)

    def mergeable_inner(self) -> RoundAggregate:
        """The rule's aggregate, for a partial merged in or shipped (nefedavg.as_mergeable): no longer attributable."""
        self.attributable = False
        return self.inner

    def finalize(self, state: GlobalState) -> GlobalState:
        return self.inner.finalize(state)

    @property
    def updates(self) -> list[int]:  # type: ignore[override]
        return self.chosen.updates

    @property
    def dropped(self) -> dict[str, str]:  # type: ignore[override]
        return {**self.chosen.dropped, **self.gate_dropped}

    @property
    def held_bytes(self) -> int:
        return self.inner.held_bytes + sum(tensor_bytes(p.delta.values()) for p in self.parts)

    def facts(self) -> dict[str, Any]:
        out = {**self.chosen.facts(), **({"gate": self.gate_facts} if self.gate_facts else {})}
        if self.dropped:
            out["dropped"] = dict(sorted(self.dropped.items()))
        return out


def leave_out(n: int, max_out: int, trial: Callable[[frozenset[int]], Verdict | None]) -> frozenset[int] | None:
    """The updates (indices of the round's `n`) to leave out, at most `max_out`, found greedily: each step leaves out
    the one whose absence brings the candidate closest to passing (Verdict.rank); None when no such set passes.
    `trial(out)`: the gate's verdict on the round without `out`, None where that round has no finite, bounded state."""
    out: frozenset[int] = frozenset()
    while len(out) < max_out:
        scored = [(v.rank, i, v) for i in range(n) if i not in out
                  for v in [trial(out | {i})] if v is not None]
        if not scored:
            return None
        _, i, verdict = min(scored, key=lambda s: (s[0], s[1]))
        out |= {i}
        if not verdict.tripped:
            return out
    return None


def without(parts: Sequence[Part], out: frozenset[int]) -> list[Part]:
    return [p for i, p in enumerate(parts) if i not in out]
