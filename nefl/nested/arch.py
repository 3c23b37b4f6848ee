"""Architecture descriptions: the fixed shape of each global model, one dataclass per family.

A submodel ladder (profile) refers to an architecture by name; everything that depends on the
architecture's shape (block counts, channel widths, heads) is read from here so that models, cost
estimates and profile validation agree. Every family describes its depth the same way: `depths`
blocks per stage, one step size per block in a profile, and `skippable(stage, block)` saying which
blocks a submodel may leave out. The code that builds and costs each family is in nefl/nested/families/.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from nefl.support.choices import check_choice

BlockKind = Literal["basic", "bottleneck"]


@dataclass(frozen=True)
class Arch:
    """A ResNet (CIFAR-style or torchvision's ImageNet ResNets and wide ResNets)."""

    name: str
    block: BlockKind
    depths: tuple[int, ...]  # blocks per stage
    widths: tuple[int, ...]  # planes per stage (bottleneck output is planes * expansion)
    stem_width: int
    default_stem: str  # "cifar" or "imagenet"
    width_per_group: int = 64  # bottleneck inner width = planes * width_per_group / 64

    family = "resnet"
    stems = ("cifar", "imagenet")

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

    def skippable(self, stage: int, block: int) -> bool:
        """Every ResNet block may be skipped (a downsampling one keeps its shortcut)."""
        return True


@dataclass(frozen=True)
class ViTArch:
    """A torchvision-style Vision Transformer: one stage of `layers` encoder blocks.

    Width scales the embedding dimension in whole heads (D' = heads' x head_dim) and the MLP
    dimension by the same ratio; depth skips encoder blocks. The "patch" stem is the strided patch
    embedding (the only stem a ViT has). torchvision's ViTs work at 224x224: a smaller input (CIFAR's
    32x32) is resized bilinearly inside the model, as fine-tuning a pretrained ViT on it is done."""

    name: str
    patch: int
    layers: int
    heads: int
    hidden: int  # embedding dimension D
    mlp: int  # MLP hidden dimension
    image_size: int | None = None  # resolution the model works at (inputs resized to it); None: the input's

    family = "vit"
    stems = ("patch",)
    default_stem = "patch"

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"architecture {self.name!r}: hidden {self.hidden} is not a multiple of heads {self.heads}")

    @property
    def depths(self) -> tuple[int, ...]:
        return (self.layers,)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def skippable(self, stage: int, block: int) -> bool:
        """Every encoder block is a pair of residuals, so any of them may be skipped."""
        return True


# torchvision's inverted-residual settings: expansion t, output channels c, repeats n, first stride s
MOBILENET_V2_SETTINGS: tuple[tuple[int, int, int, int], ...] = (
    (1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1),
)


def make_divisible(value: float, divisor: int = 8) -> int:
    """torchvision's channel rounding (to a multiple of `divisor`, never more than 10% down)."""
    new = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * value else new


@dataclass(frozen=True)
class MobileNetV2Arch:
    """torchvision's MobileNetV2: a stem conv, seven stages of inverted residuals, a 1x1 head conv.

    Width: every channel count is make_divisible(C x gamma_W, 8), as torchvision's width multiplier
    rounds (the head conv included, so the classifier input shrinks too). Depth: only the repeated
    blocks of a stage (stride 1, same channels: the ones with a residual connection) may be skipped.
    The "cifar" stem keeps small inputs large enough: stride 1 in the stem conv and in stage 2."""

    name: str
    width_mult: float = 1.0
    stem_width: int = 32
    last_width: int = 1280
    settings: tuple[tuple[int, int, int, int], ...] = MOBILENET_V2_SETTINGS
    divisor: int = 8  # channel rounding (torchvision: 8; tiny test architectures use smaller)

    family = "mobilenetv2"
    stems = ("imagenet", "cifar")
    default_stem = "imagenet"

    @property
    def depths(self) -> tuple[int, ...]:
        return tuple(n for _, _, n, _ in self.settings)

    def channels(self, stage: int) -> int:
        return make_divisible(self.settings[stage][1] * self.width_mult, self.divisor)

    @property
    def stem_channels(self) -> int:
        return make_divisible(self.stem_width * self.width_mult, self.divisor)

    @property
    def head_channels(self) -> int:
        return make_divisible(self.last_width * max(1.0, self.width_mult), self.divisor)

    def scaled(self, channels: int, gamma_w: float) -> int:
        """A submodel's channel count: the width multiplier's rounding applied to gamma_W, never above
        the global count (so it stays a prefix)."""
        return min(channels, make_divisible(channels * gamma_w, self.divisor))

    def stride(self, stem: str, stage: int, block: int) -> int:
        if block > 0:
            return 1
        s = self.settings[stage][3]
        return 1 if stem == "cifar" and stage == 1 else s

    def in_channels(self, stage: int) -> int:
        return self.stem_channels if stage == 0 else self.channels(stage - 1)

    def skippable(self, stage: int, block: int) -> bool:
        """Whether the block has a residual connection (torchvision's rule: stride 1 and as many
        channels out as in, at its own strides; the CIFAR stem only changes where downsampling is)."""
        return block > 0 or (self.settings[stage][3] == 1 and self.in_channels(stage) == self.channels(stage))


AnyArch = Arch | ViTArch | MobileNetV2Arch


def _cifar(name: str, n: int) -> Arch:
    return Arch(name, "basic", (n, n, n), (16, 32, 64), 16, "cifar")


ARCHS: dict[str, AnyArch] = {
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
        ViTArch("vit_b_16", 16, 12, 12, 768, 3072, 224),
        ViTArch("vit_b_32", 32, 12, 12, 768, 3072, 224),
        ViTArch("vit_l_16", 16, 24, 16, 1024, 4096, 224),
        ViTArch("vit_tiny_p4", 4, 6, 8, 64, 256),  # CPU experiments on 28x28 / 32x32 inputs (about ResNet-20's size)
        MobileNetV2Arch("mobilenet_v2"),
        MobileNetV2Arch("mobilenet_v2_0.5", 0.5),
        MobileNetV2Arch("mobilenet_v2_0.35", 0.35),  # CPU experiments (about ResNet-20's size and step time)
    )
}


def get_arch(name: str) -> AnyArch:
    try:
        return ARCHS[name]
    except KeyError:
        raise ValueError(f"unknown architecture {name!r}; known: {', '.join(ARCHS)}") from None
