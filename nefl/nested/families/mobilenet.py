"""The MobileNetV2 family: torchvision's MobileNetV2, nested by width multiplier and depth.

Width: every channel count (stem, each stage, the expanded width inside a block, the head conv) is
the global count times gamma_W rounded to a multiple of 8 as torchvision's width multiplier rounds,
so a submodel is a prefix of the channels. Depth: the repeated blocks of a stage (stride 1, same
channels, i.e. the ones with a residual connection) may be skipped; a present one computes
x + step * F(x) with a learnable step, as NeFL's ResNet blocks do. BatchNorm is per submodel like
the ResNets' (or shared and static under HeteroFL's preset).
"""

from __future__ import annotations

import torch
from torch import nn

from nefl.nested.arch import MobileNetV2Arch
from nefl.nested.families.base import Mapped, norm_names, step_parameter
from nefl.nested.profile import Profile, SubmodelSpec


class ConvBN(nn.Module):
    """conv + BN (+ ReLU6), torchvision's Conv2dNormActivation."""

    def __init__(self, cin: int, cout: int, k: int, stride: int = 1, groups: int = 1, act: bool = True) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn(self.conv(x))
        return nn.functional.hardtanh(x, 0.0, 6.0) if self.act else x  # nn.ReLU6 is hardtanh(0, 6)


class InvertedResidual(nn.Module):
    """1x1 expand, 3x3 depthwise, 1x1 linear projection; x + step * F(x) when it has a residual.
    A skipped block (only residual ones may be) is the identity and has no parameters."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int, residual: bool, step: float,
                 learnable_step: bool) -> None:
        super().__init__()
        self.residual = residual
        self.present = step != 0
        if not self.present:
            return
        hidden = cin * expand
        if expand != 1:
            self.expand = ConvBN(cin, hidden, 1)
        self.dw = ConvBN(hidden, hidden, 3, stride, groups=hidden)
        self.project = ConvBN(hidden, cout, 1, act=False)
        if self.residual:
            self.step = step_parameter(step, learnable_step)

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "expand"):
            x = self.expand(x)
        return self.project(self.dw(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.present:
            return x
        return x + self.step * self.branch(x) if self.residual else self.branch(x)


class NestedMobileNetV2(nn.Module):
    def __init__(
        self, arch: MobileNetV2Arch, stem: str, in_channels: int, num_classes: int,
        gamma_w: float, steps: tuple[tuple[float, ...], ...], learnable_steps: bool = True,
    ) -> None:
        super().__init__()
        self.arch = arch
        c = arch.scaled(arch.stem_channels, gamma_w)
        self.stem = ConvBN(in_channels, c, 3, 1 if stem == "cifar" else 2)
        stages = []
        for si, (t, _, n, _) in enumerate(arch.settings):
            blocks = []
            cout = arch.scaled(arch.channels(si), gamma_w)
            for bi in range(n):
                # decided on global widths: a submodel's channel rounding must not add or drop a residual
                blocks.append(InvertedResidual(c, cout, arch.stride(stem, si, bi), t, arch.skippable(si, bi),
                                               steps[si][bi], learnable_steps))
                c = cout
            stages.append(nn.ModuleList(blocks))
        self.stages = nn.ModuleList(stages)
        self.head = ConvBN(c, arch.scaled(arch.head_channels, gamma_w), 1)
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(self.head.conv.out_channels, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        """torchvision's initialisation."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for stage in self.stages:
            for block in stage:
                x = block(x)
        x = torch.flatten(nn.functional.adaptive_avg_pool2d(self.head(x), (1, 1)), 1)
        return self.fc(self.drop(x))


def _tv_block_names(arch: MobileNetV2Arch) -> dict[str, str]:
    """torchvision's features.I.conv.* prefixes -> ours, per block (the layout depends on expansion)."""
    out, i = {}, 1
    for si, (t, _, n, _) in enumerate(arch.settings):
        for bi in range(n):
            ours = f"stages.{si}.{bi}."
            parts = (["expand"] if t != 1 else []) + ["dw"]
            for j, part in enumerate(parts):
                out[f"features.{i}.conv.{j}.0."] = ours + part + ".conv."
                out[f"features.{i}.conv.{j}.1."] = ours + part + ".bn."
            out[f"features.{i}.conv.{len(parts)}."] = ours + "project.conv."
            out[f"features.{i}.conv.{len(parts) + 1}."] = ours + "project.bn."
            i += 1
    out.update({"features.0.0.": "stem.conv.", "features.0.1.": "stem.bn.", f"features.{i}.0.": "head.conv.",
                f"features.{i}.1.": "head.bn.", "classifier.1.": "fc."})
    return out


class MobileNetV2Family:
    """MobileNetV2: width multiplier rounded to 8, residual blocks skippable, every BatchNorm per submodel."""

    name = "mobilenetv2"

    def build(self, profile: Profile, sub: SubmodelSpec, learnable_steps: bool = True) -> NestedMobileNetV2:
        return NestedMobileNetV2(profile.arch, profile.stem, profile.input_shape[0], profile.num_classes,
                                 sub.gamma_w, sub.steps, learnable_steps)

    def norm_tensors(self, supernet: nn.Module, profile: Profile) -> set[str]:
        return norm_names(supernet, (nn.BatchNorm2d,))

    def from_torchvision(self, arch: MobileNetV2Arch, tv_state: dict[str, torch.Tensor]) -> Mapped:
        prefixes = _tv_block_names(arch)
        for k, v in tv_state.items():
            head, _, leaf = k.rpartition(".")
            ours = prefixes.get(head + ".")
            if ours is None:
                raise ValueError(f"torchvision key {k!r} has no counterpart in {arch.name}")
            yield k, ours + leaf, v

    def keeps_fresh(self, name: str) -> bool:
        """Another classifier, or a stem conv for other input channels."""
        return name.startswith("fc.") or name == "stem.conv.weight"

    def adapt(self, name: str, value: torch.Tensor, shape: torch.Size) -> torch.Tensor | None:
        return None


FAMILY = MobileNetV2Family()
