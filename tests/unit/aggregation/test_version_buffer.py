"""Buffered asynchronous NeFedAvg: the staleness-weighted rule element by element, its equality with a synchronous
round at staleness 0, and what it refuses."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nefl.aggregation.config import PLAIN_NEFEDAVG, AggregationConfig
from nefl.aggregation.pipeline import Pipeline, Robustness
from nefl.aggregation.robust import NormBound
from nefl.aggregation.staleness import StalenessConfig
from nefl.aggregation.version_buffer import VersionBuffer, buffered_refusal
from nefl.nested.state import GlobalState, Layout
from tests.harness.brute_force import assert_state_close, brute_force, random_updates
from tests.harness.helpers import random_ladder

PLAIN = Robustness(aggregation=PLAIN_NEFEDAVG)


def _setup(seed: int, n: int = 3) -> tuple[Layout, GlobalState, list]:
    rng = random.Random(seed)
    layout = Layout.build(random_ladder(rng, n=n))
    gen = torch.Generator().manual_seed(seed)
    counts = [rng.randint(0, 2) for _ in range(n)]
    counts[-1] += 1  # at least one update
    return layout, GlobalState.init(layout, seed=seed), random_updates(layout, counts, gen)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), exponent=st.sampled_from([0.0, 0.5, 1.0]),
       server_lr=st.sampled_from([1.0, 0.5]), version=st.integers(0, 6), weighting=st.sampled_from(["uniform", "samples"]),
       normalise=st.sampled_from(["staleness", "coverage"]))
def test_matches_the_staleness_weighted_definition(seed: int, exponent: float, server_lr: float, version: int,
                                                   weighting: str, normalise: str) -> None:
    layout, state, ups = _setup(seed)
    cfg = StalenessConfig(buffer_size=len(ups), exponent=exponent, server_lr=server_lr, max_staleness=6,
                          normalise=normalise)
    buf = VersionBuffer(Pipeline(layout, PLAIN, weighting), cfg, state, version)
    rng = random.Random(seed + 1)
    weighted = []
    for k, delta, samples in ups:
        base = rng.randint(0, version)
        assert buf.offer(k, delta, base, samples).reason is None
        w, s = (samples if weighting == "samples" else 1.0), (1 + version - base) ** -exponent  # w_i, s_i written out
        # the reference divides by the sum of the third entries: w s ("staleness") or w with s in the delta ("coverage")
        weighted.append((k, {n: server_lr * t for n, t in delta.items()}, w * s) if normalise == "staleness" else
                        (k, {n: server_lr * s * t for n, t in delta.items()}, w))
    assert buf.due(0.0)
    done = buf.commit()
    assert done.problem is None and done.version == version + 1 and buf.version == version + 1
    # element by element: old + lr x sum w s delta / (sum w s, or sum w) over the updates covering it
    assert_state_close(buf.state, brute_force(layout, state, weighted, "samples"))


def test_staleness_zero_and_a_round_sized_buffer_is_the_synchronous_round_bit_for_bit() -> None:
    layout, state, ups = _setup(3, n=4)
    pipeline = Pipeline(layout, PLAIN)
    sync = pipeline.begin_round(state, {}, 1)
    for k, delta, samples in ups:
        sync.add(k, delta, samples)
    expected = pipeline.commit(sync, state).state
    buf = VersionBuffer(Pipeline(layout, PLAIN), StalenessConfig(buffer_size=len(ups)), state, version=4)
    for k, delta, samples in ups:
        assert buf.offer(k, delta, base=4, samples=samples).staleness == 0
    buf.commit()
    for name, t in expected.flat().items():
        assert torch.equal(buf.state.flat()[name], t), name


def test_a_staler_update_counts_for_less() -> None:
    """Two updates of one submodel, one fresh and one 3 versions old: the mean leans 2:1 to the fresh one."""
    layout, state, _ = _setup(0)
    k = layout.num_submodels - 1
    buf = VersionBuffer(Pipeline(layout, PLAIN), StalenessConfig(buffer_size=2), state, version=3)
    for value, base in ((1e-3, 3), (4e-3, 0)):
        assert buf.offer(k, {n: torch.full(s, value) for n, s in layout.upload_shapes(k).items()}, base).reason is None
    buf.commit()
    name = next(n for n in layout.upload_shapes(k) if n not in layout.inconsistent)
    moved = buf.state.consistent[name] - state.consistent[name]
    torch.testing.assert_close(moved, torch.full_like(moved, (1e-3 + 4e-3 / 2) / (1 + 1 / 2)))


def test_coverage_normalisation_shortens_the_step_of_a_stale_buffer() -> None:
    """One update 3 versions old alone in the buffer: "staleness" takes its whole delta (s cancels), "coverage"
    half of it (s = 1/sqrt(4))."""
    layout, state, _ = _setup(0)
    k = layout.num_submodels - 1
    name = next(n for n in layout.upload_shapes(k) if n not in layout.inconsistent)
    for normalise, share in (("staleness", 1.0), ("coverage", 0.5)):
        buf = VersionBuffer(Pipeline(layout, PLAIN), StalenessConfig(buffer_size=1, normalise=normalise), state, 3)
        assert buf.offer(k, {n: torch.full(s, 1e-3) for n, s in layout.upload_shapes(k).items()}, base=0).reason is None
        buf.commit()
        moved = buf.state.consistent[name] - state.consistent[name]
        torch.testing.assert_close(moved, torch.full_like(moved, 1e-3 * share))


def test_refusals_leave_the_buffer_untouched() -> None:
    layout, state, ups = _setup(1)
    bound = Robustness(bound=NormBound(max_norm=1e-3, mode="reject"), aggregation=PLAIN.aggregation)
    buf = VersionBuffer(Pipeline(layout, bound), StalenessConfig(max_staleness=2), state, version=5)
    k, delta, _ = ups[0]
    assert buf.offer(k, delta, base=2).reason == "stale"
    assert buf.offer(k, delta, base=6).reason == "future-version"
    assert buf.offer(k, dict(list(delta.items())[1:]), base=5).reason == "invalid"
    assert buf.offer(k, delta, base=5).reason == "norm-bound"
    assert len(buf) == 0 and buf.commit().problem == "the buffer is empty" and buf.version == 5


def test_the_time_bound_commits_a_partial_buffer() -> None:
    layout, state, ups = _setup(2)
    buf = VersionBuffer(Pipeline(layout, PLAIN), StalenessConfig(buffer_size=10, commit_after_s=30.0), state)
    k, delta, _ = ups[0]
    buf.offer(k, delta, 0, now=100.0)
    assert not buf.due(129.0) and buf.due(130.0)


@pytest.mark.parametrize("robustness, needs", [
    (Robustness(), "--no-centre-check"),
    (Robustness(aggregation=AggregationConfig(rule="median", centre_check=False)), "--aggregator nefedavg"),
    (replace(PLAIN, bound=NormBound.for_dp(1.0), dp_noise_multiplier=1.0), "--dp-noise-multiplier"),
])
def test_buffered_mode_refuses_what_needs_a_round(robustness: Robustness, needs: str) -> None:
    assert needs in buffered_refusal(robustness)
    layout, state, _ = _setup(0)
    with pytest.raises(ValueError, match="buffered mode"):
        VersionBuffer(Pipeline(layout, robustness), StalenessConfig(), state)
    assert buffered_refusal(PLAIN) is None
