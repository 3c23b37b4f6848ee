"""Tiny architectures and random ladders for fast, exhaustive tests."""

from __future__ import annotations

import random

import torch

from nefl.nested.arch import Arch
from nefl.nested.profile import Profile, SubmodelSpec
from nefl.nested.state import GlobalState, Layout
from nefl.nested.tensors import corner

TINY_BASIC = Arch("tiny_basic", "basic", (2, 2), (4, 8), 4, "cifar")
TINY_BOTTLENECK = Arch("tiny_bottleneck", "bottleneck", (2, 1), (2, 4), 4, "cifar")
FULL = ((1.0, 1.0), (1.0, 1.0))  # every block of both stages: a submodel spec's full depth


def tiny_profile(subs: list[tuple[float, float, tuple[tuple[float, ...], ...]]], arch: Arch = TINY_BASIC,
                 method: str = "nefl", in_ch: int = 3, hw: int = 8) -> Profile:
    return Profile(
        name="tiny", description="", arch=arch, stem="cifar", num_classes=5, input_shape=(in_ch, hw, hw),
        dataset="synthetic", method=method,
        submodels=tuple(SubmodelSpec(i, g, gw, st) for i, (g, gw, st) in enumerate(subs)),
    )


def random_ladder(rng: random.Random, arch: Arch = TINY_BASIC, n: int = 4, method: str = "nefl") -> Profile:
    """Random widths and non-nested random depth sets; the last submodel is the full model."""
    subs = []
    for i in range(n - 1):
        gw = rng.choice([0.25, 0.4, 0.5, 0.75, 1.0])
        steps = tuple(tuple(float(rng.random() < 0.6) for _ in range(d)) for d in arch.depths)
        subs.append(((i + 1) / n, gw, steps))
    subs.sort(key=lambda s: s[0])
    subs.append((1.0, 1.0, tuple((1.0,) * d for d in arch.depths)))
    return tiny_profile(subs, arch, method)


def off_the_wire(delta: dict) -> dict:
    """`delta` as the wire decoder hands an update on (nefl.nested.tensors.Tiled: views of one flat buffer)."""
    import numpy as np

    from nefl.nested.tensorfile import decode_tensors, encode_tensors

    return decode_tensors("fp32", np.frombuffer(encode_tensors(delta), dtype=np.uint8))


def aligned_deltas(layout: Layout, state: GlobalState, tasks: dict[str, int], spread: float
                   ) -> dict[str, dict[str, torch.Tensor]]:
    """Client -> a seeded delta of its submodel (`tasks`): one common step of 0.01 per element in every tensor (its
    nested corner) plus `spread` of its own noise, so the centre check keeps every update."""
    g = torch.Generator().manual_seed(2)
    common = {n: torch.randn(s, generator=g) * 0.01 for n, s in layout.global_shapes.items()}
    return {client: {n: common[n][corner(t.shape)] + torch.randn(t.shape, generator=g) * spread
                     for n, t in state.slices(layout, k).items()} for client, k in tasks.items()}
