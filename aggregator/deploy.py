"""What the aggregator rolls out: a signed release built from an export directory, and the rollout's state.

A release is the export's manifest (checked file by file against its sha256s first), where it came
from (checkpoint, round, the weights' sha256) and how its files travel: cut into chunks of the wire
format (nefl/protocol/wire.py, kind "file"), each file named by the Merkle root of its chunks, so a device
checks every chunk's proof on arrival and resumes a broken download. int8 files are not rolled out (a
device's parity check compares fp32 logits with the exporter's torch logits); the release's manifest drops them.

The rollout's state (which version is stable, which is on canary on which devices, what was revoked)
lives in the federation's key directory ($NEFL_KEY_DIR/FEDERATION/rollout/rollout.json) beside the
server key that signs it, whatever directory a command runs from: one history per federation. The
broker only carries copies (retained), so a broker that lost them gets them again from `aggregator
publish` of the same export, which keeps its version.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec

from nefl.protocol.manifest import MANIFEST_FILE, ManifestError, read_manifest, read_verified
from nefl.protocol.merkle import payload_root
from nefl.protocol.messages import MAX_RELEASE_BYTES, Release, ReleaseFile, Rollout
from nefl.protocol.signing import SIGNATURE_OVERHEAD
from nefl.protocol.topics import Topics
from nefl.protocol.wire import chunk_room, frame
from nefl.support.fsio import atomic_write_bytes

DEPLOY_DIR, STATE_FILE = "deploy", "rollout.json"
SENDER = "aggregator"  # the `client` of file chunks: they come from the server
log = logging.getLogger(__name__)


class DeployError(ValueError):
    """An export that cannot be rolled out, or a rollout step the state does not allow; the message names the fix."""


class ReleaseRecord(msgspec.Struct, kw_only=True):
    version: int
    manifest_sha256: str  # of the export's manifest.json: the same export published again keeps its version
    export_dir: str
    chunks: list[int]  # per file, to clear its retained chunks when the version is retired
    created: str


class RolloutState(msgspec.Struct, kw_only=True):
    seq: int = 0
    stable: int | None = None
    canary: int | None = None
    canary_devices: list[str] = []
    revoked: list[int] = []
    reason: str = ""
    history: list[int] = []  # stable versions in the order they went stable (rollbacks included)
    releases: dict[int, ReleaseRecord] = {}

    def rollout(self, federation: str) -> Rollout:
        return Rollout(federation=federation, seq=self.seq, stable=self.stable, canary=self.canary,
                       canary_devices=self.canary_devices, revoked=self.revoked, reason=self.reason[:300],
                       time=time.time())

    def retained_versions(self) -> set[int]:
        """Versions whose files stay on the broker: stable, canary, and the stable before (a rollback target)."""
        keep = {v for v in (self.stable, self.canary) if v is not None}
        earlier = [v for v in self.history if v != self.stable and v not in self.revoked]
        return keep | set(earlier[-1:])


def state_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / STATE_FILE


def migrate_state(run_dir: Path, state_dir: Path) -> None:
    """A state an older version kept in RUN/deploy/: moved into `state_dir`, or refused when both exist."""
    old, new = run_dir / DEPLOY_DIR / STATE_FILE, state_path(state_dir)
    if not old.is_file():
        return
    if new.is_file():
        raise DeployError(f"two rollout states: {old} (the old place) and {new}; keep the one with the higher "
                          f"\"seq\" in {state_dir} and delete the other")
    new.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    shutil.copyfile(old, new)
    old.unlink()
    log.warning(f"moved the rollout state from {old} to {new} (it lives with the federation's keys now)")


def load_state(state_dir: str | Path) -> RolloutState:
    path = state_path(state_dir)
    try:
        return msgspec.json.decode(path.read_bytes(), type=RolloutState)
    except FileNotFoundError:
        return RolloutState()
    except (OSError, msgspec.DecodeError) as e:
        raise DeployError(f"{path}: unreadable rollout state ({e}); restore it from a backup") from None


def save_state(state_dir: str | Path, state: RolloutState) -> None:
    path = state_path(state_dir)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    atomic_write_bytes(path, msgspec.json.format(msgspec.json.encode(state), indent=1))


def manifest_digest(export_dir: Path) -> str:
    try:
        return hashlib.sha256((export_dir / MANIFEST_FILE).read_bytes()).hexdigest()
    except OSError as e:
        raise DeployError(f"{export_dir}: no readable {MANIFEST_FILE} ({e.strerror}); export with "
                          f"`nefl-export onnx --checkpoint RUN --out {export_dir}`") from None


def build_release(export_dir: Path, federation: str, version: int, chunk_bytes: int) -> tuple[Release, dict[str, bytes]]:
    """The release of `export_dir` and the bytes of its files, each verified against the manifest."""
    try:
        manifest = read_manifest(export_dir)
        parity = manifest.parity
        if parity.file is None or parity.sha256 is None:
            raise DeployError(f"{export_dir}: no parity reference (exported before rollouts existed); export again "
                              "with `nefl-export onnx`, which writes parity.npz")
        names = {e.file: e.sha256 for e in manifest.submodels} | {parity.file: parity.sha256}
        data = {name: read_verified(export_dir, name, sha) for name, sha in names.items()}
    except ManifestError as e:
        raise DeployError(str(e)) from None
    if any(e.int8 is not None for e in manifest.submodels):
        log.warning("int8 files are not rolled out: devices get the fp32 submodels")
        manifest = msgspec.structs.replace(
            manifest, submodels=[msgspec.structs.replace(e, int8=None) for e in manifest.submodels])
    room = chunk_room(chunk_bytes)
    files = [ReleaseFile(name=name, sha256=names[name], size=len(blob), digest=payload_root(blob, room).hex())
             for name, blob in data.items()]
    try:
        release = Release(
            federation=federation, version=version, created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            source_checkpoint=(manifest.source_checkpoint or "")[:300], source_round=manifest.source_round,
            source_state_sha256=manifest.source_state_sha256, chunk_bytes=room, manifest=manifest, files=files)
        Release.from_json(release.to_json(), MAX_RELEASE_BYTES - SIGNATURE_OVERHEAD)  # as a device will check it
    except ValueError as e:  # MessageError included: the schema's ranges, or a release too large to send
        raise DeployError(f"{export_dir}: cannot be released ({e}); with `oversized`, raise --chunk-kib") from None
    return release, data


def file_messages(topics: Topics, release: Release, data: dict[str, bytes],
                  chunk_bytes: int) -> Iterator[tuple[int, str, bytes]]:
    """(file position, topic, message) of every chunk of every file, on the wire's framing: chunk i of
    file f on deploy/file/V/f/i."""
    for position, f in enumerate(release.files):
        for index, message in enumerate(frame(data[f.name], kind="file", federation=release.federation,
                                              round=release.version, submodel=position, client=SENDER, dtype="raw",
                                              chunk_bytes=chunk_bytes).messages):
            yield position, topics.deploy_file(release.version, position, index), message


def retired_topics(topics: Topics, record: ReleaseRecord) -> list[str]:
    """The retained topics of a version no longer kept on the broker (cleared with empty payloads)."""
    return [topics.deploy_release(record.version)] + [
        topics.deploy_file(record.version, position, index)
        for position, count in enumerate(record.chunks) for index in range(count)]
