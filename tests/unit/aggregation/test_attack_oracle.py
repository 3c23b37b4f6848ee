"""The adaptive attack's oracle is the kit's own aggregation: it accepts honest updates, refuses a flipped one, and
the adaptive poison is the largest candidate it accepts, to the search's tolerance."""

from __future__ import annotations

import torch

from nefl.aggregation.attack_oracle import PipelineOracle, device_oracle
from nefl.aggregation.attack_search import direction, flat, search_poison, unflat
from nefl.aggregation.attacks import Attack, Knowledge, craft
from nefl.aggregation.pipeline import Pipeline
from nefl.nested.profile import load_profile
from nefl.nested.state import GlobalState, Layout

LAYOUT = Layout.build(load_profile("resnet8-fmnist-w"))
STATE = GlobalState.init(LAYOUT, seed=0)
SUBMODELS = (0, 1, 2, 3, 4, 2, 4, 2)
K = 2


def updates() -> list[tuple[int, dict[str, torch.Tensor]]]:
    """Honest-like updates: a shared direction plus noise, over the submodels."""
    g = torch.Generator().manual_seed(0)
    common = {n: 0.01 * torch.randn(s, generator=g) for n, s in LAYOUT.global_shapes.items()}
    out = []
    for k in SUBMODELS:
        shapes = LAYOUT.upload_shapes(k)
        out.append((k, {n: common[n][tuple(slice(0, d) for d in s)] + 0.004 * torch.randn(s, generator=g)
                        for n, s in shapes.items()}))
    return out


def oracle() -> PipelineOracle:
    return PipelineOracle(Pipeline(LAYOUT, seed=3), STATE, updates(), K, 1)


def test_the_oracle_accepts_honest_and_refuses_a_flip() -> None:
    o = oracle()
    mine = [d for k, d in updates() if k == K]
    assert o(mine[0])
    assert o.influence(mine[0]) > 0.9
    assert not o({n: -9 * t for n, t in mine[0].items()})


def test_adaptive_is_accepted_and_maximal() -> None:
    o, attack = oracle(), Attack("adaptive", tolerance=0.02)
    pool = [d for k, d in updates() if k == K]
    poison, gamma = search_poison(pool, attack.direction, attack.tolerance, lambda v: o(unflat(v, pool[0])))
    assert gamma > 0 and o(poison)
    stack = torch.stack([flat(d) for d in pool])
    beyond = stack.mean(0) - gamma / (1 - attack.tolerance) * 1.001 * direction(stack, attack.direction)
    assert not o(unflat(beyond, pool[0]))
    crafted = craft(attack, pool[0], STATE.extract(LAYOUT, K), Knowledge(pool, oracle=o))
    assert all(torch.equal(crafted[n], poison[n]) for n in poison)  # craft searches the same way


def test_a_device_oracle_judges_from_its_own_weights() -> None:
    mine = [d for k, d in updates() if k == K]
    o = device_oracle(LAYOUT, K, STATE.extract(LAYOUT, K), mine[:2], 1, seed=1)
    assert o(mine[2])
    assert not o({n: -9 * t for n, t in mine[2].items()})
