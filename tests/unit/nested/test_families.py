"""Architecture families (ViT, MobileNetV2 beside the ResNets): torchvision parity, slicing, NeFedAvg,
costs, pretrained weights from a file, ONNX export (a federation over the embedded broker is
tests/e2e/test_mobilenet_federation.py's)."""

from __future__ import annotations

import json
import random
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from safetensors.torch import save_file
from torch import nn
from torchvision.models.vision_transformer import VisionTransformer

from export.fold import fold, fold_error
from export.onnx_export import export_checkpoint, submodel_module
from export.parity import session
from nefl.aggregation.nefedavg import NeFedAvg
from nefl.nested.arch import ARCHS, MobileNetV2Arch, ViTArch
from nefl.nested.checkpoint import load_checkpoint, save_checkpoint
from nefl.nested.cost import submodel_cost
from nefl.nested.families.vit import Attention, NestedViT
from nefl.nested.methods import get_method
from nefl.nested.models import (build_submodel, build_supernet, full_steps, load_torchvision_state, pretrained_supernet_state,
                         read_state_file)
from nefl.nested.profile import Profile, ProfileError, SubmodelSpec, list_profiles, load_profile, parse_profile
from nefl.nested.state import GlobalState, Layout, load_module_state
from tests.harness.brute_force import assert_state_close, brute_force, random_updates

TINY_VIT = ViTArch("tiny_vit", 4, 3, 2, 8, 16)  # head dim 4, 8x8 inputs: 4 patches + the class token
TINY_MBV2 = MobileNetV2Arch("tiny_mbv2", stem_width=4, last_width=12, divisor=2,
                            settings=((1, 4, 1, 1), (2, 6, 2, 1), (2, 8, 3, 2)))
NEW_PROFILES = [n for n in list_profiles() if n.startswith(("vit-", "mobilenetv2-"))]


def tiny(arch, subs, layernorm: str = "consistent") -> Profile:
    stem = "patch" if arch.family == "vit" else "cifar"
    return Profile("tiny", "", arch, stem, 5, (3, 8, 8), "synthetic", "nefl",
                   tuple(SubmodelSpec(i, g, gw, st) for i, (g, gw, st) in enumerate(subs)), layernorm=layernorm)


def random_ladder(rng: random.Random, arch, n: int = 4, layernorm: str = "consistent") -> Profile:
    """Random widths and non-nested random depth sets (only skippable blocks skipped); the last is full."""
    subs = []
    for i in range(n - 1):
        steps = tuple(tuple(float(rng.random() < 0.6 or not arch.skippable(s, b)) for b in range(d))
                      for s, d in enumerate(arch.depths))
        subs.append(((i + 1) / n, rng.choice([0.25, 0.5, 0.75, 1.0]), steps))
    return tiny(arch, [*subs, (1.0, 1.0, full_steps(arch))], layernorm)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# -- torchvision parity ------------------------------------------------------------------------------

def test_vit_reproduces_torchvision_bit_for_bit() -> None:
    torch.manual_seed(0)
    ref = VisionTransformer(image_size=16, patch_size=4, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32,
                            num_classes=7).eval()
    for p in ref.parameters():  # torchvision zero-initialises the head and class token: make every tensor count
        nn.init.normal_(p, std=0.5)
    arch = ViTArch("t", 4, 2, 2, 16, 32)
    ours = NestedViT(arch, (3, 16, 16), 7, 1.0, full_steps(arch)).eval()
    load_torchvision_state(ours, ref.state_dict())
    x = torch.randn(3, 3, 16, 16)
    assert torch.equal(ours(x), ref(x))  # nn.MultiheadAttention's slow path (grad enabled)
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))  # and its fused inference fast path
    assert n_params(ours) - 2 * arch.layers == n_params(ref)  # only the two step sizes per block are extra


def test_mobilenet_v2_reproduces_torchvision_bit_for_bit() -> None:
    torch.manual_seed(0)
    ref = torchvision.models.mobilenet_v2(weights=None, width_mult=0.5).eval()
    arch = ARCHS["mobilenet_v2_0.5"]
    ours = build_supernet(replace(load_profile("mobilenetv2-fmnist-w"), arch=arch, stem="imagenet", num_classes=1000,
                                  input_shape=(3, 32, 32))).eval()
    load_torchvision_state(ours, ref.state_dict())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))
    residual_blocks = sum(arch.skippable(s, b) for s, d in enumerate(arch.depths) for b in range(d))
    assert n_params(ours) - residual_blocks == n_params(ref)


@pytest.mark.parametrize("name", ["vit_b_16", "vit_b_32", "vit_l_16", "mobilenet_v2"])
def test_torchvision_shapes_map_onto_the_supernet(name: str) -> None:
    """The full torchvision architectures (on the meta device: no memory, no time): every name and shape maps."""
    arch = ARCHS[name]
    shape = (3, 224, 224)
    profile = Profile(name, "", arch, arch.default_stem, 1000, shape, "imagenet", "nefl",
                      (SubmodelSpec(0, 1.0, 1.0, full_steps(arch)),))
    with torch.device("meta"):
        ref = getattr(torchvision.models, name)(weights=None)
        ours = build_supernet(profile)
    load_torchvision_state(ours, ref.state_dict())  # raises on any name or shape mismatch


def test_init_from_file_maps_resizes_and_names_the_first_mismatch(tmp_path: Path) -> None:
    ref = VisionTransformer(image_size=16, patch_size=4, num_layers=3, num_heads=2, hidden_dim=8, mlp_dim=16)
    state = ref.state_dict()
    path = tmp_path / "vit.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    loaded = read_state_file(path)
    # TINY_VIT sees 8x8 inputs (2x2 patches): position embeddings resampled, classifier for 5 classes fresh
    profile = random_ladder(random.Random(0), TINY_VIT)
    supernet = pretrained_supernet_state(profile, loaded, seed=0)
    assert torch.equal(supernet["stages.0.2.attn.v.weight"], state["encoder.layers.encoder_layer_2.self_attention.in_proj_weight"][16:])
    assert torch.equal(supernet["pos_embedding"][0], state["encoder.pos_embedding"][0, 0])  # the class token's row
    assert supernet["pos_embedding"].shape == (5, 8) and supernet["head.weight"].shape == (5, 8)
    layout = Layout.build(profile)
    GlobalState.init(layout, supernet_state=supernet)
    bad = dict(state)
    bad["encoder.layers.encoder_layer_1.mlp.0.weight"] = torch.zeros(3, 8)
    with pytest.raises(ValueError, match=r"shape mismatch for 'encoder.layers.encoder_layer_1.mlp.0.weight'"):
        pretrained_supernet_state(profile, bad)
    with pytest.raises(ValueError, match="'encoder.extra.weight' has no counterpart"):
        pretrained_supernet_state(profile, {**state, "encoder.extra.weight": torch.zeros(1)})
    pth = tmp_path / "m.pth"
    torch.save(torchvision.models.mobilenet_v2(weights=None).state_dict(), pth)
    assert set(read_state_file(pth)) == set(torchvision.models.mobilenet_v2(weights=None).state_dict())
    torch.save({"not": "a state dict", "code": print}, tmp_path / "evil.pth")
    with pytest.raises(ValueError, match="weights_only=True"):
        read_state_file(tmp_path / "evil.pth")


def test_serve_and_simulate_start_from_a_torchvision_file(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from aggregator.cli import app
    from aggregator.server import ServeConfig, load_start

    tv = torchvision.models.resnet18(weights=None).state_dict()
    torch.save(tv, tmp_path / "resnet18.pth")
    start = load_start(ServeConfig(profile="resnet18-cifar10-wd", init_from=str(tmp_path / "resnet18.pth"),
                                   checkpoint_dir=str(tmp_path / "run")))
    w = "stages.3.1.conv2.weight"
    assert torch.equal(start.state.consistent[w], tv["layer4.1.conv2.weight"])
    k = next(k for k, shapes in enumerate(start.layout.sub_shapes) if w in shapes)  # the smallest that has it
    c = start.layout.sub_shapes[k][w]
    assert c[0] < 512 and torch.equal(start.state.extract(start.layout, k)[w], tv["layer4.1.conv2.weight"][: c[0], : c[1]])
    # the wrong architecture's weights: exit 2 and one line naming the first key that does not fit
    result = CliRunner().invoke(app, ["simulate", "--profile", "resnet8-fmnist-w", "--rounds", "1",
                                      "--init-from", str(tmp_path / "resnet18.pth")])
    assert result.exit_code == 2
    assert "shape mismatch for 'bn1.weight': torchvision (64,) vs ours (16,)" in " ".join(result.output.split())


# -- slicing and aggregation ---------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_nefedavg_matches_brute_force_on_random_vit_and_mobilenet_ladders(seed: int) -> None:
    rng = random.Random(seed)
    arch = TINY_VIT if seed % 2 == 0 else TINY_MBV2
    layernorm = "per_submodel" if seed == 2 else "consistent"
    method = replace(get_method("heterofl"), ladder="profile") if seed == 3 else get_method("nefl")
    layout = Layout.build(random_ladder(rng, arch, layernorm=layernorm), method)
    state = GlobalState.init(layout, seed=seed)
    counts = [rng.randint(0, 3) for _ in range(layout.num_submodels)]
    counts[rng.randrange(len(counts))] = 0  # at least one untrained submodel
    ups = random_updates(layout, counts, torch.Generator().manual_seed(seed))
    weighting = "samples" if seed % 2 else "uniform"
    agg = NeFedAvg(layout, weighting)
    for k, d, ns in ups:
        agg.add(k, d, ns)
    assert_state_close(agg.finalize(state), brute_force(layout, state, ups, weighting))


@pytest.mark.parametrize("name", NEW_PROFILES)
def test_every_submodel_tensor_is_a_leading_corner_along_its_first_two_dims(name: str) -> None:
    """What slicing and NeFedAvg's per-channel coverage assume of every family (q, k, v kept apart for it)."""
    layout = Layout.build(load_profile(name))
    for shapes in layout.sub_shapes:
        for n, s in shapes.items():
            g = layout.global_shapes[n]
            assert len(s) == len(g) and all(a <= b for a, b in zip(s, g)) and tuple(s[2:]) == tuple(g[2:]), (n, s, g)


def test_norm_and_step_tensors_are_inconsistent_as_configured() -> None:
    rng = random.Random(1)
    vit = Layout.build(random_ladder(rng, TINY_VIT))
    assert vit.inconsistent == {n for n in vit.global_shapes if n.endswith(".step")}  # LayerNorm consistent
    per_sub = Layout.build(random_ladder(rng, TINY_VIT, layernorm="per_submodel"))
    assert {n for n in per_sub.inconsistent if "ln" in n} == {n for n in per_sub.global_shapes if "ln" in n}
    mbv2 = Layout.build(random_ladder(rng, TINY_MBV2))
    bn = {n for n in mbv2.global_shapes if ".bn." in n}
    assert bn and mbv2.inconsistent == bn | {n for n in mbv2.global_shapes if n.endswith(".step")}
    state = GlobalState.init(per_sub)
    spec = per_sub.profile.submodels[0]
    for n, t in state.inconsistent[0].items():
        if n.endswith(".step"):
            assert t.shape == (2,) and torch.all(t == spec.steps[0][int(n.split(".")[2])])


def _masked_supernet(layout: Layout, state: GlobalState, k: int) -> nn.Module:
    """The full-width supernet computing submodel k: its weights in the leading corners, zeros elsewhere,
    its step sizes (0 for skipped blocks), and LayerNorm statistics over the submodel's width only."""
    model = build_supernet(layout.profile).eval()
    full = {n: torch.zeros(s) for n, s in layout.global_shapes.items()}
    sub = state.extract(layout, k)
    for n, t in sub.items():
        full[n][tuple(slice(0, d) for d in t.shape)] = t
    load_module_state(model, full)

    def masked_ln(m: nn.LayerNorm, inputs: tuple[torch.Tensor], _out: torch.Tensor) -> torch.Tensor:
        d = layout.sub_shapes[k][m.prefix + ".weight"][0]
        x = inputs[0][..., :d]
        y = nn.functional.layer_norm(x, (d,), m.weight[:d], m.bias[:d], m.eps)
        return torch.cat([y, torch.zeros(*y.shape[:-1], m.weight.shape[0] - d)], dim=-1)

    for prefix, m in model.named_modules():
        if isinstance(m, nn.LayerNorm):
            sub_name = prefix + ".weight"
            if sub_name in layout.sub_shapes[k]:
                m.prefix = prefix
                m.register_forward_hook(masked_ln)
    return model


@pytest.mark.parametrize("arch", [TINY_VIT, TINY_MBV2], ids=["vit", "mobilenetv2"])
def test_sliced_submodel_equals_masked_full_width_forward(arch) -> None:
    layout = Layout.build(random_ladder(random.Random(5), arch))
    state = GlobalState.init(layout, seed=5)
    gen = torch.Generator().manual_seed(5)
    for own in state.inconsistent:  # non-trivial BN statistics and step sizes
        for n, t in own.items():
            t.copy_(0.5 + torch.rand(t.shape, generator=gen) if n.endswith(("running_var", ".step")) else
                    0.2 * torch.randn(t.shape, generator=gen))
    for t in state.consistent.values():  # every weight non-trivial (a ViT's classifier starts at zero)
        t.copy_(0.5 * torch.randn(t.shape, generator=gen))
    x = torch.randn(4, 3, 8, 8, generator=gen)
    for k in range(layout.num_submodels):
        sliced = layout.module(k).eval()
        load_module_state(sliced, state.extract(layout, k))
        with torch.no_grad():
            got, want = sliced(x), _masked_supernet(layout, state, k)(x)
        assert want.abs().max() > 1e-3
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


# -- costs -------------------------------------------------------------------------------------------

def hooked_macs(model: nn.Module, shape: tuple[int, ...]) -> int:
    """Conv/linear MACs by running the module; an attention (whose projections run inside torch's
    multi-head attention, not as modules) counts its four projections and two token-by-token products
    from the shapes it really ran with."""
    total = 0

    def hook(m: nn.Module, inp, out: torch.Tensor) -> None:
        nonlocal total
        if isinstance(m, nn.Conv2d):
            total += out.numel() * m.in_channels * m.kernel_size[0] * m.kernel_size[1] // m.groups
        elif isinstance(m, Attention):
            tokens, dim = out.shape[1], out.shape[2]
            total += 4 * tokens * dim * dim + 2 * tokens * tokens * dim
        elif isinstance(m, nn.Linear) and id(m) not in projections:
            total += out.numel() * m.in_features

    projections = {id(lin) for m in model.modules() if isinstance(m, Attention) for lin in m.children()}
    kinds = (nn.Conv2d, nn.Linear, Attention)
    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, kinds)]
    with torch.no_grad():
        model.eval()(torch.zeros(1, *shape))
    for h in handles:
        h.remove()
    return total


@pytest.mark.parametrize("name", ["vit-tiny-fmnist-wd", "mobilenetv2-fmnist-wd", "vit-b16-cifar10-w"])
def test_cost_counts_what_the_module_has_and_computes(name: str) -> None:
    profile = load_profile(name)
    big = profile.arch.name == "vit_b_16"
    for sub in profile.submodels[:1] if big else profile.submodels:
        cost = submodel_cost(profile, sub)
        if big:  # 86M parameters: count them on the meta device only
            with torch.device("meta"):
                assert n_params(build_submodel(profile, sub)) == cost.params
            continue
        model = build_submodel(profile, sub)
        assert n_params(model) == cost.params
        assert hooked_macs(model, profile.input_shape) == cost.macs


def test_profile_show_needs_no_torch() -> None:
    """Costs are torch-free arithmetic: `nefl profile show` runs on the inference-only install."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None; from nefl.cli import app; "
            "app(['profile', 'show', 'vit-tiny-fmnist-wd', '--method', 'depthfl'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[3])
    assert out.returncode == 0 and "305.05K" in out.stdout, out.stderr


def test_ladders_shrink_and_hit_their_targets() -> None:
    for name in NEW_PROFILES:
        p = load_profile(name)
        full = submodel_cost(p, p.submodels[-1]).params
        ratios = [submodel_cost(p, s).params / full for s in p.submodels]
        assert ratios == sorted(ratios) and ratios[-1] == 1.0, name
        assert all(abs(r - s.gamma) < 0.12 for r, s in zip(ratios, p.submodels)), (name, ratios)


# -- profile validation --------------------------------------------------------------------------------

BASE = 'name = "x"\nnum_classes = 10\ninput_shape = [1, 28, 28]\n'


@pytest.mark.parametrize("body,needle", [
    (BASE + 'arch = "mobilenet_v2_0.35"\nstem = "cifar"\n[[submodels]]\ngamma = 1.0\ngamma_w = 1.0\n'
     'steps = [[1], [0, 1], [1, 1, 1], [1, 1, 1, 1], [1, 1, 1], [1, 1, 1], [1]]\n', "block(s) [1]"),
    (BASE + 'arch = "resnet20"\nlayernorm = "per_submodel"\n[[submodels]]\ngamma = 1.0\ngamma_w = 1.0\n', "only ViT"),
    (BASE + 'arch = "vit_tiny_p4"\nlayernorm = "sometimes"\n[[submodels]]\ngamma = 1.0\ngamma_w = 1.0\n', "layernorm"),
    (BASE + 'arch = "vit_tiny_p4"\nstem = "cifar"\n[[submodels]]\ngamma = 1.0\ngamma_w = 1.0\n', "'stem'"),
])
def test_family_specific_profile_errors_name_the_field(body: str, needle: str) -> None:
    import tomllib

    with pytest.raises(ProfileError, match=re.escape(needle)):
        parse_profile(tomllib.loads(body), "x.toml")


def test_depth_prefix_baseline_keeps_blocks_without_residual() -> None:
    layout = Layout.build(load_profile("mobilenetv2-fmnist-wd"), "depthfl")
    for spec in layout.profile.submodels:
        assert all(v == 1 for s, st in enumerate(spec.steps) for b, v in enumerate(st) if not layout.profile.arch.skippable(s, b))


# -- export ----------------------------------------------------------------------------------------------

def profile_toml(profile: Profile) -> str:
    """A profile as the TOML file a checkpoint carries (JSON arrays and strings are valid TOML)."""
    head = {k: v for k, v in profile.to_dict().items() if k not in ("submodels", "description")}
    lines = [f"{k} = {json.dumps(v)}" for k, v in head.items()]
    for sub in profile.to_dict()["submodels"]:
        lines += ["[[submodels]]"] + [f"{k} = {json.dumps(v)}" for k, v in sub.items()]
    return "\n".join(lines) + "\n"


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", [TINY_VIT, TINY_MBV2], ids=["vit", "mobilenetv2"])
def test_every_submodel_exports_to_onnx_with_parity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch) -> None:
    """Small ladders (non-nested depth sets, a per-submodel rewrite each) through the real export: fold,
    ONNX, onnxruntime parity; then each file against the unfolded module at a batch size it never saw."""
    monkeypatch.setitem(ARCHS, arch.name, arch)  # the checkpoint's profile.toml names it
    path = tmp_path / "tiny.toml"
    path.write_text(profile_toml(random_ladder(random.Random(2), arch)))
    layout = Layout.build(load_profile(path))
    state = GlobalState.init(layout, seed=1)
    gen = torch.Generator().manual_seed(1)
    for t in state.consistent.values():  # every weight non-trivial (a ViT's classifier starts at zero)
        t.copy_(0.5 * torch.randn(t.shape, generator=gen))
    for own in state.inconsistent:
        for n, t in own.items():
            t.copy_(0.5 + torch.rand(t.shape, generator=gen) if n.endswith(("running_var", ".step", "bn.weight")) else
                    0.1 * torch.randn(t.shape, generator=gen))
    ckpt_dir = save_checkpoint(tmp_path / "ckpt", state, layout, {"round": 1, "accuracy": [0.5] * layout.num_submodels})
    manifest = export_checkpoint(ckpt_dir, tmp_path / "onnx")
    ckpt = load_checkpoint(ckpt_dir)
    x = torch.randn(3, *layout.profile.input_shape, generator=gen)
    assert [e["index"] for e in manifest["submodels"]] == list(range(layout.num_submodels))
    for entry in manifest["submodels"]:
        model = submodel_module(ckpt, entry["index"])
        assert fold_error(model, fold(model), x) < 1e-5
        with torch.no_grad():
            ref = model(x).numpy()
        out = session(tmp_path / "onnx" / entry["file"]).run(None, {"input": x.numpy()})[0]
        assert np.abs(ref).max() > 1e-2 and np.abs(out - ref).max() < 1e-4
        assert entry["flops"] == submodel_cost(layout.profile, layout.profile.submodels[entry["index"]]).macs
