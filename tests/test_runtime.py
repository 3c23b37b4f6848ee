"""Adaptive ONNX runtime: integrity checks, load-driven submodel choice, HTTP API, CLI."""

from __future__ import annotations

import io
import json
import shutil
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from edge_client.cli import app
from edge_client.http_api import make_server
from edge_client.runtime import AdaptiveRuntime, ImageError, ModelsError
from export.onnx_export import export_checkpoint, submodel_module
from nefl.checkpoint import load_checkpoint, save_checkpoint
from nefl.profile import load_profile
from nefl.state import GlobalState, Layout

torch.set_num_threads(1)
GIB = 1 << 30
IDLE = lambda: (0.0, 8 * GIB)  # noqa: E731


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Three rungs of the ladder (smallest, middle, largest) keep the export part of these tests short."""
    root = tmp_path_factory.mktemp("runtime")
    layout = Layout.build(load_profile("resnet20-fmnist-w"))
    ckpt = save_checkpoint(root / "ckpt", GlobalState.init(layout, 1), layout, {"round": 0})
    export_checkpoint(ckpt, root / "onnx", submodels=[0, 2, 4])
    return ckpt, root / "onnx"


def _runtime(models_dir: Path, probe=IDLE, budget: float = 1000.0) -> AdaptiveRuntime:
    return AdaptiveRuntime(models_dir, probe=probe, latency_budget_ms=budget, threads=1, calibration_runs=3)


def _png(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def test_predictions_match_the_torch_module(models: tuple[Path, Path]) -> None:
    ckpt_dir, models_dir = models
    rt = _runtime(models_dir)
    images = np.random.default_rng(0).integers(0, 256, (4, 1, 28, 28), dtype=np.uint8)
    result = rt.predict(images)
    assert result.submodel == 4 and result.gamma == 1.0 and result.latency_ms > 0
    x = (torch.from_numpy(images).float() / 255 - 0.2860) / 0.3530
    with torch.no_grad():
        ref = torch.softmax(submodel_module(load_checkpoint(ckpt_dir), 4)(x), 1).numpy()
    assert np.abs(result.probabilities - ref).max() < 1e-4
    assert result.labels == ref.argmax(1).tolist()


def test_tampered_file_is_refused(models: tuple[Path, Path], tmp_path: Path) -> None:
    copy = tmp_path / "onnx"
    shutil.copytree(models[1], copy)
    data = bytearray((copy / "submodel-3.onnx").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (copy / "submodel-3.onnx").write_bytes(bytes(data))
    with pytest.raises(ModelsError, match="submodel-3.onnx: sha256 does not match"):
        _runtime(copy)


def test_missing_manifest_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ModelsError, match="nefl-export onnx"):
        _runtime(tmp_path)


def test_no_load_picks_the_largest_and_high_load_a_smaller_one(models: tuple[Path, Path]) -> None:
    idle = _runtime(models[1])
    budget = 3 * idle.calibrated_ms[-1]
    idle.latency_budget_ms = budget
    assert idle.predict(np.zeros((1, 28, 28), np.uint8)).submodel == 4
    busy = _runtime(models[1], probe=lambda: (100.0, 8 * GIB), budget=budget)
    result = busy.predict(np.zeros((1, 28, 28), np.uint8))
    assert result.submodel < 4
    assert "cpu 100%" in result.reason


def test_tight_budget_falls_back_to_the_smallest(models: tuple[Path, Path]) -> None:
    result = _runtime(models[1], budget=1e-6).predict(np.zeros((2, 1, 28, 28), np.uint8))
    assert result.submodel == 0 and result.reason.startswith("fallback to smallest")
    assert len(result.labels) == 2


def test_low_memory_headroom_picks_a_smaller_submodel(models: tuple[Path, Path]) -> None:
    rt = _runtime(models[1])
    largest, smallest = rt.submodels[-1], rt.submodels[0]
    available = rt.memory_reserve_bytes + (largest.memory_bytes(1) + smallest.memory_bytes(1)) // 2
    rt._probe = lambda: (0.0, available)
    rt._last_probe = None
    assert rt.predict(np.zeros((1, 28, 28), np.uint8)).submodel < 4


def test_observed_latency_corrects_the_prediction(models: tuple[Path, Path]) -> None:
    rt = _runtime(models[1])
    rt.calibrated_ms = [ms / 100 for ms in rt.calibrated_ms]  # pretend calibration was far too optimistic
    for _ in range(5):
        rt.predict(np.zeros((1, 28, 28), np.uint8))
    assert rt.correction > 5  # the EMA has learned that runs take much longer than predicted


def test_bad_pixels_are_rejected(models: tuple[Path, Path]) -> None:
    rt = _runtime(models[1])
    with pytest.raises(ImageError, match="uint8 pixels of shape"):
        rt.predict(np.zeros((3, 32, 32), np.uint8))
    with pytest.raises(ImageError, match="not a readable image"):
        rt.decode_image(b"definitely not a png")


def _request(url: str, data: bytes | None = None, method: str | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "image/png"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.timeout(60)
def test_http_server_answers_and_rejects_bad_input(models: tuple[Path, Path]) -> None:
    rt = _runtime(models[1])
    server = make_server(rt, "127.0.0.1", 0, max_body=20_000)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        image = np.random.default_rng(2).integers(0, 256, (28, 28), dtype=np.uint8)
        status, body = _request(f"{base}/predict", _png(image))
        assert status == 200 and body["submodel"] == 4 and len(body["probabilities"]) == 10
        expected = rt.predict(image[None]).labels[0]
        assert body["class"] == expected and body["class_name"] == rt.class_names[expected]
        # an RGB image of another size is converted to the model's channels and size
        status, body = _request(f"{base}/predict", _png(np.full((40, 50, 3), 200, np.uint8)))
        assert status == 200 and 0 <= body["class"] < 10
        assert _request(f"{base}/health")[0] == 200
        status, body = _request(f"{base}/models")
        assert status == 200 and [s["submodel"] for s in body["submodels"]] == [0, 2, 4]
        status, body = _request(f"{base}/predict", b"this is not an image")
        assert status == 400 and "not a readable image" in body["error"]
        status, body = _request(f"{base}/nope")
        assert status == 404 and "POST /predict" in body["error"]
        status, body = _request(f"{base}/predict", b"\0" * 30_000)
        assert status == 413 and "limit" in body["error"]
        status, body = _request(f"{base}/predict", b"", method="POST")
        assert status == 400 and "empty body" in body["error"]
        assert _request(f"{base}/health")[0] == 200  # still serving after all of the above
    finally:
        server.shutdown()
        server.server_close()


def test_infer_cli_prints_prediction_and_submodel(models: tuple[Path, Path], tmp_path: Path) -> None:
    img = tmp_path / "shirt.png"
    img.write_bytes(_png(np.random.default_rng(3).integers(0, 256, (28, 28), dtype=np.uint8)))
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"garbage")
    runner = CliRunner()
    ok = runner.invoke(app, ["infer", "--models", str(models[1]), "--latency-budget-ms", "1000", "--threads", "1", str(img)])
    assert ok.exit_code == 0, ok.output
    assert "shirt.png" in ok.output and "largest within" in " ".join(ok.output.split())
    mixed = runner.invoke(app, ["infer", "--models", str(models[1]), "--threads", "1", str(img), str(bad)])
    assert mixed.exit_code == 1 and "not a readable image" in mixed.output
