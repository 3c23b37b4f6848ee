"""The per-tensor step bound on per-submodel tensors (nefl/aggregation/step_bound.py): against a brute-force
reimplementation, the lone -weights update it exists for, its warm-up, and that no update it bounds can
ratchet it."""

from __future__ import annotations

import base64
import itertools
import json
import math
import random
import statistics

import pytest
import torch

from aggregator.federation import Federation, Robustness, Update
from nefl.aggregation.nefedavg import NeFedAvg
from nefl.aggregation.robust import NormBound
from nefl.aggregation.step_bound import StepBound
from nefl.nested.state import GlobalState, Layout
from nefl.nested.tensors import corner
from nefl.aggregation.config import AggregationConfig
from tests.harness.helpers import FULL, random_ladder, tiny_profile

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
    running variance); the lower median of the copies' RMS and the history; each copy above k x that scaled to it."""
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
        limit = k_ * statistics.median_low(pool) if len(pool) >= peers else math.inf
        for k, o, step, size, log in copies:
            if size > limit:
                step = [x * limit / size for x in step]
                vals = [float(a) * math.exp(x) if log else float(a) + x for a, x in zip(o, step)]
                out.inconsistent[k][name] = torch.tensor(vals, dtype=torch.float64).reshape(
                    old.inconsistent[k][name].shape).to(old.inconsistent[k][name].dtype)
    return out


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
    bounded = StepBound(layout, CFG).apply(state, new, [1] * layout.num_submodels)
    assert bounded.get(2, 0) > 0 and 0 not in bounded and 1 not in bounded
    assert bool((new.inconsistent[2][var] > 0).all()) and bool(new.inconsistent[2][var].isfinite().all())
    peers = [float((new.inconsistent[k][gamma] - state.inconsistent[k][gamma]).square().mean().sqrt()) for k in (0, 1)]
    step = float((new.inconsistent[2][gamma] - state.inconsistent[2][gamma]).square().mean().sqrt())
    assert step == pytest.approx(CFG.step_k * statistics.median_low([*peers, 1.0]), rel=1e-4)  # the median of 3 copies
    assert float(new.inconsistent[2][gamma].min()) > 0.8  # gamma was 1: the attacker moved it by at most ~0.1


def test_two_flipped_copies_of_four_cannot_raise_the_bound() -> None:
    """bench_robust's IID seed 1, round 1: four submodels trained, two of them half attackers whose batch norm and
    step sizes flip (averaged: gamma 1 -> 0 and 1/3). A median of the four sizes is halfway to the attackers' and
    let both through; the lower median is an honest copy's, so both are held to k x that."""
    layout = Layout.build(tiny_profile([(0.25, 0.25, FULL), (0.5, 0.5, FULL), (0.75, 0.75, FULL), (1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=0)
    new = moved(layout, state, [0, 2], torch.Generator().manual_seed(0), [0.01, 0.01])  # two honest copies
    for k, share in ((1, 1.0), (3, 2 / 3)):  # the flip (-2 x the weights) averaged with 1 and 2 honest updates
        for n, t in state.inconsistent[k].items():
            new.inconsistent[k][n] = t * 3.0 ** share if n.endswith("running_var") else t - share * t
    gamma, _ = gamma_and_var(layout)
    bounded = StepBound(layout, CFG).apply(state, new, [2, 2, 0, 3])
    assert bounded.get(1, 0) > 0 and bounded.get(3, 0) > 0 and 0 not in bounded and 2 not in bounded
    honest = max(float((new.inconsistent[k][gamma] - state.inconsistent[k][gamma]).square().mean().sqrt()) for k in (0, 2))
    for k in (1, 3):  # held to k x the honest size: gamma stays near 1 (the mean of the middle two allowed 1.0)
        step = float((new.inconsistent[k][gamma] - state.inconsistent[k][gamma]).square().mean().sqrt())
        assert step <= CFG.step_k * honest * (1 + 1e-4) and float(new.inconsistent[k][gamma].min()) > 0.9


def test_warm_up_leaves_a_round_with_too_few_sizes_unbounded_and_history_ends_it() -> None:
    layout = Layout.build(tiny_profile([(0.5, 0.5, FULL), (1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=0)
    bound = StepBound(layout, CFG)
    gen = torch.Generator().manual_seed(1)
    big = moved(layout, state, [1], gen, [2.0])
    assert bound.apply(state, big.clone(), [1] * layout.num_submodels) == {}  # one copy, no history: nothing to compare it with
    bound.commit()
    assert not any(bound.history.values())  # a lone copy never enters the history
    for _ in range(3):  # rounds with both copies, both small: two sizes a round are not enough for an entry
        small = moved(layout, state, [0, 1], gen, [0.01, 0.01])
        assert bound.apply(state, small, [1] * layout.num_submodels) == {}
        bound.commit()
    bound.history = {n: h.__class__([0.01] * 3, maxlen=h.maxlen) for n, h in bound.history.items()}  # as a busier past left it
    assert bound.apply(state, big, [1] * layout.num_submodels) == {1: len(state.inconsistent[1])}  # now the lone copy is bounded


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
        bound.apply(state, new, [1] * layout.num_submodels)
        bound.commit()
    honest = 0.01 * math.exp(0.5 * 0.01 ** 2)  # E[RMS] is about the scale for the linear tensors
    assert max(bound.history[gamma]) < 3 * honest
    assert bound.limit(gamma, []) < CFG.step_k * 3 * honest


def test_history_survives_a_restart_and_a_corrupt_one_is_refused() -> None:
    layout = Layout.build(tiny_profile([(0.5, 0.5, FULL), (0.75, 0.75, FULL), (1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=0)
    bound = StepBound(layout, CFG)
    bound.apply(state, moved(layout, state, [0, 1, 2], torch.Generator().manual_seed(3), [0.1, 0.2, 0.3]), [1] * layout.num_submodels)
    bound.commit()
    again = StepBound(layout, CFG)
    again.load_state_dict(bound.state_dict())
    assert again.history == bound.history and any(again.history.values())
    for bad in ({"history": {"nope": [1.0]}}, {"history": {next(iter(bound.history)): [math.nan]}}, [1.0]):
        with pytest.raises(ValueError, match="step-bound history"):
            again.load_state_dict(bad)


def test_anchors_survive_a_restart_and_corrupt_ones_are_refused() -> None:
    """The copies' anchor windows round-trip through the checkpoint's JSON metadata value for value, and a resumed
    bound keeps whole the same repairing steps; a checkpoint without anchors (older) leaves them empty."""
    layout = Layout.build(tiny_profile([(0.5, 0.5, FULL), (0.75, 0.75, FULL), (1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=0)
    bound, gen = StepBound(layout, CFG), torch.Generator().manual_seed(4)
    for _ in range(CFG.step_window + 2):
        new = moved(layout, state, [0, 1, 2], gen, [0.01, 0.02, 0.03])
        bound.apply(state, new, [1] * layout.num_submodels)
        bound.commit()
        state = new
    again = StepBound(layout, CFG)
    again.load_state_dict(json.loads(json.dumps(bound.state_dict())))
    assert again.anchor.past.keys() == bound.anchor.past.keys() and len(bound.anchor.past) == len(state.inconsistent[0]) * 3
    assert all(len(w) == CFG.step_window and all(torch.equal(a, b) for a, b in zip(w, bound.anchor.past[key]))
               for key, w in again.anchor.past.items())
    gamma, _ = gamma_and_var(layout)
    far = state.inconsistent[2][gamma] + 1.0
    back = (far + bound.anchor.past[2, gamma][-1]) / 2
    assert again.anchor.closer(gamma, 2, far, back) and bound.anchor.closer(gamma, 2, far, back)
    older = StepBound(layout, CFG)
    older.load_state_dict({"history": bound.state_dict()["history"]})
    assert not older.anchor.past
    good = bound.state_dict()
    k, name, values = good["anchors"][0]
    for anchors in ([[k, "nope", values]], [[k, name, values[:1] + ["AAAA"]]], [[k, name, [
            base64.b64encode(torch.full_like(state.inconsistent[k][name], math.nan).numpy().tobytes()).decode()]]], "x"):
        with pytest.raises(ValueError, match="step-bound anchors"):
            again.load_state_dict({**good, "anchors": anchors})


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


# --- the consistent tensors' thinly covered cells ---------------------------------------------------------

def nefedavg_round(layout: Layout, state: GlobalState, tasks: list[tuple[int, float]], gen: torch.Generator,
                   evil: tuple[int, dict[str, torch.Tensor]] | None = None) -> tuple[GlobalState, list[int]]:
    """A real NeFedAvg round: one update per (submodel, step scale) in `tasks`, random steps, and `evil`'s
    (submodel, delta). Returns the candidate state and the updates per submodel."""
    agg = NeFedAvg(layout)
    for k, s in tasks:
        agg.add(k, {n: torch.randn(shape, generator=gen) * s for n, shape in layout.upload_shapes(k).items()})
    if evil is not None:
        agg.add(*evil)
    return agg.finalize(state), list(agg.updates)


def nested(shapes: list[torch.Size]) -> bool:
    return all(all(a <= b for a, b in zip(s, t)) or all(a >= b for a, b in zip(s, t)) for s in shapes for t in shapes)


def by_rows_brute(layout: Layout, name: str) -> bool:
    """A cell is also judged class by class: a tensor of >= 2 dims whose first no submodel cuts while another is cut,
    and the 1-D bias beside such a weight."""
    shapes = {s[name] for s in layout.sub_shapes if name in s}
    if len(layout.global_shapes[name]) == 1 and name.endswith("bias"):
        weight = name[:-4] + "weight"
        return weight in layout.global_shapes and by_rows_brute(layout, weight) and \
            layout.global_shapes[weight][0] == layout.global_shapes[name][0]
    return len(layout.global_shapes[name]) >= 2 and len(shapes) > 1 and len({s[0] for s in shapes}) == 1


def row_positions(idxs: list[tuple[int, ...]]) -> list[list[int]]:
    """The positions in a cell's element list `idxs` of each row (leading index: a class), row by row."""
    return [[j for j, i in enumerate(idxs) if i[0] == r] for r in sorted({i[0] for i in idxs})]


def brute_cells(layout: Layout, old: GlobalState, new: GlobalState, updates: list[int], history: dict[str, list[float]],
                k_: float, peers: int) -> tuple[GlobalState, dict[str, float]]:
    """The cell rule element by element: each element's cell is the set of submodels whose slice holds it, its
    coverage their updates; per tensor, the moved cells covered twice or more and the history make the pool,
    a cell covered by fewer than `peers` above k x its median is scaled to it, one covered by more above k x the
    history's median (once it holds `peers` entries) to that, and then each of its rows (the classifier's classes:
    `by_rows_brute`) above that limit to it, in a thin cell above k x the median of the well-covered cells' rows and
    their own history (`#rows`) where that is lower. Returns the new state and this round's history entries (the
    median of the well-covered cells, and of their rows)."""
    out, entries = new.clone(), {}
    for name, full in layout.global_shapes.items():
        if name in layout.inconsistent:
            continue
        holders = [k for k, s in enumerate(layout.sub_shapes) if name in s]
        if not nested([layout.sub_shapes[k][name] for k in holders]):
            continue
        o, n = old.consistent[name].double(), new.consistent[name].double()
        members: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        for idx in itertools.product(*(range(d) for d in full)):
            key = tuple(k for k in holders if all(i < d for i, d in zip(idx, layout.sub_shapes[k][name])))
            if key:
                members.setdefault(key, []).append(idx)
        cells_ = []
        for key, idxs in members.items():
            step = [float(n[i]) - float(o[i]) for i in idxs]
            size = math.sqrt(sum(x * x for x in step) / len(step))
            cover = sum(updates[k] for k in key)
            if cover > 0 and size > 0:
                cells_.append((idxs, step, size, cover))
        well = [size for _, _, size, cover in cells_ if cover >= 2]
        pool, own = well + history.get(name, []), history.get(name, [])
        rows = by_rows_brute(layout, name)

        well_rows = [math.sqrt(sum(step[j] ** 2 for j in row) / len(row)) for idxs, step, _, cover in cells_ if rows
                     and cover >= 2 for row in row_positions(idxs)]
        rows_pool = well_rows + history.get(name + "#rows", [])
        for idxs, step, size, cover in cells_:
            by = pool if cover < peers else own
            limit = k_ * statistics.median_low(by) if len(by) >= peers else math.inf
            if size > limit:
                step = [x * limit / size for x in step]
            row_limit = limit
            if cover < peers and len(rows_pool) >= peers:
                row_limit = min(limit, k_ * statistics.median_low(rows_pool))
            if rows and math.isfinite(row_limit):  # then each class's row
                for row in row_positions(idxs):
                    rms_ = math.sqrt(sum(step[j] ** 2 for j in row) / len(row))
                    for j in row if rms_ > row_limit else []:
                        step[j] *= row_limit / rms_
            for i, x in zip(idxs, step):
                out.consistent[name][i] = float(o[i]) + x
        if well:
            entries[name] = statistics.median_low(well)
        if well_rows:
            entries[name + "#rows"] = statistics.median_low(well_rows)
    return out, entries


@pytest.mark.parametrize("seed", range(4))
def test_the_bound_matches_brute_force(seed: int) -> None:
    """Per-submodel copies (moved in log space for running variances) and shared cells (a real NeFedAvg
    round) against the two element-by-element rules, over rounds: the history takes part from the second."""
    rng = random.Random(seed)
    layout = Layout.build(random_ladder(rng, n=4))
    gen = torch.Generator().manual_seed(seed)
    state = GlobalState.init(layout, seed=seed)
    bound = StepBound(layout, CFG)
    for _ in range(4):
        tasks = [(rng.randrange(4), rng.choice([0.01, 0.02, 0.5])) for _ in range(rng.randint(1, 5))]
        new, updates = nefedavg_round(layout, state, tasks, gen)
        ks = sorted({k for k, _ in tasks})
        new.inconsistent = moved(layout, state, ks, gen, [rng.choice([0.01, 0.02, 0.5]) for _ in ks]).inconsistent
        past = {n: list(h) for n, h in bound.history.items()}
        want = brute(state, new, past, CFG.step_k, CFG.min_cover)
        want_cells, entries = brute_cells(layout, state, new, updates, past, CFG.step_k, CFG.min_cover)
        got = new.clone()
        bound.apply(state, got, updates)
        for k in range(layout.num_submodels):
            for n in got.inconsistent[k]:
                torch.testing.assert_close(got.inconsistent[k][n], want.inconsistent[k][n], rtol=1e-5, atol=1e-6)
        for n in got.consistent:
            torch.testing.assert_close(got.consistent[n], want_cells.consistent[n], rtol=1e-5, atol=1e-6)
        bound.commit()
        # the cells' and rows' histories: a round's entry is the lower median of its well-covered cells, and only then
        for n in [n for n in bound.history if n not in bound.names]:
            assert list(bound.history[n]) == pytest.approx([*past[n], *([entries[n]] if n in entries else [])])
        state = got


WIDTHS = [(0.5, 0.5, FULL), (0.75, 0.75, FULL), (1.0, 1.0, FULL)]


def test_a_lone_minus_weights_on_the_outer_ring_is_bounded_and_so_are_well_covered_cells() -> None:
    """Two honest updates on submodels 1 and 2 and -weights on submodel 3, the only update of its outer ring:
    after a few honest rounds (the history) the ring moves at most k x the typical cell step; the cells the
    three updates share, where -weights is a third of NeFedAvg's average, at most k x the history's median."""
    layout = Layout.build(tiny_profile(WIDTHS))
    state, gen, bound = GlobalState.init(layout, seed=0), torch.Generator().manual_seed(5), StepBound(layout, CFG)
    for _ in range(3):
        honest, updates = nefedavg_round(layout, state, [(0, 0.01), (1, 0.01), (2, 0.01)], gen)
        got = honest.clone()
        bound.apply(state, got, updates)
        for n, t in honest.consistent.items():  # cells covered 3, 2 and 1 times by alike steps: none bounded (the
            assert by_rows_brute(layout, n) or torch.equal(got.consistent[n], t), n  # classifier's 2-element rows: noisy)
        bound.commit()
    minus = {n: -t for n, t in state.extract(layout, 2).items() if n in layout.upload_shapes(2)}
    new, updates = nefedavg_round(layout, state, [(0, 0.01), (1, 0.01)], gen, evil=(2, minus))
    plain = new.clone()
    bound.apply(state, new, updates)
    name = next(n for n in bound.cells if n.endswith("conv1.weight") and len(bound.cells[n]) == 3)
    (outer, _), (middle, _), (inner, _) = bound.cells[name]
    step = [float((new.consistent[name][b] - state.consistent[name][b]).square().mean().sqrt()) for b in outer]
    weight = float(state.consistent[name][outer[0]].square().mean().sqrt())
    assert max(step) <= CFG.step_k * 0.02 and max(step) < weight / 10  # -weights would have moved it by its size
    limit = CFG.step_k * statistics.median_low(bound.history[name])
    for b in inner:  # covered by all three updates: NeFedAvg's average, scaled to the bound
        size = float((new.consistent[name][b] - state.consistent[name][b]).square().mean().sqrt())
        assert size == pytest.approx(limit, rel=1e-5) and not torch.equal(new.consistent[name][b], plain.consistent[name][b])


def test_an_attacker_alone_on_the_outer_rings_cannot_ratchet_the_cell_bound() -> None:
    """30 rounds of two honest updates and the attacker's on the largest submodel: 3 x an honest step where the
    others cover it too (what the centre check's size clip lets through) and 1e3 on its outer ring, which one
    update decides and so never enters the history: the bound stays k x the honest cell steps and holds the
    ring to it every round."""
    layout = Layout.build(tiny_profile(WIDTHS))
    state, gen, bound = GlobalState.init(layout, seed=0), torch.Generator().manual_seed(6), StepBound(layout, CFG)
    shared = [n for n in bound.cells if len(bound.cells[n]) == 3]
    for r in range(30):
        delta = {n: torch.randn(shape, generator=gen) * 0.03 for n, shape in layout.upload_shapes(2).items()}
        for n in shared:
            for b in bound.cells[n][0][0]:
                delta[n][b] = 1e3
        new, updates = nefedavg_round(layout, state, [(0, 0.01), (1, 0.01)], gen, evil=(2, delta))
        bound.apply(state, new, updates)
        bound.commit()
        for n in shared if r >= 1 else []:  # round 1 is the warm-up: two well-covered cells, no history
            ring_ = torch.cat([(new.consistent[n][b] - state.consistent[n][b]).reshape(-1) for b in bound.cells[n][0][0]])
            assert float(ring_.square().mean().sqrt()) <= CFG.step_k * 0.02 * (1 + 1e-6), n
        state = new
    for n in shared:
        assert max(bound.history[n]) < 0.02, n  # averages of honest steps and the clipped attacker's


def test_a_push_on_one_class_is_held_class_by_class() -> None:
    """The bias push in a round of three: the attacker alone on the largest submodel adds 0.1 to every element of
    class 0's row of the classifier, honest elsewhere (steps of 0.01). In every cell (the outer ring, one update; the
    middle ring, two; the columns all three share) class 0's row is held to k x the typical cell step; judged by the
    cell's RMS over all five classes it passed at about sqrt(5) x that."""
    layout = Layout.build(tiny_profile(WIDTHS))
    state, gen, bound = GlobalState.init(layout, seed=0), torch.Generator().manual_seed(5), StepBound(layout, CFG)
    for _ in range(3):
        honest, updates = nefedavg_round(layout, state, [(0, 0.01), (1, 0.01), (2, 0.01)], gen)
        bound.apply(state, honest, updates)
        bound.commit()
        state = honest
    delta = {n: torch.randn(shape, generator=gen) * 0.01 for n, shape in layout.upload_shapes(2).items()}
    delta["fc.weight"][0] += 0.1
    new, updates = nefedavg_round(layout, state, [(0, 0.01), (1, 0.01)], gen, evil=(2, delta))
    plain = new.clone()
    bound.apply(state, new, updates)
    whole = StepBound(layout, CFG)
    whole.rows, whole.history = frozenset(), bound.history
    cell_only = plain.clone()
    whole.apply(state, cell_only, updates)
    inner, middle = layout.sub_shapes[0]["fc.weight"][1], layout.sub_shapes[1]["fc.weight"][1]
    typical = max(bound.history["fc.weight"])
    for cols in (slice(middle, None), slice(inner, middle), slice(0, inner)):
        step, by_cell = (float((t.consistent["fc.weight"] - state.consistent["fc.weight"])[0, cols].square().mean().sqrt())
                         for t in (new, cell_only))
        assert step <= CFG.step_k * typical * (1 + 1e-6) and by_cell > 1.5 * step, (cols, step, by_cell)


# --- what no resnet ladder has, and values a bad update sends ----------------------------------------------

def odd_layout() -> tuple[Layout, GlobalState]:
    """Three nested submodels by hand: empty and 0-dim tensors, a 2-D per-submodel tensor, names only the
    larger submodels hold, shared tensors cut in their last dim only or with elements no submodel holds,
    float64 tensors next to float32 ones."""
    S = torch.Size
    shared = {"conv.weight": [S((2, 2, 3, 3)), S((4, 3, 3, 3)), S((6, 4, 3, 3))],
              "fc.weight": [S((5, 2)), S((5, 4)), S((5, 6))], "wide.weight": [S((2, 3, 2)), S((4, 3, 2)), S((6, 3, 2))],
              "empty.weight": [S((0, 1)), S((0, 2)), S((0, 3))], "none.weight": [S((3, 0))] * 3,
              "scale": [S(())] * 3, "half.bias": [None, S((3,)), S((4,))]}
    own = {"bn.weight": [S((2,)), S((4,)), S((6,))], "bn.running_var": [S((2,)), S((4,)), S((6,))],
           "blk.step": [S(())] * 3, "proj.weight": [S((2, 2)), S((3, 3)), S((4, 4))],
           "gone.running_var": [S((0,))] * 3, "top.running_var": [None, None, S((3,))]}
    full = {n: s[-1] for n, s in [*shared.items(), *own.items()]} | {"wide.weight": S((8, 3, 2)), "none.weight": S((4, 0))}
    subs = [{n: s[k] for n, s in [*shared.items(), *own.items()] if s[k] is not None} for k in range(3)]
    layout = Layout(None, None, full, subs, frozenset(own), frozenset())  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(7)

    def init(name: str, shape: torch.Size) -> torch.Tensor:
        t = torch.randn(shape, generator=gen, dtype=torch.float64)
        t = t.abs() + 0.5 if name.endswith("running_var") else t
        return t if name in ("fc.weight", "blk.step") else t.float()

    state = GlobalState({n: init(n, s) for n, s in full.items() if n in shared},
                        [{n: init(n, s) for n, s in sub.items() if n in own} for sub in subs])
    return layout, state


def test_the_bound_matches_brute_force_on_odd_tensors() -> None:
    """As `test_the_bound_matches_brute_force`, on `odd_layout`: the shared tensors' outer rings (one update
    each) at times moved 50 x their inner cells, so that they are bounded, and the copies at random scales."""
    layout, state = odd_layout()
    rng, gen = random.Random(8), torch.Generator().manual_seed(8)
    bound, bounded, updates = StepBound(layout, CFG), {}, [2, 1, 1]
    for _ in range(6):
        new = moved(layout, state, [0, 1, 2], gen, [rng.choice([0.01, 0.02, 0.5]) for _ in range(3)])
        for n, t in new.consistent.items():
            scale = torch.full(t.shape, rng.choice([0.01, 0.5]), dtype=torch.float64)
            scale[corner(layout.sub_shapes[1][n])] = 0.01
            new.consistent[n] = (t + torch.randn(t.shape, generator=gen, dtype=torch.float64) * scale).to(t.dtype)
        past = {n: list(h) for n, h in bound.history.items()}
        want = brute(state, new, past, CFG.step_k, CFG.min_cover)
        want_cells, entries = brute_cells(layout, state, new, updates, past, CFG.step_k, CFG.min_cover)
        got = new.clone()
        for k, count in bound.apply(state, got, updates).items():
            bounded[k] = bounded.get(k, 0) + count
        for k in range(layout.num_submodels):
            for n in got.inconsistent[k]:
                assert got.inconsistent[k][n].dtype == state.inconsistent[k][n].dtype
                torch.testing.assert_close(got.inconsistent[k][n], want.inconsistent[k][n], rtol=1e-5, atol=1e-6)
        for n in got.consistent:
            assert got.consistent[n].dtype == state.consistent[n].dtype
            torch.testing.assert_close(got.consistent[n], want_cells.consistent[n], rtol=1e-5, atol=1e-6)
        bound.commit()
        for n in bound.cells:
            assert list(bound.history[n]) == pytest.approx([*past[n], *([entries[n]] if n in entries else [])])
        state = got
    assert bounded.get(2, 0) > 0  # rings and copies were bounded, not only compared


def test_non_finite_and_non_positive_values_and_negative_zero() -> None:
    """A copy's NaN or -1 running variance is rebuilt from its log step (a NaN value's step is 0), scaled to the
    bound, and stays positive, as does a lone copy's 0 within the bound (warm-up); a NaN step size is no peer;
    -0.0 for 0.0 is no move (a copy of step 0 would have made the median 0 and bounded the moved copy to
    nothing), NaN for NaN is (its step is set to 0: a NaN in the old state stays); a thin cell's inf value
    puts its step size at inf and the cell back to the old state, a thin cell's NaN size is no move: the
    rule's values stay."""
    layout = Layout.build(tiny_profile(WIDTHS))
    state = GlobalState.init(layout, seed=0)
    gen = torch.Generator().manual_seed(9)
    gamma, var = gamma_and_var(layout)
    bias, mean, var2 = gamma.replace("weight", "bias"), var.replace("var", "mean"), var.replace("bn1", "bn2")
    state.inconsistent[2][mean][0] = math.nan
    new = moved(layout, state, [0, 1], gen, [0.01, 0.01])
    new.inconsistent[2] = {n: t + 0.01 for n, t in state.inconsistent[2].items()}
    new.inconsistent[2][mean][0] = 0.0
    new.inconsistent[2][mean][1:] = state.inconsistent[2][mean][1:]
    for k in range(3):
        new.inconsistent[k][var2] = state.inconsistent[k][var2].clone()
    new.inconsistent[2][var2][0] = 0.0
    for k in (0, 1):
        new.inconsistent[k][bias] = -state.inconsistent[k][bias]  # all 0.0: -0.0
    new.inconsistent[2][bias] = state.inconsistent[2][bias] + 0.5
    new.inconsistent[2][var][:3] = torch.tensor([math.nan, -1.0, 0.0])
    new.inconsistent[2][gamma][0] = math.nan
    cells_ = [n for n in sorted(layout.global_shapes) if n.endswith("conv1.weight") and n not in layout.inconsistent][:2]
    updates = [1, 1, 1]
    new.consistent = {n: t + 0.01 * torch.randn(t.shape, generator=gen) for n, t in state.consistent.items()}
    bound = StepBound(layout, CFG)
    for n in [gamma, var, *cells_]:
        bound.history[n].extend([0.01] * 3)
    (ring_inf, _), (ring_nan, _) = bound.cells[cells_[0]][0], bound.cells[cells_[1]][0]
    assert len(bound.cells[cells_[0]]) == len(bound.cells[cells_[1]]) == 3
    new.consistent[cells_[0]][ring_inf[0]][(0,) * 4] = math.inf
    new.consistent[cells_[1]][ring_nan[0]][(0,) * 4] = math.nan
    rule = new.clone()
    bounded = bound.apply(state, new, updates)
    old_var, got_var = state.inconsistent[2][var], new.inconsistent[2][var]
    assert bool((got_var > 0).all()) and bool(got_var.isfinite().all()) and got_var[0] == old_var[0]
    peers = [float((new.inconsistent[k][var] / state.inconsistent[k][var]).log().square().mean().sqrt()) for k in (0, 1)]
    limit = CFG.step_k * statistics.median_low([*peers, 0.01, 0.01, 0.01])
    assert float((got_var / old_var).double().log().square().mean().sqrt()) == pytest.approx(limit, rel=1e-4)
    got_gamma = new.inconsistent[2][gamma]
    assert got_gamma[0] == state.inconsistent[2][gamma][0] and torch.equal(got_gamma[1:], rule.inconsistent[2][gamma][1:])
    assert torch.equal(new.inconsistent[2][bias], rule.inconsistent[2][bias])  # a lone copy: warm-up, no bound
    assert float(new.inconsistent[2][var2][0]) == pytest.approx(1e-30, rel=1e-4, abs=0)
    torch.testing.assert_close(new.inconsistent[2][var2][1:], state.inconsistent[2][var2][1:], rtol=1e-6, atol=0)
    assert new.inconsistent[2][mean][0].isnan() and torch.equal(new.inconsistent[2][mean][1:], state.inconsistent[2][mean][1:])
    for b in ring_inf:
        assert torch.equal(new.consistent[cells_[0]][b], state.consistent[cells_[0]][b])
    assert torch.equal(new.consistent[cells_[1]].isnan(), rule.consistent[cells_[1]].isnan())
    assert torch.equal(new.consistent[cells_[1]].nan_to_num(), rule.consistent[cells_[1]].nan_to_num())
    assert bounded == {2: 2}  # the variance copy and the inf ring
    bound.commit()
    assert list(bound.history[var]) == list(bound.history[gamma]) == [0.01] * 3  # two finite sizes: no entry


@pytest.mark.parametrize("element", [0.0, 1.0])
def test_a_push_in_one_channel_under_the_tensor_bound_is_cut_there_with_step_element(element: float) -> None:
    """A copy honest in every batch-norm channel but one, pushed there by less than the tensor's RMS bound lets
    through: off, it passes whole; with `step_element`, that channel is held to `step_element` x the bound and
    every other element, and the honest copies, are committed as sent."""
    layout = Layout.build(tiny_profile([(0.5, 0.5, FULL), (0.75, 0.75, FULL), (1.0, 1.0, FULL)]))
    state = GlobalState.init(layout, seed=0)
    cfg = AggregationConfig(step_element=element)
    bound = StepBound(layout, cfg)
    gen = torch.Generator().manual_seed(4)
    for _ in range(6):
        new = moved(layout, state, [0, 1, 2], gen, [0.01, 0.01, 0.01])
        bound.apply(state, new, [1] * layout.num_submodels)
        bound.commit()
        state = new
    gamma, _ = gamma_and_var(layout)
    new = moved(layout, state, [0, 1, 2], gen, [0.01, 0.01, 0.01])
    new.inconsistent[2][gamma].view(-1)[0] = state.inconsistent[2][gamma].view(-1)[0] + 0.05
    sent = new.clone()
    bound.apply(state, new, [1] * layout.num_submodels)
    step = new.inconsistent[2][gamma].double() - state.inconsistent[2][gamma].double()
    assert torch.equal(new.inconsistent[2][gamma].view(-1)[1:], sent.inconsistent[2][gamma].view(-1)[1:])
    for k in (0, 1):
        assert torch.equal(new.inconsistent[k][gamma], sent.inconsistent[k][gamma])
    if element:
        assert float(step.view(-1)[0]) < element * cfg.step_k * 0.01 * 1.5  # the bound: k x about the honest RMS
    else:
        assert float(step.view(-1)[0]) == pytest.approx(0.05, rel=1e-5)


def test_step_element_is_zero_or_at_least_one() -> None:
    for bad in (0.5, -1.0, math.inf):
        with pytest.raises(ValueError, match="step_element"):
            AggregationConfig(step_element=bad)
