"""The held-out gate (nefl/aggregation/gate.py): its paired statistic against a brute-force reference, a one-tensor
poison of one submodel trips it while an honest step passes, the ratchet, and recovery (a refused state never
becomes the reference)."""

from __future__ import annotations

import math
import random

import torch

from nefl.aggregation.gate import Gate, draw, paired_z

N = 400
X = torch.randn(N, 4, generator=torch.Generator().manual_seed(1))
W_TRUE = torch.tensor([1.0, -2.0, 0.5, 3.0])
Y = X @ W_TRUE + 0.1 * torch.randn(N, generator=torch.Generator().manual_seed(2))


def evaluate(state, k, idx):  # state: submodel -> weights; per-image squared error
    return (X[idx] @ state[k] - Y[idx]) ** 2


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


def test_draw_depends_on_the_seed():
    assert torch.equal(draw(1000, 50, 7), draw(1000, 50, 7))
    assert not torch.equal(draw(1000, 50, 7), draw(1000, 50, 8))


def good():
    return {0: W_TRUE + 0.3, 1: W_TRUE - 0.2}


def test_one_tensor_poison_trips_its_submodel_and_an_honest_step_passes():
    gate = Gate(evaluate, N, size=256)
    cur = good()
    honest = {k: cur[k] + 0.5 * (W_TRUE - cur[k]) for k in cur}  # a step toward the optimum
    assert not gate.judge(honest, cur, [0, 1], seed=3).tripped
    poisoned = dict(honest)
    poisoned[1] = honest[1].clone()
    poisoned[1][3] += 2.0  # one element of one submodel's own tensor (bn-style: one copy a round)
    v = gate.judge(poisoned, cur, [0, 1], seed=4)
    assert list(v.tripped) == [1]


def test_ratchet_and_recovery():
    gate = Gate(evaluate, N, size=256, window=3)
    best = {k: W_TRUE.clone() for k in (0, 1)}
    gate.committed(best)
    slightly_worse = {k: W_TRUE + 0.25 for k in (0, 1)}
    # against the previous state alone a slightly worse state would pass; against the best recent it trips
    assert gate.judge(slightly_worse, slightly_worse, [0], seed=5).tripped  # current == candidate, best recent wins
    # recovery: a refused state is not committed, so the next honest round is judged against the last good one
    assert gate.recent[0] is best
    assert not gate.judge({k: W_TRUE + 0.001 for k in (0, 1)}, best, [0, 1], seed=6).tripped


def test_pipeline_refuses_a_tripped_round_and_the_next_honest_round_commits():
    from nefl.aggregation.config import AggregationConfig
    from nefl.aggregation.pipeline import Pipeline, Robustness
    from nefl.nested.profile import load_profile
    from nefl.nested.state import GlobalState, Layout

    layout = Layout.build(load_profile("resnet8-fmnist-w"))
    start = GlobalState.init(layout, seed=0)
    k = layout.num_submodels - 1
    name = sorted(layout.upload_shapes(k))[-1]

    def loss(state, j, idx):  # a loss that grows with the distance of one tensor of submodel j from the start
        d = (state.extract(layout, j)[name].double() - start.extract(layout, j)[name].double()).abs().max()
        return d + 0.01 * torch.sin(idx.double())

    gate = Gate(loss, 1000, size=128)
    p = Pipeline(layout, Robustness(aggregation=AggregationConfig(centre_check=False)), gate=gate)

    def round_(state, scale):
        agg = p.begin_round(state, {}, 1)
        for j in range(layout.num_submodels):
            agg.add(j, {n: torch.zeros(s) for n, s in layout.upload_shapes(j).items()})
        poison = {n: torch.zeros(s) for n, s in layout.upload_shapes(k).items()}
        poison[name] += scale
        agg.add(k, poison)
        return p.commit(agg, state)

    bad = round_(start, 5.0)  # one update poisons one tensor of one submodel
    assert bad.state is None and bad.problem.startswith("gate:") and f"submodel {k}" in bad.problem
    good = round_(start, 0.0)  # recovery: the old state stayed, the next honest round commits from it
    assert good.state is not None and good.problem is None
