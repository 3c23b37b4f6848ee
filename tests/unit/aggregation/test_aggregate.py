import itertools
import random
from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from nefl.aggregation.aggregate import UpdateError, coverage_mean
from nefl.aggregation.update_check import check_update
from nefl.aggregation.nefedavg import NeFedAvg
from nefl.nested.methods import get_method
from nefl.nested.state import GlobalState, Layout, corner
from nefl.nested.tensors import ring
from tests.harness.brute_force import assert_state_close, brute_force, random_updates
from tests.harness.helpers import FULL, TINY_BASIC, TINY_BOTTLENECK, off_the_wire, random_ladder, tiny_profile

@pytest.mark.parametrize("seed", range(6))
def test_matches_brute_force_on_random_ladders(seed: int) -> None:
    rng = random.Random(seed)
    arch = TINY_BOTTLENECK if seed % 3 == 2 else TINY_BASIC
    # heterofl's BN sharing on the same random (non-nested) ladder, so both BN modes are covered
    method = replace(get_method("heterofl"), ladder="profile") if seed % 2 else get_method("nefl")
    layout = Layout.build(random_ladder(rng, arch, n=4), method)
    gen = torch.Generator().manual_seed(seed)
    state = GlobalState.init(layout, seed=seed)
    counts = [rng.randint(0, 3) for _ in range(layout.num_submodels)]
    counts[rng.randrange(len(counts))] = 0  # at least one untrained submodel
    ups = random_updates(layout, counts, gen)
    weighting = "samples" if seed % 2 else "uniform"
    agg = NeFedAvg(layout, weighting)
    for k, d, ns in ups:
        agg.add(k, d, ns)
    assert_state_close(agg.finalize(state), brute_force(layout, state, ups, weighting))


def test_paper_worked_example() -> None:
    """Block-1 conv in submodels 1, 3, 5; |M1| = |M5| = 2, |M3| = 3: parts averaged over 2, 5 and 7."""
    on, off = FULL, ((1.0, 1.0), (0.0, 1.0))
    widths = [0.25, 0.5, 0.625, 0.75, 1.0]
    profile = tiny_profile([(g, w, on if i in (0, 2, 4) else off) for i, (g, w) in enumerate(zip([0.2, 0.4, 0.6, 0.8, 1.0], widths))])
    layout = Layout.build(profile)
    state = GlobalState.init(layout, seed=0)
    agg = NeFedAvg(layout)
    name = "stages.1.0.conv2.weight"  # 8 x 8 x 3 x 3 globally
    values = {0: [1.0, 2.0], 2: [10.0, 20.0, 30.0], 4: [100.0, 200.0]}
    for k, vals in values.items():
        for v in vals:
            agg.add(k, {n: torch.full(s, v) for n, s in layout.upload_shapes(k).items()})
    new = agg.finalize(state)
    got = new.consistent[name] - state.consistent[name]
    c1, c3 = layout.sub_shapes[0][name][0], layout.sub_shapes[2][name][0]  # 2 and 5 channels
    assert (c1, c3) == (2, 5)
    assert torch.allclose(got[:c1, :c1], torch.tensor(363.0 / 7))  # over 7 updates
    assert torch.allclose(got[c1:c3, :c3], torch.tensor(360.0 / 5))  # over 5 updates
    assert torch.allclose(got[:c3, c1:c3], torch.tensor(360.0 / 5))
    assert torch.allclose(got[c3:, :], torch.tensor(150.0))  # only submodel 5: over 2 updates
    counts = agg.coverage(name)[:, :, 0, 0]
    assert counts[0, 0] == 7 and counts[c1, c1] == 5 and counts[c3, c3] == 2


def test_uncovered_elements_keep_their_value() -> None:
    skip = ((1.0, 0.0), (1.0, 0.0))
    profile = tiny_profile([(0.3, 0.5, skip), (1.0, 1.0, FULL)])
    layout = Layout.build(profile)
    state = GlobalState.init(layout, seed=1)
    agg = NeFedAvg(layout)
    agg.add(0, {n: torch.ones(s) for n, s in layout.upload_shapes(0).items()})
    new = agg.finalize(state)
    # blocks skipped by the only trained submodel, and channels beyond its width: untouched, not zeroed
    assert torch.equal(new.consistent["stages.0.1.conv1.weight"], state.consistent["stages.0.1.conv1.weight"])
    w = "stages.1.0.conv1.weight"
    assert torch.equal(new.consistent[w][4:], state.consistent[w][4:])
    assert torch.allclose(new.consistent[w][:4, :2], state.consistent[w][:4, :2] + 1)
    # the untrained submodel's inconsistent parameters are untouched
    for n, t in state.inconsistent[1].items():
        assert torch.equal(new.inconsistent[1][n], t)
    assert all(torch.isfinite(t).all() for t in new.consistent.values())


@pytest.mark.parametrize("weighting", ["uniform", "samples"])
def test_merge_of_partials_equals_single_aggregate(weighting: str) -> None:
    rng = random.Random(7)
    layout = Layout.build(random_ladder(rng, n=4))
    state = GlobalState.init(layout, seed=7)
    ups = random_updates(layout, [2, 1, 3, 2], torch.Generator().manual_seed(7))
    whole, a, b = NeFedAvg(layout, weighting), NeFedAvg(layout, weighting), NeFedAvg(layout, weighting)
    for i, (k, d, ns) in enumerate(ups):
        whole.add(k, d, ns)
        (a if i % 2 else b).add(k, d, ns)
    a.merge(b)
    assert a.updates == whole.updates
    assert_state_close(a.finalize(state), whole.finalize(state), atol=1e-6)


def test_single_full_submodel_is_plain_fedavg() -> None:
    layout = Layout.build(tiny_profile([(1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=3)
    gen = torch.Generator().manual_seed(3)
    clients = [{n: t + torch.randn(t.shape, generator=gen) for n, t in state.extract(layout, 0).items()} for _ in range(4)]
    agg = NeFedAvg(layout)
    start = state.extract(layout, 0)
    for w in clients:
        agg.add(0, {n: w[n] - start[n] for n in layout.upload_shapes(0)})
    new = agg.finalize(state)
    got = new.extract(layout, 0)
    for n in start:
        torch.testing.assert_close(got[n], torch.stack([c[n] for c in clients]).mean(0), atol=1e-5, rtol=1e-5)


def test_rejects_malformed_updates_without_touching_sums() -> None:
    layout = Layout.build(tiny_profile([(0.5, 0.5, FULL), (1.0, 1.0, FULL)]))
    agg = NeFedAvg(layout)
    good = {n: torch.zeros(s) for n, s in layout.upload_shapes(0).items()}
    name = "fc.weight"
    cases = {
        "shape": {**good, name: torch.zeros(5, 99)},
        "missing": {n: t for n, t in good.items() if n != name},
        "unexpected": {**good, "evil": torch.zeros(1)},
        "non-finite": {**good, name: torch.full(good[name].shape, float("nan"))},
        "dtype": {**good, name: torch.zeros(good[name].shape, dtype=torch.int64)},
    }
    for why, delta in cases.items():
        with pytest.raises(UpdateError):
            agg.add(0, delta)
    with pytest.raises(UpdateError):
        agg.add(5, good)
    assert agg.total_updates == 0 and all(not g for g in agg.groups)


@pytest.mark.parametrize("method", ["nefl", "fjord", "heterofl"])
def test_inconsistent_set_is_every_bn_and_step(method: str) -> None:
    """The paper's inconsistency: step sizes and every BN (shortcut BN included) stay per submodel;
    with HeteroFL's shared static BN only the running statistics stay local and the affine is shared."""
    layout = Layout.build(tiny_profile([(0.5, 0.5, ((1.0, 0.0), (0.0, 1.0))), (1.0, 1.0, FULL)]), method)
    names = set(layout.global_shapes)
    steps = {n for n in names if n.endswith(".step")}
    shortcut_bn = {n for n in names if ".shortcut.bn." in n}
    stats = {n for n in names if n.endswith(("running_mean", "running_var"))}
    affine = {n.rsplit(".", 1)[0] + suffix for n in stats for suffix in (".weight", ".bias")}
    assert steps and shortcut_bn and shortcut_bn <= stats | affine
    if method == "heterofl":
        assert layout.inconsistent == steps | stats and layout.local == stats
    else:
        assert layout.inconsistent == steps | stats | affine and not layout.local
    # the stem conv, the block convs and the classifier are consistent: averaged across submodels
    assert not {n for n in names if "conv" in n or n.startswith("fc.")} & layout.inconsistent


def test_uncovered_negative_zero_keeps_its_sign_bit() -> None:
    """Untouched weights keep their exact bits: old + 0.0 would flip -0.0 to +0.0 and change the state digest."""
    skip = ((1.0, 0.0), (1.0, 0.0))
    layout = Layout.build(tiny_profile([(0.3, 0.5, skip), (1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=1)
    skipped, sliced = "stages.0.1.conv1.weight", "stages.1.0.conv1.weight"
    state.consistent[skipped].fill_(-0.0)
    state.consistent[sliced][4:] = -0.0
    agg = NeFedAvg(layout)
    agg.add(0, {n: torch.ones(s) for n, s in layout.upload_shapes(0).items()})
    new = agg.finalize(state)
    assert torch.signbit(new.consistent[skipped]).all()
    assert torch.signbit(new.consistent[sliced][4:]).all()
    assert torch.equal(new.consistent[sliced][4:].view(torch.int32), state.consistent[sliced][4:].view(torch.int32))
    assert torch.allclose(new.consistent[sliced][:4, :2], state.consistent[sliced][:4, :2] + 1)


@given(st.lists(st.integers(1, 5), min_size=1, max_size=4).flatmap(
    lambda outer: st.tuples(st.just(outer), st.tuples(*(st.integers(0, d) for d in outer)))))
def test_rings_partition_the_difference_of_two_corners(shapes) -> None:
    outer, inner = torch.Size(shapes[0]), torch.Size(shapes[1])
    hits = torch.zeros(outer, dtype=torch.int32)
    for region in ring(outer, inner):
        hits[region] += 1
    want = torch.ones(outer, dtype=torch.int32)
    want[tuple(slice(0, d) for d in inner)] = 0
    assert torch.equal(hits, want)


@pytest.mark.parametrize("seed", range(8))
def test_fold_equals_the_coverage_rule(seed: int) -> None:
    """finalize's fold against coverage_mean, the rule written once for any windows: nested and non-nested
    ladders, groups missing (the full model too: then tensors no group has whole start from a new buffer),
    weights that are no sample counts (a robust rule's trust), -0.0 where nothing covers it; `state` untouched."""
    rng = random.Random(seed)
    nested = tiny_profile([(0.25, 0.25, FULL), (0.5, 0.5, ((1.0, 0.0), (1.0, 1.0))), (0.75, 0.75, FULL), (1.0, 1.0, FULL)])
    layout = Layout.build(nested if seed % 2 else random_ladder(rng, TINY_BOTTLENECK if seed % 4 == 2 else TINY_BASIC))
    state = GlobalState.init(layout, seed=seed)
    for t in state.consistent.values():
        t[torch.rand(t.shape, generator=torch.Generator().manual_seed(seed)) < 0.3] = -0.0
    before = state.clone()
    counts = [rng.randint(0, 2) for _ in range(layout.num_submodels)]
    counts[-1] = 0 if seed % 4 < 2 else 1
    agg = NeFedAvg(layout)
    for k, delta, _ in random_updates(layout, counts, torch.Generator().manual_seed(seed)):
        agg.add_weighted(k, delta, rng.uniform(0.05, 3.0))
    parts = {n: [(corner(g[n].shape), g[n].clone(), float(agg.weights[k])) for k, g in enumerate(agg.groups) if n in g]
             for n in state.consistent}
    covers = {n: agg.coverage(n).expand(t.shape) for n, t in state.consistent.items()}
    new = agg.finalize(state)
    for n, old in state.consistent.items():
        assert torch.equal(old.view(torch.int32), before.consistent[n].view(torch.int32))
        assert new.consistent[n].shape == old.shape and new.consistent[n].dtype == old.dtype
        torch.testing.assert_close(new.consistent[n], coverage_mean(old, parts[n]), atol=1e-6, rtol=1e-6, msg=n)
        bare = covers[n] == 0
        assert torch.equal(new.consistent[n][bare].view(torch.int32), old[bare].view(torch.int32)), n


def test_a_state_in_another_dtype_stays_in_it() -> None:
    """The group sums are float32; a float64 state gets float64 tensors back, its uncovered elements bit for bit."""
    skip = ((1.0, 0.0), (1.0, 0.0))
    layout = Layout.build(tiny_profile([(0.3, 0.5, skip), (1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=4)
    state.consistent = {n: t.double() / 3 for n, t in state.consistent.items()}
    agg = NeFedAvg(layout)
    agg.add(0, {n: torch.ones(s) for n, s in layout.upload_shapes(0).items()})
    new = agg.finalize(state)
    assert all(t.dtype == torch.float64 for t in new.consistent.values())
    w = "stages.1.0.conv1.weight"
    assert torch.equal(new.consistent[w][4:], state.consistent[w][4:])
    assert torch.equal(new.consistent["stages.0.1.conv1.weight"], state.consistent["stages.0.1.conv1.weight"])
    torch.testing.assert_close(new.consistent[w][:4, :2], state.consistent[w][:4, :2] + 1)


def test_owned_updates_are_adopted_and_others_never_written() -> None:
    layout = Layout.build(tiny_profile([(0.5, 0.5, FULL), (1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=2)
    gen = torch.Generator().manual_seed(2)
    mine = {n: torch.randn(s, generator=gen) for n, s in layout.upload_shapes(1).items()}
    theirs = [{n: torch.randn(s, generator=gen) for n, s in layout.upload_shapes(k).items()} for k in (0, 1)]
    kept = [{n: t.clone() for n, t in d.items()} for d in theirs]
    agg = NeFedAvg(layout, "samples")
    agg.add(1, mine, 3, owned=True)
    assert all(agg.groups[1][n] is t for n, t in mine.items())  # no copy of a handed-over update
    agg.add(0, theirs[0], 2)
    agg.add(1, theirs[1], 5)
    agg.finalize(state)
    for d, k in zip(theirs, kept):  # a caller's tensors are never summed into
        assert all(torch.equal(d[n], k[n]) for n in d)


def test_a_finalized_aggregate_refuses_more_work() -> None:
    layout = Layout.build(tiny_profile([(1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=0)
    agg = NeFedAvg(layout)
    agg.add(0, {n: torch.ones(s) for n, s in layout.upload_shapes(0).items()})
    agg.finalize(state)
    for again in (lambda: agg.finalize(state), lambda: agg.merge(NeFedAvg(layout)),
                  lambda: agg.add(0, {n: torch.ones(s) for n, s in layout.upload_shapes(0).items()})):
        with pytest.raises(RuntimeError, match="finalized"):
            again()


def test_a_decoded_updates_layout_is_judged_as_the_per_tensor_check_judges_it() -> None:
    """The fast check (one cached verdict per tiling and submodel) refuses exactly what the per-tensor
    check refuses, with the same message, for every pairing of an upload with a submodel."""
    layout = Layout.build(random_ladder(random.Random(3), n=3))
    for j, k in itertools.product(range(layout.num_submodels), repeat=2):
        delta = {n: torch.randn(s) for n, s in sorted(layout.upload_shapes(j).items())}  # the wire's order
        errors = []
        for form in (delta, off_the_wire(delta), off_the_wire(delta)):  # the last one hits the cache
            try:
                check_update(layout, k, form, values=False)
                errors.append(None)
            except UpdateError as e:
                errors.append(str(e))
        assert errors[0] == errors[1] == errors[2] and (errors[0] is None) == (j == k)


@pytest.mark.parametrize("weighting", ["uniform", "samples"])
@pytest.mark.parametrize("counts", [[2, 3, 1], [2, 3, 0]])
def test_nefedavg_of_decoded_updates_equals_nefedavg_of_plain_ones(weighting: str, counts: list[int]) -> None:
    """The flat fast path (the first update's buffer adopted, later ones added as one buffer) sums exactly
    what the per-tensor path sums, whether the full model's group sum holds the new tensors or a new buffer does."""
    layout = Layout.build(random_ladder(random.Random(5), n=3))
    state = GlobalState.init(layout, seed=1)
    ups = random_updates(layout, counts, torch.Generator().manual_seed(2))
    plain, wired = NeFedAvg(layout, weighting), NeFedAvg(layout, weighting)
    for k, delta, samples in ups:
        plain.add(k, {n: t.clone() for n, t in delta.items()}, samples)
        wired.add_validated(k, off_the_wire(delta), samples, owned=True)
    a, b = plain.finalize(state), wired.finalize(state)
    assert all(torch.equal(a.consistent[n], b.consistent[n]) for n in a.consistent)
    assert all(torch.equal(x[n], y[n]) for x, y in zip(a.inconsistent, b.inconsistent) for n in x)
