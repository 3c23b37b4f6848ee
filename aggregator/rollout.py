"""`aggregator publish` and `aggregator rollout`: roll an export out to the devices that follow the federation.

    aggregator publish --export DIR [--canary 0.34 | --canary-devices a,b]    files + signed release + rollout
    aggregator rollout status | promote | rollback [--to V]

Without a canary a published version goes stable at once. With one, only the canary devices get it;
the command then watches their signed reports (deploy/status/{client}) and applies `CanaryRule` to
each: a canary that refused the version, rolled it back, or answers with an error rate or p95 latency
worse than its own previous version's by more than the rule's margin is against it; one that answered
`min_requests` requests within the margins is for it. More than half of the canaries against rolls it
back for everyone (revoked: no device will take it again); more than half for promotes it to stable
and the other devices take it. The same decisions can be
taken by hand with `aggregator rollout promote|rollback`. Every change is a new signed `Rollout`
with a higher sequence number (nefl/protocol/messages.py), kept in the federation's key directory
(KEY_DIR/FEDERATION/rollout/rollout.json): one history, wherever the command runs.

A report counts only under the key the federation's enrolment journal holds for its id (`aggregator
enroll ID --follower --public-key KEY`, or a training device's pin): canaries are drawn from enrolled devices that
reported, at random (the operator's randomness, not a function of the ids), and a majority of them
decides, so one enrolled device that lies about its own numbers does not decide alone.

`RolloutWatcher` keeps the same view (who runs which version) live for the dashboard of
`aggregator serve --http` (/api/rollout).
"""

from __future__ import annotations

import logging
import math
import queue
import random
import secrets
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

import msgspec
import typer
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from rich.table import Table

from aggregator.keys import KeyDir
from aggregator.deploy import (DeployError, ReleaseRecord, RolloutState, build_release, file_messages, load_state,
                               manifest_digest, migrate_state, retired_topics, save_state, state_path)
from aggregator.enrolment import Enrolment
from nefl.support.cli_options import (BrokerOption, BrokerOptions, CheckpointDirOption, ChunkKibOption, FederationOption, JsonOption,
                                      KeyDirOption, LogFormatOption, LogLevelOption, LogOptions)
from nefl.support.option_groups import grouped, option_group
from nefl.support.logs import console, progress, setup_logging
from nefl.protocol.messages import DeployReport, MessageError, Rollout
from nefl.protocol.mqtt import QOS, BrokerSettings, Connection, parse_broker
from nefl.protocol.signing import KeyFileError, Signer, parse_public_key, verify, verify_self_signed
from nefl.protocol.topics import Topics
from nefl.protocol.messages import DEFAULT_CHUNK_BYTES

log = logging.getLogger("aggregator.rollout")
DISCOVER_S = 2.0  # retained reports arrive right after subscribing; this long is plenty on a LAN


@dataclass(frozen=True)
class CanaryRule:
    """When a canary version is judged: each canary device has answered `min_requests` requests with it,
    and it is rolled back when its error rate exceeds the device's previous version's by more than
    `max_error_increase`, or its p95 latency by more than a factor `max_p95_ratio`."""

    min_requests: int = 30
    max_p95_ratio: float = 1.5
    max_error_increase: float = 0.02
    watch_s: float = 600.0  # give up waiting (the canary stays; decide with `aggregator rollout`)


@dataclass(frozen=True)
class Verdict:
    decision: Literal["wait", "promote", "rollback"]
    why: str


def judge_device(client: str, report: DeployReport | None, version: int, rule: CanaryRule) -> Verdict:
    if report is None or report.state == "offline":
        return Verdict("wait", f"{client}: no report (offline?)")
    refused = next((r.reason for r in report.refused if r.version == version), None)
    if refused is not None:
        return Verdict("rollback", f"{client}: {refused}")
    if report.version != version:
        return Verdict("wait", f"{client}: runs v{report.version}, {report.state}")
    now, before = report.current, report.before
    if now is None or now.requests < rule.min_requests:
        return Verdict("wait", f"{client}: {now.requests if now else 0} of {rule.min_requests} requests on v{version}")
    rate = now.errors / now.requests
    rate_before = before.errors / before.requests if before is not None and before.requests else 0.0
    if rate > rate_before + rule.max_error_increase:
        return Verdict("rollback", f"{client}: error rate {rate:.1%} on v{version}, {rate_before:.1%} on "
                                   f"v{before.version if before else '-'} (allowed +{rule.max_error_increase:.1%})")
    if before is not None and before.p95_ms and now.p95_ms is not None and now.p95_ms > before.p95_ms * rule.max_p95_ratio:
        return Verdict("rollback", f"{client}: p95 {now.p95_ms:.1f} ms on v{version}, {before.p95_ms:.1f} ms on "
                                   f"v{before.version} (x{now.p95_ms / before.p95_ms:.1f} > x{rule.max_p95_ratio:g})")
    p95 = f"p95 {now.p95_ms:.1f} ms" + (f" vs {before.p95_ms:.1f} ms on v{before.version}" if before and before.p95_ms else "")
    return Verdict("promote", f"{client}: {now.requests} requests, {now.errors} errors, {p95}")


def judge(reports: dict[str, DeployReport], devices: list[str], version: int, rule: CanaryRule) -> Verdict:
    """A majority of the canaries decides: rollback when more than half are against it, promote when more
    than half are for it, otherwise wait. Each canary speaks only for itself, so among three or more one
    that lies (good numbers for a bad version, or bad ones for a good version) cannot decide alone."""
    verdicts = [judge_device(d, reports.get(d), version, rule) for d in devices]
    quorum = len(devices) // 2 + 1
    for decision in ("rollback", "promote"):
        found = [v.why for v in verdicts if v.decision == decision]
        if found and len(found) >= quorum:
            return Verdict(decision, "; ".join(found))  # type: ignore[arg-type]
    return Verdict("wait", "; ".join(f"{v.why} ({v.decision})" if v.decision != "wait" else v.why for v in verdicts))


class EnrolledKeys:
    """The key the federation's enrolment journal holds for an id (a device's: granted with `aggregator enroll
    ID --public-key` or pinned when a join token was spent; a follower's: `aggregator enroll ID --follower --public-key`),
    re-read whenever the journal changes."""

    def __init__(self, keys: KeyDir) -> None:
        self.enrolment = Enrolment(keys.federation, journal=keys.journal)

    def __call__(self, client: str) -> str | None:
        self.enrolment.reload()
        return self.enrolment.report_key(client)


class FleetBook:
    """What the broker says about the fleet: the retained rollout (checked against the server key, never
    older than `seq_floor`, the operator state's) and the newest signed report of each device, taken only
    under the key its enrolment holds (`enrolled`). Bytes from the broker are hostile: anything that does
    not check out is counted in `rejected`, never raised, and never displaces the real device's report."""

    def __init__(self, topics: Topics, server_key: Ed25519PublicKey, enrolled: Callable[[str], str | None],
                 seq_floor: int = 0) -> None:
        self.topics, self.server_key, self.enrolled, self.seq_floor = topics, server_key, enrolled, seq_floor
        self.rollout: Rollout | None = None
        self.reports: dict[str, DeployReport] = {}
        self.rejected: Counter[str] = Counter()

    def feed(self, topic: str, payload: bytes) -> None:
        if not payload:
            return  # a retained message cleared
        try:
            if topic == self.topics.deploy_rollout:
                self.rollout = self._check_rollout(payload)
                return
            client = self.topics.client_of(topic, "deploy/status")
            if client is not None:
                self.reports[client] = self._check(client, payload)
        except MessageError as e:
            self.rejected[e.reason] += 1
            log.debug(f"{topic}: refused ({e})")

    def online(self) -> list[str]:
        """Devices whose last report is online and still signed by their enrolled key (not revoked since)."""
        return sorted(c for c, r in self.reports.items() if r.state != "offline" and self.enrolled(c) == r.key)

    def _check_rollout(self, payload: bytes) -> Rollout:
        rollout = Rollout.from_json(verify(payload, self.server_key))
        if rollout.federation != self.topics.federation:
            raise MessageError("wrong_federation", f"a rollout of federation {rollout.federation!r}")
        newest = max(self.seq_floor, self.rollout.seq if self.rollout is not None else 0)
        if rollout.seq < newest:
            raise MessageError("replayed", f"rollout #{rollout.seq} is older than #{newest}")
        return rollout

    def _check(self, client: str, payload: bytes) -> DeployReport:
        # every report signed, the last will included: an unsigned one (an older follower's, or anyone's) is refused
        body, key = verify_self_signed(payload, lambda b: DeployReport.from_json(b).key)
        report = DeployReport.from_json(body)
        if report.client != client or report.federation != self.topics.federation:
            raise MessageError("client_mismatch", f"report names {report.client}@{report.federation} on {client}'s topic")
        enrolled = self.enrolled(client)
        if enrolled is None:
            raise MessageError("not_enrolled", f"a report of {client}, which is not enrolled (`aggregator enroll "
                                               f"{client} --follower --public-key KEY`)")
        if enrolled != key:
            raise MessageError("key_mismatch", f"a report of {client} signed by {key[:12]}..., not its enrolled key")
        last = self.reports.get(client)
        if report.state == "offline":
            return self._closed(client, report, last)
        if last is not None and (report.connection, report.time) < (last.connection, last.time):
            raise MessageError("replayed", f"report of {client} older than the last one")
        if last is not None and last.state == "offline" and report.connection <= last.connection:
            raise MessageError("replayed", f"report of {client} from a connection its last will closed")
        return report

    @staticmethod
    def _closed(client: str, will: DeployReport, last: DeployReport | None) -> DeployReport:
        """The device's signed last will (or its clean goodbye): the last report, offline, when the will names
        the connection that report came on or a later one; a will of an earlier connection is a replay."""
        if last is None:
            return will
        if will.connection < last.connection:
            raise MessageError("replayed", f"a last will of {client} for an earlier connection than its last report's")
        return msgspec.structs.replace(last, state="offline", connection=will.connection)


class RolloutBroker:
    """A broker connection for the operator's commands: publishes (waited for), retained rollout and reports."""

    def __init__(self, settings: BrokerSettings, topics: Topics, server_key: Ed25519PublicKey,
                 enrolled: Callable[[str], str | None], seq_floor: int = 0) -> None:
        self.topics = topics
        self.book = FleetBook(topics, server_key, enrolled, seq_floor)
        self.conn = Connection(settings, f"nefl-rollout-{secrets.token_hex(4)}", None, b"", log)
        self.lock = threading.Lock()  # held while a message is taken in: a reader in another thread sees whole updates

    def connect(self, timeout_s: float = 10.0) -> None:
        self.conn.start()
        end = time.monotonic() + timeout_s
        while not self.conn.just_connected():
            if time.monotonic() > end:
                self.conn.stop()
                raise DeployError(f"cannot reach the broker at {self.conn.settings.url} within {timeout_s:g} s; "
                                  "is it running, and is the URL right?")
            time.sleep(0.05)
        for topic in (self.topics.deploy_rollout, self.topics.deploy_statuses):
            self.conn.client.subscribe(topic, QOS)

    def listen(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            try:
                topic, payload = self.conn.inbox.get(timeout=min(left, 0.2))
            except queue.Empty:
                continue
            with self.lock:
                self.book.feed(topic, payload)

    def publish(self, topic: str, payload: bytes, retain: bool = True) -> None:
        self.conn.client.publish(topic, payload, qos=QOS, retain=retain).wait_for_publish(30)

    def close(self) -> None:
        self.conn.stop()

    def online(self) -> list[str]:
        return self.book.online()


@dataclass
class Operator:
    """One operator command's world: where the state and key live, the broker link, the federation."""

    state_dir: Path
    federation: str
    signer: Signer
    state: RolloutState
    fleet: RolloutBroker

    @property
    def topics(self) -> Topics:
        return self.fleet.topics

    def apply(self, reason: str, **changes: Any) -> Rollout:
        """A new signed rollout: the state changed, saved, then published (retained); retired files cleared."""
        for name, value in changes.items():
            setattr(self.state, name, value)
        self.state.seq += 1
        self.state.reason = reason
        save_state(self.state_dir, self.state)
        rollout = self.state.rollout(self.federation)
        self.fleet.publish(self.topics.deploy_rollout, self.signer.sign(rollout.to_json()))
        self.retire()
        log.info(f"rollout #{rollout.seq}: stable v{rollout.stable}"
                 + (f", canary v{rollout.canary} on {', '.join(rollout.canary_devices)}" if rollout.canary else "")
                 + f" ({reason})")
        return rollout

    def retire(self) -> None:
        keep = self.state.retained_versions()
        for version, record in list(self.state.releases.items()):
            if version not in keep and record.chunks:
                for topic in retired_topics(self.topics, record):
                    self.fleet.publish(topic, b"")
                record.chunks = []  # cleared: a later rollback to it publishes the files again
        save_state(self.state_dir, self.state)

    def publish_files(self, export_dir: Path, version: int, chunk_bytes: int, fmt: str) -> None:
        """The release's files (retained chunks) first, then the signed release: a device that sees the
        release finds every chunk already there."""
        release, data = build_release(export_dir, self.federation, version, chunk_bytes)
        with progress(fmt, log, total=len(release.files)) as step:
            for position, topic, message in file_messages(self.topics, release, data, chunk_bytes):
                if topic.endswith("/0"):
                    step(f"v{version}: {release.files[position].name}")
                self.fleet.publish(topic, message)
        self.fleet.publish(self.topics.deploy_release(version), self.signer.sign(release.to_json()))
        self.state.releases[version] = ReleaseRecord(
            version=version, manifest_sha256=manifest_digest(export_dir), export_dir=str(export_dir.resolve()),
            chunks=[release.chunks(f) for f in release.files], created=release.created)
        save_state(self.state_dir, self.state)
        total = sum(f.size for f in release.files)
        log.info(f"published v{version}: {len(release.files)} files, {total} bytes in "
                 f"{sum(release.chunks(f) for f in release.files)} chunks (from {release.source_checkpoint or export_dir}, "
                 f"round {release.source_round})")

    def ensure_files(self, version: int, chunk_bytes: int, fmt: str) -> None:
        """A rollback target whose files were cleared from the broker: publish them again from its export."""
        record = self.state.releases.get(version)
        if record is None:
            raise DeployError(f"v{version} was never published here; versions: {sorted(self.state.releases)}")
        if not record.chunks:
            export_dir = Path(record.export_dir)
            if manifest_digest(export_dir) != record.manifest_sha256:
                raise DeployError(f"v{version}'s export {export_dir} changed since it was published; publish it "
                                  "as a new version instead")
            self.publish_files(export_dir, version, chunk_bytes, fmt)

    def check_current(self) -> None:
        """Refuse to sign from a state older than what the broker holds: another state (another key or
        state directory, a restored backup) published since, and acting here would fork the history."""
        seen = self.fleet.book.rollout
        if seen is not None and seen.seq > self.state.seq:
            raise DeployError(f"the broker holds rollout #{seen.seq}, newer than #{self.state.seq} in {self.state_dir}: "
                              "run this with the --key-dir (or --state-dir) of the operator that published it")

    def watch(self, version: int, rule: CanaryRule) -> Verdict:
        """Watch the canary devices' reports until the rule decides or `watch_s` passes."""
        devices = self.state.canary_devices
        end, said = time.monotonic() + rule.watch_s, ""
        while time.monotonic() < end:
            self.fleet.listen(1.0)
            verdict = judge(self.fleet.book.reports, devices, version, rule)
            if verdict.decision != "wait":
                return verdict
            if verdict.why != said:
                log.info(f"canary v{version}: {verdict.why}")
                said = verdict.why
        return Verdict("wait", f"undecided after {rule.watch_s:g} s: {said}")

    def promote(self, version: int, why: str) -> Rollout:
        history = [*self.state.history, version]
        return self.apply(f"v{version} promoted: {why}", stable=version, canary=None, canary_devices=[], history=history)

    def revoke_canary(self, version: int, why: str) -> Rollout:
        return self.apply(f"v{version} rolled back on the canary: {why}", canary=None, canary_devices=[],
                          revoked=sorted({*self.state.revoked, version}))

    def rollback(self, to: int | None, why: str, chunk_bytes: int, fmt: str) -> Rollout:
        """Revoke the stable version for `to` (default: the stable one before it), its files published again
        if the broker no longer holds them."""
        bad = self.state.stable
        earlier = [v for v in self.state.history if v != bad and v not in self.state.revoked]
        target = to or (earlier[-1] if earlier else None)
        if bad is None or target is None or target == bad:
            raise DeployError(f"nothing to roll back to (stable v{bad}, earlier stable versions {earlier or 'none'}); "
                              "give --to VERSION")
        self.ensure_files(target, chunk_bytes, fmt)
        return self.apply(f"v{bad} rolled back to v{target}: {why}", stable=target, canary=None, canary_devices=[],
                          revoked=sorted({*self.state.revoked, bad}), history=[*self.state.history, target])


OPERATOR_RANDOM = secrets.SystemRandom()


def choose_canaries(online: list[str], fraction: float | None, named: list[str], enrolled: Callable[[str], str | None],
                    rng: random.Random = OPERATOR_RANDOM) -> list[str]:
    """The named devices (each enrolled), or floor(fraction x online) of the online ones but at least one
    (0.34 of 3 is one device), drawn at random: nobody can pick an id that gets drawn, and successive
    versions spread over the fleet."""
    if named:
        unknown = sorted(d for d in set(named) if enrolled(d) is None)
        if unknown:
            raise DeployError(f"--canary-devices {', '.join(unknown)}: not enrolled in this federation "
                              "(`aggregator enroll ID --follower --public-key KEY`)")
        return sorted(set(named))
    if fraction is None or not online:
        return []
    return sorted(rng.sample(sorted(online), max(1, math.floor(fraction * len(online) + 1e-9))))


def connect_operator(checkpoint_dir: str | None, federation: str, broker: str, credentials: tuple[str | None, ...],
                     create_key: bool = True, key_dir: str | None = None, state_dir: str | None = None,
                     need_state: bool = False) -> Operator:
    """The operator's world, or exit 2 with the fix (bad URL, key, state, broker unreachable). Only the
    commands that sign create the server key when it is missing (as `aggregator key` does). The state is
    the key directory's (or `state_dir`); one an older version left in the run directory is moved there.
    `need_state`: a command that only reads the state refuses one that was never written."""
    checkpoint_dir = checkpoint_dir or f"runs/{federation}"
    try:
        topics = Topics(federation)
        settings = parse_broker(broker, *credentials)
        keys = KeyDir(federation, key_dir)
        signer = keys.server_signer(checkpoint_dir, create=create_key)
        where = Path(state_dir) if state_dir else keys.rollout_dir
        migrate_state(Path(checkpoint_dir), where)
        if need_state and not state_path(where).is_file():
            raise DeployError(f"no rollout state in {where}: nothing was published with these keys; give the "
                              "--key-dir (or --state-dir) of the operator that ran `aggregator publish`")
        state = load_state(where)
        fleet = RolloutBroker(settings, topics, parse_public_key(signer.public_text), EnrolledKeys(keys), state.seq)
        fleet.connect()
    except (ValueError, KeyFileError, OSError) as e:  # DeployError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
    fleet.listen(DISCOVER_S)
    return Operator(where, federation, signer, state, fleet)


@option_group("Federation")
class FederationOptions:
    """Where an operator command finds the federation: its broker, keys and rollout state."""

    broker: BrokerOption()
    federation: FederationOption() = "default"
    checkpoint_dir: CheckpointDirOption("The federation's run directory: a server key or rollout state an older "
                                        "version kept there is moved to the key directory (default: "
                                        "runs/FEDERATION).") = None
    key_dir: KeyDirOption = None
    state_dir: Annotated[Optional[str], typer.Option(
        help="Where the rollout's state lives (default: KEY_DIR/FEDERATION/rollout, one history per "
             "federation).")] = None
    mqtt: BrokerOptions = field(default_factory=BrokerOptions)


@contextmanager
def operating(where: FederationOptions, create_key: bool = True) -> Iterator[Operator]:
    """One operator command: connected, a DeployError turned into its one line and exit 2, disconnected after.
    A command that signs (`create_key`) first checks that the state is the newest the broker has seen; one
    that only reads (`rollout status`) needs a state to read."""
    op = connect_operator(where.checkpoint_dir, where.federation, where.broker, where.mqtt.credentials, create_key,
                          where.key_dir, where.state_dir, need_state=not create_key)
    try:
        if create_key:
            op.check_current()
        yield op
    except DeployError as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
    finally:
        op.fleet.close()


RULE = CanaryRule()


@grouped
def publish_command(
    export: Path = typer.Option(..., "--export", help="Export directory (`nefl-export onnx --out DIR`)."),
    canary: float = typer.Option(None, "--canary", min=0.0, max=1.0, help="Give the new version first to this fraction "
                                 "of the devices that follow (rounded down, at least one), then judge it."),
    canary_devices: str = typer.Option(None, "--canary-devices", help="Or these devices (comma-separated client ids)."),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="With a canary: watch it and promote or roll back by the "
                              "rule (else decide later with `aggregator rollout promote|rollback`)."),
    watch_s: float = typer.Option(RULE.watch_s, "--watch-s", min=1, help="Longest wait for the canary's verdict."),
    min_requests: int = typer.Option(RULE.min_requests, "--min-requests", min=1, help="Requests each canary answers "
                                     "with the new version before it is judged."),
    max_p95_ratio: float = typer.Option(RULE.max_p95_ratio, "--max-p95-ratio", min=1.0, help="Roll back when a "
                                        "canary's p95 latency exceeds its previous version's by this factor."),
    max_error_increase: float = typer.Option(RULE.max_error_increase, "--max-error-increase", min=0.0, max=1.0,
                                             help="Roll back when a canary's error rate exceeds its previous "
                                                  "version's by more than this (0.02: two points)."),
    chunk_kib: ChunkKibOption = DEFAULT_CHUNK_BYTES // 1024,
    *,
    where: FederationOptions,
    logs: LogOptions,
) -> None:
    """Roll an export out to the devices following the federation (`edge-client serve --follow`): signed, retained."""
    setup_logging(logs.log_level, logs.log_format, context={"federation": where.federation})
    named = [d.strip() for d in (canary_devices or "").split(",") if d.strip()]
    with operating(where) as op:
        code = _publish(op, export, canary, named, wait, chunk_kib * 1024, logs.log_format,
                        CanaryRule(min_requests, max_p95_ratio, max_error_increase, watch_s))
    raise typer.Exit(code)


def _publish(op: Operator, export: Path, fraction: float | None, named: list[str], wait: bool, chunk_bytes: int,
             fmt: str, rule: CanaryRule) -> int:
    """Exit code: 0 published (or promoted), 1 rolled back or undecided."""
    digest = manifest_digest(export)
    known = next((r.version for r in op.state.releases.values() if r.manifest_sha256 == digest), None)
    version = known or max(op.state.releases, default=0) + 1
    if version in op.state.revoked:
        raise DeployError(f"{export} is v{version}, which was rolled back; export a new checkpoint to publish")
    op.publish_files(export, version, chunk_bytes, fmt)
    devices = choose_canaries(op.fleet.online(), fraction, named, op.fleet.book.enrolled)
    if fraction is not None and not devices:
        raise DeployError(f"no device follows federation {op.federation!r} yet (no report on "
                          f"{op.topics.deploy_statuses}): start `edge-client serve --follow`, or name --canary-devices")
    if version == op.state.stable:
        op.apply(f"v{version} published again", stable=version)
        return 0
    if not devices:
        op.promote(version, "published without a canary")
        return 0
    op.apply(f"v{version} on canary", canary=version, canary_devices=devices)
    if not wait:
        return 0
    verdict = op.watch(version, rule)
    if verdict.decision == "promote":
        op.promote(version, verdict.why)
        return 0
    if verdict.decision == "rollback":
        op.revoke_canary(version, verdict.why)
        log.warning(f"v{version} rolled back before the other devices got it: {verdict.why}")
        return 1
    log.warning(f"canary v{version} {verdict.why}; decide with `aggregator rollout promote|rollback`")
    return 1


rollout_app = typer.Typer(help="See and steer a model rollout: who runs which version; promote or roll back.",
                          no_args_is_help=True, add_completion=False)


@rollout_app.command("status")
@grouped
def status_command(
    as_json: JsonOption = False,
    log_level: LogLevelOption = "warning",
    log_format: LogFormatOption = "plain",
    *,
    where: FederationOptions,
) -> None:
    """Which device runs which version, its health and latency against the version before (--json: the rollout
    and the device reports as JSON)."""
    setup_logging(log_level, log_format)
    with operating(where, create_key=False) as op:
        view = fleet_view(op.fleet.book.rollout or op.state.rollout(where.federation), op.fleet.book.reports)
    if as_json:
        print(msgspec.json.format(msgspec.json.encode(view), indent=1).decode())
        return
    show(view)


def fleet_view(rollout: Rollout, reports: dict[str, DeployReport]) -> dict[str, Any]:
    """What `rollout status` and the dashboard show: the rollout and one row per device."""
    return {"rollout": msgspec.to_builtins(rollout),
            "devices": [msgspec.to_builtins(r) | {"client": c} for c, r in sorted(reports.items())]}


def show(view: dict[str, Any]) -> None:
    out, r = console(), view["rollout"]
    out.print(f"rollout #{r['seq']}: stable {_v(r.get('stable'))}"
              + (f", canary v{r['canary']} on {', '.join(r['canary_devices'])}" if r.get("canary") else "")
              + (f", revoked {r['revoked']}" if r.get("revoked") else ""), soft_wrap=True)
    if r.get("reason"):
        out.print(f"last change: {r['reason']}", soft_wrap=True)
    table = Table("device", "state", "version", "target", "health", "requests", "errors", "p95 ms", "before (p95 ms)",
                  "fetched", "event")
    for d in view["devices"]:
        now, before = d.get("current") or {}, d.get("before") or {}
        table.add_row(d["client"], d["state"], _v(d.get("version")), _v(d.get("target")), d.get("health", ""),
                      str(now.get("requests", "")), str(now.get("errors", "")), _ms(now.get("p95_ms")),
                      f"v{before['version']} ({_ms(before.get('p95_ms'))})" if before else "-",
                      f"{d.get('fetched_bytes', 0)}/{d.get('release_bytes', 0)}", d.get("event", ""))
    out.print(table)


def _v(version: int | None) -> str:
    return "-" if version is None else f"v{version}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


@rollout_app.command("promote")
@grouped
def promote_command(*, where: FederationOptions, logs: LogOptions) -> None:
    """Make the canary version stable: every device takes it."""
    setup_logging(logs.log_level, logs.log_format)
    with operating(where) as op:
        if op.state.canary is None:
            raise DeployError("no canary to promote (`aggregator rollout status` shows the rollout)")
        op.promote(op.state.canary, "by the operator")


@rollout_app.command("rollback")
@grouped
def rollback_command(
    to: int = typer.Option(None, "--to", min=1, help="The version to go back to (default: the stable one before)."),
    reason: str = typer.Option("by the operator", "--reason", help="Why, for the devices' logs and the status."),
    chunk_kib: ChunkKibOption = DEFAULT_CHUNK_BYTES // 1024,
    *,
    where: FederationOptions,
    logs: LogOptions,
) -> None:
    """Revoke the canary, or the stable version in favour of an earlier one: a signed rollback devices obey."""
    setup_logging(logs.log_level, logs.log_format)
    with operating(where) as op:
        if op.state.canary is not None and to is None:
            op.revoke_canary(op.state.canary, reason)
        else:
            op.rollback(to, reason, chunk_kib * 1024, logs.log_format)


class RolloutWatcher:
    """The live rollout view for `aggregator serve --http` (/api/rollout): its own subscriber connection,
    the rollout checked against the server key, device reports against their enrolled keys."""

    def __init__(self, settings: BrokerSettings, federation: str, server_key_text: str, keys: KeyDir) -> None:
        try:
            seq = load_state(keys.rollout_dir).seq
        except DeployError as e:  # the dashboard still shows the fleet; the operator's commands say how to fix it
            log.warning(f"{e}; the rollout view takes any signed rollout")
            seq = 0
        self.fleet = RolloutBroker(settings, Topics(federation), parse_public_key(server_key_text), EnrolledKeys(keys), seq)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollout-watcher", daemon=True)

    def start(self) -> RolloutWatcher:
        self.fleet.conn.start()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.fleet.conn.just_connected():
                for topic in (self.fleet.topics.deploy_rollout, self.fleet.topics.deploy_statuses):
                    self.fleet.conn.client.subscribe(topic, QOS)
            self.fleet.listen(0.5)

    def snapshot(self) -> dict[str, Any]:
        with self.fleet.lock:
            rollout = self.fleet.book.rollout
            return {"rollout": None, "devices": []} if rollout is None else fleet_view(rollout, self.fleet.book.reports)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.fleet.close()
