"""The per-tensor step bound on per-submodel tensors (nefl/step_bound.py): against a brute-force
reimplementation, the lone -weights update it exists for, its warm-up, and that no update it bounds can
ratchet it."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from aggregator.federation import Federation, Robustness, Update
from nefl.robust import NormBound
from nefl.settings import AggregationConfig
from nefl.state import GlobalState, Layout
from nefl.step_bound import StepBound
from tests.helpers import random_ladder, tiny_profile
from tests.test_aggregate import FULL

CFG = AggregationConfig()


def moved(layout: Layout, state: GlobalState, ks: list[int], gen: torch.Generator, scale: list[float]) -> GlobalState:
    """`state` with the per-submodel tensors of submodels `ks` moved by random steps of RMS about scale[i]."""
    new = state.clone()
    for k, s in zip(ks, scale):
        for n, t in new.inconsistent[k].items():
            step = torch.randn(t.shape, generator=gen) * s
            new.inconsistent[k][n] = t * step.exp() if n.endswith("running_var") else t + step
    return new


def brute(old: GlobalState, new: GlobalState, history: dict[str, list[float]], k_: float, peers: int) -> GlobalState:
    """The rule written element by element: per tensor name, every copy that moved; its step (log ratio for a
    running variance); the median of the copies' RMS and the history; each copy above k x that scaled to it."""
    out = new.clone()
    names = sorted({n for d in old.inconsistent for n in d})
    for name in names:
        copies = []
        for k in range(len(old.inconsistent)):
            if name not in old.inconsistent[k]:
                continue
            o, n = old.inconsistent[k][name].double().reshape(-1), new.inconsistent[k][name].double().reshape(-1)
            if torch.equal(o, n):
                continue
            log = name.endswith("running_var")
            step = [math.log(max(float(b), 1e-30)) - math.log(float(a)) if log else float(b) - float(a) for a, b in zip(o, n)]
            copies.append((k, o, step, math.sqrt(sum(x * x for x in step) / max(1, len(step))), log))
        pool = [c[3] for c in copies] + history.get(name, [])
        limit = k_ * statistics.median(pool) if len(pool) >= peers else math.inf
        for k, o, step, size, log in copies:
            if size > limit:
                step = [x * limit / size for x in step]
                vals = [float(a) * math.exp(x) if log else float(a) + x for a, x in zip(o, step)]
                out.inconsistent[k][name] = torch.tensor(vals, dtype=torch.float64).reshape(
                    old.inconsistent[k][name].shape).to(old.inconsistent[k][name].dtype)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_the_bound_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    layout = Layout.build(random_ladder(rng, n=4))
    gen = torch.Generator().manual_seed(seed)
    state = GlobalState.init(layout, seed=seed)
    bound = StepBound(layout, CFG)
    history: dict[str, list[float]] = {}
    for _ in range(4):  # several rounds: the history takes part from the second on
        ks = sorted(rng.sample(range(4), rng.randint(1, 4)))
        new = moved(layout, state, ks, gen, [rng.choice([0.01, 0.02, 0.5]) for _ in ks])
        want = brute(state, new, history, CFG.step_k, CFG.min_cover)
        got = new.clone()
        bound.apply(state, got)
        for k in range(layout.num_submodels):
            for n in got.inconsistent[k]:
                torch.testing.assert_close(got.inconsistent[k][n], want.inconsistent[k][n], rtol=1e-5, atol=1e-6)
        bound.commit()
        history = {n: list(h) for n, h in bound.history.items()}
        state = got


def gamma_and_var(layout: Layout) -> tuple[str, str]:
    names = sorted(layout.inconsistent)
    return next(n for n in names if n.endswith("bn1.weight")), next(n for n in names if n.endswith("bn1.running_var"))


def test_a_lone_minus_weights_copy_is_bounded_by_its_peers_and_variances_stay_positive() -> None:
    layout = Layout.build(tiny_profile([(0.5, 0.5, FULL), (0.75, 0.75, FULL), (1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=0)
    gen = torch.Generator().manual_seed(0)
    new = moved(layout, state, [0, 1], gen, [0.02, 0.03])  # two honest copies
    for n, t in state.inconsistent[2].items():  # the attacker's: -1.0 x (and -1.5 x) the weights, alone on submodel 3
        new.inconsistent[2][n] = t - 1.5 * t if n.endswith("running_var") else t - t
    gamma, var = gamma_and_var(layout)
    bounded = StepBound(layout, CFG).apply(state, new)
    assert bounded.get(2, 0) > 0 and 0 not in bounded and 1 not in bounded
    assert bool((new.inconsistent[2][var] > 0).all()) and bool(new.inconsistent[2][var].isfinite().all())
    peers = [float((new.inconsistent[k][gamma] - state.inconsistent[k][gamma]).square().mean().sqrt()) for k in (0, 1)]
    step = float((new.inconsistent[2][gamma] - state.inconsistent[2][gamma]).square().mean().sqrt())
    assert step == pytest.approx(CFG.step_k * statistics.median([*peers, 1.0]), rel=1e-4)  # the median of 3 copies
    assert float(new.inconsistent[2][gamma].min()) > 0.8  # gamma was 1: the attacker moved it by at most ~0.1


def test_warm_up_leaves_a_round_with_too_few_sizes_unbounded_and_history_ends_it() -> None:
    layout = Layout.build(tiny_profile([(0.5, 0.5, FULL), (1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=0)
    bound = StepBound(layout, CFG)
    gen = torch.Generator().manual_seed(1)
    big = moved(layout, state, [1], gen, [2.0])
    assert bound.apply(state, big.clone()) == {}  # one copy, no history: nothing to compare it with
    bound.commit()
    assert not any(bound.history.values())  # a lone copy never enters the history
    for _ in range(3):  # rounds with both copies, both small: two sizes a round are not enough for an entry
        small = moved(layout, state, [0, 1], gen, [0.01, 0.01])
        assert bound.apply(state, small) == {}
        bound.commit()
    bound.history = {n: h.__class__([0.01] * 3, maxlen=h.maxlen) for n, h in bound.history.items()}  # as a busier past left it
    assert bound.apply(state, big) == {1: len(state.inconsistent[1])}  # now the lone copy is bounded


def test_an_attacker_at_the_bound_every_round_cannot_ratchet_it() -> None:
    """Two honest copies and the attacker's, which always sends as much as the bound lets through: the history
    holds each round's median copy, an honest one, so the bound stays k x the honest size."""
    layout = Layout.build(tiny_profile([(0.5, 0.5, FULL), (0.75, 0.75, FULL), (1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=0)
    bound = StepBound(layout, CFG)
    gen = torch.Generator().manual_seed(2)
    gamma, _ = gamma_and_var(layout)
    for _ in range(30):
        new = moved(layout, state, [0, 1, 2], gen, [0.01, 0.01, 1e3])
        bound.apply(state, new)
        bound.commit()
    honest = 0.01 * math.exp(0.5 * 0.01 ** 2)  # E[RMS] is about the scale for the linear tensors
    assert max(bound.history[gamma]) < 3 * honest
    assert bound.limit(gamma, []) < CFG.step_k * 3 * honest


def test_history_survives_a_restart_and_a_corrupt_one_is_refused() -> None:
    layout = Layout.build(tiny_profile([(0.5, 0.5, FULL), (0.75, 0.75, FULL), (1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=0)
    bound = StepBound(layout, CFG)
    bound.apply(state, moved(layout, state, [0, 1, 2], torch.Generator().manual_seed(3), [0.1, 0.2, 0.3]))
    bound.commit()
    again = StepBound(layout, CFG)
    again.load_state_dict(bound.state_dict())
    assert again.history == bound.history and any(again.history.values())
    for bad in ({"history": {"nope": [1.0]}}, {"history": {next(iter(bound.history)): [math.nan]}}, [1.0]):
        with pytest.raises(ValueError, match="step-bound history"):
            again.load_state_dict(bad)


@pytest.mark.parametrize("centre_check", [True, False])
def test_the_server_commits_through_the_bound_only_with_the_centre_check(centre_check: bool) -> None:
    """The round engine (serve, the workers' coordinator and the simulator) bounds the steps at commit: the
    -weights update, alone on its submodel and inside every update bound, leaves running variances positive;
    without the centre check the rule's state is committed as it is (plain NeFedAvg: at zero)."""
    layout = Layout.build(tiny_profile([(0.5, 0.5, FULL), (0.75, 0.75, FULL), (1.0, 1.0, FULL)]))
    robustness = Robustness(NormBound(relative=None, adaptive_k=None), aggregation=AggregationConfig(centre_check=centre_check))
    fed = Federation(layout, GlobalState.init(layout, seed=0), "t", 3, 1, 60.0, robustness=robustness)
    fed.adopt_round(1, {"a": 0, "b": 1, "evil": 2}, [], now=0.0)
    gen = torch.Generator().manual_seed(4)
    for c, k in fed.round.assignments.items():  # honest: shrink by 0.4 (as training shrinks variances), plus noise
        weights = {n: t for n, t in fed.state.extract(layout, k).items() if n in layout.upload_shapes(k)}
        scale = 9.0 if c == "evil" else 0.4  # clipped to 3 x the median relative norm: -1.2 x the weights
        fed.accept(Update(c, 1, k, 10, {n: -scale * t + 0.01 * torch.randn(t.shape, generator=gen)
                                        for n, t in weights.items()}, 100))
    facts = fed.close_round()
    _, var = gamma_and_var(layout)
    assert facts["committed"] and not facts.get("dropped")
    assert bool((fed.state.inconsistent[2][var] > 0).all()) == centre_check
    assert ("steps_bounded" in facts) == centre_check
