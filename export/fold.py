"""Inference-only rewrite of a NestedResNet: BatchNorm and step sizes folded into the convolutions.

At inference a BN is an affine map per channel, and relu(shortcut + s * BN(conv(x))) equals
relu(shortcut + conv'(x)) with conv' = conv scaled by s * gamma / sqrt(var + eps) plus a bias. The
folded graph has only Conv/Relu/Add/Pool/Gemm nodes: fewer ops for onnxruntime and for the int8
quantizer. Folding is done in float64 and rounded once, so the result matches the original to
float32 noise (checked by `fold_error`).
"""

from __future__ import annotations

import torch
from torch import nn

from nefl.models import Block, NestedResNet, Shortcut, Stem


def fold_conv_bn(conv: nn.Conv2d, bn: nn.BatchNorm2d, scale: float = 1.0) -> nn.Conv2d:
    """conv followed by eval-mode bn, times `scale`, as one biased conv."""
    w = conv.weight.detach().double()
    gamma, beta = bn.weight.detach().double(), bn.bias.detach().double()
    mean, var = bn.running_mean.double(), bn.running_var.double()
    factor = scale * gamma / torch.sqrt(var + bn.eps)
    out = nn.Conv2d(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding, bias=True)
    with torch.no_grad():
        out.weight.copy_((w * factor.view(-1, 1, 1, 1)).float())
        out.bias.copy_((scale * beta - factor * mean).float())
    return out


class FoldedBlock(nn.Module):
    """relu(shortcut(x) + branch(x)) with the step size already inside the branch's last conv."""

    def __init__(self, block: Block) -> None:
        super().__init__()
        sc: Shortcut | None = block.shortcut
        self.shortcut = fold_conv_bn(sc.conv, sc.bn) if sc is not None else None
        self.present = block.present
        self.convs = nn.ModuleList()
        if not self.present:
            return
        step = float(block.step.detach())
        for i in range(1, block.num_convs + 1):
            scale = step if i == block.num_convs else 1.0
            self.convs.append(fold_conv_bn(getattr(block, f"conv{i}"), getattr(block, f"bn{i}"), scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.shortcut is None else self.shortcut(x)
        if not self.present:
            return identity if self.shortcut is None else torch.relu(identity)
        y = x
        for i, conv in enumerate(self.convs):
            y = conv(y)
            if i < len(self.convs) - 1:
                y = torch.relu(y)
        return torch.relu(identity + y)


class FoldedResNet(nn.Module):
    """The same function as the NestedResNet it was built from, in eval mode, with no BN nodes."""

    def __init__(self, model: NestedResNet) -> None:
        super().__init__()
        stem: Stem = model.stem
        self.stem_conv = fold_conv_bn(stem.conv, stem.bn)
        self.stem_pool = stem.pool
        self.blocks = nn.ModuleList(FoldedBlock(b) for stage in model.stages for b in stage)
        self.fc = nn.Linear(model.fc.in_features, model.fc.out_features)
        self.fc.load_state_dict(model.fc.state_dict())
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem_pool(torch.relu(self.stem_conv(x)))
        for block in self.blocks:
            x = block(x)
        x = torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)
        return self.fc(x)


def fold(model: NestedResNet) -> FoldedResNet:
    """A new folded module; `model` itself is left untouched (its BN stays trainable)."""
    if model.training:
        raise ValueError("fold needs an eval-mode model: BN folding uses the running statistics")
    return FoldedResNet(model)


@torch.no_grad()
def fold_error(model: NestedResNet, folded: FoldedResNet, inputs: torch.Tensor) -> float:
    """Max abs difference of the logits, relative to the largest logit (at least 1).

    Folding reorders float32 arithmetic, so its error grows with the activations' scale; an
    absolute bound would fail large but correct models (e.g. a submodel whose BN never trained).
    """
    ref = model(inputs)
    return float((ref - folded(inputs)).abs().max() / ref.abs().max().clamp_min(1.0))
