"""Inputs for checking exported files, and the fp32 parity check itself.

Parity is measured on real test images when the profile's dataset is on disk (a random tensor
can hide errors that only show on the value ranges a trained network sees), otherwise on seeded
random inputs. The torch reference is the unfolded eval-mode module, so the check covers folding
and export together.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

from nefl.nested.data import DatasetUnavailable, get_dataset_info, load_dataset
from nefl.nested.profile import Profile
from nefl.protocol.manifest import parity_bound
from nefl.support.fsio import atomic_write

PARITY_ATOL = 1e-4  # logits near zero
PARITY_RTOL = 1e-5  # float32 keeps ~7 digits: at logits ~300 a correct export already differs by ~1e-4
PARITY_BATCHES = (1, 8)
PARITY_FILE = "parity.npz"  # the inputs and torch's logits, for a device to repeat the check (docs/deploy.md)


class ParityError(RuntimeError):
    """An exported file disagrees with its torch module; no manifest is written."""


@dataclass(frozen=True)
class Normalisation:
    mean: tuple[float, ...]
    std: tuple[float, ...]
    class_names: tuple[str, ...] | None


@dataclass
class ReferenceData:
    """Normalised float32 inputs N x C x H x W; labels only when they are real test images."""

    inputs: np.ndarray
    labels: np.ndarray | None
    source: str


def normalisation(profile: Profile) -> Normalisation:
    """The registry's mean/std for the profile's dataset; pixels/255 for datasets it lacks."""
    channels = profile.input_shape[0]
    try:
        info = get_dataset_info(profile.dataset)
    except ValueError:
        return Normalisation((0.0,) * channels, (1.0,) * channels, None)
    names = getattr(info.tv_class, "classes", None)
    return Normalisation(info.mean, info.std, tuple(names) if isinstance(names, list) else None)


def reference_data(profile: Profile, data_root: str | Path | None, count: int, seed: int = 0) -> ReferenceData:
    norm = normalisation(profile)
    mean = np.asarray(norm.mean, dtype=np.float32).reshape(1, -1, 1, 1)
    std = np.asarray(norm.std, dtype=np.float32).reshape(1, -1, 1, 1)
    try:
        ds = load_dataset(profile.dataset, data_root, train=False, download=False)
    except (ValueError, DatasetUnavailable):
        ds = None
    if ds is not None and tuple(ds.images.shape[1:]) == tuple(profile.input_shape):
        images = ds.images[:count].numpy().astype(np.float32) / 255.0
        return ReferenceData((images - mean) / std, ds.labels[:count].numpy(), f"{profile.dataset} test split")
    rng = np.random.default_rng(seed)
    pixels = rng.random((count, *profile.input_shape), dtype=np.float32)
    return ReferenceData((pixels - mean) / std, None, f"seeded random inputs (seed {seed})")


def session(path: str | Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def run_onnx(sess: ort.InferenceSession, inputs: np.ndarray, batch_size: int = 256) -> np.ndarray:
    name = sess.get_inputs()[0].name
    outs = [sess.run(None, {name: inputs[i:i + batch_size]})[0] for i in range(0, len(inputs), batch_size)]
    return np.concatenate(outs)


@dataclass(frozen=True)
class Parity:
    """How far the exported logits are from torch's, and the bound that distance must stay within.

    The bound scales with the logits' magnitude (max|a-b| <= atol + rtol * max|ref|): an absolute
    bound alone rejects correct exports whose logits are large, while a purely relative one would
    accept anything on near-zero logits.
    """

    max_diff: float
    ref_max: float

    @property
    def bound(self) -> float:
        return parity_bound(PARITY_ATOL, PARITY_RTOL, self.ref_max)

    @property
    def ok(self) -> bool:
        return self.max_diff <= self.bound


def compare(outputs: np.ndarray, reference: np.ndarray) -> Parity:
    return Parity(float(np.abs(outputs - reference).max()), float(np.abs(reference).max()))


@torch.no_grad()
def torch_logits(model: nn.Module, inputs: np.ndarray) -> np.ndarray:
    return model(torch.from_numpy(inputs)).numpy()


def parity(path: str | Path, model: nn.Module, inputs: np.ndarray) -> Parity:
    """ORT vs torch logits over the parity batch sizes, worst case of each."""
    sess = session(path)
    results = []
    for b in PARITY_BATCHES:
        x = inputs[:b]
        results.append(compare(run_onnx(sess, x), torch_logits(model, x)))
    return Parity(max(r.max_diff for r in results), max(r.ref_max for r in results))


def write_reference(path: Path, inputs: np.ndarray, logits: dict[int, np.ndarray]) -> Path:
    """The parity inputs and torch's logits of each submodel (0-based K as `logits_K`), as a plain npz
    that numpy reads without pickles, so a device can repeat the parity check with its onnxruntime."""
    arrays = {"inputs": inputs.astype(np.float32)} | {f"logits_{k}": v.astype(np.float32) for k, v in logits.items()}

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:  # a file object: np.savez would append .npz to the temp name
            np.savez(f, **arrays)

    return atomic_write(path, write)


def top1(path: str | Path, inputs: np.ndarray, labels: np.ndarray) -> float:
    logits = run_onnx(session(path), inputs)
    return float((logits.argmax(1) == labels).mean())
