"""The held-out gate (nefl/aggregation/gate.py): its paired statistic against a brute-force reference, a one-tensor
poison of one submodel trips it while an honest step passes, the ratchet, and recovery (a refused state never
becomes the reference)."""

from __future__ import annotations

import math
import random

import torch

from nefl.aggregation.attribution import leave_out
from nefl.aggregation.gate import Gate, Scores, Trip, Verdict, paired_z

N = 400
X = torch.randn(N, 4, generator=torch.Generator().manual_seed(1))
W_TRUE = torch.tensor([1.0, -2.0, 0.5, 3.0])
Y = X @ W_TRUE + 0.1 * torch.randn(N, generator=torch.Generator().manual_seed(2))


def loss_scores(loss):  # a measure without top-1 (a regression): no image ever counts as wrong
    return Scores(loss, torch.zeros_like(loss))


def evaluate(state, k):  # state: submodel -> weights; per-image squared error
    return loss_scores((X @ state[k] - Y) ** 2)


def test_paired_z_matches_brute_force():
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(2, 60)
        a = [rng.gauss(0, 1) for _ in range(n)]
        b = [x + rng.gauss(rng.uniform(-0.5, 0.5), rng.uniform(0.01, 2)) for x in a]
        d = [y - x for x, y in zip(a, b)]
        mean = sum(d) / n
        sd = math.sqrt(sum((v - mean) ** 2 for v in d) / (n - 1))
        assert math.isclose(paired_z(torch.tensor(b, dtype=torch.float64), torch.tensor(a, dtype=torch.float64)), mean / (sd / math.sqrt(n)), rel_tol=1e-9)
    assert paired_z(torch.ones(5), torch.ones(5)) == 0.0


def good():
    return {0: W_TRUE + 0.3, 1: W_TRUE - 0.2}


def test_one_tensor_poison_trips_its_submodel_and_an_honest_step_passes():
    gate = Gate(evaluate)
    cur = good()
    honest = {k: cur[k] + 0.5 * (W_TRUE - cur[k]) for k in cur}  # a step toward the optimum
    assert not gate.judge(honest, gate.baseline(cur, [0, 1])).tripped
    poisoned = dict(honest)
    poisoned[1] = honest[1].clone()
    poisoned[1][3] += 2.0  # one element of one submodel's own tensor (bn-style: one copy a round)
    v = gate.judge(poisoned, gate.baseline(cur, [0, 1]))
    assert list(v.tripped) == [1]


def test_ratchet_and_recovery():
    gate = Gate(evaluate, window=3)
    best = {k: W_TRUE.clone() for k in (0, 1)}
    gate.committed(best, gate.judge(best, gate.baseline(best, [0, 1])))
    slightly_worse = {k: W_TRUE + 0.25 for k in (0, 1)}
    # against the previous state alone a slightly worse state would pass; against the best recent it trips
    assert gate.judge(slightly_worse, gate.baseline(slightly_worse, [0])).tripped  # current == candidate, best recent wins
    # recovery: a refused state is not committed, so the next honest round is judged against the last good one
    assert gate.recent[0][0] is best
    assert not gate.judge({k: W_TRUE + 0.001 for k in (0, 1)}, gate.baseline(best, [0, 1])).tripped


def _one_tensor_pipeline(attribute: int, target: float = 0.0, honest: float = 0.0, widest_only: bool = False):
    from nefl.aggregation.config import AggregationConfig
    from nefl.aggregation.pipeline import Pipeline, Robustness
    from nefl.nested.profile import load_profile
    from nefl.nested.state import GlobalState, Layout

    layout = Layout.build(load_profile("resnet8-fmnist-w"))
    start = GlobalState.init(layout, seed=0)
    k = layout.num_submodels - 1
    name = sorted(layout.upload_shapes(k))[-1]

    def loss(state, j):  # a loss that grows with the distance of one tensor of submodel j from start + `target`
        d = (state.extract(layout, j)[name].double() - start.extract(layout, j)[name].double() - target).abs().max()
        d = d if not widest_only or j == k else torch.zeros(())  # widest_only: no other submodel's loss sees it
        return loss_scores(d + 0.01 * torch.sin(torch.arange(128).double()))

    gate = Gate(loss)
    cfg = AggregationConfig(centre_check=False, gate=True, gate_attribute=attribute)
    p = Pipeline(layout, Robustness(aggregation=cfg), gate=gate)

    def round_(state, scales):  # one honest (zero) update per submodel, and one update per scale poisoning one tensor
        agg = p.begin_round(state, {}, 1)
        for j in range(layout.num_submodels):
            step = {n: torch.zeros(s) for n, s in layout.upload_shapes(j).items()}
            step[name] += honest
            agg.add(j, step, client=f"h{j}")
        for i, scale in enumerate(scales):
            poison = {n: torch.zeros(s) for n, s in layout.upload_shapes(k).items()}
            poison[name] += scale
            agg.add(k, poison, client=f"evil{i}")
        return agg, p.commit(agg, state)

    return start, k, round_


def test_a_tripped_round_commits_without_the_update_that_tripped_it():
    start, k, round_ = _one_tensor_pipeline(attribute=32)
    agg, done = round_(start, [5.0])
    assert done.problem is None and agg.dropped == {"evil0": "gate"}
    facts = agg.facts()["gate"]
    assert facts["left_out"] == ["evil0"] and list(facts["harm_z"]) == ["evil0"] and k + 1 in facts["tripped"]
    for n, t in done.state.consistent.items():  # the honest updates are zero: what committed is the start
        assert torch.equal(t, start.consistent[n]), n
    # two poisoners of six honest updates: both left out; a round of poisoners alone cannot pass and is refused
    agg, done = round_(start, [5.0, 3.0])
    assert done.problem is None and sorted(agg.dropped) == ["evil0", "evil1"]


def test_a_poison_that_an_honest_round_hides_is_left_out():
    # every honest update takes the tensor to its target (loss 1 -> 0); the poison pulls back, but the round as a
    # whole still improves on the last state, so only the round without it shows what it costs
    start, k, round_ = _one_tensor_pipeline(attribute=32, target=1.0, honest=1.0)
    agg, done = round_(start, [-0.5])
    facts = agg.facts()["gate"]
    assert done.problem is None and agg.dropped == {"evil0": "gate"}
    assert "tripped" not in facts and list(facts["harm_z"]) == ["evil0"]
    _, clean = round_(start, [])
    for n, t in done.state.consistent.items():  # what committed is the honest round's state
        assert torch.equal(t, clean.state.consistent[n]), n


def test_a_poison_of_one_submodel_that_the_mean_over_submodels_hides_is_left_out():
    # the round improves on the last state; the poison costs its submodel 0.05 (above the 0.02 margin) and the mean
    # over the submodels 0.01 (below it), so only the per-submodel screen sees it
    start, k, round_ = _one_tensor_pipeline(attribute=32, target=1.0, honest=1.0, widest_only=True)
    agg, done = round_(start, [0.9])
    facts = agg.facts()["gate"]
    assert done.problem is None and agg.dropped == {"evil0": "gate"}
    assert "tripped" not in facts and list(facts["harm_z"]) == ["evil0"]


def test_without_attribution_a_tripped_round_is_refused_and_the_next_honest_round_commits():
    start, k, round_ = _one_tensor_pipeline(attribute=0)
    _, bad = round_(start, [5.0])  # one update poisons one tensor of one submodel
    assert bad.state is None and bad.problem.startswith("gate:") and f"submodel {k + 1} " in bad.problem
    _, good = round_(start, [])  # recovery: the old state stayed, the next honest round commits from it
    assert good.state is not None and good.problem is None


def test_leave_out_finds_the_bad_set_when_it_is_small_enough():
    rng = random.Random(3)
    for _ in range(300):
        n = rng.randint(1, 9)
        bad = frozenset(i for i in range(n) if rng.random() < 0.3)
        max_out = rng.randint(0, n)

        def trial(out, bad=bad):
            left = len(bad - out) + 0.01 * len(out - bad)  # each bad update still in costs far more than an honest out
            return Verdict({0: Trip(left, 0.0)} if bad - out else {}, {0: left}, left)

        got = leave_out(n, max_out, trial)
        if not bad:
            assert got == frozenset({0}) if max_out else got is None  # (never asked: a passing round is not searched)
        elif len(bad) <= max_out:
            assert got == bad
        else:
            assert got is None


def test_a_round_the_gate_passes_commits_what_the_pipeline_without_it_commits():
    """The screen's trial candidates are bounded by the step bound too; what it remembers is the whole round's."""
    from nefl.aggregation.pipeline import Pipeline, Robustness
    from nefl.nested.profile import load_profile
    from nefl.nested.state import GlobalState, Layout

    layout = Layout.build(load_profile("resnet8-fmnist-w"))
    flat = Gate(lambda state, j: loss_scores(0.01 * torch.sin(torch.arange(64).double())))  # scores every state alike
    gated, plain = (Pipeline(layout, Robustness(), gate=g) for g in (flat, None))
    gen = torch.Generator().manual_seed(5)
    states = [GlobalState.init(layout, seed=0)] * 2
    for r in range(3):
        updates = [(j, c, {n: 0.01 * torch.randn(s, generator=gen) for n, s in layout.upload_shapes(j).items()})
                   for j in range(layout.num_submodels) for c in range(3)]
        for i, p in enumerate((gated, plain)):
            agg = p.begin_round(states[i], {f"c{j}{c}": j for j, c, _ in updates}, r)
            for j, c, d in updates:
                agg.add(j, {n: t.clone() for n, t in d.items()}, client=f"c{j}{c}")
            done = p.commit(agg, states[i])
            assert done.problem is None
            states[i] = done.state
    for n in states[0].consistent:
        assert torch.equal(states[0].consistent[n], states[1].consistent[n]), n
    assert gated.steps.history == plain.steps.history and any(gated.steps.history.values())
    assert repr(gated.steps.anchor.state_dict()) == repr(plain.steps.anchor.state_dict())


def test_a_one_class_push_that_barely_moves_the_loss_trips_on_error():
    # near-uniform outputs (early training): a push toward class 0 flips most predictions to it while the mean
    # cross-entropy moves by less than the loss margin, so only the error measure sees it
    g = torch.Generator().manual_seed(4)
    n, classes = 512, 4
    y = torch.randint(0, classes, (n,), generator=g)
    logits = 0.2 * torch.nn.functional.one_hot(y, classes) + 0.05 * torch.randn(n, classes, generator=g)

    def scores(state, k):
        out = logits + state
        return Scores(torch.nn.functional.cross_entropy(out, y, reduction="none"), (out.argmax(1) != y).double())

    push = torch.tensor([0.25, 0.0, 0.0, 0.0])
    loss_only = Gate(lambda s, k: loss_scores(scores(s, k).loss))
    both = Gate(scores)
    base_state = torch.zeros(classes)
    cand = scores(push, 0)
    ref = scores(base_state, 0)
    assert (ref.wrong.mean() - cand.wrong.mean()).item() < -0.3  # top-1 falls by more than 30 points
    assert (cand.loss.mean() - ref.loss.mean()).item() < loss_only.margin
    assert not loss_only.judge(push, loss_only.baseline(base_state, [0])).tripped
    v = both.judge(push, both.baseline(base_state, [0]))
    assert v.tripped[0].top1 < -0.3 and v.z[0] > both.z
    honest = torch.tensor([-0.01, 0.01, 0.0, 0.0])  # a small change that flips a few predictions passes
    assert not both.judge(honest, both.baseline(base_state, [0])).tripped
