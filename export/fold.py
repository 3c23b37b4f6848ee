"""Inference-only rewrite of a submodel: BatchNorm and step sizes folded into the layers before them.

At inference a BN is an affine map per channel, and relu(shortcut + s * BN(conv(x))) equals
relu(shortcut + conv'(x)) with conv' = conv scaled by s * gamma / sqrt(var + eps) plus a bias. The
folded graph has only Conv/Relu/Add/Pool/Gemm nodes: fewer ops for onnxruntime and for the int8
quantizer. Folding is done in float64 and rounded once, so the result matches the original to
float32 noise (checked by `fold_error`). A MobileNetV2 folds the same way (its depthwise convs
included); a ViT has no BN: its step sizes fold into the attention output and second MLP
projections, and its attention is written in plain MatMul/Softmax ops for the exporter.
"""

from __future__ import annotations

import torch
from torch import nn

from nefl.nested.families.mobilenet import ConvBN, InvertedResidual, NestedMobileNetV2
from nefl.nested.families.vit import Attention, EncoderBlock, NestedViT, patch_tokens
from nefl.nested.models import Block, NestedResNet, Shortcut, Stem


def fold_conv_bn(conv: nn.Conv2d, bn: nn.BatchNorm2d, scale: float = 1.0) -> nn.Conv2d:
    """conv followed by eval-mode bn, times `scale`, as one biased conv."""
    w = conv.weight.detach().double()
    gamma, beta = bn.weight.detach().double(), bn.bias.detach().double()
    mean, var = bn.running_mean.double(), bn.running_var.double()
    factor = scale * gamma / torch.sqrt(var + bn.eps)
    out = nn.Conv2d(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                    groups=conv.groups, bias=True)
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


def scaled_linear(lin: nn.Linear, scale: float) -> nn.Linear:
    """`lin` times a step size, as one linear layer (computed in float64, rounded once)."""
    out = nn.Linear(lin.in_features, lin.out_features)
    with torch.no_grad():
        out.weight.copy_((lin.weight.detach().double() * scale).float())
        out.bias.copy_((lin.bias.detach().double() * scale).float())
    return out


class FoldedConv(nn.Module):
    """A ConvBN folded into one biased conv, then ReLU6 when the original had it."""

    def __init__(self, layer: ConvBN, scale: float = 1.0) -> None:
        super().__init__()
        self.conv, self.act = fold_conv_bn(layer.conv, layer.bn, scale), layer.act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        return torch.clamp(x, 0.0, 6.0) if self.act else x


class FoldedInvertedResidual(nn.Module):
    """x + branch(x) with the step size inside the projection conv; the identity when skipped."""

    def __init__(self, block: InvertedResidual) -> None:
        super().__init__()
        self.present, self.residual = block.present, block.residual
        if not self.present:
            return
        step = float(block.step.detach()) if block.residual else 1.0
        parts = ([block.expand] if hasattr(block, "expand") else []) + [block.dw]
        self.convs = nn.Sequential(*(FoldedConv(p) for p in parts), FoldedConv(block.project, step))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.present:
            return x
        return x + self.convs(x) if self.residual else self.convs(x)


class FoldedMobileNetV2(nn.Module):
    """The same function as the NestedMobileNetV2 it was built from, in eval mode, with no BN nodes."""

    def __init__(self, model: NestedMobileNetV2) -> None:
        super().__init__()
        self.stem = FoldedConv(model.stem)
        self.blocks = nn.Sequential(*(FoldedInvertedResidual(b) for stage in model.stages for b in stage))
        self.head = FoldedConv(model.head)
        self.fc = scaled_linear(model.fc, 1.0)
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head(self.blocks(self.stem(x)))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class PlainAttention(nn.Module):
    """Multi-head attention in MatMul/Softmax ops, the output projection pre-scaled by the step."""

    def __init__(self, attn: Attention, step: float) -> None:
        super().__init__()
        self.q, self.k, self.v = (scaled_linear(lin, 1.0) for lin in (attn.q, attn.k, attn.v))
        self.out = scaled_linear(attn.out, step)
        self.heads = attn.heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, s, d = x.shape
        hd = d // self.heads

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(n, s, self.heads, hd).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        weights = torch.softmax(q @ k.transpose(-2, -1) * hd ** -0.5, dim=-1)
        return self.out((weights @ v).transpose(1, 2).reshape(n, s, d))


class FoldedEncoderBlock(nn.Module):
    def __init__(self, block: EncoderBlock) -> None:
        super().__init__()
        s_attn, s_mlp = (float(v) for v in block.step.detach())
        self.ln_1, self.ln_2 = block.ln_1, block.ln_2
        self.attn = PlainAttention(block.attn, s_attn)
        self.fc1, self.fc2 = scaled_linear(block.mlp.fc1, 1.0), scaled_linear(block.mlp.fc2, s_mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln_2(x))))


class FoldedViT(nn.Module):
    """The same function as the NestedViT it was built from: skipped blocks gone, steps folded."""

    def __init__(self, model: NestedViT) -> None:
        super().__init__()
        self.resize = model.resize
        self.conv_proj, self.ln, self.head = model.conv_proj, model.ln, model.head
        self.class_token = nn.Parameter(model.class_token.detach().clone())
        self.pos_embedding = nn.Parameter(model.pos_embedding.detach().clone())
        self.blocks = nn.Sequential(*(FoldedEncoderBlock(b) for b in model.stages[0] if b.present))
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.blocks(patch_tokens(self, x)))[:, 0])


_FOLDS: dict[type[nn.Module], type[nn.Module]] = {
    NestedResNet: FoldedResNet, NestedMobileNetV2: FoldedMobileNetV2, NestedViT: FoldedViT,
}


def fold(model: nn.Module) -> nn.Module:
    """A new folded module; `model` itself is left untouched (its BN stays trainable)."""
    if model.training:
        raise ValueError("fold needs an eval-mode model: BN folding uses the running statistics")
    try:
        return _FOLDS[type(model)](model)
    except KeyError:
        raise ValueError(f"no inference rewrite for {type(model).__name__}; add one to export/fold.py") from None


@torch.no_grad()
def fold_error(model: nn.Module, folded: nn.Module, inputs: torch.Tensor) -> float:
    """Max abs difference of the logits, relative to the largest logit (at least 1).

    Folding reorders float32 arithmetic, so its error grows with the activations' scale; an
    absolute bound would fail large but correct models (e.g. a submodel whose BN never trained).
    """
    ref = model(inputs)
    return float((ref - folded(inputs)).abs().max() / ref.abs().max().clamp_min(1.0))
