"""The registry of architecture families (the torch side): `family_of` is the one dispatch point."""

from __future__ import annotations

from nefl.nested.arch import AnyArch
from nefl.nested.families.base import Family
from nefl.nested.families.mobilenet import FAMILY as MOBILENET
from nefl.nested.families.resnet import FAMILY as RESNET
from nefl.nested.families.vit import FAMILY as VIT

FAMILIES: dict[str, Family] = {f.name: f for f in (RESNET, VIT, MOBILENET)}


def family_of(arch: AnyArch) -> Family:
    try:
        return FAMILIES[arch.family]
    except KeyError:
        raise ValueError(f"architecture {arch.name!r} names family {arch.family!r}; known: {', '.join(FAMILIES)}") from None
