"""Poisoning attacks a hostile participant can mount, for the simulator's attack suite and for test
devices that attack a real federation (docs/security.md measures what each rule does against them).

Model poisoning replaces the honest delta after local training: its sign flipped, flipped and scaled
(within the server's norm bound: the relative bound is 10 x the weight norm), minus the weights
themselves, Gaussian noise, or "a little is enough" (Baruch et al. 2019): the coordinate-wise mean of
the round's honest updates shifted by z standard deviations, small enough to sit inside the spread that
median and trimmed mean keep. Data poisoning trains honestly on poisoned data: flipped labels, or a
pixel-pattern backdoor (Gu et al. 2017) that should make any triggered image the target class.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import torch

from nefl.nested.data import ArrayDataset
from nefl.support.settings import Attack

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
    elif attack.kind == "backdoor":
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


def craft(attack: Attack, delta: dict[str, torch.Tensor], weights: dict[str, torch.Tensor],
          honest: Sequence[dict[str, torch.Tensor]] = (), participants: int = 1, attackers: int = 1,
          generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """The delta an attacker uploads instead of its honest `delta`. `weights`: the submodel weights it
    was sent (same names); `honest`: the round's honest updates of its submodel (ALIE's omniscient
    attacker; its own honest delta when it knows no other)."""
    kind = attack.kind
    if kind == "sign-flip":
        return {n: -t for n, t in delta.items()}
    if kind == "scaled-flip":
        return {n: -attack.scale * t for n, t in delta.items()}
    if kind == "neg-weights":
        return {n: -attack.scale * weights[n].to(t.dtype) for n, t in delta.items()}
    if kind == "noise":
        total = math.sqrt(sum(float(t.double().square().sum()) for t in delta.values()))
        count = sum(t.numel() for t in delta.values())
        std = attack.scale * total / math.sqrt(max(1, count))
        return {n: torch.randn(t.shape, generator=generator) * std for n, t in delta.items()}
    if kind == "alie":
        pool = list(honest) or [delta]
        z = alie_z(participants, attackers)
        out = {}
        for n in delta:
            stack = torch.stack([d[n] for d in pool])
            std = stack.std(0, unbiased=False) if len(pool) > 1 else stack[0].abs()
            out[n] = stack.mean(0) - z * std
        return out
    return delta  # data attacks upload what they trained
