"""Robust rules over nested submodels (nefl/aggregation/: median, trimmed_mean, krum, fltrust) against element-by-element brute force,
the centre check, and the aggregation seam: every rule is begun, fed and finalized the same way."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nefl.aggregation.centre_check import Screened
from nefl.aggregation.config import PLAIN_NEFEDAVG, AggregationConfig
from nefl.aggregation.coverage import Sketch, coverage_cells, distinct_sample, shared_core
from nefl.aggregation.median import coordinate_median
from nefl.aggregation.nefedavg import Mergeable, NeFedAvg, as_mergeable
from nefl.aggregation.pipeline import Pipeline, Robustness
from nefl.aggregation.trimmed_mean import trimmed_mean
from nefl.nested.state import GlobalState, Layout
from tests.harness.brute_force import assert_state_close, brute_force, random_updates
from tests.harness.helpers import FULL, off_the_wire, random_ladder, tiny_profile

NO_CHECK = PLAIN_NEFEDAVG


def begin(layout: Layout, state: GlobalState, cfg: AggregationConfig, assignments=None, reference=None):
    rule = Pipeline(layout, Robustness(aggregation=cfg), reference=reference)
    return rule.begin_round(state, assignments or {"x": 0}, 1)


@given(st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6)), min_size=1, max_size=5))
def test_cells_partition_the_covered_elements_with_their_exact_covering_sets(corners) -> None:
    shape = torch.Size((6, 6, 3))
    shapes = [torch.Size((a, b, 3)) for a, b in corners]
    hits = torch.zeros(shape, dtype=torch.int64)
    for cell, covering in coverage_cells(shape, shapes):
        hits[cell] += 1
        region = torch.zeros(shape, dtype=torch.bool)
        region[cell] = True
        for i, s in enumerate(shapes):  # a corner covers the whole cell or none of it, and is listed iff it does
            inside = region[:s[0], :s[1]].sum() == region.sum()
            assert inside == (i in covering)
    covered = torch.zeros(shape, dtype=torch.bool)
    for s in shapes:
        covered[:s[0], :s[1]] = True
    assert torch.equal(hits, covered.long())


def covering(layout: Layout, ups, name: str, idx: tuple[int, ...]) -> list[float]:
    return [float(d[name][idx]) for k, d, _ in ups
            if name in layout.upload_shapes(k) and all(i < n for i, n in zip(idx, layout.upload_shapes(k)[name]))]


@pytest.mark.parametrize("rule", ["median", "trimmed-mean"])
@pytest.mark.parametrize("seed", range(4))
def test_coordinate_rules_match_brute_force_where_coverage_is_robust(rule: str, seed: int) -> None:
    rng = random.Random(seed)
    layout = Layout.build(random_ladder(rng, n=4))
    state = GlobalState.init(layout, seed=seed)
    ups = random_updates(layout, [rng.randint(1, 4) for _ in range(4)], torch.Generator().manual_seed(seed))
    cfg = AggregationConfig(rule=rule, trim=0.25, centre_check=False)
    agg = begin(layout, state, cfg)
    for k, d, ns in ups:
        agg.add(k, d, ns)
    new = agg.finalize(state)

    def stat(values: list[float]) -> float:
        v = sorted(values)
        if rule == "median":
            return (v[(len(v) - 1) // 2] + v[len(v) // 2]) / 2
        cut = min(int(0.25 * len(v)), (len(v) - 1) // 2)
        return sum(v[cut:len(v) - cut]) / (len(v) - 2 * cut)

    checked = 0
    for name, old in state.consistent.items():
        for idx in itertools.product(*(range(n) for n in old.shape)):
            values = covering(layout, ups, name, idx)
            if len(values) >= cfg.min_cover:
                assert math.isclose(float(new.consistent[name][idx]), float(old[idx]) + stat(values), abs_tol=1e-5)
                checked += 1
            elif not values:
                assert float(new.consistent[name][idx]) == float(old[idx])  # uncovered: untouched
    assert checked > 0


def test_thin_coverage_takes_a_bounded_step() -> None:
    """Submodel 2's outer ring is covered by one update only: a huge value there moves it by at most
    max_norm_ratio x the robust per-element step of the same tensor, not by the attacker's size."""
    layout = Layout.build(tiny_profile([(0.5, 0.5, FULL), (1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=0)
    cfg = AggregationConfig(rule="median", centre_check=False)
    agg = begin(layout, state, cfg)
    small = {n: torch.full(s, 0.01) for n, s in layout.upload_shapes(0).items()}
    for _ in range(3):
        agg.add(0, small)
    agg.add(1, {n: torch.full(s, 1e3) for n, s in layout.upload_shapes(1).items()})
    new = agg.finalize(state)
    name = "stages.1.0.conv1.weight"
    inner = layout.upload_shapes(0)[name]
    step = new.consistent[name] - state.consistent[name]
    ring = step.clone()
    ring[:inner[0], :inner[1]] = 0
    robust_rms = 0.01  # the 4 covering updates' median in the inner corner
    limit = cfg.max_norm_ratio * robust_rms * math.sqrt(ring.numel())  # the ring's cells together, loosely
    assert 0 < float(ring.norm()) <= limit * 1.01
    assert torch.allclose(step[:inner[0], :inner[1]], torch.tensor(0.01))  # median of 0.01, 0.01, 0.01, 1e3


def test_a_round_too_small_for_robustness_is_the_plain_mean() -> None:
    layout = Layout.build(tiny_profile([(1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=0)
    ups = random_updates(layout, [2], torch.Generator().manual_seed(0))
    agg = begin(layout, state, AggregationConfig(rule="median", centre_check=False))
    for k, d, ns in ups:
        agg.add(k, d, ns)
    assert_state_close(agg.finalize(state), brute_force(layout, state, ups, "uniform"))


@pytest.mark.parametrize("seed", range(3))
def test_nefedavg_through_the_seam_is_exact(seed: int) -> None:
    """The default rule without the centre check is NeFedAvg, bit for bit, begun by the rule."""
    rng = random.Random(seed)
    layout = Layout.build(random_ladder(rng, n=4))
    state = GlobalState.init(layout, seed=seed)
    ups = random_updates(layout, [rng.randint(0, 3) for _ in range(4)], torch.Generator().manual_seed(seed))
    agg = begin(layout, state, NO_CHECK)
    assert isinstance(agg, NeFedAvg) and isinstance(agg, Mergeable)
    for k, d, ns in ups:
        agg.add(k, d, ns)
    assert_state_close(agg.finalize(state), brute_force(layout, state, ups, "uniform"))


def honest_and_hostile(layout: Layout, k: int, n: int, seed: int, noise: float = 0.5):
    """n honest deltas around one direction (devices training one model agree on a descent direction)."""
    g = torch.Generator().manual_seed(seed)
    base = {name: torch.randn(s, generator=g) for name, s in layout.upload_shapes(k).items()}
    return [{name: t + noise * torch.randn(t.shape, generator=g) for name, t in base.items()} for _ in range(n)], base


def test_krum_drops_the_update_far_from_the_rest() -> None:
    layout = Layout.build(tiny_profile([(1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=0)
    honest, base = honest_and_hostile(layout, 0, 6, seed=1)
    agg = begin(layout, state, AggregationConfig(rule="krum", centre_check=False))
    for i, d in enumerate(honest):
        agg.add(0, d, client=f"h{i}")
    agg.add(0, {n: -5 * t for n, t in base.items()}, client="evil")
    new = agg.finalize(state)
    assert agg.dropped["evil"] == "krum" and len(agg.dropped) <= 2
    moved = sum(float((new.consistent[n] - state.consistent[n]).flatten() @ base[n].flatten()) for n in state.consistent)
    assert moved > 0  # the step still follows the honest direction


def test_fltrust_trusts_by_cosine_to_the_root_update_of_the_same_submodel() -> None:
    layout = Layout.build(tiny_profile([(0.5, 0.5, FULL), (1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=0)
    honest, base = honest_and_hostile(layout, 1, 2, seed=2, noise=0.1)
    root = {n: 0.5 * t for n, t in base.items()}
    calls = []

    def reference(s: GlobalState, k: int, index: int) -> dict[str, torch.Tensor]:
        calls.append((k, index))
        return {n: t.clone() for n, t in root.items()}

    agg = begin(layout, state, AggregationConfig(rule="fltrust", centre_check=False), reference=reference)
    agg.add(1, honest[0], client="a")
    agg.add(1, {n: -3 * t for n, t in base.items()}, client="evil")
    new = agg.finalize(state)
    assert calls == [(1, 1)] and agg.dropped == {"evil": "zero_trust"} and 0.9 < agg.trust["a"] <= 1
    # the one trusted update, rescaled to the root update's norm, is the whole step
    norm = lambda d: math.sqrt(sum(float(t.square().sum()) for t in d.values()))  # noqa: E731
    scale = norm(root) / norm(honest[0])
    for n in layout.upload_shapes(1):
        if n in layout.inconsistent:
            torch.testing.assert_close(new.inconsistent[1][n], state.inconsistent[1][n] + honest[0][n] * scale)


@pytest.mark.parametrize("arrival", ["attacker_first", "attacker_last"])
def test_centre_check_drops_a_flipped_update_and_clips_an_outsized_one(arrival: str) -> None:
    layout = Layout.build(tiny_profile([(0.5, 0.5, FULL), (1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=0)
    honest, base = honest_and_hostile(layout, 1, 8, seed=3)
    cfg = AggregationConfig(hold=4)  # four judged together, the rest one by one
    assignments = {f"h{i}": 1 for i in range(8)} | {"flip": 1, "big": 1}
    agg = Pipeline(layout, Robustness(aggregation=cfg)).begin_round(state, assignments, 1)
    assert isinstance(agg, Screened)
    hostile = [("flip", {n: -9 * t for n, t in base.items()}), ("big", {n: 30 * t for n, t in base.items()})]
    sends = [(f"h{i}", d) for i, d in enumerate(honest)]
    sends = hostile + sends if arrival == "attacker_first" else sends + hostile
    for c, d in sends:
        agg.add(1, d, client=c)
    agg.finalize(state)
    assert agg.dropped == {"flip": "against_centre"}
    assert set(agg.clipped) == {"big"} and agg.clipped["big"] < 0.2
    assert all(agg.agreement[f"h{i}"] > 0.5 for i in range(8)) and agg.agreement["flip"] <= 0.2


def test_centre_check_passes_everything_when_too_few_updates_for_a_centre() -> None:
    layout = Layout.build(tiny_profile([(1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=0)
    honest, base = honest_and_hostile(layout, 0, 1, seed=4)
    agg = Pipeline(layout, Robustness(aggregation=AggregationConfig())).begin_round(state, {"a": 0, "b": 0}, 1)
    agg.add(0, honest[0], client="a")
    agg.add(0, {n: -t for n, t in base.items()}, client="b")
    agg.finalize(state)
    assert agg.dropped == {}


def test_a_screened_worker_ships_the_sums_of_what_it_kept() -> None:
    layout = Layout.build(tiny_profile([(1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=0)
    honest, base = honest_and_hostile(layout, 0, 4, seed=5)
    agg = Pipeline(layout, Robustness(aggregation=AggregationConfig())).begin_round(state, {f"c{i}": 0 for i in range(5)}, 1)
    for i, d in enumerate(honest):
        agg.add(0, d, client=f"c{i}")
    agg.add(0, {n: -9 * t for n, t in base.items()}, client="c4")
    sums = agg.partial()
    want = NeFedAvg(layout)
    for d in honest:
        want.add(0, d)
    assert sums.updates == [4] and agg.dropped == {"c4": "against_centre"}
    assert all(torch.allclose(sums.groups[0][n], want.groups[0][n]) for n in want.groups[0])


def test_non_mergeable_rules_refuse_partials_and_dp() -> None:
    layout = Layout.build(tiny_profile([(1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=0)
    agg = begin(layout, state, AggregationConfig(rule="median", centre_check=False))
    assert not isinstance(agg, Mergeable)
    with pytest.raises(ValueError, match="cannot ship or merge partial aggregates .* nor take DP noise"):
        as_mergeable(agg)
    screened = Pipeline(layout, Robustness(aggregation=AggregationConfig(rule="median"))).begin_round(state, {"a": 0}, 1)
    assert not isinstance(screened, Mergeable)
    with pytest.raises(ValueError, match="--root-data"):
        Pipeline(layout, Robustness(aggregation=AggregationConfig(rule="fltrust")))


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 9), st.floats(0, 0.45))
def test_statistics_match_sorted_definitions(n: int, trim: float) -> None:
    x = torch.randn(n, 3, generator=torch.Generator().manual_seed(n))
    s = x.sort(0).values
    assert torch.allclose(coordinate_median(x), (s[(n - 1) // 2] + s[n // 2]) / 2)
    cut = min(int(trim * n), (n - 1) // 2)
    assert torch.allclose(trimmed_mean(x, trim), s[cut:n - cut].mean(0))


def test_shared_core_is_the_corner_every_assigned_submodel_holds() -> None:
    layout = Layout.build(tiny_profile([(0.5, 0.5, ((1.0, 0.0), (1.0, 1.0))), (1.0, 1.0, FULL)]))
    core = shared_core(layout, [0, 1])
    assert "stages.0.1.conv1.weight" not in core  # submodel 1 skips that block
    name = "stages.1.0.conv1.weight"
    assert core[name] == tuple(slice(0, n) for n in layout.upload_shapes(0)[name])
    assert all(n not in layout.inconsistent for n in core)


def test_a_big_flipped_update_among_three_is_outvoted_not_followed() -> None:
    """Three updates, one hostile at 9x: a median centre of three sketches follows the big one wherever the two
    honest ones differ (the e2e attack slipped through that way); the majority vote on direction does not."""
    layout = Layout.build(tiny_profile([(1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=0)
    dropped = 0
    for seed in range(20):
        honest, _ = honest_and_hostile(layout, 0, 3, seed=100 + seed, noise=2.0)  # pairwise cosine about 0.2
        agg = Pipeline(layout, Robustness(aggregation=AggregationConfig())).begin_round(state, {"a": 0, "b": 0, "evil": 0}, 1)
        agg.add(0, honest[0], client="a")
        agg.add(0, honest[1], client="b")
        agg.add(0, {n: -9 * t for n, t in honest[2].items()}, client="evil")
        agg.finalize(state)
        assert not {"a", "b"} & set(agg.dropped)
        dropped += agg.dropped.get("evil") == "against_centre"
    assert dropped >= 19


def test_when_no_update_has_a_majority_none_is_dropped_for_its_direction() -> None:
    """Honest updates can point apart (pairwise negative: non-IID shards, submodels of different size): then
    nobody agrees with half of the others, the vote has nothing to go by (the e2e run dropped an honest update
    that way), and only the size bound applies."""
    layout = Layout.build(tiny_profile([(1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=0)
    gen = torch.Generator().manual_seed(3)
    e1, e2 = ({n: torch.randn(s, generator=gen) for n, s in layout.upload_shapes(0).items()} for _ in range(2))
    # a and b point apart (cosine about -0.1); evil is -9 x their sum, which both of them agree with
    a = e1
    b = {n: e2[n] - 0.1 * e1[n] for n in e1}
    shared = {n: a[n] + b[n] for n in e1}
    agg = Pipeline(layout, Robustness(aggregation=AggregationConfig())).begin_round(state, {"a": 0, "b": 0, "evil": 0}, 1)
    agg.add(0, a, client="a")
    agg.add(0, b, client="b")
    agg.add(0, {n: -9 * t for n, t in shared.items()}, client="evil")
    agg.finalize(state)
    assert agg.facts()["agreement"] == {"a": 0.0, "b": 0.0, "evil": 0.0}
    assert agg.dropped == {}
    # none confirmed by the vote: the outsized one is held to the round's median relative norm, not to 3 x it
    assert set(agg.clipped) == {"evil"}
    assert agg.clipped["evil"] == pytest.approx(sorted(agg.ratios)[1] / agg.ratios[2])



@pytest.mark.parametrize("server_agrees", [False, True])
def test_the_vote_does_not_drop_an_update_along_the_servers_own_step(server_agrees: bool) -> None:
    """Two updates that agree outvote a third that points elsewhere (as two large submodels outvoted an honest small
    one over `serve`); where the server's own step of the last commit points along the third, it is kept."""
    layout = Layout.build(tiny_profile([(1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=0)
    gen = torch.Generator().manual_seed(5)
    e1, e2, e3 = ({n: torch.randn(s, generator=gen) for n, s in layout.upload_shapes(0).items()} for _ in range(3))
    a = {n: e1[n] + 0.5 * e2[n] for n in e1}
    b = {n: e1[n] - 0.5 * e2[n] for n in e1}
    pipeline = Pipeline(layout, Robustness(aggregation=AggregationConfig()))
    pipeline.server_step = {n: e3[n] + 0.1 * e1[n] for n in e1} if server_agrees else {n: -t for n, t in e3.items()}
    agg = pipeline.begin_round(state, {"a": 0, "b": 0, "small": 0}, 1)
    agg.add(0, a, client="a")
    agg.add(0, b, client="b")
    agg.add(0, e3, client="small")
    agg.finalize(state)
    assert agg.facts()["agreement"]["small"] == 0.0 and agg.facts()["with_server"]["small"] != 0
    assert agg.dropped == ({} if server_agrees else {"small": "against_centre"})


class FineTuning:
    """The server's images as a Pipeline sees them: fine-tuning that takes a known step, no running statistics."""

    head = None

    def __init__(self, step: float) -> None:
        self.step = step

    def __call__(self, state: GlobalState) -> None:
        pass

    def finetune(self, state: GlobalState, lr: float, epochs: int) -> dict[str, torch.Tensor]:
        step = {n: torch.full_like(t, self.step) for n, t in state.consistent.items()}
        for n, t in step.items():
            state.consistent[n] += t
        return step


@pytest.mark.parametrize("on", [True, False])
def test_the_next_rounds_vote_knows_the_fine_tuning_step_of_the_last_commit(on: bool) -> None:
    """The step of the candidate that committed, kept until the next commit; none before the first, none where the veto
    is off, and a candidate that cannot commit leaves the last one in place."""
    layout = Layout.build(tiny_profile([(1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=0)
    pipeline = Pipeline(layout, Robustness(aggregation=AggregationConfig(server_veto=on)), statistics=FineTuning(0.01))
    gen = torch.Generator().manual_seed(3)
    ups = [{n: torch.randn(s, generator=gen) for n, s in layout.upload_shapes(0).items()} for _ in range(2)]

    def round_(start: GlobalState, index: int):
        agg = pipeline.begin_round(start, {"a": 0, "b": 0}, index)
        for c, d in zip("ab", ups):
            agg.add(0, d, client=c)
        return pipeline.commit(agg, start)

    assert pipeline.server_step is None
    done = round_(state, 1)
    assert done.state is not None
    if not on:
        assert pipeline.server_step is None
        return
    assert set(pipeline.server_step) == set(state.consistent)
    assert all(torch.allclose(t, torch.full_like(t, 0.01)) for t in pipeline.server_step.values())
    pipeline.statistics = FineTuning(float("nan"))
    assert round_(done.state, 2).state is None
    assert all(torch.allclose(t, torch.full_like(t, 0.01)) for t in pipeline.server_step.values())

def test_an_update_unrelated_to_the_others_is_not_carried_by_a_chance_positive_cosine() -> None:
    """-weights in a net with batch norm after every conv is near orthogonal to honest updates, so the sign of
    its cosine with each is a coin flip (over `serve` it had a positive cosine with one of the two honest updates
    in 3 rounds of 4, was kept and moved the model to chance). Agreeing takes a cosine above agree_z spreads of
    unrelated vectors' cosine: a positive 0.015 with both honest updates does not count, their 0.5 does."""
    layout = Layout.build(tiny_profile([(1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=0)
    (a, b), _ = honest_and_hostile(layout, 0, 2, seed=6, noise=1.0)  # pairwise cosine about 0.5
    names = [n for n in a if n not in layout.inconsistent]
    flat = lambda d: torch.cat([d[n].reshape(-1) for n in names])  # noqa: E731
    va, vb = flat(a), flat(b)
    basis, _ = torch.linalg.qr(torch.stack([va, vb], 1))
    r = torch.randn(va.shape, generator=torch.Generator().manual_seed(7))
    r -= basis @ (basis.T @ r)  # orthogonal to both honest updates
    v = r + 0.01 * r.norm() * (va / va.norm() + vb / vb.norm())
    assert 0 < float(v @ va) and 0 < float(v @ vb)  # the old vote counted it as agreeing with both
    evil, at = {}, 0
    for n in names:
        evil[n], at = 9 * v[at:at + a[n].numel()].reshape(a[n].shape), at + a[n].numel()
    agg = Pipeline(layout, Robustness(aggregation=AggregationConfig())).begin_round(state, {"a": 0, "b": 0, "evil": 0}, 1)
    agg.add(0, a, client="a")
    agg.add(0, b, client="b")
    agg.add(0, {**{n: torch.zeros_like(t) for n, t in a.items()}, **evil}, client="evil")
    agg.finalize(state)
    assert agg.dropped == {"evil": "against_centre"}
    assert agg.agreement == {"a": 1.0, "b": 1.0, "evil": 0.0}  # evil, outsized, does not vote


def test_weakly_aligned_honest_updates_still_outvote_a_flip() -> None:
    """Honest updates of submodels far apart in size can align by less than the spread of unrelated vectors'
    cosine (over `serve`, submodels 5 and 1 on their shared core); the margin then follows the round's strongest
    cosine down, so the two still agree and a flip of one of them is dropped, not kept for want of a vote."""
    layout = Layout.build(tiny_profile([(1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=0)
    gen = torch.Generator().manual_seed(8)
    a, e = ({n: torch.randn(s, generator=gen) for n, s in layout.upload_shapes(0).items()} for _ in range(2))
    b = {n: e[n] + 0.03 * a[n] for n in a}  # cosine about 0.03: under the spread 3 / sqrt(2,777) = 0.057
    agg = Pipeline(layout, Robustness(aggregation=AggregationConfig())).begin_round(state, {"a": 0, "b": 0, "evil": 0}, 1)
    for c, d in (("a", a), ("b", b), ("evil", {n: -9 * t for n, t in b.items()})):
        agg.add(0, d, client=c)
    agg.finalize(state)
    assert 0 < agg.margin < agg.spread
    assert agg.dropped == {"evil": "against_centre"}
    assert agg.agreement == {"a": 1.0, "b": 1.0, "evil": 0.0}  # evil, outsized, does not vote


def test_an_outsized_update_does_not_vote() -> None:
    """Over `serve`, late in training, two honest updates aligned by less than the margin and a flip at 9 x had a
    chance cosine with one of them: it confirmed that one and the other honest update was dropped. An update above
    the size bound does not vote: nobody has a majority and nothing is dropped (the outsized one, agreeing with b,
    is clipped to the bound)."""
    layout = Layout.build(tiny_profile([(1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=0)
    gen = torch.Generator().manual_seed(9)
    a, b, r = ({n: torch.randn(s, generator=gen) for n, s in layout.upload_shapes(0).items()} for _ in range(3))
    agg = Pipeline(layout, Robustness(aggregation=AggregationConfig())).begin_round(state, {"a": 0, "b": 0, "evil": 0}, 1)
    for c, d in (("a", a), ("b", b), ("evil", {n: 9 * (r[n] + 0.3 * b[n]) for n in a})):  # evil: cosine 0.3 with b
        agg.add(0, d, client=c)
    agg.finalize(state)
    assert agg.dropped == {} and agg.agreement == {"a": 0.0, "b": 0.0, "evil": 0.5}
    assert agg.clipped["evil"] == pytest.approx(3 * sorted(agg.ratios)[1] / agg.ratios[2])  # it agrees with b


def test_a_bare_majority_drops_nobody() -> None:
    """Late rounds of many small, diverse honest updates: 3 of 5 agree, 2 are unrelated to everyone. Under half as
    the quorum the vote dropped the 2 (over the short simulation, 4 honest updates of 10, and a submodel fell
    behind); it acts only while two thirds reach agreement."""
    layout = Layout.build(tiny_profile([(1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=0)
    agreeing, _ = honest_and_hostile(layout, 0, 3, seed=10, noise=1.0)  # pairwise cosine about 0.5
    unrelated, _ = honest_and_hostile(layout, 0, 2, seed=11, noise=30.0)  # about 0 with everyone, the same size
    unrelated = [{n: t / 30 for n, t in d.items()} for d in unrelated]
    clients = {f"c{i}": 0 for i in range(5)}
    agg = Pipeline(layout, Robustness(aggregation=AggregationConfig())).begin_round(state, clients, 1)
    for c, d in zip(clients, agreeing + unrelated):
        agg.add(0, d, client=c)
    agg.finalize(state)
    assert [agg.agreement[c] for c in clients] == [0.5, 0.5, 0.5, 0.0, 0.0]
    assert agg.dropped == {} and agg.clipped == {}


def test_outsized_updates_do_not_count_against_the_quorum() -> None:
    """30% attackers sending 9 x flips, all among the first `hold`: 5 honest of those 8 agree, under two thirds
    of 8, and the vote abstained (the simulator's IID run fell to 13%). The flips are outsized and do not vote,
    so they do not count for the quorum either: 5 of 5 voters agree and the flips are dropped."""
    layout = Layout.build(tiny_profile([(1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=0)
    honest, _ = honest_and_hostile(layout, 0, 7, seed=12, noise=1.0)  # pairwise cosine about 0.5
    order = ["h0", "evil0", "evil1", "h1", "h2", "evil2", "h3", "h4", "h5", "h6"]
    clients = {c: 0 for c in order}
    agg = Pipeline(layout, Robustness(aggregation=AggregationConfig(hold=8))).begin_round(state, clients, 1)
    for c in order:
        d = honest[int(c[1:])] if c.startswith("h") else {n: -9 * t for n, t in honest[int(c[4:])].items()}
        agg.add(0, d, client=c)
    agg.finalize(state)
    assert agg.dropped == {f"evil{i}": "against_centre" for i in range(3)}
    assert (agg.judged, agg.agreed) == (7, 7)  # the seven honest updates: 5 judged together, 2 on arrival


@pytest.mark.parametrize("seed", range(3))
def test_the_sketch_of_a_decoded_update_is_the_sketch_of_its_tensors(seed: int) -> None:
    """The gather from the flat buffer (positions worked out once per tiling) picks the same elements as
    cutting the cells out of each tensor."""
    rng = random.Random(seed)
    layout = Layout.build(random_ladder(rng, n=4))
    for size in (16, 10_000):  # a sample of the core, and all of it
        sketch = Sketch(shared_core(layout, range(layout.num_submodels)), size, seed)
        for k in range(layout.num_submodels):
            delta = {n: torch.randn(s) for n, s in layout.upload_shapes(k).items()}
            assert torch.equal(sketch(off_the_wire(delta)), sketch(delta))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 2000), st.integers(1, 50), st.integers(0, 2**32 - 1))
def test_the_sketch_picks_distinct_sorted_positions_in_range(total: int, size: int, seed: int) -> None:
    picked = distinct_sample(total + size, size, torch.Generator().manual_seed(seed))
    assert picked.numel() == size and bool((picked[1:] > picked[:-1]).all())
    assert 0 <= int(picked[0]) and int(picked[-1]) < total + size


def test_the_sketch_samples_positions_uniformly() -> None:
    """Every position equally likely, in the branch that draws with replacement (total >= 16 x size): a chi-square
    test of 40,000 draws of 5 of 100 positions (99 degrees of freedom; about 148 is its 0.999 quantile)."""
    counts = torch.zeros(100)
    for seed in range(40_000):
        counts[distinct_sample(100, 5, torch.Generator().manual_seed(seed))] += 1
    expected = 40_000 * 5 / 100
    assert float(((counts - expected) ** 2 / expected).sum()) < 149


def test_the_vote_counts_the_recent_others_as_the_definition_does() -> None:
    """agrees(i) against its definition: the share of the `compare` most recent other sketches whose cosine
    with it exceeds the margin (agree_z / sqrt(sketch size), or half the strongest cosine between an arrival and
    the sketches it was compared with, if lower), for updates judged on arrival and for ones held from the start."""
    layout = Layout.build(tiny_profile([(1.0, 1.0, ((1.0, 1.0), (1.0, 1.0)))]))
    state = GlobalState.init(layout, seed=0)
    clients = {f"c{i}": 0 for i in range(30)}
    agg = begin(layout, state, AggregationConfig(hold=4, sketch=64), clients)
    agg.compare = 5
    g = torch.Generator().manual_seed(1)
    base = {n: torch.randn(s, generator=g) for n, s in layout.upload_shapes(0).items()}
    for m, c in enumerate(clients):  # a shared direction of random sign and weight: cosines on both sides of the
        w = 2 * float(torch.rand(1, generator=g)) - 1  # margin; every seventh outsized, left out of the vote
        size = 20.0 if m % 7 == 6 else 1.0
        agg.add_validated(0, {n: size * (w * t + torch.randn(t.shape, generator=g)) for n, t in base.items()}, client=c)
        rows, n = torch.from_numpy(agg.sketches[:agg.count]), agg.count
        cos = lambda x, y: float(x @ y) / float(x.norm() * y.norm())  # noqa: E731
        strongest = max([0.0] + [cos(rows[m], rows[j]) for m in range(n) for j in range(max(0, m - agg.compare), m)])
        margin = min(3 / math.sqrt(64), 0.5 * strongest)
        assert agg.margin == pytest.approx(margin, abs=1e-6)
        limit = 3 * float(torch.tensor(agg.ratios, dtype=torch.float64).median()) if n >= 3 else math.inf
        for i in range(n):
            others = [j for j in range(max(0, n - agg.compare - 1), n) if j != i][-agg.compare:]
            voters = [rows[j] for j in others if agg.ratios[j] <= limit]  # the size bound's outliers do not vote
            want = sum(cos(rows[i], o) > margin for o in voters) / max(1, len(voters))
            assert agg.agrees(i) == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_judging_arrivals_in_batches_decides_as_judging_each_on_arrival(seed: int) -> None:
    """After the first `hold`, updates are judged in batches (one product with the recent sketches per batch),
    each as of its arrival: the same drops, clips, agreement and sums as judging every arrival at once, which
    forcing a judgement after each add does."""
    rng = random.Random(seed)
    layout = Layout.build(random_ladder(rng, n=3) if seed % 2 else tiny_profile([(1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=seed)
    g = torch.Generator().manual_seed(seed)
    ks = [rng.randrange(layout.num_submodels) for _ in range(40)]
    bases = {k: {n: torch.randn(s, generator=g) for n, s in layout.upload_shapes(k).items()} for k in set(ks)}
    stream = []
    for i, k in enumerate(ks):  # mostly honest; flips at 9 x, outsized and small ones among them
        w = rng.choice([1.0] * 6 + [-9.0, -9.0, 20.0, 0.1])
        stream.append((f"c{i}", k, {n: w * t + rng.choice([0.3, 1.0]) * torch.randn(t.shape, generator=g)
                                     for n, t in bases[k].items()}))
    clients = {c: k for c, k, _ in stream}
    runs = []
    for each_on_arrival in (False, True):
        agg = begin(layout, state, AggregationConfig(hold=4, sketch=256), clients)
        agg.compare = 6
        for c, k, d in stream:
            agg.add(k, {n: t.clone() for n, t in d.items()}, client=c)
            if each_on_arrival and agg.count >= agg.hold:
                agg._judge_pending()
            assert len(agg.pending) <= agg.hold
        runs.append((agg, agg.finalize(state)))
    (a, new_a), (b, new_b) = runs
    assert a.dropped or a.clipped  # the stream exercises the vote or the size bound
    assert a.dropped or seed % 2  # one submodel: the vote acts
    assert (a.dropped, a.clipped, a.agreement, a.judged, a.agreed) == (b.dropped, b.clipped, b.agreement, b.judged, b.agreed)
    assert_state_close(new_a, new_b, atol=1e-6)
