"""The ResNet family: nested ResNets built as physically smaller modules.

A submodel is not the global model under a mask: hidden widths are ceil(C * gamma_W) and skipped
blocks have no residual branch at all, so memory and compute on the device shrink with the
submodel. Parameter names are the same in every submodel and in the global model, which is what
lets slicing and NeFedAvg work by name with prefix slices.
"""

from __future__ import annotations

import torch
from torch import nn

from nefl.nested.arch import Arch
from nefl.nested.families.base import Mapped, norm_names
from nefl.nested.profile import Profile, SubmodelSpec, scaled


def _conv(cin: int, cout: int, k: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=False)


class Shortcut(nn.Module):
    """1x1 projection + BN; kept even when its block is skipped so shapes still line up."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv = _conv(cin, cout, 1, stride)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x))


class Block(nn.Module):
    """Residual block computing relu(shortcut(x) + step * F(x)); F is absent when skipped."""

    def __init__(
        self, kind: str, cin: int, mid: int, cout: int, stride: int,
        projection: bool, step: float, learnable_step: bool,
    ) -> None:
        super().__init__()
        self.shortcut = Shortcut(cin, cout, stride) if projection else None
        self.present = step != 0
        if not self.present:
            return
        if kind == "basic":
            convs = [(cin, mid, 3, stride), (mid, cout, 3, 1)]
        else:
            convs = [(cin, mid, 1, 1), (mid, mid, 3, stride), (mid, cout, 1, 1)]
        for i, (a, b, k, s) in enumerate(convs, start=1):
            self.add_module(f"conv{i}", _conv(a, b, k, s))
            self.add_module(f"bn{i}", nn.BatchNorm2d(b))
        self.num_convs = len(convs)
        self.step = nn.Parameter(torch.tensor(float(step)), requires_grad=learnable_step)

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(1, self.num_convs + 1):
            x = getattr(self, f"bn{i}")(getattr(self, f"conv{i}")(x))
            if i < self.num_convs:
                x = torch.relu(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.shortcut is None else self.shortcut(x)
        if not self.present:
            return identity if self.shortcut is None else torch.relu(identity)
        return torch.relu(identity + self.step * self.branch(x))


class Stem(nn.Module):
    def __init__(self, kind: str, cin: int, cout: int) -> None:
        super().__init__()
        k, s = (3, 1) if kind == "cifar" else (7, 2)
        self.conv = nn.Conv2d(cin, cout, k, stride=s, padding=k // 2, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1) if kind == "imagenet" else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(torch.relu(self.bn(self.conv(x))))


class NestedResNet(nn.Module):
    def __init__(
        self, arch: Arch, stem: str, in_channels: int, num_classes: int,
        gamma_w: float, steps: tuple[tuple[float, ...], ...], learnable_steps: bool = True,
    ) -> None:
        super().__init__()
        self.arch = arch
        c = scaled(arch.stem_width, gamma_w)
        self.stem = Stem(stem, in_channels, c)
        stages = []
        global_in = arch.stem_width
        for si, depth in enumerate(arch.depths):
            blocks = []
            for bi in range(depth):
                stride = arch.stage_stride(si) if bi == 0 else 1
                global_out = arch.out_channels(si)
                projection = stride != 1 or global_in != global_out
                cout = scaled(global_out, gamma_w)
                mid = scaled(arch.inner_channels(si), gamma_w)
                blocks.append(Block(arch.block, c, mid, cout, stride, projection, steps[si][bi], learnable_steps))
                c, global_in = cout, global_out
            stages.append(nn.ModuleList(blocks))
        self.stages = nn.ModuleList(stages)
        self.fc = nn.Linear(c, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for stage in self.stages:
            for block in stage:
                x = block(x)
        x = torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)
        return self.fc(x)


_TV_STEM = {"conv1.": "stem.conv.", "bn1.": "stem.bn."}


def torchvision_key(name: str) -> str | None:
    """Map a torchvision ResNet state-dict key to ours (None for keys we don't have)."""
    for tv, ours in _TV_STEM.items():
        if name.startswith(tv):
            return ours + name[len(tv):]
    if name.startswith("layer"):
        stage_s, block, rest = name[len("layer"):].split(".", 2)
        rest = rest.replace("downsample.0.", "shortcut.conv.").replace("downsample.1.", "shortcut.bn.")
        return f"stages.{int(stage_s) - 1}.{block}.{rest}"
    if name.startswith("fc."):
        return name
    return None


class ResNetFamily:
    """ResNets: widths ceil(C * gamma_W), depth by skipping blocks, every BatchNorm per submodel."""

    name = "resnet"

    def build(self, profile: Profile, sub: SubmodelSpec, learnable_steps: bool = True) -> NestedResNet:
        return NestedResNet(profile.arch, profile.stem, profile.input_shape[0], profile.num_classes,
                            sub.gamma_w, sub.steps, learnable_steps)

    def norm_tensors(self, supernet: nn.Module, profile: Profile) -> set[str]:
        return norm_names(supernet, (nn.BatchNorm2d,))

    def from_torchvision(self, arch: Arch, tv_state: dict[str, torch.Tensor]) -> Mapped:
        for k, v in tv_state.items():
            ours = torchvision_key(k)
            if ours is None:
                raise ValueError(f"torchvision key {k!r} has no counterpart in a ResNet")
            yield k, ours, v

    def keeps_fresh(self, name: str) -> bool:
        """Another classifier, or a stem for other input channels (or the CIFAR stem): left fresh."""
        return name.startswith("fc.") or name == "stem.conv.weight"

    def adapt(self, name: str, value: torch.Tensor, shape: torch.Size) -> torch.Tensor | None:
        return None


FAMILY = ResNetFamily()
