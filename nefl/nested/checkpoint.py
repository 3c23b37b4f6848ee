"""Checkpoints: global state as safetensors plus JSON metadata, replaced as a whole.

A run directory DIR holds

    DIR/CURRENT                  one line: the name of the committed snapshot
    DIR/checkpoints/<name>/      state.safetensors (flat names, see GlobalState.flat), meta.json
                                 (profile, its hash, method, round), profile.toml (the ladder, so
                                 export and resume need nothing else), metrics.json (the round's line)
    DIR/metrics.jsonl            one line per round, appended after the checkpoint is committed

A snapshot is written into a fresh temp directory, every file fsynced, and renamed to its final
name; only then does replacing CURRENT commit it. A crash at any instant thus leaves CURRENT
naming the old complete snapshot or the new one, never a mix that --resume would have to refuse
with the old state already gone. The round's metrics line rides inside the snapshot, so a crash
between the commit and the metrics.jsonl append loses nothing (replay_metrics restores it).
Runs written before snapshots (the three files directly in DIR) still load. Loading never
unpickles anything.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from safetensors import SafetensorError
from safetensors.torch import load_file

from nefl.nested.profile import Profile, ProfileError, load_profile
from nefl.nested.state import GlobalState, Layout, all_finite
from nefl.nested.tensorfile import encode_tensors
from nefl.support.fsio import atomic_write, fsync_dir, fsync_file

STATE_FILE, META_FILE, PROFILE_FILE, ROUND_METRICS_FILE = "state.safetensors", "meta.json", "profile.toml", "metrics.json"
POINTER_FILE, SNAPSHOTS_DIR, METRICS_FILE = "CURRENT", "checkpoints", "metrics.jsonl"
UPDATES_TOTAL_KEY = "updates_per_submodel_total"  # meta: committed federated updates per submodel so far
_SNAPSHOT_NAME = re.compile(r"[0-9]{8}")
_TEMP_PREFIX = ".tmp-"
_TORN = object()  # a metrics line that does not parse

# Tests set this to crash the writer (os._exit) at a named step; production leaves it None.
_crash_hook: Callable[[str], None] | None = None


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; never silently replaced by a fresh start."""


@dataclass
class Checkpoint:
    state: GlobalState
    layout: Layout
    meta: dict[str, Any]


def _step(name: str) -> None:
    if _crash_hook is not None:
        _crash_hook(name)


def save_checkpoint(directory: str | Path, state: GlobalState, layout: Layout, meta: dict[str, Any],
                    metrics: dict[str, Any] | None = None) -> Path:
    """Write a new snapshot of DIR and commit it; the previous one stays until CURRENT has moved.

    `metrics` is the round's metrics line, kept with the snapshot so replay_metrics can restore it.
    """
    files = _snapshot_files(state, layout, meta, metrics)
    d = Path(directory)
    snapshots = d / SNAPSHOTS_DIR
    _make_dirs(snapshots)
    previous = _pointer(d)
    name = _next_name(snapshots)
    _step("mkdtemp")
    tmp = Path(tempfile.mkdtemp(dir=snapshots, prefix=_TEMP_PREFIX))
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the checkpoint from a service user
    for file_name, write in files.items():
        _step(f"write:{file_name}")
        write(tmp / file_name)
        _step(f"fsync:{file_name}")
        fsync_file(tmp / file_name)
    _step("fsync:snapshot")
    fsync_dir(tmp)
    _step("rename")
    os.rename(tmp, snapshots / name)
    _step("fsync:checkpoints")
    fsync_dir(snapshots)
    _commit(d, name)
    _collect(d, keep={name, previous})
    return d


def _make_dirs(path: Path) -> None:
    """mkdir -p that makes each new entry durable, so a committed CURRENT never outlives its folder."""
    if path.is_dir():
        return
    _make_dirs(path.parent)
    path.mkdir(exist_ok=True)
    fsync_dir(path.parent)


def _next_name(snapshots: Path) -> str:
    """Names count up, so a crashed writer's uncommitted snapshot is never reused or mistaken for the newest."""
    taken = [int(p.name) for p in snapshots.iterdir() if _SNAPSHOT_NAME.fullmatch(p.name)]
    return f"{max(taken, default=0) + 1:08d}"


def _snapshot_files(state: GlobalState, layout: Layout, meta: dict[str, Any],
                    metrics: dict[str, Any] | None) -> dict[str, Callable[[Path], None]]:
    """The snapshot's writers, with the JSON already serialised: a value json can't take fails before the disk is touched."""
    flat = state.flat()
    full_meta = {**meta, "profile": layout.profile.name, "profile_hash": profile_hash(layout), "method": layout.method.name}
    # msgspec's encoder: json's indenting one is pure Python, slow on a large fleet's pins and histories
    texts = {META_FILE: msgspec.json.format(msgspec.json.encode(full_meta), indent=2).decode()}
    profile_src = Path(layout.profile.source)
    if profile_src.is_file():
        texts[PROFILE_FILE] = profile_src.read_text()
    if metrics is not None:
        texts[ROUND_METRICS_FILE] = _metrics_line(metrics)
    files: dict[str, Callable[[Path], None]] = {STATE_FILE: lambda p: p.write_bytes(encode_tensors(flat, None))}
    for name, text in texts.items():
        files[name] = lambda p, text=text: p.write_text(text)
    return files


def _commit(d: Path, name: str) -> None:
    """Replacing CURRENT is the commit: before its rename readers see the old snapshot, after it the new."""
    def write(tmp: str) -> None:
        Path(tmp).write_text(name + "\n")
        _step("pointer:rename")

    _step("pointer:write")
    atomic_write(d / POINTER_FILE, write)


def _collect(d: Path, keep: set[str | None]) -> None:
    """Best effort after the commit: older snapshots, and temp files a crashed writer left behind."""
    for p in sorted((d / SNAPSHOTS_DIR).iterdir()):
        if p.name not in keep:
            _step(f"gc:{p.name}")
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    p.unlink()
    for p in d.glob(f".{POINTER_FILE}.*"):
        with contextlib.suppress(OSError):
            p.unlink()


def _pointer(d: Path) -> str | None:
    path = d / POINTER_FILE
    try:
        name = path.read_text().strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable ({e}); {recovery_hint(d)}") from None
    if not _SNAPSHOT_NAME.fullmatch(name):
        raise CheckpointError(f"{path}: names no snapshot ({name[:40]!r}); {recovery_hint(d)}")
    return name


def has_checkpoint(directory: str | Path) -> bool:
    """Whether DIR holds a committed checkpoint (snapshot or old flat layout) that a fresh run would clobber."""
    d = Path(directory)
    return (d / POINTER_FILE).exists() or (d / META_FILE).exists()


def checkpoint_files(directory: str | Path) -> Path:
    """The folder holding the committed checkpoint's files: the snapshot CURRENT names, or DIR for old runs."""
    d = Path(directory)
    name = _pointer(d)
    if name is None:
        if (d / META_FILE).exists() and (d / STATE_FILE).exists():
            return d
        raise CheckpointError(
            f"{d}: no checkpoint here (needs {POINTER_FILE}, or {META_FILE} and {STATE_FILE}); check --checkpoint-dir")
    snapshot = d / SNAPSHOTS_DIR / name
    if not snapshot.is_dir():
        raise CheckpointError(f"{d / POINTER_FILE}: snapshot {snapshot} is missing; {recovery_hint(d, name)}")
    return snapshot


def profile_hash(layout: Layout) -> str:
    """Hash of the ladder actually trained (after the method's derivation)."""
    return layout.profile.hash


def recovery_hint(directory: str | Path, broken: str | None = None) -> str:
    """The fix for a committed snapshot that cannot be used: the newest other snapshot whose files
    read back whole (a commit keeps the previous one until the next), or a backup."""
    d = Path(directory)
    broken = broken or _committed_name(d)
    names = sorted((p.name for p in (d / SNAPSHOTS_DIR).glob("*") if _SNAPSHOT_NAME.fullmatch(p.name)), reverse=True) \
        if (d / SNAPSHOTS_DIR).is_dir() else []
    for name in names:
        snapshot = d / SNAPSHOTS_DIR / name
        try:
            meta = json.loads((snapshot / META_FILE).read_text())
            intact = all(not t.is_floating_point() or all_finite(t) for t in load_file(str(snapshot / STATE_FILE)).values())
        except (OSError, ValueError, SafetensorError):
            continue
        if name != broken and intact:
            return (f"the earlier snapshot {snapshot} (round {meta.get('round')}) is intact: `echo {name} > "
                    f"{d / POINTER_FILE}` makes --resume continue from it (or restore a backup, or start without --resume)")
    return "restore a backup or start without --resume"


def _committed_name(d: Path) -> str | None:
    try:
        return (d / POINTER_FILE).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def load_checkpoint(directory: str | Path, profile: Profile | None = None) -> Checkpoint:
    """Load and verify; `profile` (when given) must be the one the checkpoint was trained with."""
    d = checkpoint_files(directory)
    meta_path, state_path = d / META_FILE, d / STATE_FILE
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{meta_path}: corrupt metadata ({e}); {recovery_hint(directory)}") from None
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
        raise CheckpointError(f"{state_path}: corrupt state file ({e}); {recovery_hint(directory)}") from None
    try:
        state = GlobalState.from_flat(flat, layout)
    except ValueError as e:
        raise CheckpointError(f"{state_path}: {e}") from None
    bad = [n for n, t in flat.items() if t.is_floating_point() and not all_finite(t)]
    if bad:
        raise CheckpointError(f"{state_path}: non-finite values in {bad[:3]}; {recovery_hint(directory)}")
    return Checkpoint(state, layout, meta)


def _metrics_line(facts: dict[str, Any]) -> str:
    return json.dumps(facts) + "\n"


def append_metrics(directory: str | Path, facts: dict[str, Any]) -> None:
    """Append one line to DIR/metrics.jsonl, durably: the next round must not start before it is on disk."""
    d = Path(directory)
    _make_dirs(d)
    path = d / METRICS_FILE
    created = not path.exists()
    with open(path, "a") as f:
        f.write(_metrics_line(facts))
        f.flush()
        os.fsync(f.fileno())
    if created:
        fsync_dir(d)


def replay_metrics(directory: str | Path) -> int:
    """Repair DIR/metrics.jsonl after a crash, before a resumed run appends to it.

    Drops a torn last line, then re-appends the committed checkpoint's line if the crash came
    between the commit and the append. Returns how many lines it restored (0 or 1).
    """
    d = Path(directory)
    lines = _drop_torn_tail(d / METRICS_FILE)
    if not has_checkpoint(d):
        return 0
    saved = checkpoint_files(d) / ROUND_METRICS_FILE
    if not saved.exists():
        return 0  # an old flat checkpoint, or one saved without metrics
    try:
        facts = json.loads(saved.read_text())
    except (OSError, ValueError):
        facts = None
    if not isinstance(facts, dict):
        raise CheckpointError(f"{saved}: corrupt metrics line; delete it to resume without restoring it")
    if any(_round_of(seen) == facts.get("round") for seen in lines):
        return 0
    append_metrics(d, facts)
    return 1


def read_metrics(directory: str | Path) -> list[dict[str, Any]]:
    """The round lines of DIR/metrics.jsonl for readers (status, dashboards): a line torn by a crash
    mid-append is skipped here, and only `replay_metrics` on resume repairs the file. A served round's scores
    come later, in a line of their own (`"evaluated": true`): they are merged into that round's line."""
    try:
        text = (Path(directory) / METRICS_FILE).read_text(errors="replace")
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            facts = json.loads(line)
        except ValueError:
            continue
        if not isinstance(facts, dict):
            continue
        if facts.get("evaluated"):
            line = next((m for m in reversed(out) if m.get("round") == facts.get("round")), None)
            if line is not None:
                line.update(facts)
                continue
        out.append(facts)
    return out


def _drop_torn_tail(path: Path) -> list[str]:
    """Truncate an unterminated or unparsable last line (a crash mid-append); returns the lines kept."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    start = data.rfind(b"\n", 0, max(len(data) - 1, 0)) + 1  # where the last line begins
    keep = len(data) if data.endswith(b"\n") and _round_of(data[start:]) is not _TORN else start
    if keep < len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
            os.fsync(f.fileno())
    return data[:keep].decode(errors="replace").splitlines()


def _round_of(line: str | bytes) -> Any:
    """The line's round, None if it has none, _TORN if it is not JSON at all."""
    try:
        facts = json.loads(line)
    except ValueError:
        return _TORN
    return facts.get("round") if isinstance(facts, dict) else None
