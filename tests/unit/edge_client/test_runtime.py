"""Adaptive ONNX runtime: integrity checks, load-driven submodel choice, HTTP API, CLI."""

from __future__ import annotations

import io
import json
import re
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from typer.testing import CliRunner

from edge_client.cli import app
from edge_client.http_api import make_server
from edge_client.runtime import AdaptiveRuntime, ExternalLoadProbe, ImageError, ImageTooLarge, ModelsError, decode_image
from export.onnx_export import export_checkpoint, submodel_module
from nefl.nested.checkpoint import load_checkpoint, save_checkpoint
from nefl.protocol.manifest import sha256_file
from nefl.nested.profile import load_profile
from nefl.nested.state import GlobalState, Layout

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[3]
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


def test_the_load_probe_reads_the_last_moments_not_a_quiet_spell_before_them() -> None:
    """A request after a quiet minute must see load that began a second ago: the probe samples in
    the background, and reads only what is outside this process tree."""
    readings = {"external": 0.0}
    prober = SimpleNamespace(snapshot=lambda: SimpleNamespace(external_cpu_percent=readings["external"],
                                                              memory_available=8 * GIB))
    probe = ExternalLoadProbe(interval_s=0.01, prober=prober)
    assert probe() == (0.0, 8 * GIB)
    readings["external"] = 100.0  # two busy loops started
    deadline = time.monotonic() + 5
    while probe()[0] != 100.0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert probe()[0] == 100.0
    sampler = next(t for t in threading.enumerate() if t.name == "load-probe")
    del probe
    sampler.join(5)  # the sampler holds the probe weakly and ends with it
    assert not sampler.is_alive()


def _serve(models_dir: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", "from edge_client.cli import app; app()", "serve", "--models",
                             str(models_dir), "--port", str(port), "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def test_serve_on_a_taken_port_says_so_in_one_line(models: tuple[Path, Path]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        proc = _serve(models[1], taken.getsockname()[1])
        output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 2, output
    assert "Traceback" not in output and "choose another --port" in output
    assert len([line for line in output.splitlines() if line.strip()]) == 1, output  # one line, no 100-line trace


def test_serve_stops_cleanly_on_sigterm(models: tuple[Path, Path]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _serve(models[1], port)
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end and proc.poll() is None:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=30)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0, output  # a service manager's stop is not a failure (it was 143)
    assert "stopping (SIGTERM)" in output and "Traceback" not in output


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
        assert status == 200 and body["submodel"] == 5 and len(body["probabilities"]) == 10
        expected = rt.predict(image[None]).labels[0]
        assert body["class"] == expected and body["class_name"] == rt.class_names[expected]
        # an RGB image of another size is converted to the model's channels and size
        status, body = _request(f"{base}/predict", _png(np.full((40, 50, 3), 200, np.uint8)))
        assert status == 200 and 0 <= body["class"] < 10
        assert _request(f"{base}/health")[0] == 200
        status, body = _request(f"{base}/models")
        assert status == 200 and [s["submodel"] for s in body["submodels"]] == [1, 3, 5]
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


# --- manifest: paths confined to the export directory -------------------------------------------------------------


def _point_manifest_at(models_dir: Path, copy: Path, name: str, target: Path) -> None:
    """Copy the export and make submodel 3's entry name `name`, with the true hash of `target` (a valid-looking lie)."""
    shutil.copytree(models_dir, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    entry = next(e for e in manifest["submodels"] if e["index"] == 2)
    entry["file"], entry["sha256"] = name, sha256_file(target)
    (copy / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_manifest_files_outside_the_directory_are_refused(models: tuple[Path, Path], tmp_path: Path, how: str) -> None:
    evil = tmp_path / "elsewhere" / "evil.onnx"
    evil.parent.mkdir()
    shutil.copy(models[1] / "submodel-1.onnx", evil)  # a real model: only the location is wrong
    copy = tmp_path / "onnx"
    if how == "symlink":
        _point_manifest_at(models[1], copy, "link.onnx", evil)
        (copy / "link.onnx").symlink_to(evil)
        expected = "outside the export directory"
    else:
        _point_manifest_at(models[1], copy, "../elsewhere/evil.onnx" if how == "dotdot" else str(evil), evil)
        expected = "not a plain path inside the export directory"
    with pytest.raises(ModelsError, match=expected) as info:
        _runtime(copy)
    assert "\n" not in str(info.value)


def test_symlink_inside_the_directory_is_followed(models: tuple[Path, Path], tmp_path: Path) -> None:
    copy = tmp_path / "onnx"
    _point_manifest_at(models[1], copy, "alias.onnx", models[1] / "submodel-3.onnx")
    (copy / "alias.onnx").symlink_to(copy / "submodel-3.onnx")
    assert [s.file for s in _runtime(copy).submodels] == ["submodel-1.onnx", "alias.onnx", "submodel-5.onnx"]


@pytest.mark.parametrize(("edit", "expected"), [
    (lambda m: m.update(format_version=2), "manifest format 2, this runtime reads 1"),
    (lambda m: m["submodels"][0].update(gamma=1.5), r"\$.submodels\[0\].gamma"),
    (lambda m: m["input"].update(std=[0.0]), "std must be finite and positive"),
    (lambda m: m["submodels"][1].update(index=0), "submodel indices repeat"),
    (lambda m: m.pop("output"), "missing required field `output`"),
])
def test_invalid_manifest_is_one_clear_line(models: tuple[Path, Path], tmp_path: Path, edit, expected: str) -> None:
    copy = tmp_path / "onnx"
    shutil.copytree(models[1], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ModelsError, match=expected) as info:
        _runtime(copy)
    assert "\n" not in str(info.value) and "export again" in str(info.value)


# --- image decoding: odd inputs are 4xx, never 500 ----------------------------------------------------------------


def _encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _bomb_png(width: int, height: int, rows: int | None = None) -> bytes:
    """An RGBA PNG of zeros, compressed one row at a time so making it needs no width*height buffer."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    comp = zlib.compressobj(9)
    row = bytes(1 + 4 * width)
    idat = b"".join(comp.compress(row) for _ in range(height if rows is None else rows)) + comp.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 6, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


_GRAY = Image.fromarray(np.random.default_rng(4).integers(0, 256, (28, 28), dtype=np.uint8))
DECODABLE = {
    "png": _png(np.asarray(_GRAY)),
    "16-bit png": _encode(Image.fromarray(np.full((20, 20), 32896, np.uint16)), "PNG"),
    "palette png with transparency": _encode(_GRAY.convert("RGB").convert("P"), "PNG", transparency=3),
    "rgba png": _encode(Image.new("RGBA", (10, 10), (128, 128, 128, 0)), "PNG"),
    "cmyk jpeg": _encode(Image.new("CMYK", (40, 40), (10, 20, 30, 40)), "JPEG"),
    "animated gif": _encode(Image.new("L", (30, 30), 50), "GIF", save_all=True,
                            append_images=[Image.new("L", (30, 30), 200)]),
    "ppm": b"P6 2 2 255\n" + bytes(range(12)),
    "16-bit pgm": b"P5 2 2 65535\n" + b"\x80\x80" * 4,
    "plain pgm": b"P2 2 2 255\n1 2 3 4\n",
    "plain pbm": b"P1 2 2\n1 0 1 0\n",
    "pfm": b"Pf 2 2 -1.0\n" + np.full(4, 0.5, "<f4").tobytes(),
    "bmp": _encode(_GRAY, "BMP"),
    "3000x2000 jpeg (decoded at 1/8 scale)": _encode(Image.new("RGB", (3000, 2000), (90, 90, 90)), "JPEG"),
}
UNREADABLE = {
    "truncated png": DECODABLE["png"][:len(DECODABLE["png"]) // 2],
    "pgm with maxval 0": b"P5 2 2 0\n" + b"\0" * 4,
    "plain pgm with a bad token": b"P2 2 2 255\n1 2 x 4\n",
    "zero-size pgm": b"P5 0 0 255\n",
    "tiff (not accepted)": _encode(_GRAY, "TIFF"),
    "text": b"definitely not a png",
}
TOO_LARGE = {
    "3000x2000 png header": _bomb_png(3000, 2000, rows=1),
    "100000x100000 ppm header": b"P6 100000 100000 255\n",
}


@pytest.mark.parametrize("name", DECODABLE)
def test_odd_but_valid_images_decode(name: str) -> None:
    for shape in ((1, 28, 28), (3, 32, 32)):
        pixels = decode_image(DECODABLE[name], shape)
        assert pixels.shape == shape and pixels.dtype == np.uint8


def test_16_bit_images_are_scaled_not_clipped() -> None:
    for name in ("16-bit png", "16-bit pgm"):  # mid-gray in 16 bits; PIL's convert("L") would give 255
        assert 126 <= decode_image(DECODABLE[name], (1, 28, 28)).mean() <= 130


@pytest.mark.parametrize("name", UNREADABLE)
def test_unreadable_images_are_image_errors(name: str) -> None:
    with pytest.raises(ImageError, match="not a readable image"):
        decode_image(UNREADABLE[name], (1, 28, 28))


@pytest.mark.parametrize("name", TOO_LARGE)
def test_oversized_images_are_refused_from_the_header(name: str) -> None:
    with pytest.raises(ImageTooLarge, match="resize it to 28x28"):
        decode_image(TOO_LARGE[name], (1, 28, 28))


@st.composite
def image_bytes(draw: st.DrawFn) -> bytes:
    """Random bytes, or a real image of every accepted format with bytes overwritten (mostly in its header) and cut."""
    if draw(st.booleans()):
        return draw(st.binary(min_size=1, max_size=2048))
    data = bytearray(draw(st.sampled_from(list(DECODABLE.values()))))
    for _ in range(draw(st.integers(0, 6))):
        end = len(data) if draw(st.booleans()) else min(len(data), 48)
        data[draw(st.integers(0, end - 1))] = draw(st.integers(0, 255))
    return bytes(data[:draw(st.integers(1, len(data)))])


@settings(max_examples=400, deadline=None, database=None)
@given(data=image_bytes(), rgb=st.booleans())
def test_fuzzed_bytes_decode_or_raise_image_error(data: bytes, rgb: bool) -> None:
    shape = (3, 32, 32) if rgb else (1, 28, 28)
    try:
        pixels = decode_image(data, shape)
    except ImageError:
        return
    assert pixels.shape == shape and pixels.dtype == np.uint8


# --- HTTP server limits: a real server on 127.0.0.1 ---------------------------------------------------------------


@contextmanager
def _serving(rt: AdaptiveRuntime, **limits) -> Iterator[str]:
    server = make_server(rt, "127.0.0.1", 0, **limits)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _stalled_upload(base: str) -> socket.socket:
    """Headers and a few body bytes of an upload that will never finish."""
    sock = socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])))
    sock.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n\x89PNG")
    return sock


def _trickle(socks: list[socket.socket], stop: threading.Event) -> None:
    """A byte every 0.2 s on each socket: a per-read timeout alone would never fire."""
    while not stop.wait(0.2):
        for sock in socks:
            try:
                sock.send(b"x")
            except OSError:
                pass


def _assert_answered(socks: list[socket.socket], *statuses: bytes) -> None:
    for sock in socks:
        sock.settimeout(5)
        assert sock.recv(64).split(b" ")[1] in statuses


@pytest.mark.timeout(60)
def test_stalled_uploads_neither_add_threads_nor_block_a_normal_request(models: tuple[Path, Path]) -> None:
    image = _png(np.zeros((28, 28), np.uint8))
    with _serving(_runtime(models[1]), workers=2, queue_size=2, timeout_s=2.0) as base:
        threads = threading.active_count()
        stop = threading.Event()
        holding = [_stalled_upload(base) for _ in range(2)]  # both workers, kept busy by a trickle
        trickler = threading.Thread(target=_trickle, args=(holding, stop), daemon=True)
        trickler.start()
        flood: list[socket.socket] = []
        try:
            time.sleep(0.3)
            start = time.monotonic()
            assert _request(f"{base}/predict", image)[0] == 200  # queued, served once the trickles hit the deadline
            assert time.monotonic() - start < 5
            _assert_answered(holding, b"408")
            time.sleep(0.3)  # both workers back on the queue, so the flood fills exactly 2 workers + 2 slots
            flood += [_stalled_upload(base) for _ in range(30)]
            time.sleep(0.2)
            assert threading.active_count() == threads + 1  # + the trickler: 30 connections, no new server thread
            start = time.monotonic()
            status, body = _request(f"{base}/predict", image)
            assert status == 503 and "busy" in body["error"] and time.monotonic() - start < 1
            deadline = time.monotonic() + 15  # the flood drains at 2 workers x 2 s deadline
            while (status := _request(f"{base}/predict", image)[0]) == 503 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert status == 200
            _assert_answered(flood, b"408", b"503")  # every stalled client got an answer, not a silent close
        finally:
            stop.set()
            for sock in holding + flood:
                sock.close()


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _rss_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


@pytest.mark.timeout(60)
def test_decompression_bomb_gets_413_fast_and_small(models: tuple[Path, Path]) -> None:
    bomb = _bomb_png(4096, 4096)  # ~65 KB that inflates to 4096x4096 RGBA = 64 MiB
    assert len(bomb) < 100_000
    with _serving(_runtime(models[1])) as base:
        measured = _reset_peak_rss()
        before = _rss_kib("VmRSS") if measured else 0
        start = time.monotonic()
        status, body = _request(f"{base}/predict", bomb)
        elapsed = time.monotonic() - start
        assert status == 413 and "4096x4096" in body["error"] and "resize it to 28x28" in body["error"]
        assert elapsed < 1
        if measured:
            assert _rss_kib("VmHWM") - before < 32 << 10  # decoding it would take 64 MiB and more
        status, body = _request(f"{base}/predict", TOO_LARGE["100000x100000 ppm header"])
        assert status == 413 and "decompression-bomb" in body["error"]


@pytest.mark.timeout(60)
def test_oversized_body_gets_a_readable_413(models: tuple[Path, Path]) -> None:
    with _serving(_runtime(models[1])) as base:  # default 4 MiB cap; the client sends all 5 MB before reading
        status, body = _request(f"{base}/predict", b"\0" * 5_000_000)
        assert status == 413 and "4194304-byte limit" in body["error"]
        assert _request(f"{base}/health")[0] == 200


@pytest.mark.timeout(120)
def test_fuzzed_uploads_get_200_or_4xx(models: tuple[Path, Path]) -> None:
    with _serving(_runtime(models[1])) as base:
        @settings(max_examples=80, deadline=None, database=None)
        @given(data=image_bytes())
        def upload(data: bytes) -> None:
            status, body = _request(f"{base}/predict", data)
            assert status in (200, 400, 413), body
            assert ("class" in body) if status == 200 else body["error"]

        upload()
        assert _request(f"{base}/health")[0] == 200
