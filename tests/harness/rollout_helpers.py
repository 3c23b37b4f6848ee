"""Shared by the rollout tests and benchmarks/bench_rollout.py: signed releases as the aggregator sends them,
a degraded copy of an export (slower, otherwise identical), and the processes of a followed fleet."""

from __future__ import annotations

import io
import json
import shutil
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
from PIL import Image

from aggregator.deploy import build_release, file_messages
from nefl.protocol.manifest import read_manifest, sha256_file, write_manifest
from nefl.protocol.messages import Rollout
from nefl.protocol.signing import Signer
from nefl.protocol.topics import Topics

CHUNK = 16 * 1024  # small messages: every file travels in several chunks


def release_messages(signer: Signer, export: Path, version: int, federation: str = "t",
                     chunk_bytes: int = CHUNK) -> tuple[bytes, list[tuple[str, bytes]]]:
    """(signed release, [(topic, chunk)]) exactly as `aggregator publish` sends them."""
    release, data = build_release(export, federation, version, chunk_bytes)
    topics = Topics(federation)
    return signer.sign(release.to_json()), [(t, m) for _, t, m in file_messages(topics, release, data, chunk_bytes)]


def rollout(signer: Signer, seq: int, stable: int | None, federation: str = "t", **kw) -> bytes:
    return signer.sign(Rollout(federation=federation, seq=seq, stable=stable, **kw).to_json())


def slow_export(src: Path, dst: Path, extra_matmuls: int = 4, n: int = 384) -> Path:
    """A copy of an export whose every submodel computes the same logits but does `extra_matmuls` n x n
    matrix products more per image (about +7 ms on one core): a latency regression that passes the
    hash and parity checks, as a bad release from a broken exporter would. Needs the onnx package."""
    import onnx
    from onnx import helper, numpy_helper

    dst.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(src)
    weights = (np.random.default_rng(0).standard_normal((n, n)) / np.sqrt(n)).astype(np.float32)
    entries = []
    for entry in manifest.submodels:
        model = onnx.load(str(src / entry.file))
        graph, out = model.graph, model.graph.output[0].name
        graph.initializer.extend([numpy_helper.from_array(weights, "slow_w"),
                                  numpy_helper.from_array(np.array(0.0, dtype=np.float32), "slow_zero")])
        for node in graph.node:  # the real logits feed the final Add below
            node.output[:] = ["slow_logits" if o == out else o for o in node.output]
        nodes = [helper.make_node("ReduceMean", [graph.input[0].name], ["slow_s"], keepdims=0),
                 helper.make_node("Mul", ["slow_w", "slow_s"], ["slow_m0"])]
        for i in range(extra_matmuls):
            nodes += [helper.make_node("MatMul", [f"slow_m{i}", "slow_w"], [f"slow_p{i}"]),
                      helper.make_node("Tanh", [f"slow_p{i}"], [f"slow_m{i + 1}"])]
        nodes += [helper.make_node("ReduceMean", [f"slow_m{extra_matmuls}"], ["slow_r"], keepdims=0),
                  helper.make_node("Mul", ["slow_r", "slow_zero"], ["slow_z"]),
                  helper.make_node("Add", ["slow_logits", "slow_z"], [out])]
        graph.node.extend(nodes)
        onnx.checker.check_model(model)
        onnx.save(model, str(dst / entry.file))
        entries.append(msgspec.structs.replace(entry, sha256=sha256_file(dst / entry.file)))
    shutil.copy(src / manifest.parity.file, dst / manifest.parity.file)
    write_manifest(dst, msgspec.structs.replace(manifest, submodels=entries,
                                                created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())))
    return dst


def png(seed: int, shape: tuple[int, int] = (28, 28)) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def get_json(url: str, timeout: float = 5.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    except OSError:
        return 0, {}


@dataclass
class Answer:
    sent: float  # perf_counter when the request was sent
    seconds: float
    status: int  # 0: no HTTP answer at all (connection refused, reset, timeout)
    version: int | None = None


@dataclass
class LoadLoop:
    """POSTs images to a device's /predict back to back in a thread and records every answer, so a swap
    during the loop shows as failed requests (if any) and as the gap between answers."""

    port: int
    image: bytes = field(default_factory=lambda: png(0))
    answers: list[Answer] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def _run(self) -> None:
        while not self._stop.is_set():
            sent = time.perf_counter()
            req = urllib.request.Request(f"http://127.0.0.1:{self.port}/predict", data=self.image, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    status, version = r.status, json.loads(r.read()).get("version")
            except urllib.error.HTTPError as e:
                status, version = e.code, None
            except OSError:
                status, version = 0, None
            self.answers.append(Answer(sent, time.perf_counter() - sent, status, version))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    @property
    def failed(self) -> list[Answer]:
        return [a for a in self.answers if a.status != 200]
