"""Parameter, MAC and activation counts of every family's submodels, and the shape rules they share
with the modules: pure arithmetic on the profile, no torch, so `nefl profile show` and the device's
selection run on the small (inference-only) install.

A family's modules (nefl/nested/families/NAME.py) build exactly what its cost function counts; the tests check
both against each other. FLOPs are multiply-accumulates of convolutions, linear layers and (for
transformers) the attention products.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from nefl.nested.arch import ViTArch
from nefl.nested.profile import Profile, SubmodelSpec, scaled


@dataclass(frozen=True)
class Cost:
    params: int
    macs: int
    activations: int  # elements of every layer output of one sample: drives training memory


def full_steps(depths: tuple[int, ...]) -> tuple[tuple[float, ...], ...]:
    return tuple((1.0,) * d for d in depths)


# -- ResNet ---------------------------------------------------------------------------------------

def _out(size: int, k: int, stride: int) -> int:
    return (size + 2 * (k // 2) - k) // stride + 1


def resnet_cost(profile: Profile, sub: SubmodelSpec) -> Cost:
    arch, gw = profile.arch, sub.gamma_w
    cin, h, w = profile.input_shape
    params = macs = acts = 0

    def conv(a: int, b: int, k: int, stride: int) -> None:
        nonlocal params, macs, acts, h, w
        h, w = _out(h, k, stride), _out(w, k, stride)
        params += a * b * k * k + 2 * b  # conv weight + BN affine
        macs += a * b * k * k * h * w
        acts += 2 * b * h * w  # conv output + BN output

    c = scaled(arch.stem_width, gw)
    k, s = (3, 1) if profile.stem == "cifar" else (7, 2)
    conv(cin, c, k, s)
    if profile.stem == "imagenet":
        h, w = _out(h, 3, 2), _out(w, 3, 2)
    global_in = arch.stem_width
    for si, depth in enumerate(arch.depths):
        for bi in range(depth):
            stride = arch.stage_stride(si) if bi == 0 else 1
            global_out = arch.out_channels(si)
            cout, mid = scaled(global_out, gw), scaled(arch.inner_channels(si), gw)
            h0, w0 = h, w
            if stride != 1 or global_in != global_out:
                conv(c, cout, 1, stride)
                h, w = h0, w0
            if sub.present(si, bi):
                params += 1  # step size
                if arch.block == "basic":
                    conv(c, mid, 3, stride)
                    conv(mid, cout, 3, 1)
                else:
                    conv(c, mid, 1, 1)
                    conv(mid, mid, 3, stride)
                    conv(mid, cout, 1, 1)
            h, w = _out(h0, 1, stride), _out(w0, 1, stride)
            c, global_in = cout, global_out
    params += c * profile.num_classes + profile.num_classes
    macs += c * profile.num_classes
    return Cost(params, macs, acts)


# -- ViT ------------------------------------------------------------------------------------------

def widths(arch: ViTArch, gamma_w: float) -> tuple[int, int, int]:
    """(heads, embedding dim, MLP dim) of a submodel: whole heads, D' a multiple of the head dim, and
    the MLP scaled by the ratio the heads realise (so a block keeps its shape's proportions)."""
    heads = scaled(arch.heads, gamma_w)
    return heads, heads * arch.head_dim, scaled(arch.mlp, heads / arch.heads)


def image_size(arch: ViTArch, input_shape: tuple[int, int, int]) -> tuple[int, int]:
    return (arch.image_size, arch.image_size) if arch.image_size else (input_shape[1], input_shape[2])


def grid(arch: ViTArch, input_shape: tuple[int, int, int]) -> tuple[int, int]:
    h, w = image_size(arch, input_shape)
    if h % arch.patch or w % arch.patch:
        raise ValueError(f"{arch.name}: input {h}x{w} is not a multiple of the patch size {arch.patch}; "
                         "pick a profile input_shape divisible by it")
    return h // arch.patch, w // arch.patch


def vit_cost(profile: Profile, sub: SubmodelSpec) -> Cost:
    arch = profile.arch
    heads, d, m = widths(arch, sub.gamma_w)
    gh, gw = grid(arch, profile.input_shape)
    tokens = gh * gw + 1
    patch_in = profile.input_shape[0] * arch.patch ** 2
    params = patch_in * d + d + d + tokens * d + 2 * d + d * profile.num_classes + profile.num_classes
    macs = patch_in * d * (tokens - 1) + d * profile.num_classes
    acts = tokens * d * 2  # patch embedding, position-embedded tokens
    for present in sub.steps[0]:
        if not present:
            continue
        params += 2 * 2 * d + 4 * (d * d + d) + 2 * d * m + m + d + 2
        macs += 4 * tokens * d * d + 2 * tokens * tokens * d + 2 * tokens * d * m
        acts += tokens * (9 * d + 2 * m) + 2 * heads * tokens * tokens
    return Cost(params, macs, acts)


# -- MobileNetV2 ----------------------------------------------------------------------------------

def _out3(size: int, stride: int) -> int:
    return (size + 2 - 3) // stride + 1  # 3x3, padding 1 (a 1x1 conv has stride 1 here)


def mobilenet_cost(profile: Profile, sub: SubmodelSpec) -> Cost:
    arch, gw = profile.arch, sub.gamma_w
    cin, h, w = profile.input_shape
    params = macs = acts = 0

    def conv(a: int, b: int, k: int, stride: int, groups: int = 1, act: bool = True) -> None:
        nonlocal params, macs, acts, h, w
        h, w = (_out3(h, stride), _out3(w, stride)) if k == 3 else (h, w)
        params += a // groups * b * k * k + 2 * b  # conv weight + BN affine
        macs += a // groups * b * k * k * h * w
        # conv and BN outputs, and ReLU6's (not in place: its output is a tensor of its own in the peak)
        acts += (3 if act else 2) * b * h * w

    c = arch.scaled(arch.stem_channels, gw)
    conv(cin, c, 3, 1 if profile.stem == "cifar" else 2)
    for si, (t, _, n, _) in enumerate(arch.settings):
        cout = arch.scaled(arch.channels(si), gw)
        for bi in range(n):
            stride = arch.stride(profile.stem, si, bi)
            if sub.present(si, bi):
                hidden = c * t
                if t != 1:
                    conv(c, hidden, 1, 1)
                conv(hidden, hidden, 3, stride, groups=hidden)
                conv(hidden, cout, 1, 1, act=False)
                params += arch.skippable(si, bi)  # a residual block's step size
            c = cout
    last = arch.scaled(arch.head_channels, gw)
    conv(c, last, 1, 1)
    params += last * profile.num_classes + profile.num_classes
    macs += last * profile.num_classes
    return Cost(params, macs, acts)


COSTS: dict[str, Callable[[Profile, SubmodelSpec], Cost]] = {
    "resnet": resnet_cost, "vit": vit_cost, "mobilenetv2": mobilenet_cost,
}


def submodel_cost(profile: Profile, sub: SubmodelSpec) -> Cost:
    try:
        return COSTS[profile.arch.family](profile, sub)
    except KeyError:
        raise ValueError(f"no cost function for family {profile.arch.family!r}; add one to nefl/nested/families/costs.py") from None
