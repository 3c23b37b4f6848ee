"""Every tensor screened (nefl/aggregation/tensor_screen.py, in the centre check): the per-tensor clip against a
brute-force reimplementation, one poisoned tensor in an otherwise honest update bounded in that tensor, thin
tensors judged without themselves, the history, and recovery from a committed poisoned state under the step bound."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from nefl.aggregation.config import AggregationConfig
from nefl.aggregation.pipeline import Pipeline, Robustness
from nefl.aggregation.tensor_screen import SizeHistory, TensorSizes, measure
from nefl.nested.state import GlobalState, Layout
from tests.harness.brute_force import assert_state_close, brute_force
from tests.harness.helpers import FULL, random_ladder, tiny_profile

WIDTHS = [(0.5, 0.5, FULL), (0.75, 0.75, FULL), (1.0, 1.0, FULL)]
# the vote drops nothing, the whole-update clip never acts and nothing is merged per element: what is left is the
# per-tensor clip
SIZE_ONLY = {"min_agree": 0.0, "max_norm_ratio": 1e9, "coordinate_trim": 0.0}


def rms(t: torch.Tensor) -> float:
    return math.sqrt(sum(float(x) ** 2 for x in t.reshape(-1)) / t.numel())


def brute_references(layout: Layout, ups: list[tuple[int, dict]], history: dict[str, list[float]], hold: int,
                     min_cover: int) -> list[dict[str, float]]:
    """Per update and tensor, its reference by the definition (every median the lower one of an even count), over the
    updates judged with it (the first `hold` together, each later one with those before it and itself): a
    per-submodel tensor, the median of its copy's sizes in the updates of its submodel once `min_cover` carry it (else
    none); a shared one, the median of its sizes in the updates that carry it and the history once `min_cover` carry
    it, else of the others' and the history once they are `min_cover` - 1; none in warm-up."""
    out = []
    for i, (k, delta) in enumerate(ups):
        seen = ups[:max(hold, i + 1)]
        refs = {}
        for name, t in delta.items():
            if not t.numel():
                continue
            if name in layout.inconsistent:
                values = [rms(d[name]) for kk, d in seen if kk == k]
                refs[name] = statistics.median_low(values) if len(values) >= min_cover else math.inf
                continue
            values, least = [rms(d[name]) for _, d in seen if name in d], min_cover
            if len(values) < min_cover:
                values.remove(rms(t))
                least -= 1
            pool = values + history.get(name, [])
            refs[name] = statistics.median_low(pool) if len(pool) >= least else math.inf
        out.append(refs)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_per_tensor_clip_matches_brute_force(seed: int) -> None:
    """Random ladders, rounds of 1-7 updates at random scales with random tensors blown up, a random history, the
    first `hold` judged together and the rest on arrival: each tensor above c x its reference is scaled to it,
    then NeFedAvg, element by element."""
    rng = random.Random(seed)
    layout = Layout.build(random_ladder(rng, n=4))
    cfg = AggregationConfig(hold=rng.choice([1, 3, 8]), tensor_clip=rng.choice([1.5, 3.0]), **SIZE_ONLY)
    gen = torch.Generator().manual_seed(seed)
    state = GlobalState.init(layout, seed=seed)
    ups = []
    for _ in range(rng.randint(1, 9)):
        k, scale = rng.randrange(layout.num_submodels), rng.choice([0.01, 0.02, 0.05])
        delta = {n: torch.randn(s, generator=gen) * scale for n, s in layout.upload_shapes(k).items()}
        for n in rng.sample(sorted(delta), 3):
            delta[n] *= rng.choice([10.0, 100.0])
        ups.append((k, delta))
    pipeline = Pipeline(layout, Robustness(aggregation=cfg))
    history = {n: [rng.choice([0.01, 0.03]) for _ in range(rng.randint(0, 4))] for n in pipeline.sizes.history}
    for n, h in history.items():
        pipeline.sizes.history[n].extend(h)
    refs = brute_references(layout, ups, history, min(cfg.hold, len(ups)), cfg.min_cover)
    want = []
    for (k, delta), ref in zip(ups, refs):
        clipped = {n: t * min(1.0, cfg.tensor_clip * ref[n] / rms(t)) if t.numel() and rms(t) > 0 else t
                   for n, t in delta.items()}
        want.append((k, clipped, 1))
    agg = pipeline.begin_round(state, {f"c{i}": k for i, (k, _) in enumerate(ups)}, 1)
    for i, (k, delta) in enumerate(ups):
        agg.add(k, {n: t.clone() for n, t in delta.items()}, client=f"c{i}")
    got = agg.finalize(state)
    assert agg.dropped == {} and agg.clipped == {}
    assert_state_close(got, brute_force(layout, state, want, "uniform"))


def honest(layout: Layout, k: int, gen: torch.Generator, scale: float = 0.01) -> dict[str, torch.Tensor]:
    return {n: torch.randn(s, generator=gen) * scale for n, s in layout.upload_shapes(k).items()}


def poison_bias_push(layout: Layout, state: GlobalState, delta: dict[str, torch.Tensor]) -> list[str]:
    """The issue's push toward class 0 on the classifier's bias and row 0 of its weight, beside the honest delta."""
    delta["fc.bias"][0] += 5.0
    delta["fc.weight"][0] += 1.0
    return ["fc.bias", "fc.weight"]


def poison_running_var(layout: Layout, state: GlobalState, delta: dict[str, torch.Tensor]) -> list[str]:
    name = next(n for n in sorted(delta) if n.endswith("bn1.running_var"))
    delta[name] = 99 * state.inconsistent[2][name]  # x100
    return [name]


def poison_step_flip(layout: Layout, state: GlobalState, delta: dict[str, torch.Tensor]) -> list[str]:
    name = next(n for n in sorted(delta) if n.endswith(".step"))
    delta[name] = -2 * state.inconsistent[2][name]  # the step size's sign flipped
    return [name]


def committed_step(layout: Layout, old: GlobalState, new: GlobalState, name: str) -> float:
    """The RMS of tensor `name`'s step (submodel 3's copy), in log space for a running variance (as it is bounded)."""
    if name in layout.inconsistent:
        o, n = old.inconsistent[2][name], new.inconsistent[2][name]
        return rms(n.log() - o.log() if name.endswith("running_var") else n - o)
    return rms(new.consistent[name] - old.consistent[name])


@pytest.mark.parametrize("poison", [poison_bias_push, poison_running_var, poison_step_flip])
@pytest.mark.parametrize("round_size", [3, 6, 9])
def test_one_poisoned_tensor_in_an_honest_update_is_bounded_in_that_tensor(poison, round_size: int) -> None:
    """Honest updates on submodels 1-3 and one on submodel 3 that is honest but for one tensor (or the classifier's
    bias and weight), in round 1 (no history): the rest of its update goes in as sent, and the committed step of
    that tensor is within c x the honest updates' largest. A shared tensor and a copy that 3 updates of its submodel
    carry are clipped by the screen, to c x the round's median size of it; a thinner copy by the step bound (its
    update, outsized, by the whole-update clip too)."""
    layout = Layout.build(tiny_profile(WIDTHS))
    state, gen = GlobalState.init(layout, seed=0), torch.Generator().manual_seed(1)
    cfg = AggregationConfig()
    pipeline = Pipeline(layout, Robustness(aggregation=cfg))
    ks = [i % 3 for i in range(round_size - 1)]
    ups = [(k, honest(layout, k, gen)) for k in ks]
    evil = honest(layout, 2, gen)
    names = poison(layout, state, evil)
    agg = pipeline.begin_round(state, {**{f"h{i}": k for i, k in enumerate(ks)}, "evil": 2}, 1)
    for i, (k, d) in enumerate(ups):
        agg.add(k, d, client=f"h{i}")
    agg.add(2, evil, client="evil")
    commit = pipeline.commit(agg, state)
    assert commit.state is not None and agg.dropped == {}
    screened = [n for n in names if n not in layout.inconsistent or ks.count(2) >= 2]
    assert agg.tensors_clipped.get("evil", 0) >= len(screened)
    if screened == names:  # what is left of it is honest: not clipped as a whole
        assert "evil" not in agg.clipped
    for name in names:
        largest = max(rms(d[name]) for _, d in ups if name in d)
        if name.endswith("running_var"):  # bounded in log space
            largest = max(rms((state.inconsistent[k][name] + d[name]).log() - state.inconsistent[k][name].log()) for k, d in ups)
        assert committed_step(layout, state, commit.state, name) <= cfg.tensor_clip * largest * (1 + 1e-4)


def test_a_thin_tensor_is_judged_by_its_peers_and_history_never_by_itself() -> None:
    cfg = AggregationConfig()
    sizes = TensorSizes({"t": [0.01, 0.02, 0.03]}, frozenset({"bn"}), cfg)
    sizes.add(0, {"t": (5.0, 25.0)})  # alone on it this round
    assert sizes.reference("t", 0, 5.0) == 0.02
    sizes.add(1, {"t": (0.04, 0.0016)})  # two: still thin, each judged by the other and the history (lower median)
    assert sizes.reference("t", 0, 5.0) == 0.02 and sizes.reference("t", 1, 0.04) == 0.02
    sizes.add(2, {"t": (0.05, 0.0025)})  # three carry it: the round's median with its own, and the history
    assert sizes.reference("t", 0, 5.0) == 0.03
    assert TensorSizes({}, frozenset(), cfg).reference("t", 0, 1.0) == math.inf  # warm-up: nothing to judge by
    thin = TensorSizes({}, frozenset(), cfg)
    for k, size in enumerate((1.0, 2.0)):
        thin.add(k, {"t": (size, size * size)})
    assert thin.reference("t", 0, 1.0) == math.inf  # two, no history: one other is no centre
    assert TensorSizes({"t": [3.0]}, frozenset(), cfg).values == {}
    thin.history["t"] = [3.0]
    assert thin.reference("t", 0, 1.0) == 2.0  # the other and the history, the lower of two
    for k in (0, 0, 0, 1):  # a per-submodel tensor: by the copies of its own submodel, once 3 carry it
        sizes.add(k, {"bn": (float(k + 1), 1.0)})
    assert sizes.reference("bn", 0, 1.0) == 1.0 and sizes.reference("bn", 1, 2.0) == math.inf


def test_two_outsized_copies_of_four_cannot_raise_the_reference() -> None:
    """Half a round's copies of a tensor (two attackers of four) leave its reference at the honest sizes: the mean of
    the middle two would be halfway to theirs, and 3 x that would pass them whole."""
    sizes = TensorSizes({}, frozenset(), AggregationConfig())
    for k, size in enumerate((0.01, 0.02, 10.0, 10.0)):
        sizes.add(k, {"t": (size, size * size)})
    assert sizes.reference("t", 2, 10.0) == 0.02


def test_the_history_takes_only_rounds_with_enough_copies_and_survives_a_checkpoint() -> None:
    cfg = AggregationConfig()
    history = SizeHistory(["a", "b"], frozenset(), cfg)
    sizes = history.begin()
    for k, a in enumerate((1.0, 2.0, 30.0)):
        sizes.add(k, {"a": (a, a * a)})
    sizes.add(0, {"b": (100.0, 1e4)})  # a lone copy never enters the history
    history.commit(sizes)
    assert list(history.history["a"]) == [2.0] and not history.history["b"]
    again = SizeHistory(["a", "b"], frozenset(), cfg)
    again.load_state_dict(history.state_dict())
    assert again.history == history.history
    for bad in ({"history": {"nope": [1.0]}}, {"history": {"a": [math.inf]}}, [1.0]):
        with pytest.raises(ValueError, match="tensor-size history"):
            again.load_state_dict(bad)


def test_measure_is_the_per_element_rms_and_squared_norm() -> None:
    t = torch.tensor([[3.0, 4.0]])
    assert measure({"t": t, "empty": torch.zeros(0)}) == {"t": (pytest.approx(5 / math.sqrt(2)), pytest.approx(25.0))}


def target_round(layout: Layout, pipeline: Pipeline, state: GlobalState, target: GlobalState, gen: torch.Generator,
                 index: int) -> GlobalState:
    """One honest round of three devices, one per submodel: each moves its submodel half way to `target` (a
    quadratic's gradient step) with a little noise."""
    agg = pipeline.begin_round(state, {f"d{k}": k for k in range(3)}, index)
    for k in range(3):
        mine, goal = state.extract(layout, k), target.extract(layout, k)
        agg.add(k, {n: 0.5 * (goal[n] - mine[n]) + 0.002 * torch.randn(s, generator=gen)
                    for n, s in layout.upload_shapes(k).items()}, client=f"d{k}")
    commit = pipeline.commit(agg, state)
    assert commit.state is not None
    return commit.state


def distance(a: GlobalState, b: GlobalState) -> float:
    sq = sum(float((a.consistent[n] - b.consistent[n]).square().sum()) for n in a.consistent)
    sq += sum(float((x[n] - y[n]).square().sum()) for x, y in zip(a.inconsistent, b.inconsistent) for n in x)
    return math.sqrt(sq)


def test_honest_rounds_repair_a_committed_poisoned_state_under_the_step_bound() -> None:
    """A model trained toward a target by honest rounds; after round 6 a poisoned state is committed (the classifier's
    bias pushed by 5, a running variance x100, a step size flipped: what got through). Bounded at k x each tensor's
    history, honest rounds must still bring it back: after 20 more its distance to the target is the control run's
    (unpoisoned) plus 10%: the bound must not hold the repair to k x the settled steps of the copy's peers."""
    layout = Layout.build(tiny_profile(WIDTHS))
    start, target = GlobalState.init(layout, seed=0), GlobalState.init(layout, seed=1)
    runs = {}
    for poisoned in (False, True):
        pipeline, gen, state = Pipeline(layout), torch.Generator().manual_seed(2), start.clone()
        for r in range(1, 27):
            state = target_round(layout, pipeline, state, target, gen, r)
            if poisoned and r == 6:
                var = next(n for n in sorted(layout.inconsistent) if n.endswith("bn1.running_var"))
                step = next(n for n in sorted(layout.inconsistent) if n.endswith(".step"))
                state.consistent["fc.bias"][0] += 5.0
                state.inconsistent[2][var] *= 100
                state.inconsistent[2][step] *= -1
                assert distance(state, target) > 5
        runs[poisoned] = distance(state, target)
    assert runs[True] <= 1.1 * runs[False] + 1e-3, runs


def test_the_optional_noise_is_drawn_from_the_round_seed_at_the_tensors_reference_scale() -> None:
    """tensor_noise > 0: every kept update's tensors get N(0, (tensor_noise x reference)^2) per element, drawn from
    the round's seed (the server's secret in `serve`): the same round gives the same noise, another round other noise."""
    layout = Layout.build(tiny_profile([(1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=0)
    gen = torch.Generator().manual_seed(3)
    ups = [honest(layout, 0, gen) for _ in range(4)]

    def run(noise: float, index: int) -> GlobalState:
        pipeline = Pipeline(layout, Robustness(aggregation=AggregationConfig(tensor_noise=noise, **SIZE_ONLY)))
        agg = pipeline.begin_round(state, {f"c{i}": 0 for i in range(4)}, index)
        for i, d in enumerate(ups):
            agg.add(0, {n: t.clone() for n, t in d.items()}, client=f"c{i}")
        return agg.finalize(state)

    plain, noisy, again, other = run(0.0, 1), run(1.0, 1), run(1.0, 1), run(1.0, 2)
    name = "fc.weight"
    added = rms(noisy.consistent[name] - plain.consistent[name])
    sizes = sorted(rms(d[name]) for d in ups)
    assert 0.25 * statistics.median(sizes) < added < statistics.median(sizes)  # about reference / sqrt(4 updates)
    assert torch.equal(noisy.consistent[name], again.consistent[name])
    assert not torch.equal(noisy.consistent[name], other.consistent[name])
