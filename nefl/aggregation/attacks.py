"""Poisoning attacks a hostile participant can mount, for the simulator's attack suite and for test
devices that attack a real federation (docs/security.md measures what each rule does against them).

Model poisoning replaces the honest delta after local training: its sign flipped, flipped and scaled
(within the server's norm bound: the relative bound is 10 x the weight norm), minus the weights
themselves, Gaussian noise, or "a little is enough" (Baruch et al. 2019): the coordinate-wise mean of
the round's honest updates shifted by z standard deviations, small enough to sit inside the spread that
median and trimmed mean keep. Data poisoning trains honestly on poisoned data: flipped labels, or a
pixel-pattern backdoor (Gu et al. 2017) that should make any triggered image the target class.

Attacks by an attacker who has read the defence (issue 41; Kerckhoffs):
- bias-push: the honest delta plus a push toward the target class on the classifier's bias and that class's row of
  its weight (the last 2-D tensor), the upload's norm `scale` x the honest one: a whole-update sketch barely sees it.
- bn-poison: honest shared tensors, the per-submodel ones (batch norm, running statistics, step sizes) moved by
  -scale x themselves (running variances x (1 + scale)): no vote over the shared core sees them.
- boosted-backdoor: the backdoor's trained delta x scale (model replacement, Bagdasaryan et al. 2020).
- durable-backdoor: the same, kept only where honest training moves the model least (Neurotoxin, Zhang et al.,
  ICML 2022): the coordinates outside the largest DURABLE_TOP of the honest updates it knows, so that honest rounds
  and a server's fine-tuning on clean images (AggregationConfig.finetune_epochs) do not wash it out.
- layer-local: honest everywhere but one shared tensor, moved toward minus its weights by `scale` x the honest
  norm. The tensor is the smallest shared one (at least LAYER_MIN_ELEMENTS): a sketch that samples the shared core
  uniformly looks at it in the fewest positions, and its share of the update's norm stays small.
- min-max, min-sum (Shejwalkar & Houmansadr 2021; nefl/aggregation/attack_search.py): the known honest updates'
  mean moved against a direction by the largest gamma that keeps it as close to them as they are to each other.
- adaptive: the same poison, gamma searched with the kit's own aggregation as the oracle
  (nefl/aggregation/attack_oracle.py): the largest the defence still accepts.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from nefl.aggregation.attack_search import flat, min_max_accepts, min_sum_accepts, search_poison, unflat
from nefl.aggregation.robust import update_norm
from nefl.nested.data import ArrayDataset
from nefl.support.settings import Attack

Delta = dict[str, torch.Tensor]
LAYER_MIN_ELEMENTS = 64  # layer-local: the least elements a tensor needs to carry a poison worth sending

DURABLE_TOP = 0.1  # durable-backdoor: the share of coordinates, the honest updates' largest, it leaves alone
TRIGGER = 4  # the backdoor's pattern: a 4 x 4 checkerboard of full-white pixels in the bottom-right corner


def add_trigger(images: torch.Tensor) -> torch.Tensor:
    """uint8 N x C x H x W images with the backdoor pattern stamped on (a copy)."""
    out = images.clone()
    pattern = (torch.arange(TRIGGER).view(-1, 1) + torch.arange(TRIGGER).view(1, -1)) % 2 == 0
    corner = out[..., -TRIGGER - 1:-1, -TRIGGER - 1:-1]
    corner[..., pattern] = 255
    return out


def poison_dataset(data: ArrayDataset, indices: torch.Tensor, attack: Attack, num_classes: int, seed: int) -> ArrayDataset:
    """The attacker's own images as it trains on them: labels flipped (y -> C-1-y), or a seeded share
    triggered and relabelled to the target."""
    images, labels = data.images[indices].clone(), data.labels[indices].clone()
    if attack.kind == "label-flip":
        labels = num_classes - 1 - labels
    elif attack.backdoor:
        gen = torch.Generator().manual_seed(seed)
        chosen = torch.randperm(len(labels), generator=gen)[:max(1, round(attack.poison * len(labels)))]
        images[chosen] = add_trigger(images[chosen])
        labels[chosen] = attack.target
    return ArrayDataset(images, labels, data.info)


def triggered_test(data: ArrayDataset, target: int) -> ArrayDataset:
    """Test images whose class is not the target, triggered and labelled as the target: a model's
    accuracy on them is the backdoor's attack success rate."""
    keep = data.labels != target
    return ArrayDataset(add_trigger(data.images[keep]), torch.full((int(keep.sum()),), target, dtype=torch.int64), data.info)


def alie_z(n: int, f: int) -> float:
    """Baruch et al.'s z: the most standard deviations a colluding minority can shift the mean while
    enough honest values stay beyond it that median-style rules keep picking near it."""
    s = n // 2 + 1 - f
    return statistics.NormalDist().inv_cdf(max(0.5, min(0.999, (n - s) / n)))


@dataclass(frozen=True)
class Knowledge:
    """What an attacker knows when it crafts its upload."""

    # honest updates of its submodel this round: all of them in the simulator (omniscient), its own delta and the
    # last global step on a device
    honest: Sequence[Delta] = ()
    participants: int = 1  # the round's participants, and how many of them attack (ALIE's z)
    attackers: int = 1
    per_submodel: frozenset[str] = frozenset()  # tensors each submodel keeps its own (Layout.inconsistent)
    oracle: Callable[[Delta], bool] | None = None  # adaptive: whether the defence accepts a candidate
    generator: torch.Generator | None = None  # noise's draws


def classifier(delta: Delta) -> tuple[str, str | None]:
    """The classifier's weight (the last 2-D tensor) and its bias, if the update carries one."""
    weight = [n for n, t in delta.items() if t.dim() == 2][-1]
    bias = weight.removesuffix("weight") + "bias"
    return weight, bias if bias in delta else None


def bias_push(attack: Attack, delta: Delta) -> Delta:
    """delta + a push of +1 per element on the target's bias and weight row, sized so that the upload's norm is about
    `scale` x the honest one (the push orthogonal to it)."""
    weight, bias = classifier(delta)
    push = {weight: torch.zeros_like(delta[weight])}
    push[weight][attack.target] = 1
    if bias is not None:
        push[bias] = torch.zeros_like(delta[bias])
        push[bias][attack.target] = 1
    size = math.sqrt(max(attack.scale**2 - 1, 0.0)) * update_norm(delta) / update_norm(push)
    return {n: t + size * push[n] if n in push else t.clone() for n, t in delta.items()}


def bn_poison(attack: Attack, delta: Delta, weights: Delta, per_submodel: frozenset[str]) -> Delta:
    """Shared tensors honest; each per-submodel tensor moved by -scale x itself (gamma, beta, running means and step
    sizes flipped for scale 2), a running variance by +scale x itself (it must stay positive to do harm)."""
    def poisoned(name: str, t: torch.Tensor) -> torch.Tensor:
        w = weights[name].to(t.dtype)
        return t + attack.scale * w if name.endswith("running_var") else t - attack.scale * w
    return {n: poisoned(n, t) if n in per_submodel else t.clone() for n, t in delta.items()}


def local_target(delta: Delta, per_submodel: frozenset[str]) -> str:
    """layer-local's tensor: the smallest shared one with at least LAYER_MIN_ELEMENTS elements (else the largest)."""
    shared = [n for n in delta if n not in per_submodel] or list(delta)
    roomy = [n for n in shared if delta[n].numel() >= LAYER_MIN_ELEMENTS]
    return min(roomy, key=lambda n: delta[n].numel()) if roomy else max(shared, key=lambda n: delta[n].numel())


def layer_local(attack: Attack, delta: Delta, weights: Delta, per_submodel: frozenset[str]) -> Delta:
    """Honest but for local_target's tensor, moved by `scale` x the honest norm toward minus its weights."""
    name = local_target(delta, per_submodel)
    w = weights[name].to(delta[name].dtype)
    away = w if float(w.norm()) > 0 else -delta[name]
    out = {n: t.clone() for n, t in delta.items()}
    out[name] = delta[name] - attack.scale * update_norm(delta) * away / away.norm().clamp_min(1e-12)
    return out


def durable(attack: Attack, delta: Delta, known: Knowledge) -> Delta:
    """The backdoor's delta x scale, zero on the DURABLE_TOP share of coordinates where the honest updates it knows
    (their mean's magnitude; its own delta when it knows none) are largest."""
    pool = list(known.honest) or [delta]
    size = torch.stack([flat(d) for d in pool]).mean(0).abs()
    top = torch.topk(size, max(1, int(DURABLE_TOP * size.numel()))).indices
    kept = flat(delta) * attack.scale
    kept[top] = 0
    return unflat(kept, delta)


def searched(attack: Attack, delta: Delta, known: Knowledge) -> Delta:
    """min-max, min-sum or adaptive over the honest updates it knows (its own delta when it knows none)."""
    pool = list(known.honest) or [delta]
    if attack.kind == "adaptive":
        if known.oracle is None:
            raise ValueError("the adaptive attack needs the defence as its oracle")
        oracle = known.oracle
        accepts = lambda v: oracle(unflat(v, pool[0]))  # noqa: E731
    else:
        stack = torch.stack([flat(d) for d in pool])
        accepts = (min_max_accepts if attack.kind == "min-max" else min_sum_accepts)(stack)
    poison, _ = search_poison(pool, attack.direction, attack.tolerance, accepts)
    return poison


def craft(attack: Attack, delta: Delta, weights: Delta, known: Knowledge = Knowledge()) -> Delta:
    """The delta an attacker uploads instead of its honest `delta`. `weights`: the submodel weights it
    was sent (same names); `known`: what else it knows of the round."""
    kind = attack.kind
    if kind == "sign-flip":
        return {n: -t for n, t in delta.items()}
    if kind in ("scaled-flip", "boosted-backdoor"):
        return {n: (-attack.scale if kind == "scaled-flip" else attack.scale) * t for n, t in delta.items()}
    if kind == "durable-backdoor":
        return durable(attack, delta, known)
    if kind == "neg-weights":
        return {n: -attack.scale * weights[n].to(t.dtype) for n, t in delta.items()}
    if kind == "noise":
        count = sum(t.numel() for t in delta.values())
        std = attack.scale * update_norm(delta) / math.sqrt(max(1, count))
        return {n: torch.randn(t.shape, generator=known.generator) * std for n, t in delta.items()}
    if kind == "alie":
        pool = list(known.honest) or [delta]
        z = alie_z(known.participants, known.attackers)
        out = {}
        for n in delta:
            stack = torch.stack([d[n] for d in pool])
            std = stack.std(0, unbiased=False) if len(pool) > 1 else stack[0].abs()
            out[n] = stack.mean(0) - z * std
        return out
    if kind == "bias-push":
        return bias_push(attack, delta)
    if kind == "bn-poison":
        return bn_poison(attack, delta, weights, known.per_submodel)
    if kind == "layer-local":
        return layer_local(attack, delta, weights, known.per_submodel)
    if kind in ("min-max", "min-sum", "adaptive"):
        return searched(attack, delta, known)
    return delta  # data attacks upload what they trained
