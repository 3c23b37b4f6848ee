import json
import math
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from nefl.aggregation.nefedavg import NeFedAvg
from nefl.aggregation.robust import (
    REASON,
    DPAccountant,
    NormBound,
    UpdateGuard,
    UpdateRejected,
    check_state,
    reference_norm,
    update_norm,
)
from nefl.nested.state import GlobalState, Layout, corner
from tests.harness.helpers import off_the_wire, tiny_profile

FULL = ((1.0, 1.0), (1.0, 1.0))
FP32_MAX = float(np.finfo(np.float32).max)
ONLY_FIXED = {"relative": None, "adaptive_k": None}

finite_fp32 = st.floats(-FP32_MAX, FP32_MAX, width=32, allow_nan=False, allow_infinity=False)
deltas = st.lists(hnp.arrays(np.float32, hnp.array_shapes(max_dims=3, max_side=6), elements=finite_fp32),
                  min_size=1, max_size=4)


def as_delta(arrays: list[np.ndarray]) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.from_numpy(a.copy()) for i, a in enumerate(arrays)}


def layout_and_state(seed: int = 0) -> tuple[Layout, GlobalState]:
    layout = Layout.build(tiny_profile([(0.5, 0.5, FULL), (1.0, 1.0, FULL)]))
    return layout, GlobalState.init(layout, seed=seed)


def scaled(delta: dict[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    return {n: t * factor for n, t in delta.items()}


# -- update_norm ------------------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(deltas)
def test_update_norm_matches_float64_brute_force(arrays: list[np.ndarray]) -> None:
    expected = math.sqrt(sum(float((a.astype(np.float64) ** 2).sum()) for a in arrays))
    assert update_norm(as_delta(arrays)) == pytest.approx(expected, rel=1e-9, abs=1e-300)


@settings(max_examples=30, deadline=None)
@given(st.integers(4096, 40_000), st.sampled_from([1e-30, 1e-3, 1.0, 1e18, 1e30]), st.integers(0, 2**31 - 1))
def test_update_norm_of_large_tensors_matches_float64(numel: int, scale: float, seed: int) -> None:
    """Tensors past one 4096-element row take the fast row-wise path: float64 accuracy still holds at
    magnitudes whose squares under- or overflow float32."""
    t = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * scale
    expected = float(torch.linalg.vector_norm(t.double()))
    assert update_norm({"big": t, "small": torch.ones(3)}) == pytest.approx(math.hypot(expected, math.sqrt(3)), rel=1e-6)


def test_update_norm_does_not_overflow_at_fp32_max() -> None:
    """An fp32 sum of squares of 3e38 entries is inf; the float64 accumulation measures it."""
    big = float(torch.tensor(3e38))  # the fp32 value nearest 3e38
    got = update_norm({"a": torch.full((1000,), big), "b": torch.full((10,), -big)})
    assert math.isfinite(got) and got == pytest.approx(big * math.sqrt(1010), rel=1e-12)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_update_norm_is_inf_only_for_non_finite_input(bad: float) -> None:
    assert update_norm({"a": torch.ones(3), "b": torch.tensor([1.0, bad])}) == math.inf
    assert update_norm({"a": torch.zeros(3, dtype=torch.float16)}) == 0.0


def test_reference_norm_covers_exactly_the_uploaded_slices() -> None:
    layout, state = layout_and_state()
    for k in range(layout.num_submodels):
        weights = state.extract(layout, k)
        expected = update_norm({n: weights[n] for n in layout.upload_shapes(k)})
        assert reference_norm(state, layout, k) == pytest.approx(expected, rel=1e-12)


# -- UpdateGuard ------------------------------------------------------------------------------------

def test_default_guard_rejects_huge_updates_and_accepts_honest_ones() -> None:
    layout, state = layout_and_state()
    guard = UpdateGuard(NormBound(), layout.num_submodels)
    ref = reference_norm(state, layout, 1)
    gen = torch.Generator().manual_seed(0)
    shapes = layout.upload_shapes(1)
    honest = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    honest = scaled(honest, 0.5 * ref / update_norm(honest))  # the sweep's largest honest ratio was 0.54
    out, norm, clipped = guard.check(1, honest, ref)
    assert out is honest and not clipped and norm == pytest.approx(0.5 * ref)
    attacks = {"1e30": {n: torch.full(s, 1e30) for n, s in shapes.items()},
               "3e38": {n: torch.full(s, 3e38) for n, s in shapes.items()},
               "1e6 x honest": scaled(honest, 1e6)}
    for why, delta in attacks.items():
        with pytest.raises(UpdateRejected) as err:
            guard.check(1, delta, ref)
        assert err.value.reason == REASON == "update_norm", why
        assert "\n" not in str(err.value) and "submodel 2" in str(err.value)


def test_fixed_bound_rejects_above_and_accepts_at_the_bound() -> None:
    guard = UpdateGuard(NormBound(max_norm=5.0, **ONLY_FIXED), 1)
    guard.check(0, {"w": torch.tensor([3.0, 4.0])})
    with pytest.raises(UpdateRejected, match="exceeds 5 .the fixed bound"):
        guard.check(0, {"w": torch.tensor([3.0, 4.1])})


def test_relative_bound_needs_a_reference() -> None:
    guard = UpdateGuard(NormBound(), 1)
    for ref in (None, 0.0, math.nan):
        with pytest.raises(ValueError, match="weight norm"):
            guard.check(0, {"w": torch.ones(2)}, ref)


@settings(max_examples=100, deadline=None)
@given(deltas, st.floats(1e-6, 1e6))
def test_clip_scales_to_exactly_the_bound(arrays: list[np.ndarray], bound: float) -> None:
    delta = as_delta(arrays)
    norm = update_norm(delta)
    guard = UpdateGuard(NormBound(max_norm=bound, mode="clip", **ONLY_FIXED), 1)
    out, got, clipped = guard.check(0, delta)
    assert clipped == (norm > bound)
    if clipped:
        assert got == bound and update_norm(out) == pytest.approx(bound, rel=1e-5)
        ratio = bound / norm
        for n, t in delta.items():  # same direction: each element scaled by the same factor
            torch.testing.assert_close(out[n].double(), t.double() * ratio, rtol=1e-5, atol=1e-30 + 1e-6 * bound)
    else:
        assert out is delta and got == norm


def test_clip_mode_still_rejects_non_finite_updates() -> None:
    guard = UpdateGuard(NormBound(max_norm=1.0, mode="clip", **ONLY_FIXED), 1)
    with pytest.raises(UpdateRejected, match="not finite"):
        guard.check(0, {"w": torch.tensor([1.0, math.nan])})


def test_adaptive_bound_after_warmup_and_over_the_window() -> None:
    guard = UpdateGuard(NormBound(adaptive_k=3.0, window=5, warmup=3, relative=None), 2)
    for c in ("a", "b"):
        guard.record(0, c, 1.0)
    guard.check(0, {"w": torch.tensor([1e6])})  # warmup (3 clients) not reached: only the (absent) other bounds apply
    guard.record(0, "c", 1.0)
    guard.check(0, {"w": torch.tensor([2.9])})
    with pytest.raises(UpdateRejected, match="3 x the median of recent clients' norms 1"):
        guard.check(0, {"w": torch.tensor([3.1])})
    guard.check(1, {"w": torch.tensor([3.1])})  # per submodel: submodel 2 has no history yet
    for c in ("d", "e", "f"):
        guard.record(0, c, 100.0)  # the window keeps the last 5 clients: a, then b, leave; median now 100
    assert guard.median(0) == 100.0 and list(guard.history[0]) == ["b", "c", "d", "e", "f"]
    assert sorted(guard.recent(0)) == [1.0, 1.0, 100.0, 100.0, 100.0]
    guard.check(0, {"w": torch.tensor([250.0])})


def test_one_client_cannot_ratchet_the_adaptive_bound() -> None:
    """Honest clients near norm 1; an attacker whose accepted updates sit at the bound every round.
    Per-update history: each accepted update raised the median and so the next bound. One vote per
    client: the attacker's latest norm is one value among the clients', the median stays honest."""
    guard = UpdateGuard(NormBound(adaptive_k=10.0, window=20, warmup=3, relative=None), 1)
    for c in ("h1", "h2", "h3"):
        guard.record(0, c, 1.0)
    for _ in range(50):
        bound, _ = guard.limit(0, None)
        guard.record(0, "attacker", bound)  # the most it can get accepted
        for c in ("h1", "h2", "h3"):
            guard.record(0, c, 1.0)
    assert guard.limit(0, None)[0] == 10.0


def test_tightest_bound_wins_and_clipped_norm_is_what_gets_recorded() -> None:
    guard = UpdateGuard(NormBound(max_norm=10.0, relative=2.0, adaptive_k=4.0, mode="clip", window=4, warmup=1), 1)
    guard.record(0, "a", 1.0)
    assert guard.limit(0, 100.0)[0] == 4.0  # adaptive 4 < fixed 10 < relative 200
    assert guard.limit(0, 1.0)[0] == 2.0  # relative 2 < adaptive 4
    _, norm, clipped = guard.check(0, {"w": torch.tensor([300.0, 400.0])}, 100.0)
    assert clipped and norm == 4.0
    guard.record(0, "b", norm)
    assert max(guard.recent(0)) == 4.0


def test_state_dict_round_trips_through_json() -> None:
    bound = NormBound(adaptive_k=2.0, window=3, warmup=2)
    guard = UpdateGuard(bound, 3)
    for k, norms in enumerate([[1.0, 2.0, 3.0, 4.0], [0.5], []]):
        for i, x in enumerate(norms):
            guard.record(k, f"c{i}", x)
    guard.record(0, "c3", 5.0)  # a client's newer norm replaces its older one
    guard.record(2, "c0", math.inf)  # never recorded
    saved = json.loads(json.dumps(guard.state_dict()))
    assert saved["norms"] == [[2.0, 3.0, 5.0], [0.5], []] and saved["clients"][0] == ["c1", "c2", "c3"]
    resumed = UpdateGuard(bound, 3)
    resumed.load_state_dict(saved)
    assert resumed.state_dict() == saved
    assert resumed.limit(0, 1.0) == guard.limit(0, 1.0)
    smaller = UpdateGuard(NormBound(window=2, warmup=1), 3)
    smaller.load_state_dict(saved)  # a shorter window on resume keeps the most recent clients
    assert smaller.recent(0) == [3.0, 5.0]
    older = UpdateGuard(bound, 3)
    older.load_state_dict({"norms": saved["norms"]})  # a history without ids: each norm a client of its own
    assert older.recent(0) == [2.0, 3.0, 5.0] and older.median(0) == 3.0


@pytest.mark.parametrize("bad", [{"norms": [[1.0]]}, {"norms": [[1.0], ["x"], []]}, {"norms": [[1.0], [-1.0], []]},
                                 {"norms": [[], [], [math.nan]]}, {}, []])
def test_load_state_dict_refuses_foreign_or_corrupt_history(bad) -> None:
    with pytest.raises(ValueError, match="update-guard history"):
        UpdateGuard(NormBound(), 3).load_state_dict(bad)


@pytest.mark.parametrize("kwargs", [{"max_norm": 0.0}, {"relative": -1.0}, {"adaptive_k": math.inf},
                                    {"mode": "drop"}, {"window": 3, "warmup": 4}, {"warmup": 0}])
def test_invalid_bounds_are_refused(kwargs) -> None:
    with pytest.raises(ValueError):
        NormBound(**kwargs)


def test_dp_bound_is_a_plain_clip() -> None:
    assert NormBound.for_dp(1.5) == NormBound(max_norm=1.5, relative=None, adaptive_k=None, mode="clip")


# -- check_state ------------------------------------------------------------------------------------

def test_check_state_passes_a_fresh_state() -> None:
    _, state = layout_and_state()
    assert check_state(state, 1e6) is None


@pytest.mark.parametrize("value, expect", [(math.nan, "non-finite"), (math.inf, "non-finite"), (-math.inf, "non-finite"),
                                           (2e6, "above the bound"), (-2e6, "above the bound")])
def test_check_state_names_the_offending_tensor(value: float, expect: str) -> None:
    _, state = layout_and_state()
    bad = state.clone()
    bad.consistent["stages.1.0.conv1.weight"][3, 1, 0, 2] = value
    reason = check_state(bad, 1e6)
    assert reason is not None and expect in reason and "consistent stages.1.0.conv1.weight" in reason
    bad = state.clone()
    bad.inconsistent[1]["stages.0.0.bn1.running_var"][0] = value
    reason = check_state(bad, 1e6)
    assert reason is not None and expect in reason and "submodel 2 stages.0.0.bn1.running_var" in reason


def test_check_state_catches_the_overflowed_sum_of_two_3e38_updates() -> None:
    layout, state = layout_and_state()
    agg = NeFedAvg(layout)
    for _ in range(2):
        agg.add(1, {n: torch.full(s, 3e38) for n, s in layout.upload_shapes(1).items()})
    assert "non-finite" in check_state(agg.finalize(state), 1e6)


# -- DP noise ---------------------------------------------------------------------------------------

def noise_of(layout: Layout, state: GlobalState, counts: list[int], std: float, seed: int) -> GlobalState:
    """The change finalize makes from zero updates plus noise: the noise alone, per element."""
    agg = NeFedAvg(layout)
    for k, c in enumerate(counts):
        for _ in range(c):
            agg.add(k, {n: torch.zeros(s) for n, s in layout.upload_shapes(k).items()})
    agg.add_noise(std, torch.Generator().manual_seed(seed))
    new = agg.finalize(state)
    return GlobalState({n: new.consistent[n] - t for n, t in state.consistent.items()},
                       [{n: new.inconsistent[k][n] - t for n, t in d.items()} for k, d in enumerate(state.inconsistent)])


def region_noise(layout: Layout, noise: GlobalState, inner: bool) -> torch.Tensor:
    """Consistent elements inside submodel 1's slices (inner) or only in submodel 2 (outer)."""
    parts = []
    for n, t in noise.consistent.items():
        mask = torch.zeros_like(t, dtype=torch.bool)
        mask[corner(layout.sub_shapes[0][n])] = True
        parts.append(t[mask if inner else ~mask])
    return torch.cat(parts).double()


def test_noise_std_is_divided_by_coverage() -> None:
    """std on one update's group; over 4 updates of one submodel std/4; two groups of one update each
    overlapping: sqrt(2) * std / 2 (two independent noises, coverage 2)."""
    layout, state = layout_and_state()
    std = 0.5
    noise = noise_of(layout, state, [0, 1], std, seed=1)
    full = torch.cat([t.reshape(-1) for t in noise.consistent.values()]).double()
    assert full.numel() > 2000 and abs(float(full.mean())) < 0.05 and float(full.std()) == pytest.approx(std, rel=0.08)
    bn = torch.cat([t.reshape(-1) for t in noise.inconsistent[1].values()]).double()
    assert float(bn.std()) == pytest.approx(std, rel=0.2)
    assert all(torch.equal(t, torch.zeros_like(t)) for t in noise.inconsistent[0].values())  # no updates, no noise
    four = torch.cat([t.reshape(-1) for t in noise_of(layout, state, [0, 4], std, seed=2).consistent.values()]).double()
    assert float(four.std()) == pytest.approx(std / 4, rel=0.08)
    both = noise_of(layout, state, [1, 1], std, seed=3)
    assert float(region_noise(layout, both, inner=True).std()) == pytest.approx(math.sqrt(2) * std / 2, rel=0.15)
    assert float(region_noise(layout, both, inner=False).std()) == pytest.approx(std, rel=0.08)


def test_noise_is_reproducible_and_needs_uniform_weighting() -> None:
    layout, state = layout_and_state()
    a, b = (noise_of(layout, state, [1, 1], 0.1, seed=7) for _ in range(2))
    assert all(torch.equal(a.consistent[n], b.consistent[n]) for n in a.consistent)
    with pytest.raises(ValueError, match="weighting='uniform'"):
        NeFedAvg(layout, "samples").add_noise(0.1, torch.Generator())
    with pytest.raises(ValueError, match="noise std"):
        NeFedAvg(layout).add_noise(math.nan, torch.Generator())


# -- accountant -------------------------------------------------------------------------------------

def exact_gaussian_epsilon(sigma: float, delta: float) -> float:
    """Balle & Wang (2018): the tight (epsilon, delta) of one Gaussian mechanism of sensitivity 1."""
    def phi(x: float) -> float:
        return 0.5 * math.erfc(-x / math.sqrt(2))

    lo, hi = 0.0, 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if phi(1 / (2 * sigma) - mid * sigma) - math.exp(mid) * phi(-1 / (2 * sigma) - mid * sigma) > delta:
            lo = mid
        else:
            hi = mid
    return hi


def test_accountant_matches_the_exact_gaussian_without_subsampling() -> None:
    """q = 1: T rounds at noise z compose to one Gaussian at z / sqrt(T); PLD is tight, RDP an upper bound."""
    pytest.importorskip("dp_accounting")
    exact = exact_gaussian_epsilon(1.0, 1e-5)
    assert exact == pytest.approx(4.377, abs=1e-3)
    pld = DPAccountant(2.0, 1.0, 1e-5).epsilon(4)
    assert pld == pytest.approx(exact, rel=1e-3)
    assert DPAccountant(2.0, 1.0, 1e-5, "rdp").epsilon(4) >= pld


def test_accountant_is_monotone_and_subsampling_helps() -> None:
    pytest.importorskip("dp_accounting")
    eps = [DPAccountant(1.0, 0.1, 1e-5).epsilon(r) for r in (0, 1, 10, 100)]
    assert eps[0] == 0.0 and eps == sorted(eps) and len(set(eps)) == 4
    by_noise = [DPAccountant(z, 0.1, 1e-5).epsilon(50) for z in (0.8, 1.0, 2.0)]
    assert by_noise == sorted(by_noise, reverse=True)
    assert DPAccountant(1.0, 0.01, 1e-5).epsilon(50) < DPAccountant(1.0, 0.1, 1e-5).epsilon(50)
    rdp = DPAccountant(1.0, 0.1, 1e-5, "rdp").epsilon(100)
    assert eps[3] <= rdp <= 1.5 * eps[3]  # measured: PLD 7.05, RDP 7.90


def test_accountant_without_the_library_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "dp_accounting", None)
    with pytest.raises(ImportError, match=r"pip install 'nefl-edge\[dp\]'"):
        DPAccountant(1.0, 0.1, 1e-5).epsilon(3)


@pytest.mark.parametrize("args", [(0.0, 0.1, 1e-5), (1.0, 0.0, 1e-5), (1.0, 1.5, 1e-5), (1.0, 0.1, 1.0)])
def test_accountant_refuses_meaningless_parameters(args) -> None:
    with pytest.raises(ValueError):
        DPAccountant(*args)


def test_a_decoded_updates_norm_is_computed_once_and_again_after_a_write() -> None:
    """The cached norm of an update off the wire is the per-tensor norm, and follows in-place writes
    (clipping scales the views in place) through the buffer's version counter."""
    g = torch.Generator().manual_seed(0)
    delta = {"a": torch.randn(70, 80, generator=g), "b": torch.randn(5000, generator=g), "c": torch.randn(3, generator=g)}
    wired = off_the_wire(delta)
    assert update_norm(wired) == pytest.approx(update_norm(delta), rel=1e-6)
    assert update_norm(wired) == wired.normed[1]
    wired["a"].mul_(3.0)
    delta["a"].mul_(3.0)
    assert update_norm(wired) == pytest.approx(update_norm(delta), rel=1e-6)
    wired["b"][7] = math.inf
    assert update_norm(wired) == math.inf


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """A float32 copy of `t` whose data starts 2 bytes past a 4-byte boundary."""
    raw = np.zeros(4 * t.numel() + 6, dtype=np.uint8)
    start = 2 + (-raw.ctypes.data) % 4
    view = torch.from_numpy(raw[start:start + 4 * t.numel()]).view(torch.float32)
    view.copy_(t.reshape(-1))
    assert view.data_ptr() % 4 == 2
    return view


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 30_000), st.sampled_from([1e-30, 1e-12, 1.0, 1e12, 1e19, 1e30]), st.integers(0, 2**32 - 1),
       st.sampled_from(["contiguous", "transposed", "offset", "misaligned"]), st.sampled_from([None, "nan", "inf"]))
def test_l2_norm_against_float64(n, scale, seed, layout, bad):
    """The row-wise float32 norm against an exact float64 one, whatever the size (rows and a tail), the magnitude
    (squares that overflow or underflow float32 take the float64 path), the layout (a view, a start one element
    in, a buffer at an address that is no multiple of 4, as an update decoded in place from an MQTT packet) and
    non-finite values (NaN or inf: the finite check)."""
    from nefl.nested.tensors import l2_norm

    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n + 1, generator=g) * scale
    t = {"contiguous": t[:n], "offset": t[1:], "transposed": t[:n - n % 2].view(2, -1).t() if n > 1 else t[:n],
         "misaligned": misaligned(t[:n])}[layout]
    if bad:
        t[(seed % t.shape[0],) + (0,) * (t.dim() - 1)] = float(bad)
    want = float(torch.linalg.vector_norm(t.double()))
    got = l2_norm(t)
    if bad == "nan":
        assert math.isnan(got)
    elif bad == "inf":
        assert got == math.inf
    else:
        assert got == pytest.approx(want, rel=1e-6)
