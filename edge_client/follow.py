"""`edge-client serve --follow`: take the models the aggregator rolls out, check them, swap them in while serving.

`Follower` is the device's side of a rollout as pure logic, like the training agent: messages in,
publishes and swaps out, through a `Transport` (MQTT) and a `Serving` (edge_client/serving.py).
`run` is the thin loop that feeds it from a broker connection in a background thread of `serve`.

What it does with a rollout (docs/deploy.md, "Rolling out a trained model"):

1. The signed rollout (deploy/rollout) names the version this device should run: the canary
   version when the device is on the canary list, the stable one otherwise.
2. The signed release of that version lists its files with sizes and the Merkle root of each file's
   wire chunks (nefl/protocol/merkle.py). The device
   takes only the submodels that fit its memory now (the runtime's own rule, `Submodel.fits`),
   plus the parity reference, and checks the disk before writing a byte.
3. Each chunk's Merkle proof is checked against its file's signed root (the wire format's own check,
   `check_release_chunk`) and the chunk is written into staging on disk with its proof, so a forged chunk
   is dropped alone and a broken transfer resumes, re-verified, with the chunks still missing.
4. Complete: every file's Merkle root is computed again from disk, the manifest's parity inputs run
   through onnxruntime here and must match the exporter's torch logits within the export's bound, the
   runtime is built and calibrated, and only then swapped in between two requests. The version before
   stays on disk and, until the new one has answered `health_requests` requests without more errors, in
   memory.
5. A version that fails parity, loading or the health check is refused here for good and the
   device goes back to (or stays on) the version before, saying why; an older version is taken only
   when the signed rollout revokes the one running (the operator's rollback).

Every refusal is a log line and the `event` of the next report; the old version keeps serving.
Reports (version, health, request counts and latencies, bytes fetched) go to deploy/status/{client},
retained and signed with the device key that `edge-client join` uses.
"""

from __future__ import annotations

import io
import logging
import queue
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import onnxruntime as ort
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from edge_client.probe import format_bytes
from edge_client.runtime import (MEMORY_RESERVE_BYTES, AdaptiveRuntime, ModelsError, Submodel, memory_headroom,
                                 session_options, usable_entries)
from edge_client.serving import Active, Serving
from edge_client.store import Staging, Store, StoreError
from nefl.protocol.manifest import Manifest, ManifestError, read_verified
from nefl.protocol.messages import MAX_RELEASE_BYTES, DeployReport, MessageError, Refusal, Release, Rollout
from nefl.protocol.mqtt import QOS, Connection, Transport
from nefl.protocol.signing import Signer, verify
from nefl.protocol.topics import Topics
from nefl.protocol.wire import Chunk, WireError, check_chunk, parse_chunk

log = logging.getLogger(__name__)
MAX_REFUSALS_REPORTED = 32


@dataclass(frozen=True)
class FollowConfig:
    client_id: str
    federation: str
    server_key: Ed25519PublicKey
    device_key: Signer
    include_untrained: bool = False
    memory_reserve_bytes: int = MEMORY_RESERVE_BYTES
    max_release_bytes: int = 1 << 30  # the files this device fetches of one release, together
    keep_free_bytes: int = 64 << 20  # disk that staging must leave free
    health_requests: int = 20  # requests a new version answers before the device judges its health
    max_error_increase: float = 0.05  # error rate over the version before's, beyond which it rolls itself back
    report_every_s: float = 5.0
    retry_s: float = 30.0  # after a disk or I/O failure, try staging again this much later
    stall_s: float = 30.0  # no chunk for this long while some are missing: ask the broker for them again


RuntimeFactory = Callable[[Path], AdaptiveRuntime]
MemoryProbe = Callable[[], int | None]


class Refused(Exception):
    """A message or version this device will not take: `reason` is a counter key, the text says why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def check_parity(directory: Path, manifest: Manifest) -> None:
    """Run the release's parity inputs through onnxruntime here; Refused when a submodel's logits leave
    the export's bound (a runtime that computes differently, a file that loads but is not what was checked)."""
    spec = manifest.parity
    if spec.file is None or spec.sha256 is None:
        raise Refused("parity", "the release carries no parity reference")
    with np.load(io.BytesIO(read_verified(directory, spec.file, spec.sha256)), allow_pickle=False) as ref:
        arrays = {name: ref[name] for name in ref.files}
    inputs = arrays.get("inputs")
    for entry in manifest.submodels:
        expected = arrays.get(f"logits_{entry.index}")
        if inputs is None or expected is None:
            raise Refused("parity", f"the parity reference has no inputs or logits for submodel {entry.index + 1}")
        session = ort.InferenceSession(read_verified(directory, entry.file, entry.sha256), session_options(1, False),
                                       providers=["CPUExecutionProvider"])
        for batch in spec.batch_sizes:
            got = session.run(None, {manifest.input.name: inputs[:batch]})[0]
            want = expected[:batch]
            diff = float(np.abs(got - want).max()) if got.shape == want.shape else float("inf")
            bound = spec.bound(float(np.abs(want).max()))
            if not diff <= bound:  # NaN fails too
                raise Refused("parity", f"parity failed on this device: submodel {entry.index + 1} at batch {batch} "
                                        f"differs from the exporter's logits by {diff:.3g}, over the bound {bound:.3g}")


def check_release_chunk(release: Release, wanted: set[str], chunk: Chunk) -> tuple[str, int]:
    """(file name, index) of a chunk of a file in `wanted` whose header describes that file of the signed release
    and whose Merkle proof ties its data to the file's signed root; Refused (with the wire's reason) otherwise."""
    header, position, index = chunk.header, chunk.header.submodel, chunk.index
    if position >= len(release.files) or release.files[position].name not in wanted:
        raise Refused("unwanted", f"dropped a chunk of v{release.version}: file {position} is not one this device fetches")
    f = release.files[position]
    where = f"chunk {index} of {f.name} (v{release.version})"
    if (header.dtype, header.size, header.chunk, header.digest) != ("raw", f.size, release.chunk_bytes, f.digest):
        raise Refused("inconsistent_chunks", f"dropped {where}: its header does not describe the signed file")
    try:
        check_chunk(chunk)
    except WireError as e:
        raise Refused(e.reason, f"dropped {where}: {e.detail}, which the signed release names; waiting for an intact "
                                "copy") from None
    return f.name, index


class Follower:
    def __init__(self, cfg: FollowConfig, transport: Transport, store: Store, serving: Serving, build: RuntimeFactory,
                 memory: MemoryProbe, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.cfg, self.transport, self.store, self.serving = cfg, transport, store, serving
        self.build, self.memory, self.clock, self.wall = build, memory, clock, wall
        self.topics = Topics(cfg.federation)
        self.state = store.load_state()
        self.rollout: Rollout | None = None
        self.target: int | None = None  # what the newest rollout asks of this device
        self.release: tuple[Release, bytes, Manifest] | None = None  # being fetched: release, signed bytes, our subset
        self.staging: Staging | None = None
        self.fallback: Active | None = None  # the version before the last swap, until the new one is healthy
        self.sizes: dict[int, tuple[int, int]] = {}  # per version kept: (bytes downloaded, bytes in its release)
        self.swap_ms: float | None = None
        self.event = ""
        self.health = "unknown"
        self.dropped: Counter[str] = Counter()
        self._logged: set[tuple[str, int | None]] = set()
        self._subscribed: set[str] = set()
        self._last_report = float("-inf")
        self._last_progress = clock()
        self._retry_at: float | None = None
        self.connection = 0  # the stamp of the broker connection reports go out on

    # -- versions on disk ---------------------------------------------------------------------------------
    @property
    def version(self) -> int | None:
        active = self.serving.current()
        return None if active is None else active.version

    def load_current(self) -> None:
        """Serve what the directory holds (a restart): its signed release re-verified, then loaded."""
        version = self.store.current
        if version is None:
            return
        try:
            self.sizes[version] = (0, release_size(self._stored_release(version)))
            self.serving.swap(Active(self.build(self.store.version_dir(version)), version))
            self.health = "ok"
            log.info(f"serving v{version} from {self.store.version_dir(version)}")
        except (Refused, ModelsError, OSError) as e:
            self._note("load", f"cannot serve v{version} from disk ({e}); waiting for the rollout", version)

    def _stored_release(self, version: int) -> Release:
        return self._verify_release(self.store.release_bytes(version), version)

    # -- connection ---------------------------------------------------------------------------------------
    def on_connected(self, connection: int = 0) -> None:
        """(Re)connected with a clean session (stamped `connection`, which its reports name): subscribe again to
        what is still needed, say where we are."""
        self.connection = connection
        self._subscribed.clear()
        if self.staging is not None:
            staging = self.staging
            total = sum(staging.release.chunks(f) for f in staging.files.values())
            missing = sum(len(staging.missing(name)) for name in staging.files)
            log.info(f"resuming v{staging.version}: {total - missing} of {total} chunks already staged, asking for the "
                     f"{missing} missing")
        self._subscribe([self.topics.deploy_rollout, *self._fetch_topics()])
        self._report(force=True)

    def _fetch_topics(self) -> list[str]:
        if self.release is None or self.staging is None:
            return [self.topics.deploy_release(self.target)] if self._fetching() else []
        release, staging = self.release[0], self.staging
        topics = []
        for name in staging.files:
            position = release.file(name)[0]
            missing = staging.missing(name)
            if len(missing) == release.chunks(release.file(name)[1]):
                topics.append(self.topics.deploy_file_chunks(release.version, position))
            else:
                topics += [self.topics.deploy_file(release.version, position, i) for i in missing]
        return topics

    def _fetching(self) -> bool:
        target, current = self.target, self.version
        return (target is not None and target != current and target not in self.state.refused
                and (current is None or target > current or current in self.state.revoked))

    def _subscribe(self, topics: list[str]) -> None:
        for topic in topics:
            if topic not in self._subscribed:
                self.transport.subscribe(topic, qos=QOS)
                self._subscribed.add(topic)

    def _unsubscribe_fetch(self) -> None:
        for topic in sorted(self._subscribed - {self.topics.deploy_rollout}):
            self.transport.unsubscribe(topic)
            self._subscribed.discard(topic)

    # -- inbound: the trust boundary ----------------------------------------------------------------------
    def dispatch(self, topic: str, payload: bytes) -> None:
        """Any message is taken, or refused with a counted reason and a log line; nothing inbound raises."""
        if not payload:
            return  # a retained message being cleared
        try:
            if topic == self.topics.deploy_rollout:
                self._on_rollout(payload)
            elif topic.startswith(f"{self.topics.root}/deploy/release/"):
                self._on_release(topic, payload)
            elif topic.startswith(f"{self.topics.root}/deploy/file/"):
                self._on_chunk(payload)
            else:
                self.dropped["unexpected_topic"] += 1
        except Refused as e:
            self._note(e.reason, str(e), self.staging.version if self.staging else None)
        except Exception:  # a bug must not stop the device serving: count it, keep the trace
            self.dropped["internal_error"] += 1
            log.error(f"internal error handling {topic}; the current version keeps serving\n{traceback.format_exc()}")

    def _note(self, reason: str, message: str, version: int | None = None) -> None:
        """A refusal: counted, and the event of the next report; logged and reported at once the first time
        per (reason, version), so a flood of forged chunks is one line and one report."""
        self.dropped[reason] += 1
        self.event = message
        if (reason, version) not in self._logged:
            self._logged.add((reason, version))
            log.warning(message + (f"; still serving v{self.version}" if self.version is not None else ""))
            self._report(force=True)

    def _signed(self, payload: bytes, what: str) -> bytes:
        try:
            return verify(payload, self.cfg.server_key)
        except MessageError as e:
            raise Refused(e.reason, f"refused {what}: {e.detail}") from None

    def _on_rollout(self, payload: bytes) -> None:
        body = self._signed(payload, "rollout message")
        try:
            rollout = Rollout.from_json(body)
        except MessageError as e:
            raise Refused(e.reason, f"refused rollout message: {e}") from None
        if rollout.federation != self.cfg.federation:
            raise Refused("wrong_federation", f"refused rollout of federation {rollout.federation!r}: this device "
                                              f"follows {self.cfg.federation!r}")
        if rollout.seq < self.state.seq:
            raise Refused("replayed", f"refused rollout #{rollout.seq}: #{self.state.seq} is already applied "
                                      "(an old message replayed)")
        self.rollout = rollout
        self.state.seq = rollout.seq
        self.state.revoked = sorted(set(self.state.revoked) | set(rollout.revoked))
        self.store.save_state(self.state)
        self._pursue(rollout.target(self.cfg.client_id))

    def _pursue(self, target: int | None) -> None:
        """Move toward `target`: nothing, a rollback, or a fetch (after checking it may be taken at all)."""
        self.target = target
        current = self.version
        if self.staging is not None and self.staging.version != target:
            self._drop_staging()
        if target is None or target == current:
            self._report(force=True)
            return
        if target in self.state.refused:
            self._report(force=True)  # already said why; the rollout's controller sees it in every report
            return
        if current is not None and target < current:
            if current not in self.state.revoked:
                self._report(force=True)
                raise Refused("downgrade", f"refused v{target}: older than v{current}, which this device runs, and "
                                           f"the rollout does not revoke v{current}: no downgrade unless the operator "
                                           "signs a rollback (`aggregator rollout rollback`)")
            if self._swap_back(target, "the operator's signed rollback"
                                       + (f" ({self.rollout.reason})" if self.rollout and self.rollout.reason else "")):
                return
        if self.store.has(target):
            self._install_stored(target)
            return
        if self.staging is None:
            self._unsubscribe_fetch()  # a release asked for by an earlier rollout is not wanted any more
            self._subscribe([self.topics.deploy_release(target)])
        self._report(force=True)

    def _on_release(self, topic: str, payload: bytes) -> None:
        version = int(topic.rsplit("/", 1)[1]) if topic.rsplit("/", 1)[1].isdigit() else None
        if version is None or version != self.target or not self._fetching():
            self.dropped["unwanted"] += 1
            return
        if self.staging is not None and self.staging.version == version:
            return  # the retained release again after a reconnect: staging goes on where it was
        release = self._verify_release(payload, version)
        manifest = self._plan(release)
        try:
            self.staging = Staging(self.store, release, [e.file for e in manifest.submodels] + [manifest.parity.file],
                                   self.cfg.keep_free_bytes)
        except StoreError as e:
            self._retry_at = self.clock() + self.cfg.retry_s
            raise Refused(e.reason, f"cannot stage v{version}: {e}") from None
        self.release = (release, bytes(payload), manifest)
        self._last_progress = self.clock()
        staged = self.staging.resumed_bytes
        log.info(f"fetching v{version}: submodels {[e.index + 1 for e in manifest.submodels]} of "
                 f"{[e.index + 1 for e in release.manifest.submodels]}, {self.staging.wanted_bytes} of "
                 f"{release_size(release)} bytes" + (f" ({staged} already staged: resuming)" if staged else ""))
        self._unsubscribe_fetch()
        self._subscribe(self._fetch_topics())
        self._report(force=True)
        if self.staging.done:
            self._install()

    def _verify_release(self, payload: bytes, version: int) -> Release:
        body = self._signed(payload, f"release v{version}")
        try:
            release = Release.from_json(body, MAX_RELEASE_BYTES)
        except MessageError as e:
            raise Refused(e.reason, f"refused release v{version}: {e}") from None
        if release.federation != self.cfg.federation:
            raise Refused("wrong_federation", f"refused release of federation {release.federation!r}: this device "
                                              f"follows {self.cfg.federation!r}")
        if release.version != version:
            raise Refused("version_mismatch", f"refused release: it says v{release.version} on the topic of v{version}")
        return release

    def _plan(self, release: Release) -> Manifest:
        """The release's manifest cut to the usable submodels that fit this device's memory now; Refused
        when none does or the files would exceed `max_release_bytes`."""
        try:
            usable = usable_entries(release.manifest, self.cfg.include_untrained)
        except ModelsError as e:
            raise self._refuse_for_good(release.version, "untrained", f"refused v{release.version}: {e}") from None
        headroom = memory_headroom(self.memory(), self.cfg.memory_reserve_bytes)
        fits = [e for e in usable if Submodel.from_entry(e, e.file).fits(1, headroom)]
        if not fits:
            smallest = min(Submodel.from_entry(e, e.file).memory_bytes(1) for e in usable)
            raise Refused("memory", f"refused v{release.version}: no submodel fits this device's memory (the smallest "
                                    f"needs {format_bytes(smallest)}, {format_bytes(headroom)} usable now)")
        names = [e.file for e in fits] + [release.manifest.parity.file]
        size = sum(release.file(name)[1].size for name in names if name is not None)
        if size > self.cfg.max_release_bytes:
            raise Refused("oversized", f"refused v{release.version}: its files for this device take {format_bytes(size)}, "
                                       f"over the {format_bytes(self.cfg.max_release_bytes)} it accepts")
        return msgspec.structs.replace(release.manifest, submodels=fits)

    def _on_chunk(self, payload: bytes) -> None:
        if self.staging is None or self.release is None:
            self.dropped["unwanted"] += 1
            return
        release, staging = self.release[0], self.staging
        try:
            chunk = parse_chunk(payload)
        except WireError as e:
            raise Refused(e.reason, f"dropped a chunk of v{release.version}: {e}") from None
        header, data = chunk.header, chunk.data
        if header.kind != "file" or header.federation != self.cfg.federation or header.round != release.version:
            self.dropped["unwanted"] += 1
            return
        name, index = check_release_chunk(release, set(staging.files), chunk)
        if index in staging.have[name]:
            self.dropped["duplicate"] += 1
            return
        try:
            staging.write(name, index, data, chunk.proof)
        except StoreError as e:
            raise self._abandon_staging(e) from None
        self._last_progress = self.clock()
        if staging.file_done(name):
            prefix = self.topics.deploy_file_chunks(release.version, release.file(name)[0])[:-1]
            for topic in sorted(t for t in self._subscribed if t.startswith(prefix)):
                self.transport.unsubscribe(topic)
                self._subscribed.discard(topic)
        if staging.done:
            self._install()

    # -- installing and swapping ---------------------------------------------------------------------------
    def _install(self) -> None:
        """All chunks are here: assemble, check on this device, load, swap."""
        assert self.staging is not None and self.release is not None
        release, raw, manifest = self.release
        staging = self.staging
        try:
            directory = staging.finish(manifest, raw)
        except StoreError as e:
            if e.reason == "disk_full":
                raise self._abandon_staging(e) from None
            self._unsubscribe_fetch()  # a file that failed its final hash is fetched again
            self._subscribe(self._fetch_topics())
            raise Refused(e.reason, f"cannot stage v{release.version}: {e}") from None
        fetched, self.staging, self.release = staging.fetched_bytes, None, None
        self._unsubscribe_fetch()
        self._go_live(release, directory, fetched)

    def _install_stored(self, version: int) -> None:
        """A version already complete on disk (a crash after staging, or a rollback target kept): check and swap."""
        try:
            release = self._stored_release(version)
        except (Refused, OSError) as e:  # a release.json changed on disk, or kept from before a release format change
            self.store.discard(version)
            if version == self.target:
                self._subscribe([self.topics.deploy_release(version)])
            raise Refused("load", f"v{version} on disk is unusable ({e}); fetching it again") from None
        self._go_live(release, self.store.version_dir(version), 0)

    def _go_live(self, release: Release, directory: Path, fetched: int) -> None:
        version = release.version
        try:
            manifest = msgspec.json.decode((directory / "manifest.json").read_bytes(), type=Manifest)
            check_parity(directory, manifest)
            runtime = self.build(directory)
        except Refused as e:
            raise self._refuse_for_good(version, e.reason, f"refused v{version}: {e}") from None
        except (ModelsError, ManifestError, msgspec.DecodeError, OSError, ValueError, RuntimeError) as e:
            raise self._refuse_for_good(version, "load", f"refused v{version}: it does not load here: "
                                                         f"{str(e)[:200]}") from None
        before = self.serving.current()
        self.swap_ms = self.serving.swap(Active(runtime, version)) * 1000
        forward = before is None or before.version is None or version > before.version
        self.store.activate(version, keep_previous=forward)  # a version left by a rollback is not worth keeping
        self.fallback = before
        kept = {v: s for v, s in self.sizes.items() if v == self.store.previous}
        self.sizes = kept | {version: (fetched, release_size(release))}
        self.health = "unknown"
        self.event = (f"swapped v{before.version} -> v{version}" if before is not None else f"serving v{version}") + \
            f" ({fetched} bytes fetched, {release_size(release)} in the release; swap held requests " \
            f"{self.swap_ms:.3f} ms)"
        log.info(self.event)
        self._report(force=True)

    def _refuse_for_good(self, version: int, reason: str, message: str) -> Refused:
        """This version is never taken again here; the files are deleted; the report says why."""
        self.state.refused[version] = message
        self.store.save_state(self.state)
        if self.store.current != version:
            self.store.discard(version)
        return Refused(reason, message)

    def _swap_back(self, target: int, why: str) -> bool:
        """Serve `target` again, from memory (the health window) or from disk; False when it must be fetched."""
        bad = self.version
        if self.fallback is not None and self.fallback.version == target:
            active = self.fallback
        elif self.store.has(target):
            try:
                size = release_size(self._stored_release(target))
                active = Active(self.build(self.store.version_dir(target)), target)
            except (Refused, ModelsError, OSError) as e:
                self._note("load", f"cannot go back to v{target} from disk ({e}); fetching it", target)
                return False
            self.sizes.setdefault(target, (0, size))
        else:
            return False
        self.swap_ms = self.serving.swap(active) * 1000
        self.store.activate(target, keep_previous=False)
        self.fallback, self.health = None, "ok"
        self.event = f"rolled back v{bad} -> v{target}: {why}"
        log.warning(self.event)
        self._report(force=True)
        return True

    def _abandon_staging(self, error: StoreError) -> Refused:
        """The disk failed while staging: free what was staged, try again in retry_s."""
        version = self.staging.version if self.staging is not None else None
        self._drop_staging()
        self._retry_at = self.clock() + self.cfg.retry_s
        return Refused(error.reason, f"cannot stage v{version}: {error}; staging discarded, retrying in "
                                     f"{self.cfg.retry_s:g} s")

    def _drop_staging(self) -> None:
        if self.staging is not None:
            self.staging.discard()
        self.staging, self.release = None, None
        self._unsubscribe_fetch()

    # -- time ---------------------------------------------------------------------------------------------
    def tick(self) -> None:
        """Health of a fresh version, stalled or failed transfers, periodic reports."""
        self._check_health()
        now = self.clock()
        if self._retry_at is not None and now >= self._retry_at:
            self._retry_at = None
            if self.staging is None and self._fetching():
                self._subscribed.discard(self.topics.deploy_release(self.target))
                self.transport.unsubscribe(self.topics.deploy_release(self.target))
                self._subscribe([self.topics.deploy_release(self.target)])  # the retained release comes again
        if self.staging is not None and now - self._last_progress > self.cfg.stall_s:
            self._last_progress = now
            missing = sum(len(self.staging.missing(n)) for n in self.staging.files)
            log.info(f"no chunk of v{self.staging.version} for {self.cfg.stall_s:g} s, {missing} missing: asking again")
            self._unsubscribe_fetch()
            self._subscribe(self._fetch_topics())
        self._report()

    def _check_health(self) -> None:
        """The first `health_requests` answers of a new version against the last ones of the version before:
        more errors by over `max_error_increase` and the device rolls itself back."""
        version = self.version
        if self.health != "unknown" or version is None:
            return
        now = self.serving.stats(version)
        if now is None or now.requests < self.cfg.health_requests:
            return
        previous = self.fallback.version if self.fallback is not None else self.store.previous
        before = self.serving.stats(previous)
        rate_before = before.errors / before.requests if before is not None and before.requests else 0.0
        if now.errors / now.requests <= rate_before + self.cfg.max_error_increase:
            self.health, self.fallback = "ok", None  # the version before is kept on disk only from now on
            self._report(force=True)
            return
        self.health = "failing"
        why = (f"health check failed: {now.errors} of {now.requests} requests failed after the swap, "
               f"{before.errors if before else 0} of {before.requests if before else 0} before "
               f"(allowed +{self.cfg.max_error_increase:.0%})")
        self.state.refused[version] = f"refused v{version}: {why}"
        self.store.save_state(self.state)
        if previous is None or not self._swap_back(previous, why):
            self._note("health", f"v{version} {why}, and there is no version to go back to", version)
            self._report(force=True)

    # -- reports --------------------------------------------------------------------------------------------
    def report(self) -> DeployReport:
        active = self.serving.current()
        version = None if active is None else active.version
        refused = sorted(self.state.refused.items())[-MAX_REFUSALS_REPORTED:]
        fetched, size = self.sizes.get(version, (0, 0)) if version is not None else (0, 0)
        state = "staging" if self.staging is not None else "serving" if version is not None else "waiting"
        return DeployReport(
            client=self.cfg.client_id, federation=self.cfg.federation, key=self.cfg.device_key.public_text, state=state,
            version=version, previous=self.store.previous, target=self.target, health=self.health,
            current=self.serving.stats(version), before=self.serving.stats(self.store.previous), event=self.event[:300],
            refused=[Refusal(version=v, reason=r[:300]) for v, r in refused],
            fetched_bytes=fetched, release_bytes=size,
            submodels=sorted(s.index for s in active.runtime.submodels) if active is not None else [],
            swap_ms=None if self.swap_ms is None else round(self.swap_ms, 3), time=self.wall(),
            connection=self.connection,
        )

    def _report(self, force: bool = False) -> None:
        now = self.clock()
        if not force and now - self._last_report < self.cfg.report_every_s:
            return
        self._last_report = now
        payload = self.cfg.device_key.sign(self.report().to_json())
        self.transport.publish(self.topics.deploy_status(self.cfg.client_id), payload, qos=QOS, retain=True)


def release_size(release: Release) -> int:
    return sum(f.size for f in release.files)


def offline_report(cfg: FollowConfig, connection: int) -> bytes:
    """The last will on deploy/status/{client} for the connection stamped `connection`, signed now, before it is
    needed: "offline" from this device's key, closing that connection's reports and no other's."""
    report = DeployReport(client=cfg.client_id, federation=cfg.federation, key=cfg.device_key.public_text,
                          state="offline", connection=connection, time=connection / 1e6)
    return cfg.device_key.sign(report.to_json())


def run(follower: Follower, conn: Connection, stop: threading.Event) -> None:
    """Feed the follower from the broker until `stop` is set (the serve command's background thread)."""
    conn.start()
    try:
        while not stop.is_set():
            if conn.just_connected():
                follower.on_connected(conn.stamp)
            try:
                follower.dispatch(*conn.inbox.get(timeout=0.2))
            except queue.Empty:
                pass
            try:
                follower.tick()
            except Exception:  # keep following: the current version serves whatever went wrong here
                log.error(f"internal error in the follower's tick\n{traceback.format_exc()}")
    finally:
        conn.stop((follower.topics.deploy_status(follower.cfg.client_id), offline_report(follower.cfg, conn.stamp)))
