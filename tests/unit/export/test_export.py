"""ONNX export: folding is exact, every submodel exports and matches torch, failures write no manifest."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np
import onnx
import pytest
import torch
from typer.testing import CliRunner

import export.onnx_export as onnx_export
from export.cli import app
from export.fold import fold, fold_error
from export.onnx_export import export_checkpoint, submodel_module
from export.parity import PARITY_ATOL, PARITY_RTOL, ParityError, compare, reference_data, session
from nefl.nested.checkpoint import load_checkpoint, save_checkpoint
from nefl.nested.cost import submodel_cost
from nefl.nested.data import DatasetUnavailable, load_dataset
from nefl.nested.profile import load_profile
from nefl.nested.state import GlobalState, Layout
from nefl.protocol.manifest import FORMAT_VERSION, MANIFEST_FILE, read_manifest, sha256_file, write_manifest

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
    ckpt = make_checkpoint(root / "ckpt", "resnet20-fmnist-w", meta={"round": 7, "accuracy": [0.5, 0.6, 0.7, 0.8, 0.9]})
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


@pytest.mark.timeout(360)
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
        assert props["source_round"] == "7" and float(props["accuracy"]) == pytest.approx(0.5 + 0.1 * k)
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
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "no checkpoint here" in said
    assert "check --checkpoint" in said and "--checkpoint-dir" not in said  # this command's own option


def _fashion_mnist_available() -> bool:
    try:
        load_dataset("fashion-mnist", train=False, download=False)
    except DatasetUnavailable:
        return False
    return True


@pytest.mark.slow
@pytest.mark.timeout(360)
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


# --- parity: a bound relative to the logits' magnitude -------------------------------------------------------------


def test_float32_rounding_of_large_logits_passes_and_real_errors_fail() -> None:
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(8, 512)), 15 * rng.normal(size=(512, 10))
    exact = x @ w  # logits of several hundred
    single = (x.astype(np.float32) @ w.astype(np.float32)).astype(np.float64)
    assert np.abs(exact).max() > 300
    assert compare(single, exact).max_diff > PARITY_ATOL  # the old absolute bound rejected a correct computation
    assert compare(single, exact).ok
    wrong = single.copy()
    wrong[3, 7] += 1e-3 * np.abs(exact).max()  # off by 0.1% of the largest logit
    assert not compare(wrong, exact).ok
    small = exact / np.abs(exact).max()  # logits of magnitude 1: the absolute part still bounds them
    assert not compare(small + 5e-4, small).ok and compare(small + 5e-5, small).ok


def _scaled_fc(scale: float):
    """submodel_module with its classifier scaled up: a correct model whose logits are in the hundreds."""
    real = onnx_export.submodel_module

    def scaled(ckpt, k: int) -> torch.nn.Module:
        model = real(ckpt, k)
        with torch.no_grad():
            model.fc.weight.mul_(scale)
            model.fc.bias.mul_(scale)
        return model

    return scaled


@pytest.mark.timeout(360)
def test_submodel_with_large_logits_exports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", "resnet20-fmnist-w")
    scaled = _scaled_fc(1000.0)
    monkeypatch.setattr(onnx_export, "submodel_module", scaled)
    (entry,) = export_checkpoint(ckpt, tmp_path / "out", submodels=[0])["submodels"]
    inputs = reference_data(load_checkpoint(ckpt).layout.profile, None, onnx_export.PARITY_IMAGES).inputs
    with torch.no_grad():
        largest = float(scaled(load_checkpoint(ckpt), 0)(torch.from_numpy(inputs)).abs().max())
    assert largest > 100
    assert entry["parity_max_diff"] <= PARITY_ATOL + PARITY_RTOL * largest
    assert (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.timeout(360)
def test_wrong_export_with_large_logits_still_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", "resnet20-fmnist-w")
    real_export = onnx_export.export_onnx

    def export_with_wrong_bias(model: torch.nn.Module, path: Path, example: torch.Tensor, metadata: dict) -> None:
        with torch.no_grad():
            model.fc.bias.add_(1.0)  # off by 1 on logits of hundreds: far beyond float32 rounding
        real_export(model, path, example, metadata)

    monkeypatch.setattr(onnx_export, "submodel_module", _scaled_fc(1000.0))
    monkeypatch.setattr(onnx_export, "export_onnx", export_with_wrong_bias)
    with pytest.raises(ParityError, match="submodel 1: onnxruntime differs from torch"):
        export_checkpoint(ckpt, tmp_path / "out", submodels=[0])
    assert not (tmp_path / "out" / "manifest.json").exists()


# --- manifest: one schema, written and read back ------------------------------------------------------------------


def test_manifest_round_trips_through_the_shared_schema(exported: tuple[Path, Path, dict]) -> None:
    _, out, manifest = exported
    read = read_manifest(out)
    assert msgspec.to_builtins(read) == manifest
    assert read.format_version == FORMAT_VERSION and read.parity.rtol == PARITY_RTOL
    assert all(e.int8 is None for e in read.submodels) and "int8" not in manifest["submodels"][0]


def test_manifest_of_an_export_before_rtol_still_reads(exported: tuple[Path, Path, dict], tmp_path: Path) -> None:
    on_disk = json.loads((exported[1] / MANIFEST_FILE).read_text())
    del on_disk["parity"]["rtol"]
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(on_disk))
    assert read_manifest(tmp_path).parity.rtol == 0.0


def test_invalid_manifest_is_never_written(exported: tuple[Path, Path, dict], tmp_path: Path) -> None:
    manifest = read_manifest(exported[1])
    bad = msgspec.structs.replace(manifest, submodels=[msgspec.structs.replace(manifest.submodels[0], gamma=1.5)])
    with pytest.raises(ValueError, match=r"invalid manifest.*\$.submodels\[0\].gamma"):
        write_manifest(tmp_path, bad)
    with pytest.raises(ValueError, match="not a plain path inside the export directory"):
        msgspec.structs.replace(manifest.submodels[0], file="../evil.onnx")
    assert not (tmp_path / MANIFEST_FILE).exists()


def test_untrained_submodels_are_skipped_unless_asked_for(tmp_path: Path) -> None:
    """NeFL's promise is that every submodel is usable: one that never trained (or is at chance) must not
    reach a device silently, where it would answer exactly when the device is loaded."""
    from nefl.nested.checkpoint import UPDATES_TOTAL_KEY
    from nefl.protocol.manifest import untrained_reason

    assert untrained_reason(0, None, 10) == "never trained (0 federated updates)"
    assert "within 0.05 of chance" in untrained_reason(4, 0.12, 10) and untrained_reason(4, 0.16, 10) is None
    assert untrained_reason(None, None, 10) is None  # nothing recorded (a fresh or foreign checkpoint): keep it
    meta = {"round": 3, "accuracy": [0.09, 0.5, 0.6], UPDATES_TOTAL_KEY: [0, 2, 3]}
    ckpt = make_checkpoint(tmp_path / "ckpt", "resnet20-fmnist-w", meta=meta)
    manifest = export_checkpoint(ckpt, tmp_path / "out", submodels=[0, 1, 2])
    assert [e["index"] for e in manifest["submodels"]] == [1, 2]
    assert [e["updates"] for e in manifest["submodels"]] == [2, 3]
    everything = export_checkpoint(ckpt, tmp_path / "all", submodels=[0, 1, 2], include_untrained=True)
    assert [e["index"] for e in everything["submodels"]] == [0, 1, 2]
    with pytest.raises(ValueError, match="no trained submodel to export"):
        export_checkpoint(ckpt, tmp_path / "none", submodels=[0])

    from edge_client.runtime import AdaptiveRuntime, ModelsError

    runtime = AdaptiveRuntime(tmp_path / "all", threads=1, calibration_runs=1)
    assert [s.index for s in runtime.submodels] == [1, 2]  # the untrained one is not used by default
    both = AdaptiveRuntime(tmp_path / "all", threads=1, calibration_runs=1, include_untrained=True)
    assert [s.index for s in both.submodels] == [0, 1, 2]
    only_untrained = export_checkpoint(ckpt, tmp_path / "one", submodels=[0], include_untrained=True)
    assert only_untrained["submodels"][0]["updates"] == 0
    with pytest.raises(ModelsError, match="no trained submodel"):
        AdaptiveRuntime(tmp_path / "one", threads=1, calibration_runs=1)
