import pytest
import torch
import torchvision
from torch import nn

from nefl.nested.arch import ARCHS
from nefl.nested.cost import full_cost, submodel_cost
from nefl.nested.models import NestedResNet, build_submodel, full_steps, load_torchvision_state
from nefl.nested.profile import load_profile, scaled
from nefl.nested.state import GlobalState, Layout, load_module_state
from tests.harness.helpers import TINY_BASIC, tiny_profile


def hooked_macs(model: nn.Module, shape: tuple[int, ...]) -> int:
    """Count conv/linear multiply-accumulates by running the module (independent of nefl.nested.cost)."""
    total = 0

    def hook(m: nn.Module, _inp, out: torch.Tensor) -> None:
        nonlocal total
        if isinstance(m, nn.Conv2d):
            total += out.numel() * m.in_channels * m.kernel_size[0] * m.kernel_size[1] // m.groups
        else:
            total += out.numel() * m.in_features

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    model.eval()
    with torch.no_grad():
        model(torch.zeros(1, *shape))
    for h in handles:
        h.remove()
    return total


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name,builder", [("resnet18", torchvision.models.resnet18),
                                          ("resnet34", torchvision.models.resnet34),
                                          ("resnet50", torchvision.models.resnet50)])
def test_full_submodel_reproduces_torchvision_exactly(name: str, builder) -> None:
    torch.manual_seed(0)
    ref = builder(weights=None).eval()
    ours = NestedResNet(ARCHS[name], "imagenet", 3, 1000, 1.0, full_steps(ARCHS[name])).eval()
    load_torchvision_state(ours, ref.state_dict())
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))
    assert n_params(ours) - ARCHS[name].num_blocks == n_params(ref)  # only the step scalars are extra


def test_wide_resnet_matches_torchvision_shapes() -> None:
    with torch.device("meta"):
        ref = torchvision.models.wide_resnet101_2(weights=None)
        ours = NestedResNet(ARCHS["wide_resnet101_2"], "imagenet", 3, 1000, 1.0, full_steps(ARCHS["wide_resnet101_2"]))
    load_torchvision_state(ours, ref.state_dict())  # raises on any name or shape mismatch


def test_pretrained_state_loads_into_global_state_with_other_classes() -> None:
    """ImageNet weights into a 10-class CIFAR-stem profile: backbone copied, classifier fresh."""
    profile = load_profile("resnet18-cifar10-wd")
    layout = Layout.build(profile)
    full = NestedResNet(profile.arch, "imagenet", 3, 10, 1.0, full_steps(profile.arch))
    tv = torchvision.models.resnet18(weights=None).state_dict()
    load_torchvision_state(full, tv)
    state = GlobalState.init(layout, supernet_state=full.state_dict())
    w = "stages.2.1.conv2.weight"
    assert torch.equal(state.consistent[w], tv["layer3.1.conv2.weight"])
    sub = state.extract(layout, 0)
    c = layout.sub_shapes[0][w]
    assert torch.equal(sub[w], tv["layer3.1.conv2.weight"][: c[0], : c[1]])
    # per-submodel (inconsistent) BN starts as the slice of the pretrained BN
    var = sub["stages.0.0.bn1.running_var"]
    assert len(var) < 64 and torch.equal(var, tv["layer1.0.bn1.running_var"][: len(var)])


def test_small_submodel_has_the_size_its_spec_implies() -> None:
    profile = load_profile("resnet20-fmnist-wd")
    sub = profile.submodels[0]
    model = build_submodel(profile, sub)
    cost = submodel_cost(profile, sub)
    assert n_params(model) == cost.params
    assert hooked_macs(model, profile.input_shape) == cost.macs
    ratio = cost.params / full_cost(profile).params
    assert abs(ratio - sub.gamma) < 0.05
    # every hidden width is ceil(C * gamma_w): stem, a present block, the classifier input
    c16, c64 = scaled(16, sub.gamma_w), scaled(64, sub.gamma_w)
    assert model.stem.conv.weight.shape == (c16, 1, 3, 3)
    assert model.fc.weight.shape == (10, c64)


def test_hand_computed_tiny_submodel() -> None:
    """gamma_w 0.5 of the tiny net: widths 2 (stage 1) and 4 (stage 2), second block of each stage skipped."""
    profile = tiny_profile([(0.3, 0.5, ((1.0, 0.0), (1.0, 0.0))), (1.0, 1.0, ((1.0, 1.0), (1.0, 1.0)))])
    model = build_submodel(profile, profile.submodels[0])
    expected = (3 * 2 * 9 + 4  # stem conv + bn
                + (2 * 2 * 9 + 4) * 2 + 1  # stage 1 block 1: two convs + bns + step
                + (2 * 4 * 1 + 8)  # stage 2 block 1 shortcut conv + bn
                + (2 * 4 * 9 + 8) + (4 * 4 * 9 + 8) + 1  # stage 2 block 1 branch + step
                + 4 * 5 + 5)  # classifier
    assert n_params(model) == expected == submodel_cost(profile, profile.submodels[0]).params


def test_skipped_blocks_have_no_parameters_and_no_compute() -> None:
    arch = ARCHS["resnet20"]
    full = NestedResNet(arch, "cifar", 1, 10, 1.0, full_steps(arch))
    steps = ((1.0, 0.0, 1.0), (0.0, 1.0, 1.0), (1.0, 1.0, 1.0))
    skipped = NestedResNet(arch, "cifar", 1, 10, 1.0, steps)
    branch = lambda b: sum(p.numel() for n, p in b.named_parameters() if not n.startswith("shortcut"))  # noqa: E731
    assert n_params(full) - n_params(skipped) == branch(full.stages[0][1]) + branch(full.stages[1][0])
    assert list(skipped.stages[0][1].parameters()) == []
    # a skipped downsampling block keeps exactly its 1x1 shortcut conv + BN
    down = skipped.stages[1][0]
    assert [n for n, _ in down.named_parameters()] == ["shortcut.conv.weight", "shortcut.bn.weight", "shortcut.bn.bias"]
    assert down(torch.randn(2, 16, 8, 8)).shape == (2, 32, 4, 4)
    assert hooked_macs(skipped, (1, 28, 28)) < hooked_macs(full, (1, 28, 28))


def test_step_size_scales_the_residual_branch() -> None:
    arch = TINY_BASIC
    a = NestedResNet(arch, "cifar", 3, 5, 1.0, ((1.0, 1.0), (1.0, 1.0))).eval()
    b = NestedResNet(arch, "cifar", 3, 5, 1.0, ((1.0, 2.0), (1.0, 1.0))).eval()
    b.load_state_dict({k: v for k, v in a.state_dict().items() if k != "stages.0.1.step"}, strict=False)
    x = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        ya = a.stages[0][1](x)
        yb = b.stages[0][1](x)
        f = a.stages[0][1].branch(x)
    assert torch.allclose(ya, torch.relu(x + f)) and torch.allclose(yb, torch.relu(x + 2 * f))


def test_learnable_vs_fixed_steps() -> None:
    profile = load_profile("resnet20-fmnist-wd")
    for method, learnable in (("nefl", True), ("nefl-nl", False)):
        model = Layout.build(profile, method).module(0)
        steps = [p for n, p in model.named_parameters() if n.endswith(".step")]
        assert steps and all(p.requires_grad == learnable for p in steps)


def test_extracted_full_submodel_equals_supernet() -> None:
    profile = load_profile("resnet20-fmnist-w")
    layout = Layout.build(profile)
    state = GlobalState.init(layout, seed=0)
    model = layout.module(layout.num_submodels - 1).eval()
    load_module_state(model, state.extract(layout, layout.num_submodels - 1))
    torch.manual_seed(0)
    ref = NestedResNet(profile.arch, "cifar", 1, 10, 1.0, full_steps(profile.arch)).eval()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


def test_submodel_is_physically_smaller_than_masking() -> None:
    profile = load_profile("resnet20-fmnist-w")
    layout = Layout.build(profile)
    small, large = layout.module(0), layout.module(layout.num_submodels - 1)
    assert n_params(small) < 0.3 * n_params(large)
    assert hooked_macs(small, profile.input_shape) < 0.3 * hooked_macs(large, profile.input_shape)
