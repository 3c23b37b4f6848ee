"""A followed model directory on disk: the version serving, the one before it, and a download in progress.

    DIR/current  -> versions/v3      symlink, replaced atomically (rename over it) when a version goes live
    DIR/previous -> versions/v2      kept for a rollback
    DIR/versions/vN/                 manifest.json (the submodels this device fetched), their .onnx files,
                                     parity.npz, release.json (the signed release exactly as received)
    DIR/staging/vN/                  FILE.part while chunks arrive, FILE.proofs their Merkle proofs; renamed to
                                     versions/vN once complete
    DIR/follow.json                  the newest rollout applied, versions revoked, versions refused here and why

`edge-client infer --models DIR` and `serve --models DIR` read DIR/current, so a followed directory
is used like an export directory. A download resumes from what is on disk: every staged chunk is
checked again, with the proof it came with, against its file's Merkle root in the signed release when
staging (re)opens (nefl/protocol/merkle.py, the wire format's own check), so a crash, a restart or a
broker that dropped mid-transfer costs only the chunks that are missing, and a chunk changed on disk is
fetched again. Numpy-free.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path

import msgspec

from edge_client.probe import format_bytes
from nefl.protocol.manifest import MANIFEST_FILE, Manifest, write_manifest
from nefl.protocol.merkle import HASH_BYTES, leaf, merkle_root, merkle_root_of, proof_length
from nefl.protocol.messages import Release, ReleaseFile
from nefl.support.fsio import atomic_write_bytes, fsync_dir, fsync_file

CURRENT, PREVIOUS, VERSIONS, STAGING = "current", "previous", "versions", "staging"
log = logging.getLogger(__name__)
STATE_FILE, RELEASE_FILE = "follow.json", "release.json"


class StoreError(RuntimeError):
    """Staging cannot go on (`reason` disk_full or io_error); the message names the fix."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class FollowState(msgspec.Struct, kw_only=True):
    seq: int = 0  # the newest rollout applied: an older one is a replay
    revoked: list[int] = []  # versions the operator rolled back: never taken again
    refused: dict[int, str] = {}  # versions that failed here (parity, health, loading), and why


def followed_current(directory: Path) -> Path:
    """The directory to load models from: DIR itself for an export, DIR/current for a followed directory."""
    current = directory / CURRENT
    if not (directory / MANIFEST_FILE).exists() and current.exists():
        return current.resolve()
    return directory


class Store:
    def __init__(self, root: Path) -> None:
        self.root = root
        for sub in (VERSIONS, STAGING):
            (root / sub).mkdir(parents=True, exist_ok=True)

    # -- state ------------------------------------------------------------------------------------------
    def load_state(self) -> FollowState:
        try:
            return msgspec.json.decode((self.root / STATE_FILE).read_bytes(), type=FollowState)
        except FileNotFoundError:
            return FollowState()
        except (OSError, msgspec.DecodeError) as e:
            raise StoreError("io_error", f"{self.root / STATE_FILE}: unreadable ({e}); remove it to start over "
                             "(the device then takes the rollout's current version)") from None

    def save_state(self, state: FollowState) -> None:
        """Written through; a full disk only delays it (the state stays in memory and the next save retries)."""
        try:
            atomic_write_bytes(self.root / STATE_FILE, msgspec.json.encode(state))
        except OSError as e:
            log.warning(f"cannot write {self.root / STATE_FILE} ({e.strerror or e}); the rollout state is kept in "
                        "memory until it can be")

    # -- versions ---------------------------------------------------------------------------------------
    def version_dir(self, version: int) -> Path:
        return self.root / VERSIONS / f"v{version}"

    def _linked(self, name: str) -> int | None:
        link = self.root / name
        if not link.is_symlink() or not link.exists():
            return None
        target = os.readlink(link)
        try:
            return int(Path(target).name.removeprefix("v"))
        except ValueError:
            return None

    @property
    def current(self) -> int | None:
        return self._linked(CURRENT)

    @property
    def previous(self) -> int | None:
        return self._linked(PREVIOUS)

    def has(self, version: int) -> bool:
        d = self.version_dir(version)
        return (d / MANIFEST_FILE).is_file() and (d / RELEASE_FILE).is_file()

    def release_bytes(self, version: int) -> bytes:
        return (self.version_dir(version) / RELEASE_FILE).read_bytes()

    def activate(self, version: int, keep_previous: bool = True) -> None:
        """Point `current` at `version`; `previous` at the version it replaces (or nowhere, after a rollback,
        whose replaced version is not worth keeping); every other version is deleted."""
        old = self.current
        if keep_previous and old is not None and old != version:
            self._link(PREVIOUS, old)
        elif not keep_previous or old is None:
            (self.root / PREVIOUS).unlink(missing_ok=True)
        self._link(CURRENT, version)
        keep = {f"v{v}" for v in (self.current, self.previous) if v is not None}
        for d in (self.root / VERSIONS).iterdir():
            if d.name not in keep:
                shutil.rmtree(d, ignore_errors=True)

    def _link(self, name: str, version: int) -> None:
        tmp = self.root / f".{name}.tmp"
        tmp.unlink(missing_ok=True)
        os.symlink(Path(VERSIONS) / f"v{version}", tmp)
        os.replace(tmp, self.root / name)
        fsync_dir(self.root)

    def discard(self, version: int) -> None:
        shutil.rmtree(self.version_dir(version), ignore_errors=True)


class Staging:
    """The files of one release that this device wants, arriving chunk by chunk into FILE.part.

    Chunk i of a file lives at bytes [i * chunk_bytes, ...) of its part file and its proof at
    [i * depth * 32, ...) of its proofs file (depth: the longest proof of the file); which chunks are there is
    not recorded anywhere but recomputed from the bytes (each chunk's proof checked against the file's
    signed root), so the staged files alone are the truth about what a resumed download still needs.
    """

    def __init__(self, store: Store, release: Release, wanted: list[str], keep_free_bytes: int) -> None:
        self.store, self.release = store, release
        self.dir = store.root / STAGING / f"v{release.version}"
        for old in (store.root / STAGING).iterdir():  # a version no longer wanted only takes space
            if old != self.dir:
                shutil.rmtree(old, ignore_errors=True)
        self.files: dict[str, ReleaseFile] = {name: release.file(name)[1] for name in wanted}
        self.dir.mkdir(parents=True, exist_ok=True)
        self.have: dict[str, set[int]] = {name: self._scan(f) for name, f in self.files.items()}
        self.resumed_bytes = self.staged_bytes
        self.fetched_bytes = 0  # written by this process
        self._check_space(keep_free_bytes)

    @property
    def version(self) -> int:
        return self.release.version

    @property
    def wanted_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    @property
    def staged_bytes(self) -> int:
        return sum(self.chunk_size(f, i) for name, f in self.files.items() for i in self.have[name])

    def chunk_size(self, f: ReleaseFile, index: int) -> int:
        return min(self.release.chunk_bytes, f.size - index * self.release.chunk_bytes)

    def missing(self, name: str) -> list[int]:
        return [i for i in range(self.release.chunks(self.files[name])) if i not in self.have[name]]

    def file_done(self, name: str) -> bool:
        return len(self.have[name]) == self.release.chunks(self.files[name])

    @property
    def done(self) -> bool:
        return all(self.file_done(name) for name in self.files)

    def _part(self, name: str) -> Path:
        return self.dir / f"{name}.part"

    def _proofs(self, name: str) -> Path:
        return self.dir / f"{name}.proofs"

    def _proof_at(self, f: ReleaseFile, index: int) -> tuple[int, int]:
        """(offset, length) of chunk `index`'s proof in the proofs file."""
        count = self.release.chunks(f)
        return index * (count - 1).bit_length() * HASH_BYTES, proof_length(index, count) * HASH_BYTES

    def _scan(self, f: ReleaseFile) -> set[int]:
        """The chunks already staged whose bytes, with their staged proofs, hash up to the file's signed root."""
        have: set[int] = set()
        count, root = self.release.chunks(f), bytes.fromhex(f.digest)
        try:
            with open(self._part(f.name), "rb") as part, open(self._proofs(f.name), "rb") as proofs:
                for i in range(count):
                    part.seek(i * self.release.chunk_bytes)
                    data = part.read(self.chunk_size(f, i))
                    at, length = self._proof_at(f, i)
                    proofs.seek(at)
                    proof = proofs.read(length)
                    if len(proof) == length and merkle_root_of(data, i, count, proof) == root:
                        have.add(i)
        except FileNotFoundError:
            pass
        return have

    def _root_on_disk(self, f: ReleaseFile) -> bytes:
        """The Merkle root of the assembled part file, read chunk by chunk."""
        with open(self._part(f.name), "rb") as part:
            return merkle_root([leaf(part.read(self.chunk_size(f, i))) for i in range(self.release.chunks(f))])

    def _check_space(self, keep_free_bytes: int) -> None:
        need = self.wanted_bytes - self.staged_bytes
        free = shutil.disk_usage(self.dir).free
        if free - need < keep_free_bytes:
            raise StoreError("disk_full", f"v{self.version} needs {format_bytes(need)} more in {self.dir}, "
                             f"{format_bytes(free)} are free and {format_bytes(keep_free_bytes)} must stay free: free "
                             "some space (or lower --keep-free)")

    def write(self, name: str, index: int, data: bytes | memoryview, proof: bytes | memoryview) -> None:
        """Store chunk `index` of `name` and its Merkle proof (already checked against the signed root by the caller)."""
        try:
            _write_at(self._proofs(name), proof, self._proof_at(self.files[name], index)[0])
            _write_at(self._part(name), data, index * self.release.chunk_bytes)
        except OSError as e:
            reason = "disk_full" if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else "io_error"
            raise StoreError(reason, f"writing {name} of v{self.version} into {self.dir} failed: "
                                     f"{e.strerror or e}") from None
        self.have[name].add(index)
        self.fetched_bytes += len(data)

    def finish(self, manifest: Manifest, release_raw: bytes) -> Path:
        """Verify every whole file, write the device's manifest and the signed release beside them, and
        move the complete directory into versions/ (a crash before that leaves only staging behind)."""
        try:
            for name, f in self.files.items():
                part = self._part(name)
                if part.stat().st_size != f.size or self._root_on_disk(f) != bytes.fromhex(f.digest):
                    part.unlink()
                    self.have[name].clear()
                    raise StoreError("io_error", f"{name} of v{self.version} does not hash to the signed release after "
                                                 "assembly (changed on disk?); downloading it again")
                fsync_file(part)
                os.replace(part, self.dir / name)
                self._proofs(name).unlink(missing_ok=True)
            write_manifest(self.dir, manifest)
            atomic_write_bytes(self.dir / RELEASE_FILE, release_raw)
            target = self.store.version_dir(self.version)
            shutil.rmtree(target, ignore_errors=True)
            os.replace(self.dir, target)
            fsync_dir(target.parent)
        except OSError as e:
            raise StoreError("disk_full" if e.errno == errno.ENOSPC else "io_error",
                             f"finishing v{self.version} in {self.dir} failed: {e.strerror or e}") from None
        return target

    def discard(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _write_at(path: Path, data: bytes | memoryview, offset: int) -> None:
    """`data` at `offset` of `path` (created if missing); OSError, a short write as ENOSPC."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        written = os.pwrite(fd, data, offset)
    finally:
        os.close(fd)
    if written != len(data):
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (a short write)")


