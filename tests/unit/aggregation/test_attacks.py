"""The attacks of issue 41 are what they claim: shapes kept, each poison where and as large as it says, the
searched ones at the edge of their criterion."""

from __future__ import annotations

import math

import pytest
import torch

from nefl.aggregation.attack_search import flat, largest_gamma, min_max_accepts, min_sum_accepts
from nefl.aggregation.attacks import DURABLE_TOP, Attack, Knowledge, classifier, craft, local_target
from nefl.aggregation.robust import update_norm

Delta = dict[str, torch.Tensor]
PER_SUBMODEL = frozenset({"bn.weight", "bn.bias", "bn.running_mean", "bn.running_var", "block.step"})


def model(seed: int, scale: float = 1.0) -> Delta:
    g = torch.Generator().manual_seed(seed)
    shapes = {"conv.weight": (8, 3, 3, 3), "bn.weight": (8,), "bn.bias": (8,), "bn.running_mean": (8,),
              "bn.running_var": (8,), "block.step": (), "stem.weight": (8, 8), "fc.weight": (10, 8), "fc.bias": (10,)}
    return {n: scale * torch.randn(s, generator=g) for n, s in shapes.items()}


def weights() -> Delta:
    w = model(99)
    w["bn.running_var"] = w["bn.running_var"].abs() + 0.5
    return w


def honest(n: int = 6) -> list[Delta]:
    common = model(0, 0.1)
    return [{k: common[k] + model(10 + i, 0.03)[k] for k in common} for i in range(n)]


def same_shapes(a: Delta, b: Delta) -> bool:
    return a.keys() == b.keys() and all(a[n].shape == b[n].shape for n in a)


def test_default_scales_are_the_issues() -> None:
    assert Attack("bias-push").scale == 2.7
    assert Attack("boosted-backdoor").scale == 2.5
    assert Attack("scaled-flip").scale == 9.0
    assert Attack("bias-push", 4.0).scale == 4.0
    assert Attack("boosted-backdoor").on_data and Attack("boosted-backdoor").backdoor
    with pytest.raises(ValueError):
        Attack("min-max", direction="sideways")


def test_bias_push_moves_only_the_target_class_by_the_scale() -> None:
    h = honest()[0]
    out = craft(Attack("bias-push", 2.7, target=3), h, weights())
    assert same_shapes(out, h)
    assert classifier(h) == ("fc.weight", "fc.bias")
    push = {n: out[n] - h[n] for n in h}
    assert all(float(push[n].abs().max()) == 0 for n in h if not n.startswith("fc."))
    assert float(push["fc.weight"][3].min()) > 0 and float(push["fc.bias"][3]) > 0
    others = torch.cat([push["fc.weight"][torch.arange(10) != 3].flatten(), push["fc.bias"][torch.arange(10) != 3]])
    assert float(others.abs().max()) == 0
    assert update_norm(push) == pytest.approx(math.sqrt(2.7**2 - 1) * update_norm(h), rel=1e-5)


def test_bn_poison_leaves_shared_tensors_honest() -> None:
    h, w = honest()[0], weights()
    out = craft(Attack("bn-poison", 2.0), h, w, Knowledge(per_submodel=PER_SUBMODEL))
    assert same_shapes(out, h)
    for n in h:
        if n not in PER_SUBMODEL:
            assert torch.equal(out[n], h[n])
    assert torch.allclose(w["bn.weight"] + out["bn.weight"], -w["bn.weight"] + h["bn.weight"])  # gamma flipped
    assert torch.allclose(w["bn.running_var"] + out["bn.running_var"], 3 * w["bn.running_var"] + h["bn.running_var"])
    assert float((w["bn.running_var"] + out["bn.running_var"] - h["bn.running_var"]).min()) > 0


def test_boosted_backdoor_scales_its_trained_delta() -> None:
    h = honest()[0]
    out = craft(Attack("boosted-backdoor"), h, weights())
    assert all(torch.allclose(out[n], 2.5 * h[n]) for n in h)


def test_durable_backdoor_leaves_alone_where_honest_updates_move_most() -> None:
    """Brute force over the coordinates: the DURABLE_TOP share with the largest |mean honest update| is zero, every
    other coordinate is 2.5 x the trained delta."""
    pool, h = honest(), honest()[0]
    out = craft(Attack("durable-backdoor"), h, weights(), Knowledge(honest=pool))
    assert same_shapes(out, h) and Attack("durable-backdoor").backdoor and Attack("durable-backdoor").on_data
    size = [abs(sum(float(flat(d)[i]) for d in pool) / len(pool)) for i in range(flat(h).numel())]
    cut = sorted(size, reverse=True)[int(DURABLE_TOP * len(size)) - 1]
    for i, (got, mine) in enumerate(zip(flat(out).tolist(), flat(h).tolist())):
        assert got == (0.0 if size[i] >= cut else pytest.approx(2.5 * mine, rel=1e-6)), i


def test_layer_local_poisons_only_the_least_looked_at_shared_tensor() -> None:
    h, w = honest()[0], weights()
    name = local_target(h, PER_SUBMODEL)
    assert name == "stem.weight"  # the smallest shared tensor with room (fc.bias is too small, the BN ones are not shared)
    out = craft(Attack("layer-local", 2.0), h, w, Knowledge(per_submodel=PER_SUBMODEL))
    assert same_shapes(out, h)
    assert all(torch.equal(out[n], h[n]) for n in h if n != name)
    poison = out[name] - h[name]
    assert float(poison.norm()) == pytest.approx(2.0 * update_norm(h), rel=1e-5)
    assert float(torch.nn.functional.cosine_similarity(poison.flatten(), -w[name].flatten(), dim=0)) == pytest.approx(1.0)


@pytest.mark.parametrize("kind", ["min-max", "min-sum"])
@pytest.mark.parametrize("direction", ["unit-mean", "std", "sign"])
def test_min_max_and_min_sum_sit_at_the_edge_of_their_bound(kind: str, direction: str) -> None:
    pool = honest()
    attack = Attack(kind, direction=direction, tolerance=0.01)
    out = craft(attack, pool[0], weights(), Knowledge(pool))
    assert same_shapes(out, pool[0])
    stack = torch.stack([flat(d) for d in pool])
    v, mean = flat(out), stack.mean(0)
    assert float((v - mean).norm()) > 0  # a poison, not the mean
    accepts = (min_max_accepts if kind == "min-max" else min_sum_accepts)(stack)
    assert accepts(v)
    if kind == "min-max":  # the distance bound holds
        assert float(torch.cdist(v[None], stack).max()) <= float(torch.cdist(stack, stack).max()) + 1e-6
    else:
        assert float(torch.cdist(v[None], stack).square().sum()) <= float(torch.cdist(stack, stack).square().sum(1).max()) + 1e-5
    beyond = mean + (v - mean) / (1 - attack.tolerance) * 1.001  # gamma / (1 - tolerance): outside the bound
    assert not accepts(beyond)


def test_largest_gamma_brackets_the_edge_to_the_tolerance() -> None:
    for edge in (1e-4, 0.3, 1.0, 7.5, 1e5):
        g = largest_gamma(lambda x: x <= edge, 0.01)
        assert g <= edge and g / (1 - 0.01) > edge
    assert largest_gamma(lambda x: False, 0.01) == 0.0


def test_adaptive_is_the_largest_the_oracle_accepts() -> None:
    pool = honest()
    mean = torch.stack([flat(d) for d in pool]).mean(0)
    edge = 0.37  # an oracle that accepts a candidate within this distance of the honest mean
    oracle = lambda d: float((flat(d) - mean).norm()) <= edge  # noqa: E731
    attack = Attack("adaptive", tolerance=0.01)
    out = craft(attack, pool[0], weights(), Knowledge(pool, oracle=oracle))
    dist = float((flat(out) - mean).norm())
    assert oracle(out) and dist > edge * (1 - attack.tolerance)
    with pytest.raises(ValueError, match="oracle"):
        craft(attack, pool[0], weights(), Knowledge(pool))
