"""On-device inference over an exported ladder: per request, the largest submodel the device affords now.

NeFL's test-time half: every submodel of the ladder is a complete classifier, so a device under
load can answer with a smaller one instead of missing its deadline. Each submodel's batch-1
latency is measured once at start-up; a request's latency is predicted from it, scaled by the CPU
left to us (external load only: our own inference is subtracted) and corrected by an exponential
moving average of observed/predicted ratios, so a device that is slower or faster than the
calibration moment is tracked without recalibrating.
"""

from __future__ import annotations

import io
import logging
import os
import statistics
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnxruntime as ort

from nefl.protocol.manifest import Manifest, ManifestError, SubmodelEntry, read_manifest, read_verified, untrained_reason

MIN_FREE_CORES = 0.1  # a fully loaded CPU still gives us a time slice; avoids dividing by zero
MAX_IMAGE_PIXELS = 2048 * 2048  # decoded size cap, checked on the header: a 65 KB PNG can declare 4096x4096 RGBA
IMAGE_FORMATS = ("PNG", "JPEG", "PPM", "BMP", "GIF", "WEBP")  # PIL would also try EPS (ghostscript), TIFF, ...
FORMATS_HINT = "send PNG, JPEG, PPM/PGM, BMP, GIF or WebP bytes"
MEMORY_RESERVE_BYTES = 64 << 20  # available memory a request's submodel must leave untouched

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage

Probe = Callable[[], tuple[float | None, int | None]]


class ModelsError(RuntimeError):
    """An export directory the runtime refuses to use (missing, tampered, unsupported)."""


class ImageError(ValueError):
    """Input that is not an image the model can take."""


class ImageTooLarge(ImageError):
    """An image whose decoded pixels would exceed the cap; refused from its header, before decoding."""


@dataclass(frozen=True)
class Submodel:
    index: int
    gamma: float
    file: str
    weight_bytes: int
    activation_bytes_per_sample: int
    flops: int

    @classmethod
    def from_entry(cls, entry: SubmodelEntry, file: str) -> "Submodel":
        return cls(entry.index, entry.gamma, file, entry.weight_bytes, entry.activation_bytes_per_sample, entry.flops)

    def memory_bytes(self, batch: int) -> int:
        return self.weight_bytes + batch * self.activation_bytes_per_sample

    def fits(self, batch: int, headroom: int | None) -> bool:
        """The memory rule of the choice per request, and of which submodels a followed rollout fetches."""
        return headroom is None or self.memory_bytes(batch) <= headroom


def memory_headroom(available: int | None, reserve: int) -> int | None:
    """Bytes a submodel may take now: available memory less the reserve (None: unknown, nothing is refused)."""
    return None if available is None else available - reserve


@dataclass(frozen=True)
class Result:
    labels: list[int]
    probabilities: np.ndarray  # N x num_classes, softmax of the logits
    submodel: int  # 0-based index in the ladder
    gamma: float
    latency_ms: float
    predicted_ms: float
    reason: str


log = logging.getLogger(__name__)
LoadedModel = tuple[SubmodelEntry, str, bytes]  # entry, file name, verified bytes of that file


def usable_entries(manifest: Manifest, include_untrained: bool) -> list[SubmodelEntry]:
    """The submodels allowed to answer, smallest gamma first: an untrained one (or one no better
    than chance) would be picked exactly when the device is loaded, so it is skipped with a warning."""
    keep = []
    for entry in sorted(manifest.submodels, key=lambda e: e.gamma):
        why = untrained_reason(entry.updates, entry.accuracy, manifest.output.num_classes)
        if why is not None:
            log.warning(f"submodel {entry.index + 1}: {why}; "
                        + ("serving it anyway (--include-untrained)" if include_untrained else "not used (--include-untrained uses it)"))
        if why is None or include_untrained:
            keep.append(entry)
    if not keep:
        raise ModelsError("no trained submodel in this export: train more rounds, or pass --include-untrained")
    return keep


def load_models(models_dir: str | Path, precision: str = "fp32",
                include_untrained: bool = False) -> tuple[Manifest, list[LoadedModel]]:
    """The manifest and its usable submodels, smallest gamma first, with the `precision` file of each.

    Sessions are built from the verified bytes, not the path, so nothing can swap a file in between.
    """
    try:
        manifest = read_manifest(models_dir)
        models = []
        for entry in usable_entries(manifest, include_untrained):
            spec = entry if precision == "fp32" else entry.int8
            if spec is None:
                raise ModelsError(f"{models_dir}: submodel {entry.index + 1} has no int8 file; "
                                  "export with --quantize int8")
            models.append((entry, spec.file, read_verified(models_dir, spec.file, spec.sha256)))
    except ManifestError as e:
        raise ModelsError(str(e)) from None
    return manifest, models


def session_options(threads: int, enable_cpu_mem_arena: bool) -> ort.SessionOptions:
    """Few threads, no inter-op parallelism: a small device shares its cores with everything else."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.enable_cpu_mem_arena = enable_cpu_mem_arena
    return opts


class ExternalLoadProbe:
    """(CPU % used by everything outside this process tree, available memory) from edge_client.probe.

    Our own inference is not load (the probe separates this process tree from the rest over the
    same interval): left in, a busy runtime would read its own work as load and shrink its model
    for no reason. A background thread reads the probe every `interval_s`, so a request always sees
    the last moments' load, never the average of a long quiet stretch before it (load that started
    a second ago would hide in a minute's average).
    """

    def __init__(self, interval_s: float = 0.25, prober: Any = None) -> None:
        from edge_client.probe import Prober  # lazy: the probe is optional for users passing their own

        self._prober = prober or Prober()
        self._latest: tuple[float | None, int | None] = self._read()
        threading.Thread(target=_sample_while_alive, args=(weakref.ref(self), interval_s), name="load-probe",
                         daemon=True).start()

    def _read(self) -> tuple[float | None, int | None]:
        snap = self._prober.snapshot()
        return snap.external_cpu_percent, snap.memory_available

    def __call__(self) -> tuple[float | None, int | None]:
        return self._latest


def _sample_while_alive(probe: weakref.ref[ExternalLoadProbe], interval_s: float) -> None:
    """The sampling thread holds the probe weakly: it ends once the probe is no longer used."""
    while (live := probe()) is not None:
        live._latest = live._read()
        del live
        time.sleep(interval_s)


class AdaptiveRuntime:
    def __init__(
        self, models_dir: str | Path, probe: Probe | None = None, latency_budget_ms: float = 20.0,
        threads: int | None = None, enable_cpu_mem_arena: bool = True, precision: str = "fp32",
        memory_reserve_bytes: int = MEMORY_RESERVE_BYTES, ema_alpha: float = 0.2, calibration_runs: int = 7,
        probe_interval_s: float = 0.25, include_untrained: bool = False,
    ) -> None:
        if precision not in ("fp32", "int8"):
            raise ValueError(f"precision must be 'fp32' or 'int8', got {precision!r}")
        self.models_dir = Path(models_dir)
        self.manifest, models = load_models(self.models_dir, precision, include_untrained)
        self.precision = precision
        self.latency_budget_ms = latency_budget_ms
        self.memory_reserve_bytes = memory_reserve_bytes
        self.ema_alpha = ema_alpha
        self.threads = threads or max(1, (os.cpu_count() or 2) // 2)
        self.cores = os.cpu_count() or 1
        inp = self.manifest.input
        self.input_name = inp.name
        self.input_shape: tuple[int, int, int] = (inp.shape[0], inp.shape[1], inp.shape[2])
        self._mean = np.asarray(inp.mean, dtype=np.float32).reshape(1, -1, 1, 1)
        self._std = np.asarray(inp.std, dtype=np.float32).reshape(1, -1, 1, 1)
        self.class_names: list[str] | None = self.manifest.output.class_names
        self.submodels = [Submodel.from_entry(e, file) for e, file, _ in models]
        opts = session_options(self.threads, enable_cpu_mem_arena)
        self._sessions = [ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"]) for _, _, data in models]
        self.calibrated_ms = [self._calibrate(sess, calibration_runs) for sess in self._sessions]
        self.correction = 1.0
        self._probe = probe or ExternalLoadProbe()
        self._probe_interval_s = probe_interval_s
        self._last_probe: tuple[float, tuple[float | None, int | None]] | None = None
        self._lock = threading.Lock()

    def _calibrate(self, sess: ort.InferenceSession, runs: int) -> float:
        """Median batch-1 latency after warm-up runs (the first runs pay for allocation)."""
        x = np.zeros((1, *self.input_shape), dtype=np.float32)
        for _ in range(3):
            sess.run(None, {self.input_name: x})
        times = []
        for _ in range(runs):
            t = time.perf_counter()
            sess.run(None, {self.input_name: x})
            times.append((time.perf_counter() - t) * 1000)
        return statistics.median(times)

    def load(self) -> tuple[float | None, int | None]:
        """Current (external CPU %, available bytes), re-probed at most every probe_interval_s."""
        now = time.monotonic()
        if self._last_probe is None or now - self._last_probe[0] >= self._probe_interval_s:
            self._last_probe = (now, self._probe())
        return self._last_probe[1]

    def load_factor(self, cpu_percent: float | None) -> float:
        """How much slower than at calibration: our threads over the cores other work leaves free."""
        if cpu_percent is None:
            return 1.0
        free = max(self.cores * (1.0 - cpu_percent / 100.0), MIN_FREE_CORES)
        return max(1.0, self.threads / free)

    def choose(self, batch: int = 1) -> tuple[int, float, str]:
        """(position in self.submodels, predicted ms, why) for a request of `batch` images."""
        cpu, available = self.load()
        factor = self.load_factor(cpu) * self.correction
        headroom = memory_headroom(available, self.memory_reserve_bytes)
        load = f"cpu {cpu:.0f}%" if cpu is not None else "cpu unknown"
        for pos in range(len(self.submodels) - 1, -1, -1):
            predicted = self.calibrated_ms[pos] * batch * factor
            fits = self.submodels[pos].fits(batch, headroom)
            if predicted <= self.latency_budget_ms and fits:
                return pos, predicted, f"largest within {self.latency_budget_ms:g} ms budget and memory ({load}, x{factor:.2f})"
        predicted = self.calibrated_ms[0] * batch * factor
        return 0, predicted, f"fallback to smallest: none fits {self.latency_budget_ms:g} ms budget and memory ({load}, x{factor:.2f})"

    def preprocess(self, images: np.ndarray) -> np.ndarray:
        """uint8 pixels (C,H,W or N,C,H,W) -> normalised float32 N,C,H,W."""
        x = np.asarray(images)
        if x.ndim == len(self.input_shape):
            x = x[None]
        if x.dtype != np.uint8 or tuple(x.shape[1:]) != self.input_shape:
            raise ImageError(f"expected uint8 pixels of shape {self.input_shape} (or a batch of them), "
                             f"got {x.dtype} {tuple(x.shape)}")
        return (x.astype(np.float32) / 255.0 - self._mean) / self._std

    def decode_image(self, data: bytes, max_pixels: int = MAX_IMAGE_PIXELS) -> np.ndarray:
        return decode_image(data, self.input_shape, max_pixels)

    def predict(self, images: np.ndarray) -> Result:
        x = self.preprocess(images)
        with self._lock:  # one request at a time: concurrent runs would fight for the same cores
            pos, predicted, reason = self.choose(len(x))
            t = time.perf_counter()
            logits = self._sessions[pos].run(None, {self.input_name: x})[0]
            latency = (time.perf_counter() - t) * 1000
            base = predicted / self.correction
            self.correction += self.ema_alpha * (latency / base - self.correction)
        z = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs = z / z.sum(axis=1, keepdims=True)
        sub = self.submodels[pos]
        return Result(probs.argmax(1).tolist(), probs, sub.index, sub.gamma, latency, predicted, reason)

    def describe(self) -> dict[str, Any]:
        """What /models reports: the ladder, calibration and the current estimate."""
        return {
            "profile": self.manifest.profile, "profile_hash": self.manifest.profile_hash,
            "source_round": self.manifest.source_round, "precision": self.precision,
            "latency_budget_ms": self.latency_budget_ms, "threads": self.threads, "correction": self.correction,
            "input_shape": list(self.input_shape), "class_names": self.class_names,
            "submodels": [
                {"submodel": s.index + 1, "gamma": s.gamma, "file": s.file, "flops": s.flops, "calibrated_ms": ms}
                for s, ms in zip(self.submodels, self.calibrated_ms)
            ],
        }


def decode_image(data: bytes, shape: tuple[int, int, int], max_pixels: int = MAX_IMAGE_PIXELS) -> np.ndarray:
    """Image bytes -> uint8 C,H,W of `shape`; any input that is not such an image raises ImageError.

    The size is checked on the header PIL reads lazily, before a single pixel is decoded. Every
    other failure is caught broadly because PIL's decoders answer malformed input with a zoo of
    types (OSError, ValueError, SyntaxError, struct.error, EOFError, ...): bytes from a client must
    never become a 500.
    """
    from PIL import Image

    c, h, w = shape
    try:
        img = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        img.draft("L" if c == 1 else "RGB", (w, h))  # JPEG only: let libjpeg decode at 1/2..1/8 scale
        if img.width * img.height > max_pixels:
            raise ImageTooLarge(f"image is {img.width}x{img.height} = {img.width * img.height} pixels, at most "
                                f"{max_pixels} are accepted; resize it to {w}x{h} before sending")
        small = _to_8bit(img).convert("L" if c == 1 else "RGB").resize((w, h), Image.BILINEAR)
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):  # the warning too, under -W error
        raise ImageTooLarge(f"image dimensions are beyond PIL's decompression-bomb limit, at most {max_pixels} "
                            f"pixels are accepted; resize it to {w}x{h} before sending") from None
    except Exception as e:  # noqa: BLE001 (see the docstring)
        raise ImageError(f"not a readable image ({type(e).__name__}); {FORMATS_HINT}") from None
    arr = np.asarray(small, dtype=np.uint8)
    return arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1).copy()


def _to_8bit(img: PILImage) -> PILImage:
    """16-bit and float images scaled to 8 bits: PIL's own convert("L") clips them, turning most of the image white."""
    from PIL import Image

    if img.mode.startswith("I"):  # I, I;16, I;16B: 16-bit PNG/PGM samples, 0..65535
        scaled = np.asarray(img, dtype=np.float32) / 257.0
    elif img.mode == "F":  # PFM: floats in 0..1 by convention
        scaled = np.nan_to_num(np.asarray(img, dtype=np.float32)) * 255.0
    else:
        return img
    return Image.fromarray(np.clip(scaled, 0, 255).round().astype(np.uint8))
