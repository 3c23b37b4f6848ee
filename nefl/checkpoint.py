"""Checkpoints: global state as safetensors plus JSON metadata, written atomically.

A checkpoint directory holds `state.safetensors` (flat names, see GlobalState.flat), `meta.json`
(profile, its hash, method, round, metrics) and `profile.toml` (the ladder, so export and resume
need nothing else). Writes go to temp files that are renamed into place, so a crash leaves either
the old checkpoint or the new one, never a torn one. Loading never unpickles anything.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from nefl.profile import Profile, ProfileError, load_profile
from nefl.state import GlobalState, Layout, all_finite

STATE_FILE, META_FILE, PROFILE_FILE = "state.safetensors", "meta.json", "profile.toml"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; never silently replaced by a fresh start."""


@dataclass
class Checkpoint:
    state: GlobalState
    layout: Layout
    meta: dict[str, Any]


def _atomic_write(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_checkpoint(directory: str | Path, state: GlobalState, layout: Layout, meta: dict[str, Any]) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    profile_src = Path(layout.profile.source)
    if profile_src.exists():
        _atomic_write(d / PROFILE_FILE, lambda tmp: Path(tmp).write_text(profile_src.read_text()))
    flat = {k: v.contiguous() for k, v in state.flat().items()}
    _atomic_write(d / STATE_FILE, lambda tmp: save_file(flat, tmp))
    full_meta = {
        **meta,
        "profile": layout.profile.name,
        "profile_hash": profile_hash(layout),
        "method": layout.method.name,
    }
    _atomic_write(d / META_FILE, lambda tmp: Path(tmp).write_text(json.dumps(full_meta, indent=2)))
    return d


def profile_hash(layout: Layout) -> str:
    """Hash of the ladder actually trained (after the method's derivation)."""
    return layout.profile.hash


def load_checkpoint(directory: str | Path, profile: Profile | None = None) -> Checkpoint:
    """Load and verify; `profile` (when given) must be the one the checkpoint was trained with."""
    d = Path(directory)
    meta_path, state_path = d / META_FILE, d / STATE_FILE
    if not meta_path.exists() or not state_path.exists():
        raise CheckpointError(f"{d}: no checkpoint here (needs {META_FILE} and {STATE_FILE}); check --checkpoint-dir")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{meta_path}: corrupt metadata ({e}); restore a backup or start without --resume") from None
    if profile is None:
        src = d / PROFILE_FILE
        if not src.exists():
            raise CheckpointError(f"{d}: no {PROFILE_FILE} beside the checkpoint; pass --profile")
        try:
            profile = load_profile(src)
        except ProfileError as e:
            raise CheckpointError(str(e)) from None
    try:
        layout = Layout.build(profile, meta.get("method"))
    except ValueError as e:
        raise CheckpointError(f"{meta_path}: {e}") from None
    if meta.get("profile_hash") != profile_hash(layout):
        raise CheckpointError(
            f"{d}: checkpoint was trained with profile {meta.get('profile')!r} (hash {meta.get('profile_hash')}), "
            f"not {profile.name!r} (hash {profile_hash(layout)}); use the matching --profile or another --checkpoint-dir"
        )
    try:
        flat = load_file(str(state_path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{state_path}: corrupt state file ({e}); restore a backup or start without --resume") from None
    try:
        state = GlobalState.from_flat(flat, layout)
    except ValueError as e:
        raise CheckpointError(f"{state_path}: {e}") from None
    bad = [n for n, t in flat.items() if t.is_floating_point() and not all_finite(t)]
    if bad:
        raise CheckpointError(f"{state_path}: non-finite values in {bad[:3]}")
    return Checkpoint(state, layout, meta)
