"""The ViT family: torchvision-compatible Vision Transformers, nested by embedding width and depth.

NeFL's transformer scaling (paper, ViT section): width keeps whole heads and scales the embedding
dimension D' = heads' x head_dim (heads' = ceil(heads x gamma_W)) and the MLP dimension by
ceil(M x gamma_W); depth skips whole encoder blocks, and a present block scales both of its
residuals (attention and MLP) by learnable step sizes. LayerNorm is consistent by default (the
paper found it better than treating it like BN): its D' prefix is shared by every submodel.

To keep every submodel tensor the leading corner of its global tensor (what slicing and NeFedAvg
rely on), q, k and v are separate projections (torchvision packs them into one (3D, D) tensor,
whose corner would mix q with k), the class token is stored as (D,) and the position embedding as
(S, D). The attention itself runs through torch's own nn.MultiheadAttention code with the three
projections packed on the fly, so the full model reproduces torchvision's output bit for bit.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.func import functional_call

from nefl.nested.arch import ViTArch
from nefl.nested.families.base import Mapped, norm_names, step_parameter
from nefl.nested.families.costs import grid, image_size, widths
from nefl.nested.profile import Profile, SubmodelSpec

LN_EPS = 1e-6  # torchvision's ViT LayerNorm epsilon


class Attention(nn.Module):
    """Multi-head self-attention with separate q, k, v projections (each a leading-corner slice).

    forward packs them and calls nn.MultiheadAttention's own forward through functional_call on a
    parameterless (meta) template, so training and the eval fast path are exactly torch's."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))
        with torch.device("meta"):
            template = nn.MultiheadAttention(dim, heads, batch_first=True)
        object.__setattr__(self, "_template", template)  # not a submodule: no state of its own

    @property
    def heads(self) -> int:
        return self._template.num_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = {
            "in_proj_weight": torch.cat([self.q.weight, self.k.weight, self.v.weight]),
            "in_proj_bias": torch.cat([self.q.bias, self.k.bias, self.v.bias]),
            "out_proj.weight": self.out.weight, "out_proj.bias": self.out.bias,
        }
        self._template.training = self.training  # eval() does not reach it: it is not a submodule
        out, _ = functional_call(self._template, params, (x, x, x), {"need_weights": False})
        return out


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(x)))


class EncoderBlock(nn.Module):
    """x + s_attn * attn(ln_1(x)), then + s_mlp * mlp(ln_2(x)); the identity when skipped."""

    def __init__(self, dim: int, heads: int, mlp: int, step: float, learnable_step: bool) -> None:
        super().__init__()
        self.present = step != 0
        if not self.present:
            return
        self.ln_1 = nn.LayerNorm(dim, eps=LN_EPS)
        self.attn = Attention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim, eps=LN_EPS)
        self.mlp = MLP(dim, mlp)
        self.step = step_parameter(step, learnable_step, count=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.present:
            return x
        x = self.step[0] * self.attn(self.ln_1(x)) + x
        return x + self.step[1] * self.mlp(self.ln_2(x))


class NestedViT(nn.Module):
    def __init__(
        self, arch: ViTArch, input_shape: tuple[int, int, int], num_classes: int,
        gamma_w: float, steps: tuple[tuple[float, ...], ...], learnable_steps: bool = True,
    ) -> None:
        super().__init__()
        self.arch = arch
        heads, dim, mlp = widths(arch, gamma_w)
        gh, gw = grid(arch, input_shape)
        size = image_size(arch, input_shape)
        self.resize = size if size != tuple(input_shape[1:]) else None
        self.conv_proj = nn.Conv2d(input_shape[0], dim, arch.patch, stride=arch.patch)
        self.class_token = nn.Parameter(torch.zeros(dim))
        self.pos_embedding = nn.Parameter(torch.empty(gh * gw + 1, dim).normal_(std=0.02))
        self.stages = nn.ModuleList([nn.ModuleList(
            EncoderBlock(dim, heads, mlp, steps[0][b], learnable_steps) for b in range(arch.layers))])
        self.ln = nn.LayerNorm(dim, eps=LN_EPS)
        self.head = nn.Linear(dim, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        """torchvision's initialisation (q, k, v each Xavier-uniform on their own)."""
        fan_in = self.conv_proj.in_channels * self.arch.patch ** 2
        nn.init.trunc_normal_(self.conv_proj.weight, std=math.sqrt(1 / fan_in))
        nn.init.zeros_(self.conv_proj.bias)
        for m in self.modules():
            if isinstance(m, Attention):
                for lin in (m.q, m.k, m.v):
                    nn.init.xavier_uniform_(lin.weight)
                    nn.init.zeros_(lin.bias)
                nn.init.zeros_(m.out.bias)
            elif isinstance(m, MLP):
                for lin in (m.fc1, m.fc2):
                    nn.init.xavier_uniform_(lin.weight)
                    nn.init.normal_(lin.bias, std=1e-6)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = patch_tokens(self, x)
        for block in self.stages[0]:
            x = block(x)
        return self.head(self.ln(x)[:, 0])


def patch_tokens(vit: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The encoder's input from images: (resize,) patchify, class token first, plus position embeddings.
    One definition for the supernet and its folded export (export/fold.py), which hold the same attributes."""
    if vit.resize is not None:
        x = nn.functional.interpolate(x, size=vit.resize, mode="bilinear", align_corners=False)
    x = vit.conv_proj(x)
    x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)
    token = vit.class_token.view(1, 1, -1).expand(x.shape[0], -1, -1)
    return torch.cat([token, x], dim=1) + vit.pos_embedding


_TV_BLOCK = {"ln_1.": "ln_1.", "ln_2.": "ln_2.", "self_attention.out_proj.": "attn.out.", "mlp.0.": "mlp.fc1.",
             "mlp.3.": "mlp.fc2."}
_TV_TOP = {"conv_proj.": "conv_proj.", "encoder.ln.": "ln.", "heads.head.": "head."}


def _tv_block(i: int, rest: str, k: str, v: torch.Tensor) -> Mapped:
    ours = f"stages.0.{i}."
    if rest.startswith("self_attention.in_proj_"):
        kind = rest.rsplit("_", 1)[1]  # weight or bias
        for name, part in zip("qkv", v.chunk(3)):
            yield k, f"{ours}attn.{name}.{kind}", part
        return
    for tv, mine in _TV_BLOCK.items():
        if rest.startswith(tv):
            yield k, ours + mine + rest[len(tv):], v
            return
    raise ValueError(f"torchvision key {k!r} has no counterpart in a ViT")


class ViTFamily:
    """ViTs: whole heads of the embedding dim, skipped encoder blocks, LayerNorm consistent by default."""

    name = "vit"

    def build(self, profile: Profile, sub: SubmodelSpec, learnable_steps: bool = True) -> NestedViT:
        return NestedViT(profile.arch, profile.input_shape, profile.num_classes, sub.gamma_w, sub.steps, learnable_steps)

    def norm_tensors(self, supernet: nn.Module, profile: Profile) -> set[str]:
        return norm_names(supernet, (nn.LayerNorm,)) if profile.layernorm == "per_submodel" else set()

    def from_torchvision(self, arch: ViTArch, tv_state: dict[str, torch.Tensor]) -> Mapped:
        for k, v in tv_state.items():
            if k == "class_token":
                yield k, "class_token", v.reshape(-1)
            elif k == "encoder.pos_embedding":
                yield k, "pos_embedding", v.reshape(v.shape[-2], v.shape[-1])
            elif k.startswith("encoder.layers.encoder_layer_"):
                index, rest = k[len("encoder.layers.encoder_layer_"):].split(".", 1)
                yield from _tv_block(int(index), rest, k, v)
            else:
                top = next((t for t in _TV_TOP if k.startswith(t)), None)
                if top is None:
                    raise ValueError(f"torchvision key {k!r} has no counterpart in a ViT")
                yield k, _TV_TOP[top] + k[len(top):], v

    def keeps_fresh(self, name: str) -> bool:
        """Another classifier, or a patch embedding for other input channels."""
        return name.startswith("head.") or name == "conv_proj.weight"

    def adapt(self, name: str, value: torch.Tensor, shape: torch.Size) -> torch.Tensor | None:
        """Position embeddings for another image size: the patch grid resampled bicubically (as
        torchvision's interpolate_embeddings does), the class token's row kept."""
        if name != "pos_embedding" or value.shape[1] != shape[1]:
            return None
        old, new = math.isqrt(value.shape[0] - 1), math.isqrt(shape[0] - 1)
        if old * old != value.shape[0] - 1 or new * new != shape[0] - 1:
            return None
        patches = value[1:].T.reshape(1, -1, old, old)
        resized = nn.functional.interpolate(patches, size=(new, new), mode="bicubic", align_corners=True)
        return torch.cat([value[:1], resized.reshape(-1, new * new).T])


FAMILY = ViTFamily()
