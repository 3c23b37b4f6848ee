"""Analytic parameter and FLOP counts of a submodel, computed from its spec alone.

Used to print ladders, to derive baseline ladders with a target size, and as the device agent's
first cost estimate. FLOPs are counted as multiply-accumulates of convolutions and the classifier
(the convention of the paper's tables and of most ResNet literature).
"""

from __future__ import annotations

from dataclasses import dataclass

from nefl.profile import Profile, SubmodelSpec, scaled


@dataclass(frozen=True)
class Cost:
    params: int
    macs: int
    activations: int  # elements of every conv/BN output of one sample: drives training memory


def _out(size: int, k: int, stride: int) -> int:
    return (size + 2 * (k // 2) - k) // stride + 1


def submodel_cost(profile: Profile, sub: SubmodelSpec) -> Cost:
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


def full_cost(profile: Profile) -> Cost:
    full = SubmodelSpec(-1, 1.0, 1.0, tuple((1.0,) * d for d in profile.arch.depths))
    return submodel_cost(profile, full)
