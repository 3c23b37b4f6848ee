"""The attacking device of the serve benchmarks (tests/harness/attack_device.py): honest before its first round,
then the attack, built from what a device knows (its own delta and the last global step)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from nefl.aggregation.attacks import Attack, Knowledge, craft
from nefl.nested.profile import load_profile
from nefl.nested.state import GlobalState, Layout
from tests.harness.attack_device import Attacker

LAYOUT = Layout.build(load_profile("resnet8-fmnist-w"))
K = 1


def weights(seed: int) -> dict[str, torch.Tensor]:
    return GlobalState.init(LAYOUT, seed).extract(LAYOUT, K)


def test_it_attacks_from_its_first_round_with_what_it_knows() -> None:
    delta = {n: 0.01 * torch.ones_like(t) for n, t in weights(0).items()}
    train = lambda dev, layout, task, start, budget_s: SimpleNamespace(delta={n: t.clone() for n, t in delta.items()})  # noqa: E731
    attacker = Attacker(Attack("alie"), first=2)
    hostile = attacker.wrap(train)
    task = lambda r: SimpleNamespace(round=r, submodel=K)  # noqa: E731
    first = hostile(None, LAYOUT, task(1), weights(0), 10.0)
    assert all(torch.equal(first.delta[n], delta[n]) for n in delta)  # honest before round 2
    start = weights(1)
    second = hostile(None, LAYOUT, task(2), start, 10.0)
    step = {n: start[n] - weights(0)[n] for n in start}  # the same submodel twice: the whole step
    expected = craft(Attack("alie"), delta, start, Knowledge([delta, step]))
    assert all(torch.allclose(second.delta[n], expected[n]) for n in delta)


def test_the_last_step_is_taken_where_both_tasks_cover_it() -> None:
    attacker = Attacker(Attack("min-max"), first=1)
    inconsistent = frozenset(LAYOUT.inconsistent)
    small = GlobalState.init(LAYOUT, 0).extract(LAYOUT, 0)
    attacker.previous = (0, small)
    start = weights(1)
    delta = {n: torch.full_like(t, 0.5) for n, t in start.items()}
    (step,) = attacker.last_step(K, start, delta, inconsistent)
    for n, t in step.items():
        if n in inconsistent:  # another submodel's own tensor: no step to learn from
            assert torch.equal(t, delta[n])
        else:
            common = tuple(slice(0, d) for d in small[n].shape)
            assert torch.equal(t[common], start[n][common] - small[n][common])
            outside = torch.ones_like(t, dtype=torch.bool)
            outside[common] = False
            assert torch.all(t[outside] == 0.5)  # beyond the smaller task: its own delta
