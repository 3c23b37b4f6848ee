"""Method presets: NeFL and the baselines it generalises, as settings of one machinery.

A preset only chooses (a) how the ladder is derived from the profile's target sizes, (b) whether
step sizes train, and (c) whether BatchNorm is per-submodel (inconsistent) or shared and sliced
with static statistics. Models, slicing, aggregation and training are the same code for all.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

from nefl.nested.arch import AnyArch
from nefl.nested.cost import full_cost, submodel_cost
from nefl.nested.profile import METHOD_NAMES, Profile, SubmodelSpec
from nefl.support.choices import check_choice

# per_submodel: inconsistent (FedAvg within each submodel); shared_static: consistent, sliced, stats recomputed
BatchNormMode = Literal["per_submodel", "shared_static"]
# profile: the TOML's ladder; width: gamma_W = sqrt(gamma), all blocks; depth_prefix: contiguous block prefixes
LadderRule = Literal["profile", "width", "depth_prefix"]


@dataclass(frozen=True)
class Method:
    name: str
    learnable_steps: bool
    bn: BatchNormMode
    ladder: LadderRule
    summary: str

    def __post_init__(self) -> None:
        check_choice(BatchNormMode, self.bn, f"method {self.name!r}: bn")
        check_choice(LadderRule, self.ladder, f"method {self.name!r}: ladder")

    @property
    def static_bn(self) -> bool:
        return self.bn == "shared_static"


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("nefl", True, "per_submodel", "profile", "NeFL: the profile's ladder, learnable steps, BN + steps inconsistent"),
        Method("nefl-nl", False, "per_submodel", "profile", "NeFL with fixed (non-learnable) step sizes"),
        Method("fjord", False, "per_submodel", "width", "FjORD: width only, per-width BN"),
        Method("heterofl", False, "shared_static", "width", "HeteroFL: width only, BN shared and sliced, static BN"),
        Method("depthfl", False, "per_submodel", "depth_prefix", "DepthFL (as run in the NeFL paper): contiguous depth prefix, fixed steps, per-submodel BN"),
    )
}
assert tuple(METHODS) == METHOD_NAMES


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}") from None


def _width_ladder(profile: Profile) -> list[SubmodelSpec]:
    depths = profile.arch.depths
    return [
        SubmodelSpec(s.index, s.gamma, round(math.sqrt(s.gamma), 4), tuple((1.0,) * d for d in depths))
        for s in profile.submodels
    ]


def _prefix_steps(arch: AnyArch, n: int) -> tuple[tuple[float, ...], ...]:
    """The first n blocks; a block the architecture cannot skip (a MobileNetV2 block without a
    residual) stays present beyond the prefix."""
    out, seen = [], 0
    for si, d in enumerate(arch.depths):
        out.append(tuple(1.0 if seen + i < n or not arch.skippable(si, i) else 0.0 for i in range(d)))
        seen += d
    return tuple(out)


def _depth_prefix_ladder(profile: Profile) -> list[SubmodelSpec]:
    """Contiguous block prefixes whose parameter ratio is closest to each target gamma."""
    depths = profile.arch.depths
    total = full_cost(profile).params
    ratios = []
    for n in range(1, sum(depths) + 1):
        spec = SubmodelSpec(-1, 1.0, 1.0, _prefix_steps(profile.arch, n))
        ratios.append((submodel_cost(profile, spec).params / total, n))
    ladder = []
    for s in profile.submodels:
        # a submodel smaller than the global model never becomes the whole network
        candidates = ratios if s.gamma >= 1 else ratios[:-1]
        _, n = min(candidates, key=lambda r: (abs(r[0] - s.gamma), r[1]))
        ladder.append(SubmodelSpec(s.index, s.gamma, 1.0, _prefix_steps(profile.arch, n)))
    return ladder


LADDERS: dict[LadderRule, Callable[[Profile], list[SubmodelSpec]]] = {
    "profile": lambda profile: list(profile.submodels),
    "width": _width_ladder,
    "depth_prefix": _depth_prefix_ladder,
}
assert tuple(LADDERS) == get_args(LadderRule)


def apply_method(profile: Profile, method: Method) -> Profile:
    """The ladder this method trains, derived from the profile's target sizes."""
    return profile.with_submodels(LADDERS[method.ladder](profile), method.name)
