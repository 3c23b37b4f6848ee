import math
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from nefl.aggregation.nefedavg import NeFedAvg
from nefl.cli import app
from nefl.nested.arch import ARCHS
from nefl.nested.cost import full_cost, submodel_cost
from nefl.nested.methods import METHODS, apply_method
from nefl.nested.profile import ProfileError, list_profiles, load_profile, resolve_profile_path
from nefl.nested.state import Layout

PAPER = ["resnet18-cifar10-d", "resnet18-cifar10-wd", "resnet34-cifar10-d", "resnet34-cifar10-wd",
         "resnet56-cifar10-d", "resnet56-cifar10-do", "resnet56-cifar10-wd", "resnet110-cifar10-d",
         "resnet110-cifar10-wd", "resnet110-cifar10-d-sq", "resnet110-cifar10-wd-sq"]


def test_every_shipped_profile_loads_and_builds() -> None:
    names = list_profiles()
    assert set(PAPER) <= set(names)
    assert {"resnet20-fmnist-w", "resnet20-fmnist-d", "resnet20-fmnist-wd"} <= set(names)
    for name in names:
        p = load_profile(name)
        last = p.submodels[-1]
        assert last.gamma_w == 1.0 and all(v == 1 for st in last.steps for v in st), name
        Layout.build(p)  # every submodel builds (on the meta device)


@pytest.mark.parametrize("name", PAPER + ["resnet18-cifar10-w", "resnet110-cifar10-w-sq"])
def test_paper_ladders_hit_their_target_size(name: str) -> None:
    p = load_profile(name)
    total = full_cost(p).params
    for s in p.submodels:
        ratio = submodel_cost(p, s).params / total
        assert abs(ratio - s.gamma) < 0.06, (name, s.gamma, ratio)  # the paper's own tables are this close


def test_width_ladders_use_sqrt_gamma() -> None:
    p = load_profile("resnet56-cifar10-w")
    assert [s.gamma_w for s in p.submodels] == [round(math.sqrt(s.gamma), 4) for s in p.submodels]


def test_ode_profile_keeps_compensating_steps() -> None:
    p = load_profile("resnet56-cifar10-do")
    assert p.submodels[0].steps[0][:3] == (1.0, 8.0, 0.0)


def _write(tmp_path, body: str):
    f = tmp_path / "bad.toml"
    f.write_text(body)
    return f


BASE = 'name = "x"\narch = "resnet20"\nnum_classes = 10\ninput_shape = [1, 28, 28]\n'


@pytest.mark.parametrize("body,needle", [
    (BASE + '[[submodels]]\ngamma = 0.5\ngamma_w = 0.5\nsteps = [[1, 1], [1, 1, 1], [1, 1, 1]]\n',
     "submodel 1: field 'steps', stage 1: resnet20 has 3 blocks"),
    (BASE + '[[submodels]]\ngamma = 0.5\ngamma_w = 1.5\n', "submodel 1: field 'gamma_w': must be a number in (0, 1]"),
    (BASE + '[[submodels]]\ngamma = 0.5\ngamma_w = 0.5\n[[submodels]]\ngamma = 0.2\ngamma_w = 0.5\n',
     "submodel 2: field 'gamma': submodels must be ordered"),
    (BASE + '[[submodels]]\ngamma = 0.5\ngamma_w = 0.5\nsteps = [[1, -1, 1], [1, 1, 1], [1, 1, 1]]\n', "steps must be finite numbers >= 0"),
    (BASE + '[[submodels]]\ngamma = 0.5\n', "submodel 1: missing field 'gamma_w'"),
    (BASE.replace("resnet20", "resnet9000") + '[[submodels]]\ngamma = 1\ngamma_w = 1\n', "field 'arch': unknown architecture"),
    (BASE + 'method = "magic"\n[[submodels]]\ngamma = 1\ngamma_w = 1\n', "field 'method': must be one of"),
    (BASE + 'colour = 1\n[[submodels]]\ngamma = 1\ngamma_w = 1\n', "unknown field(s) ['colour']"),
    ('name = "x"\narch = ', "not valid TOML"),
])
def test_validation_names_file_submodel_and_field(tmp_path, body: str, needle: str) -> None:
    f = _write(tmp_path, body)
    with pytest.raises(ProfileError) as e:
        load_profile(f)
    assert str(f) in str(e.value) and needle in str(e.value)


def test_unknown_profile_name_lists_shipped_ones() -> None:
    with pytest.raises(ProfileError, match="resnet20-fmnist-wd"):
        load_profile("no-such-ladder")


def test_method_presets_derive_their_ladders() -> None:
    p = load_profile("resnet20-fmnist-wd")
    for name, method in METHODS.items():
        ladder = apply_method(p, method)
        assert ladder.method == name and len(ladder.submodels) == 5
        if method.ladder == "width":
            assert all(all(v == 1 for st in s.steps for v in st) for s in ladder.submodels)
        if method.ladder == "depth_prefix":
            for s in ladder.submodels:
                flat = [v for st in s.steps for v in st]
                n = int(sum(flat))
                assert s.gamma_w == 1 and flat == [1.0] * n + [0.0] * (len(flat) - n)  # contiguous prefix
    assert apply_method(p, METHODS["nefl"]).submodels == p.submodels


@pytest.mark.parametrize("make, needle", [
    (lambda: replace(METHODS["nefl"], bn="per-submodel"), "method 'nefl': bn must be one of 'per_submodel', 'shared_static'"),
    (lambda: replace(METHODS["depthfl"], ladder="depth"), "method 'depthfl': ladder must be one of 'profile', 'width'"),
    (lambda: replace(ARCHS["resnet20"], block="Basic"), "architecture 'resnet20': block must be one of 'basic', 'bottleneck'"),
    (lambda: NeFedAvg(Layout.build(load_profile("resnet8-fmnist-w")), "sample"), "weighting must be one of 'uniform', 'samples'"),
], ids=["bn", "ladder", "block", "weighting"])
def test_a_misspelt_switch_is_refused_not_read_as_another_branch(make, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        make()


def test_profile_show_prints_the_table() -> None:
    result = CliRunner().invoke(app, ["profile", "show", "resnet20-fmnist-wd"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for col in ("gamma", "params ratio", "FLOPs"):
        assert col in result.output
    assert "0.203" in result.output  # submodel 1's actual parameter ratio
    bad = CliRunner().invoke(app, ["profile", "show", "nope"])
    assert bad.exit_code == 2


def test_a_profile_typo_names_the_nearest_shipped_profiles():
    with pytest.raises(ProfileError, match=r"did you mean resnet20-fmnist-w\b"):
        resolve_profile_path("resnet20-fmnsit-w")
    with pytest.raises(ProfileError) as e:
        resolve_profile_path("zzzz")
    assert "did you mean" not in str(e.value) and "resnet20-fmnist-w" in str(e.value)
