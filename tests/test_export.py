"""ONNX export: folding is exact, every submodel exports and matches torch, failures write no manifest."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from typer.testing import CliRunner

import export.onnx_export as onnx_export
from export.cli import app
from export.fold import fold, fold_error
from export.manifest import sha256_file
from export.onnx_export import export_checkpoint, submodel_module
from export.parity import reference_data, session
from nefl.checkpoint import load_checkpoint, save_checkpoint
from nefl.cost import submodel_cost
from nefl.data import DatasetUnavailable, load_dataset
from nefl.profile import load_profile
from nefl.state import GlobalState, Layout

torch.set_num_threads(1)


def _randomise_inconsistent(state: GlobalState, seed: int) -> None:
    """Non-trivial BN statistics/affines and step sizes, so folding has something to get wrong."""
    g = torch.Generator().manual_seed(seed)
    for own in state.inconsistent:
        for name, t in own.items():
            if name.endswith(("running_var", ".weight")):  # BN variances and scales: positive
                t.copy_(0.5 + torch.rand(t.shape, generator=g))
            elif name.endswith(".step"):
                t.fill_(0.3 + float(torch.rand(1, generator=g)))
            else:
                t.copy_(0.3 * torch.randn(t.shape, generator=g))


def make_checkpoint(directory: Path, profile: str, seed: int = 0, randomise: bool = True,
                    meta: dict | None = None) -> Path:
    layout = Layout.build(load_profile(profile))
    state = GlobalState.init(layout, seed)
    if randomise:
        _randomise_inconsistent(state, seed)
    return save_checkpoint(directory, state, layout, meta or {"round": 0})


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    root = tmp_path_factory.mktemp("export")
    ckpt = make_checkpoint(root / "ckpt", "resnet20-fmnist-w", meta={"round": 7, "accuracy": [0.1, 0.2, 0.3, 0.4, 0.5]})
    manifest = export_checkpoint(ckpt, root / "onnx")
    return ckpt, root / "onnx", manifest


@pytest.mark.parametrize("profile", ["resnet20-fmnist-wd", "resnet20-fmnist-w"])
def test_fold_matches_module_and_removes_every_bn(profile: str) -> None:
    layout = Layout.build(load_profile(profile))
    state = GlobalState.init(layout, 3)
    _randomise_inconsistent(state, 3)
    ckpt = type("C", (), {"layout": layout, "state": state})()
    x = torch.randn(4, *layout.profile.input_shape)
    for k in (0, layout.num_submodels - 1):  # the -wd ladder's first rung skips blocks, some with projections
        model = submodel_module(ckpt, k)
        folded = fold(model)
        assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in folded.modules())
        assert fold_error(model, folded, x) < 1e-5
        assert model(x).abs().max() > 1e-2  # the comparison is between real, non-vanishing logits


def test_fold_refuses_training_mode() -> None:
    layout = Layout.build(load_profile("resnet20-fmnist-w"))
    with pytest.raises(ValueError, match="eval-mode"):
        fold(layout.module(0).train())


@pytest.mark.timeout(180)
def test_every_submodel_exports_checks_and_matches_torch(exported: tuple[Path, Path, dict]) -> None:
    ckpt_dir, out, manifest = exported
    ckpt = load_checkpoint(ckpt_dir)
    profile = ckpt.layout.profile
    assert [e["index"] for e in manifest["submodels"]] == list(range(profile.num_submodels))
    inputs = reference_data(profile, None, 5).inputs
    for entry in manifest["submodels"]:
        k = entry["index"]
        path = out / entry["file"]
        model_proto = onnx.load(str(path))
        onnx.checker.check_model(model_proto, full_check=True)
        props = {p.key: p.value for p in model_proto.metadata_props}
        assert props["profile_hash"] == profile.hash and props["submodel_index"] == str(k)
        assert props["flops"] == str(submodel_cost(profile, profile.submodels[k]).macs)
        assert props["source_round"] == "7" and float(props["accuracy"]) == pytest.approx(0.1 * (k + 1))
        assert entry["parity_max_diff"] < 1e-4 and entry["sha256"] == sha256_file(path)
        # an odd batch size the exporter never saw: the batch axis is really dynamic
        ort_out = session(path).run(None, {"input": inputs})[0]
        with torch.no_grad():
            ref = submodel_module(ckpt, k)(torch.from_numpy(inputs)).numpy()
        assert ort_out.shape == (5, profile.num_classes)
        assert np.abs(ort_out - ref).max() < 1e-4
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk["format_version"] == 1 and on_disk["profile_hash"] == profile.hash
    assert on_disk["source_round"] == 7 and on_disk["input"]["shape"] == [1, 28, 28]
    assert on_disk["input"]["mean"] == [0.2860] and on_disk["output"]["class_names"][0] == "T-shirt/top"


def test_parity_failure_writes_no_manifest_and_exits_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", "resnet20-fmnist-w")
    real_export = onnx_export.export_onnx

    def export_with_wrong_bias(model: torch.nn.Module, path: Path, example: torch.Tensor, metadata: dict) -> None:
        with torch.no_grad():
            model.fc.bias.add_(1e-3)  # a real numerical mismatch, just above the 1e-4 tolerance
        real_export(model, path, example, metadata)

    monkeypatch.setattr(onnx_export, "export_onnx", export_with_wrong_bias)
    result = CliRunner().invoke(app, ["onnx", "--checkpoint", str(ckpt), "--out", str(tmp_path / "out"),
                                      "--submodels", "1"])
    assert result.exit_code == 1, result.output
    assert "parity failed" in result.output and "submodel 1" in result.output
    assert (tmp_path / "out" / "submodel-1.onnx").exists()
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_cli_rejects_a_missing_checkpoint(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["onnx", "--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "no checkpoint here" in " ".join(result.output.split())


def _fashion_mnist_available() -> bool:
    try:
        load_dataset("fashion-mnist", train=False, download=False)
    except DatasetUnavailable:
        return False
    return True


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(not _fashion_mnist_available(), reason="int8 calibration needs the Fashion-MNIST test split")
def test_int8_quantization_records_accuracy_delta(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", "resnet20-fmnist-w")
    manifest = export_checkpoint(ckpt, tmp_path / "out", quantize="int8", submodels=[0])
    (entry,) = manifest["submodels"]
    q = entry["int8"]
    path = tmp_path / "out" / q["file"]
    assert q["file"] == "submodel-1.int8.onnx" and q["sha256"] == sha256_file(path)
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    assert q["eval_images"] == 2000
    assert q["accuracy_delta"] == pytest.approx(q["accuracy_int8"] - q["accuracy_fp32"])
    # int8 must compute nearly the same function: predictions agree with fp32 on most images
    data = reference_data(load_checkpoint(ckpt).layout.profile, None, 500)
    fp32 = session(tmp_path / "out" / entry["file"]).run(None, {"input": data.inputs})[0].argmax(1)
    int8 = session(path).run(None, {"input": data.inputs})[0].argmax(1)
    assert (fp32 == int8).mean() > 0.9
