"""ResNet family descriptions: the fixed shape of each global model.

A submodel ladder (profile) refers to an architecture by name; everything that depends on the
architecture's shape (block counts, channel widths, bottleneck expansion) is read from here so
that models, cost estimates and profile validation agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from nefl.choices import check_choice

BlockKind = Literal["basic", "bottleneck"]


@dataclass(frozen=True)
class Arch:
    name: str
    block: BlockKind
    depths: tuple[int, ...]  # blocks per stage
    widths: tuple[int, ...]  # planes per stage (bottleneck output is planes * expansion)
    stem_width: int
    default_stem: str  # "cifar" or "imagenet"
    width_per_group: int = 64  # bottleneck inner width = planes * width_per_group / 64

    def __post_init__(self) -> None:
        check_choice(BlockKind, self.block, f"architecture {self.name!r}: block")

    @property
    def expansion(self) -> int:
        return 4 if self.block == "bottleneck" else 1

    @property
    def num_blocks(self) -> int:
        return sum(self.depths)

    def stage_stride(self, stage: int) -> int:
        return 1 if stage == 0 else 2

    def out_channels(self, stage: int) -> int:
        return self.widths[stage] * self.expansion

    def inner_channels(self, stage: int) -> int:
        """Channels inside a block's residual branch (before the last conv)."""
        if self.block == "bottleneck":
            return self.widths[stage] * self.width_per_group // 64
        return self.widths[stage]


def _cifar(name: str, n: int) -> Arch:
    return Arch(name, "basic", (n, n, n), (16, 32, 64), 16, "cifar")


ARCHS: dict[str, Arch] = {
    a.name: a
    for a in (
        _cifar("resnet8", 1),
        _cifar("resnet14", 2),
        _cifar("resnet20", 3),
        _cifar("resnet32", 5),
        _cifar("resnet44", 7),
        _cifar("resnet56", 9),
        _cifar("resnet110", 18),
        Arch("resnet18", "basic", (2, 2, 2, 2), (64, 128, 256, 512), 64, "cifar"),
        Arch("resnet34", "basic", (3, 4, 6, 3), (64, 128, 256, 512), 64, "cifar"),
        Arch("resnet50", "bottleneck", (3, 4, 6, 3), (64, 128, 256, 512), 64, "imagenet"),
        Arch("resnet101", "bottleneck", (3, 4, 23, 3), (64, 128, 256, 512), 64, "imagenet"),
        Arch("wide_resnet101_2", "bottleneck", (3, 4, 23, 3), (64, 128, 256, 512), 64, "imagenet", 128),
    )
}


def get_arch(name: str) -> Arch:
    try:
        return ARCHS[name]
    except KeyError:
        raise ValueError(f"unknown architecture {name!r}; known: {', '.join(ARCHS)}") from None
