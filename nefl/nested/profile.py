"""Submodel ladders: a TOML profile turned into validated, immutable specs.

A ladder is data, not code: adding a submodel or a new ladder never needs a code branch. Every
validation error names the file, the submodel and the field so a user can fix the TOML directly.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from nefl.nested.arch import ARCHS, AnyArch

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _shipped_profiles_dir() -> Path:
    """A wheel ships the ladders as nefl/profiles (pyproject maps that package onto profiles/); a
    checkout or an editable install reads the top-level profiles/ itself, so the TOML files have one source."""
    package = Path(__file__).resolve().parents[1]  # nefl/
    return next((d for d in (package / "profiles", package.parent / "profiles") if d.is_dir()), package / "profiles")


PROFILES_DIR = _shipped_profiles_dir()
METHOD_NAMES = ("nefl", "nefl-nl", "fjord", "heterofl", "depthfl")
# ViT LayerNorm: consistent (sliced and averaged like any weight, as the paper found best) or per submodel
LAYERNORM_MODES = ("consistent", "per_submodel")


class ProfileError(ValueError):
    """A profile that cannot be used; the message names file, submodel and field."""


def scaled(channels: int, gamma_w: float) -> int:
    """Width rule of the paper: ceil(C * gamma_W), guarded against float noise (16*0.25 -> 4)."""
    return max(1, math.ceil(channels * gamma_w - 1e-9))


@dataclass(frozen=True)
class SubmodelSpec:
    index: int
    gamma: float  # target parameter ratio
    gamma_w: float  # width ratio
    steps: tuple[tuple[float, ...], ...]  # per stage, per block; 0 = block skipped

    def present(self, stage: int, block: int) -> bool:
        return self.steps[stage][block] != 0

    @property
    def depth_ratio(self) -> float:
        flat = [s for stage in self.steps for s in stage]
        return sum(1 for s in flat if s != 0) / len(flat)


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    arch: AnyArch
    stem: str
    num_classes: int
    input_shape: tuple[int, int, int]
    dataset: str
    method: str
    submodels: tuple[SubmodelSpec, ...]
    source: str = "<memory>"
    layernorm: str = "consistent"  # ViT only (LAYERNORM_MODES)

    @property
    def num_submodels(self) -> int:
        return len(self.submodels)

    def to_dict(self) -> dict[str, Any]:
        # the layernorm key exists for ViTs only, so the other families' hashes stay what they were
        extra = {"layernorm": self.layernorm} if self.arch.family == "vit" else {}
        return {
            "name": self.name,
            "description": self.description,
            "arch": self.arch.name,
            "stem": self.stem,
            "num_classes": self.num_classes,
            "input_shape": list(self.input_shape),
            "dataset": self.dataset,
            "method": self.method,
            "submodels": [
                {"gamma": s.gamma, "gamma_w": s.gamma_w, "steps": [list(st) for st in s.steps]}
                for s in self.submodels
            ],
            **extra,
        }

    @functools.cached_property
    def hash(self) -> str:
        """Identity of the model family: checkpoints and exports refuse a profile that differs. Kept (the profile
        is frozen): every signed task names it."""
        canon = {k: v for k, v in self.to_dict().items() if k not in ("description",)}
        return hashlib.sha256(json.dumps(canon, sort_keys=True).encode()).hexdigest()[:16]

    def with_submodels(self, submodels: list[SubmodelSpec], method: str) -> "Profile":
        return replace(self, submodels=tuple(submodels), method=method)


def _fail(source: str, where: str, msg: str) -> ProfileError:
    return ProfileError(f"{source}: {where}: {msg}")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _parse_submodel(raw: Any, i: int, arch: AnyArch, source: str) -> SubmodelSpec:
    where = f"submodel {i + 1}"
    if not isinstance(raw, dict):
        raise _fail(source, where, "must be a table with gamma, gamma_w and steps")
    unknown = set(raw) - {"gamma", "gamma_w", "steps"}
    if unknown:
        raise _fail(source, where, f"unknown field(s) {sorted(unknown)}; allowed: gamma, gamma_w, steps")
    for field in ("gamma", "gamma_w"):
        if field not in raw:
            raise _fail(source, where, f"missing field '{field}'")
        if not _number(raw[field]) or not 0 < raw[field] <= 1:
            raise _fail(source, f"{where}: field '{field}'", f"must be a number in (0, 1], got {raw[field]!r}")
    steps = raw.get("steps")
    if steps is None:
        steps = [[1] * d for d in arch.depths]
    if not isinstance(steps, list) or len(steps) != len(arch.depths):
        raise _fail(
            source, f"{where}: field 'steps'",
            f"needs one list per stage ({len(arch.depths)} stages for {arch.name}), got {steps!r}",
        )
    for s, (stage, depth) in enumerate(zip(steps, arch.depths)):
        if not isinstance(stage, list) or len(stage) != depth:
            raise _fail(
                source, f"{where}: field 'steps', stage {s + 1}",
                f"{arch.name} has {depth} blocks in this stage, got {stage!r}",
            )
        if any(not _number(v) or v < 0 or not math.isfinite(v) for v in stage):
            raise _fail(source, f"{where}: field 'steps', stage {s + 1}", f"steps must be finite numbers >= 0, got {stage!r}")
        fixed = [b + 1 for b, v in enumerate(stage) if v != 1 and not arch.skippable(s, b)]
        if fixed:
            raise _fail(source, f"{where}: field 'steps', stage {s + 1}",
                        f"block(s) {fixed} of {arch.name} have no residual connection: their step must be 1")
    return SubmodelSpec(i, float(raw["gamma"]), float(raw["gamma_w"]), tuple(tuple(float(v) for v in st) for st in steps))


def parse_profile(data: dict[str, Any], source: str = "<memory>") -> Profile:
    required = ("name", "arch", "num_classes", "input_shape", "submodels")
    for field in required:
        if field not in data:
            raise _fail(source, "top level", f"missing field '{field}'")
    arch_name = data["arch"]
    if arch_name not in ARCHS:
        raise _fail(source, "field 'arch'", f"unknown architecture {arch_name!r}; known: {', '.join(ARCHS)}")
    arch = ARCHS[arch_name]
    stem = data.get("stem", arch.default_stem)
    if stem not in arch.stems:
        raise _fail(source, "field 'stem'", f"must be one of {arch.stems} for {arch.name}, got {stem!r}")
    layernorm = data.get("layernorm", "consistent")
    if "layernorm" in data and arch.family != "vit":
        raise _fail(source, "field 'layernorm'", f"only ViT architectures have LayerNorm; remove it for {arch.name}")
    if layernorm not in LAYERNORM_MODES:
        raise _fail(source, "field 'layernorm'", f"must be one of {LAYERNORM_MODES}, got {layernorm!r}")
    method = data.get("method", "nefl")
    if method not in METHOD_NAMES:
        raise _fail(source, "field 'method'", f"must be one of {METHOD_NAMES}, got {method!r}")
    ncls = data["num_classes"]
    if not isinstance(ncls, int) or isinstance(ncls, bool) or ncls < 2:
        raise _fail(source, "field 'num_classes'", f"must be an integer >= 2, got {ncls!r}")
    shape = data["input_shape"]
    if not (isinstance(shape, list) and len(shape) == 3 and all(isinstance(v, int) and v > 0 for v in shape)):
        raise _fail(source, "field 'input_shape'", f"must be [channels, height, width] of positive integers, got {shape!r}")
    raw_subs = data["submodels"]
    if not isinstance(raw_subs, list) or not raw_subs:
        raise _fail(source, "field 'submodels'", "needs at least one [[submodels]] table")
    subs = [_parse_submodel(raw, i, arch, source) for i, raw in enumerate(raw_subs)]
    for a, b in zip(subs, subs[1:]):
        if b.gamma < a.gamma:
            raise _fail(source, f"submodel {b.index + 1}: field 'gamma'", "submodels must be ordered by increasing gamma")
    known = {"name", "description", "arch", "stem", "num_classes", "input_shape", "dataset", "method", "submodels",
             "layernorm"}
    unknown = set(data) - known
    if unknown:
        raise _fail(source, "top level", f"unknown field(s) {sorted(unknown)}; allowed: {sorted(known)}")
    return Profile(
        name=str(data["name"]),
        description=str(data.get("description", "")),
        arch=arch,
        stem=stem,
        num_classes=ncls,
        input_shape=(shape[0], shape[1], shape[2]),
        dataset=str(data.get("dataset", "cifar10")),
        method=method,
        submodels=tuple(subs),
        source=source,
        layernorm=layernorm,
    )


def resolve_profile_path(name_or_path: str | Path) -> Path:
    """Accept a path, or the name of a shipped profile (with or without .toml)."""
    p = Path(name_or_path)
    if p.exists():
        return p
    shipped = PROFILES_DIR / (p.name if p.suffix == ".toml" else f"{p.name}.toml")
    if shipped.exists():
        return shipped
    shipped_names = list_profiles()
    if not shipped_names:
        raise ProfileError(f"{name_or_path}: no such profile file, and no shipped profiles in {PROFILES_DIR}; "
                           "pass a TOML path or reinstall nefl-edge")
    near = difflib.get_close_matches(p.stem, shipped_names, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(near)}? " if near else ""
    raise ProfileError(f"{name_or_path}: no such profile file; {hint}pass a path or one of: {', '.join(shipped_names)}")


def load_profile(name_or_path: str | Path) -> Profile:
    path = resolve_profile_path(name_or_path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"{path}: not valid TOML: {e}") from None
    return parse_profile(data, str(path))


def list_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.toml"))
