"""manifest.json: the one typed schema an export is written in and a device reads it back with.

export/ writes it and edge_client/runtime.py reads it through the same Structs, so a field renamed
on one side fails here, in one place, rather than on a device. Stdlib + msgspec only: the runtime
imports this on devices that have no torch.

FORMAT_VERSION changes whenever a field the runtime relies on changes meaning. Fields a newer
exporter adds are ignored by an older runtime, so adding one needs no new version.

The manifest on disk is not signed: each sha256 vouches only for its own file (a rollout signs it
inside its release message, nefl/protocol/messages.py `Release`). A manifest naming
`../elsewhere/evil.onnx` together with evil's hash would load anything on the disk, so every file
it names must stay inside the export directory, checked on the name and again after symlinks.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Annotated

import msgspec

from nefl.support.fsio import atomic_write_text

FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
MAX_MANIFEST_BYTES = 1 << 20  # checked before parsing; a real manifest is a few KB
MAX_INPUT_SIDE = 4096  # the runtime allocates calibration inputs of this shape

Count = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
Ratio = Annotated[float, msgspec.Meta(gt=0, le=1)]  # gamma, gamma_w: as in the profile
Fraction = Annotated[float, msgspec.Meta(ge=0, le=1)]
NonNegative = Annotated[float, msgspec.Meta(ge=0)]
Sha256 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
FileName = Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
Side = Annotated[int, msgspec.Meta(ge=1, le=MAX_INPUT_SIDE)]


CHANCE_MARGIN = 0.05  # accuracy this close to 1/num_classes counts as untrained


def untrained_reason(updates: int | None, accuracy: float | None, num_classes: int,
                     margin: float = CHANCE_MARGIN) -> str | None:
    """Why a submodel should not answer requests: never trained, or no better than guessing.
    NeFL's promise is that every submodel is usable; one that is not must not be picked silently
    when the device is under load."""
    if updates == 0:
        return "never trained (0 federated updates)"
    chance = 1.0 / num_classes
    if accuracy is not None and accuracy < chance + margin:
        return f"accuracy {accuracy:.3f} is within {margin:g} of chance ({chance:.3f})"
    return None


class ManifestError(ValueError):
    """An export directory whose manifest or files cannot be trusted; the message names the fix."""


def _check_relative(name: str) -> None:
    """The name half of the confinement (confined_path does the symlink half)."""
    posix = PurePosixPath(name)
    if posix.is_absolute() or PureWindowsPath(name).drive or ".." in posix.parts or "\\" in name or "\0" in name:
        raise ValueError(f"file {name!r} is not a plain path inside the export directory")


class Int8File(msgspec.Struct, kw_only=True, frozen=True):
    file: FileName
    sha256: Sha256
    format: str
    accuracy_fp32: Fraction
    accuracy_int8: Fraction
    accuracy_delta: Annotated[float, msgspec.Meta(ge=-1, le=1)]
    eval_images: Count

    def __post_init__(self) -> None:
        _check_relative(self.file)


class SubmodelEntry(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    index: Count  # 0-based position in the profile's ladder
    file: FileName
    sha256: Sha256
    gamma: Ratio
    gamma_w: Ratio
    params: Count
    flops: Count  # MACs
    weight_bytes: Count
    activation_bytes_per_sample: Count
    accuracy: Fraction | None
    parity_max_diff: NonNegative
    updates: Count | None = None  # committed federated updates this submodel had (None: not recorded)
    int8: Int8File | None = None  # omitted from the file when there is none

    def __post_init__(self) -> None:
        _check_relative(self.file)


class InputSpec(msgspec.Struct, kw_only=True, frozen=True):
    name: str
    shape: list[Side]  # C, H, W
    mean: list[float]
    std: list[float]

    def __post_init__(self) -> None:
        if len(self.shape) != 3 or self.shape[0] not in (1, 3):
            raise ValueError(f"input shape must be [C, H, W] with C 1 or 3, got {self.shape}")
        channels = self.shape[0]
        if len(self.mean) != channels or len(self.std) != channels:
            raise ValueError(f"mean and std need one value per channel ({channels})")
        if not all(math.isfinite(s) and s > 0 for s in self.std):
            raise ValueError(f"std must be finite and positive, got {self.std}")


class OutputSpec(msgspec.Struct, kw_only=True, frozen=True):
    name: str
    num_classes: Positive
    class_names: list[str] | None

    def __post_init__(self) -> None:
        if self.class_names is not None and len(self.class_names) != self.num_classes:
            raise ValueError(f"{len(self.class_names)} class names for {self.num_classes} classes")


def parity_bound(atol: float, rtol: float, ref_max: float) -> float:
    """How far ONNX logits may be from the reference: absolute for logits near zero, relative for large
    ones (float32 keeps ~7 digits). The exporter and a device checking a rollout use this one bound."""
    return atol + rtol * ref_max


class ParitySpec(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """Bound the export checked: max|onnx - torch| <= tolerance + rtol * max|torch logit|."""

    tolerance: NonNegative  # the absolute part (the field's name predates rtol)
    rtol: NonNegative = 0.0  # exports written before the relative bound used none
    inputs: str
    batch_sizes: list[Positive]
    # the parity inputs and torch's logits for them (npz: `inputs`, `logits-K` per 0-based submodel K), so a
    # device can repeat the check on its own onnxruntime; exports written before it have none
    file: FileName | None = None
    sha256: Sha256 | None = None

    def __post_init__(self) -> None:
        if self.file is not None:
            _check_relative(self.file)
        if (self.file is None) != (self.sha256 is None):
            raise ValueError("parity file and its sha256 go together")

    def bound(self, ref_max: float) -> float:
        return parity_bound(self.tolerance, self.rtol, ref_max)


class Manifest(msgspec.Struct, kw_only=True, frozen=True):
    format_version: int = FORMAT_VERSION
    profile: str
    profile_hash: str
    method: str
    dataset: str
    source_round: Count | None
    source_checkpoint: str | None = None  # the run directory the checkpoint came from (as given to the exporter)
    source_state_sha256: Sha256 | None = None  # of that checkpoint's state.safetensors: exactly which weights
    created: str
    input: InputSpec
    output: OutputSpec
    parity: ParitySpec
    submodels: list[SubmodelEntry]

    def __post_init__(self) -> None:
        if not self.submodels:
            raise ValueError("no submodels")
        indices = [e.index for e in self.submodels]
        if len(set(indices)) != len(indices):
            raise ValueError(f"submodel indices repeat: {indices}")


class _Version(msgspec.Struct):
    format_version: int


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(directory: str | Path, manifest: Manifest) -> Path:
    """Validate as a reader would, then write atomically: a manifest on disk is always complete and loadable."""
    data = msgspec.json.encode(manifest)
    try:
        msgspec.json.decode(data, type=Manifest)  # Meta ranges are checked on decode only, not on construction
    except msgspec.ValidationError as e:
        raise ValueError(f"refusing to write an invalid manifest: {e}") from None
    return atomic_write_text(Path(directory) / MANIFEST_FILE, msgspec.json.format(data, indent=2).decode() + "\n")


def read_manifest(directory: str | Path) -> Manifest:
    """The directory's manifest, size-capped, version-checked and validated; ManifestError otherwise."""
    d = Path(directory)
    path = d / MANIFEST_FILE
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise ManifestError(f"{d}: no {MANIFEST_FILE}; export one with "
                            f"`nefl-export onnx --checkpoint CKPT --out {d}`") from None
    except OSError as e:
        raise ManifestError(f"{path}: cannot read it ({e.strerror}); check the path and its permissions") from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{path}: over {MAX_MANIFEST_BYTES} bytes, not a manifest nefl-export wrote; export again")
    try:
        version = msgspec.json.decode(data, type=_Version).format_version
        if version != FORMAT_VERSION:
            raise ManifestError(f"{path}: manifest format {version}, this runtime reads {FORMAT_VERSION}; "
                                "export again with a matching nefl-export")
        return msgspec.json.decode(data, type=Manifest)
    except msgspec.DecodeError as e:  # ValidationError included; msgspec names the field, e.g. `$.submodels[0].gamma`
        raise ManifestError(f"{path}: invalid manifest ({e}); export again with `nefl-export onnx`") from None


def confined_path(directory: str | Path, name: str) -> Path:
    """`name` inside `directory` with symlinks resolved; refused if it lands outside (or on the directory)."""
    root = Path(directory).resolve()
    path = (root / name).resolve()
    if path == root or not path.is_relative_to(root):
        raise ManifestError(f"{Path(directory) / name}: resolves to {path}, outside the export directory; "
                            "refusing to load it (copy the real file into the directory and export again)")
    return path


def read_verified(directory: str | Path, name: str, sha256: str) -> bytes:
    """The bytes of a file the manifest names, confined and hash-checked.

    Callers load these bytes, not the path again, so the file cannot change between check and use.
    """
    path = confined_path(directory, name)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ManifestError(f"{path}: listed in the manifest but missing; copy the whole export directory") from None
    except OSError as e:
        raise ManifestError(f"{path}: cannot read it ({e.strerror}); copy the whole export directory") from None
    if hashlib.sha256(data).hexdigest() != sha256:
        raise ManifestError(f"{path}: sha256 does not match the manifest (tampered or corrupt); refusing to load it")
    return data
