"""Who trains which submodel (aggregator/assignment.py): the coverage and paper policies on their own, against
brute force and the paper's tier windows (their use in a round is tests/unit/aggregator/test_federation.py's)."""

import random
from collections import Counter
from itertools import product

from aggregator.assignment import Candidate, assign_coverage, assign_paper, coverage_order, paper_window


def test_coverage_keeps_capable_devices_for_large_submodels_and_gives_the_rest_their_bound() -> None:
    mixed = [Candidate("a", 4, 4), Candidate("b", 0, 0), Candidate("c", 2, 2)]
    assert assign_coverage(mixed, coverage_order([0] * 5), random.Random(0)) == {"b": 0, "c": 1, "a": 2}
    alike = [Candidate(f"c{i}", 4, 4) for i in range(7)]
    got = assign_coverage(alike, coverage_order([0] * 5), random.Random(0))
    assert sorted(got.values()) == [0, 1, 2, 3, 4, 4, 4]
    assert coverage_order([3, 0, 1, 0, 2]) == [1, 3, 2, 4, 0]


def test_paper_policy_draws_uniformly_within_the_tier_window() -> None:
    """Simulator tiers (bound = top of the window) and server tiers (tier = the announced bound)."""
    assert [list(paper_window(t, min(t + 2, 4))) for t in range(5)] == \
        [[0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4], [1, 2, 3, 4], [2, 3, 4]]
    assert list(paper_window(3, 3)) == [1, 2, 3] and list(paper_window(0, 0)) == [0]
    rng = random.Random(0)
    draws = 3000
    for tier in range(5):
        bound = min(tier + 2, 4)
        counts = Counter(assign_paper([Candidate("x", bound, tier)], [], rng)["x"] for _ in range(draws))
        window = paper_window(tier, bound)
        assert set(counts) == set(window)
        for k in window:  # uniform: 3000 draws over 3-5 submodels, well inside 5 standard deviations
            assert abs(counts[k] - draws / len(window)) < 0.1 * draws, (tier, counts)


def test_coverage_covers_as_many_submodels_as_the_best_assignment() -> None:
    """Brute force over small pools: whatever the order of need, no assignment covers more."""
    rng = random.Random(0)
    for _ in range(300):
        bounds = [rng.randrange(5) for _ in range(rng.randrange(1, 5))]
        pool = [Candidate(f"c{i}", b, b) for i, b in enumerate(bounds)]
        order = coverage_order([rng.randrange(3) for _ in range(5)])
        best = max(len(set(ks)) for ks in product(*(range(b + 1) for b in bounds)))
        got = assign_coverage(pool, order, rng)
        assert len(set(got.values())) == best and all(got[c.client] <= c.max_submodel for c in pool), (bounds, order)
