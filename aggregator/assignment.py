"""Which submodel each participant of a round trains, within the bound its device announced.

A device announces the largest submodel it can train now; the server may assign any submodel up to
that bound. Always assigning the bound starves the small submodels whenever devices are alike (two
identical laptops train submodel 5 forever and submodels 1-4 stay at chance), yet NeFL's point is
that every submodel is usable. So the choice is a policy, named on the command line:

  coverage  every submodel gets a participant each round when the pool allows (default)
  largest   each participant trains its announced bound
  paper     the paper's dynamic setting: tier t picks uniformly among submodels t-2..t+2

A policy is a pure function of the participants and the training history, so it is tested without a
federation and the simulator and the server assign with the same code.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from nefl.support.choices import check_choice
from nefl.support.settings import PAPER_WINDOW

Assignment = Literal["coverage", "largest", "paper"]  # as `--assignment` takes them


@dataclass(frozen=True)
class Candidate:
    """A participant as the policy sees it (0-based submodels)."""

    client: str
    max_submodel: int  # the largest it can train now
    tier: int  # centre of the paper's window: a fixed tier in the simulator, else max_submodel


Policy = Callable[[Sequence[Candidate], Sequence[int], random.Random], dict[str, int]]


def coverage_order(trained: Sequence[int]) -> list[int]:
    """Submodels by need: fewest updates so far first, smaller first among equals; rotating through
    the least-trained lets two clients cover five submodels over three rounds."""
    return sorted(range(len(trained)), key=lambda k: (trained[k], k))


def paper_window(tier: int, max_submodel: int) -> range:
    """Submodels tier `tier` picks from, clipped to what the device can train now."""
    hi = min(max_submodel, tier + PAPER_WINDOW)
    return range(min(max(0, tier - PAPER_WINDOW), hi), hi + 1)


def assign_largest(candidates: Sequence[Candidate], order: Sequence[int], rng: random.Random) -> dict[str, int]:
    return {c.client: c.max_submodel for c in candidates}


def assign_paper(candidates: Sequence[Candidate], order: Sequence[int], rng: random.Random) -> dict[str, int]:
    """One uniform draw per candidate, in the order given, so a seeded run replays exactly."""
    return {c.client: rng.choice(paper_window(c.tier, c.max_submodel)) for c in candidates}


def assign_coverage(candidates: Sequence[Candidate], order: Sequence[int], rng: random.Random) -> dict[str, int]:
    """Each submodel in `order` goes to the least capable free candidate that can train it, which
    keeps the capable ones for the larger submodels (eligibility is nested, so this covers as many
    submodels as any assignment can); the candidates left over train their bound."""
    free = sorted(candidates, key=lambda c: c.max_submodel)  # stable: ties keep the candidates' order
    out: dict[str, int] = {}
    for k in order:
        pick = next((c for c in free if c.max_submodel >= k), None)
        if pick is not None:
            out[pick.client] = k
            free.remove(pick)
    return {**out, **{c.client: c.max_submodel for c in free}}


POLICIES: dict[Assignment, Policy] = {"coverage": assign_coverage, "largest": assign_largest, "paper": assign_paper}


def get_policy(name: str) -> Policy:
    check_choice(Assignment, name, "--assignment")
    return POLICIES[name]
