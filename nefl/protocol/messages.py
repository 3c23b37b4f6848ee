"""Control messages: one typed, versioned, validated class per JSON message that crosses the broker.

Every byte from the broker is hostile until proven otherwise, on the server and on the device.
`decode` is the one strict loader both sides use: size cap before parsing, bounded nesting,
no NaN/Infinity (msgspec's JSON is strict), integers and floats range-checked by the schema, and
any failure becomes a `MessageError` with a short reason code that the caller counts. Nothing
from inbound bytes can raise anything else.

Server-to-device messages (task, control, server status) and the coordinator's messages to its
workers are signed (nefl/protocol/signing.py) and `Stamped`: the signature covers the whole body, which names
its type, federation, run, the run's incarnation and the message's sequence number, so a signed task
cannot be replayed as a status, into another run, or into a later incarnation of the same federation.
Devices sign their announces, statuses and upload notices; workers and relays sign everything they send
the coordinator (docs/security.md, "What each signature binds").
"""

from __future__ import annotations

import functools
import math
import re
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import msgspec

from nefl.protocol.manifest import Manifest

VERSION = 2  # 2: digests (the Merkle root of wire v2, nefl/protocol/wire.py) where v1 named a payload's sha256
# a message whose own layout changed says so in its `v` (its default), and the loader checks that, not VERSION:
# 3: a release names each file by the Merkle root of its wire chunks where 2 listed a sha256 per chunk
RELEASE_VERSION = 3
# 3: a task says its federation's mode ("sync" rounds, or "buffered" versions: docs/operations.md) and, buffered, the
# model version it trains from; a sync server still sends version 2 tasks, which this build reads too
TASK_VERSION = 3
MAX_CONTROL_BYTES = 16 * 1024  # announce, client status, task, control
MAX_STATUS_BYTES = 256 * 1024  # the server status carries the profile and capped client lists
MAX_DEPTH = 16  # the deepest honest message (a server status with its profile) nests 5 levels
MAX_LISTED = 200  # client ids listed in a server status; counts carry the rest
# the largest MQTT message a publisher sends: tensor payloads are cut in chunks of it (nefl/protocol/wire.py), under
# EMQX's 1 MB default; here, not in wire.py, so that command lines show it without importing torch. 1000 KiB: a
# resnet20 update is one message, and the coordinator's CPU per MiB is lower than with smaller chunks
DEFAULT_CHUNK_BYTES = 1000 * 1024

NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
Name = Annotated[str, msgspec.Meta(pattern=NAME_PATTERN)]
Hex64 = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
Short = Annotated[str, msgspec.Meta(max_length=64)]
Reason = Annotated[str, msgspec.Meta(max_length=300)]
Count = Annotated[int, msgspec.Meta(ge=0, le=2**53)]
Round = Annotated[int, msgspec.Meta(ge=0, le=2**31)]
Submodel = Annotated[int, msgspec.Meta(ge=0, le=255)]
Seconds = Annotated[float, msgspec.Meta(gt=0, le=7 * 86400)]
KeyText = Annotated[str, msgspec.Meta(max_length=64)]  # a base64 Ed25519 public key
Lr = Annotated[float, msgspec.Meta(gt=0, le=100)]
Epochs = Annotated[int, msgspec.Meta(ge=1, le=1000)]
BatchSize = Annotated[int, msgspec.Meta(ge=1, le=65536)]

T = TypeVar("T", bound="Message")


class MessageError(ValueError):
    """An inbound message refused for `reason` (a short counter key); never fatal to the receiver."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.detail = message


class Message(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False):
    """Base of every control message: the wire version first, checked before anything else."""

    v: int = VERSION
    also_reads: ClassVar[frozenset[int]] = frozenset()  # older wire versions of this message it still decodes

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def from_json(cls: type[T], payload: bytes, max_bytes: int = MAX_CONTROL_BYTES) -> T:
        return decode(payload, cls, max_bytes)


class DeviceSummary(msgspec.Struct, kw_only=True, frozen=True):
    """What the server logs about a device; every field optional, every value bounded."""

    machine: Short = ""
    system: Short = ""
    cpus: Annotated[int, msgspec.Meta(ge=0, le=65536)] | None = None
    mem_total_mb: Count | None = None
    mem_available_mb: Count | None = None
    cpu_percent: Annotated[float, msgspec.Meta(ge=0, le=1e6)] | None = None
    torch_threads: Annotated[int, msgspec.Meta(ge=0, le=65536)] | None = None


class Announce(Message, frozen=True, tag="announce", tag_field="type"):
    """Client -> server, retained: what this device can train now (max_submodel 1-based, 0 = nothing).

    It only says which rounds *to come* may pick the device: an announce never refuses a task the
    device already has (that is a `Decline`). `seq` counts up within one agent process (`session`),
    so the server can drop one that arrives after a newer one."""

    client: Name
    samples: Annotated[int, msgspec.Meta(ge=1, le=10**9)]
    max_submodel: Annotated[int, msgspec.Meta(ge=0, le=256)]
    selection: Reason = ""
    device: DeviceSummary = DeviceSummary()
    dataset: Short = ""
    key: KeyText = ""  # the device's Ed25519 public key (base64); the announce is then signed with it
    token: Annotated[str, msgspec.Meta(max_length=64)] = ""  # enrolment proof (nefl/protocol/tokens.py), not the token
    session: Short = ""  # random per agent process; "" from devices that predate sequence numbers
    seq: Count = 0


class Decline(Message, frozen=True, tag="decline", tag_field="type"):
    """Client -> server, signed like its announce: the device will not train this one task
    (federation, run, round, submodel), and why. The server stops waiting for it in that round only."""

    client: Name
    federation: Name
    run: Name
    round: Round
    submodel: Submodel
    reason: Reason = ""
    key: KeyText = ""


class ClientStatus(Message, frozen=True, tag="client_status", tag_field="type"):
    """Client -> server, retained, signed by the device key; the broker publishes the "offline" one as the
    client's last will (signed in advance). `seq` stamps the connection (it grows from one connection to the
    next), so a replayed status of an earlier connection is refused."""

    state: Literal["online", "offline"]
    seq: Count = 0


class StatusBook:
    """The newest signed status (connection stamp, state) per sender, of clients or workers. A connection
    says "online" and its last will says "offline" with the same stamp; a later connection's stamp is
    larger, so a status replayed from an earlier connection is refused."""

    def __init__(self) -> None:
        self.last: dict[str, tuple[int, str]] = {}

    def newer(self, who: str, seq: int, state: str) -> bool:
        """True: a status to act on; False: the newest one again (a retained copy); MessageError("replayed")."""
        last = self.last.get(who)
        if last is not None and (seq, state) == last:
            return False
        if last is not None and (seq < last[0] or (seq == last[0] and state == "online")):
            raise MessageError("replayed", f"{who}: a {state} status of an earlier connection")
        self.last[who] = (seq, state)
        return True

    def forget(self, who: str) -> None:
        self.last.pop(who, None)


class Sent(Message, frozen=True, kw_only=True, tag="sent", tag_field="type"):
    """Client -> server on `sent/{client}`, signed by the device key: "I published my update for this task".
    The server asks for a resend when no update (or worker receipt) for it follows within a bound."""

    client: Name
    run: Name
    round: Round
    submodel: Submodel
    digest: Hex64  # the update's Merkle root (nefl/protocol/wire.py), as its signed header names it


class Stamped(Message, frozen=True, kw_only=True):
    """A signed message of the aggregator: the run incarnation that sent it (it grows with every start,
    --resume included, per server key) and its place in that incarnation's sequence."""

    incarnation: Count = 0
    seq: Count = 0

    def stamp(self) -> tuple[int, int]:
        return self.incarnation, self.seq


class Task(Stamped, frozen=True, kw_only=True, tag="task", tag_field="type"):
    """Server -> one client, retained, signed: train `submodel` (0-based) of `round` from the weights
    whose chunks hash to `model_digest` (the Merkle root of nefl/protocol/wire.py). `resend`: the server got no update
    for this task although the device said it sent one: publish it again on `resend/{client}`.

    Version TASK_VERSION adds `mode` and `version`. Buffered ("buffered"): `round` numbers the task (the update names
    it), `version` is the model version whose weights it trains from (the model chunks carry it as their round),
    and `deadline_s` is the longest a task may take; the device trains for its own time budget within it. A sync
    server sends version 2 tasks (no mode: sync), so devices of an older build keep working with it."""

    v: int = TASK_VERSION
    also_reads: ClassVar[frozenset[int]] = frozenset({VERSION})

    federation: Name
    run: Name
    round: Round
    submodel: Submodel
    lr: Lr
    epochs: Epochs
    batch_size: BatchSize
    profile_hash: Short
    deadline_s: Seconds
    chunks: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)]
    model_digest: Hex64
    model_bytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 34)]
    resend: bool = False
    mode: Literal["sync", "buffered"] = "sync"
    version: Round = 0  # buffered: the model version the task trains from

    @property
    def model_round(self) -> int:
        """The round its weights' chunks carry: the round (sync), the model version (buffered)."""
        return self.version if self.mode == "buffered" else self.round


class Control(Stamped, frozen=True, tag="control", tag_field="type"):
    """Server -> all, retained, signed: the federation's run `run` is over."""

    federation: Name
    run: Name
    event: Literal["end"]


class AnnounceRefusal(Stamped, frozen=True, tag="announce_refusal", tag_field="type"):
    """Server -> one client, signed: its announce was refused for `reason` (an enrolment reason code of
    docs/security.md), with a one-line `hint` for its operator. `key` is the device key that signed the
    refused announce ("" when the refusal came before any signature was checked): a device stops only on a
    refusal of its own key, so an announce forged under its id cannot stop it."""

    client: Name
    federation: Name
    run: Name
    reason: Name
    key: KeyText = ""
    hint: Reason = ""


class UpdateRefusal(Stamped, frozen=True, tag="update_refusal", tag_field="type"):
    """Server -> one client on its refusal topic, signed, buffered mode: its update for task `round` (trained from
    model `version`, submodel 0-based) was not taken, for `reason` ("stale": more versions behind than the bound,
    "unassigned", "norm-bound", ...; docs/operations.md); `current`: the server's version then."""

    client: Name
    federation: Name
    run: Name
    round: Round
    submodel: Submodel
    version: Round
    current: Round
    reason: Name


class _Tagged(msgspec.Struct):
    type: str = ""


def message_type(body: bytes) -> str:
    """The `type` tag of a JSON message body ("" when it has none or is no JSON object): which class decodes it."""
    try:
        return msgspec.json.decode(body, type=_Tagged).type
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return ""


# what the device's operator should do about each refused announce, by reason ({client}: the device's id)
REFUSAL_HINTS = {
    "revoked": "this device was revoked by the operator: ask for a new token (aggregator enroll {client}) and join "
               "with --join-token",
    "bad_token": "the join token is not one issued for this id: ask the operator to issue a new token "
                 "(aggregator enroll {client})",
    "token_used": "the join token was spent already: ask the operator to issue a new token (aggregator enroll {client})",
    "token_expired": "the join token expired: ask the operator to issue a new token (aggregator enroll {client})",
    "not_enrolled": "this id is not enrolled: enrol with a join token (aggregator enroll {client}, then "
                    "edge-client join --join-token)",
    "key_mismatch": "this id is pinned to another device key: use that device's key, or ask the operator to revoke "
                    "and re-enrol the id",
    "unsigned": "this server needs signed announces: join with a join token (aggregator enroll {client})",
}
FINAL_REFUSALS = frozenset({"revoked", "bad_token", "token_used", "token_expired"})  # retrying never helps


def refusal_hint(reason: str, client: str) -> str:
    return REFUSAL_HINTS[reason].format(client=client) if reason in REFUSAL_HINTS else ""


class TrainingSettings(msgspec.Struct, kw_only=True, frozen=True):
    batch_size: BatchSize = 32
    local_epochs: Epochs = 1
    round_timeout: Seconds = 120.0


class ServerStatus(Stamped, frozen=True, tag="server_status", tag_field="type"):
    """Server -> all, retained, signed (except the broker-published last will, which only says
    "offline" and is never trusted for anything else)."""

    state: Literal["waiting", "training", "evaluating", "finished", "offline"]
    federation: Name | None = None
    run: Name | None = None
    round: Round = 0
    rounds: Round = 0
    profile: dict[str, Any] | None = None
    method: Short = ""
    profile_hash: Short = ""
    key: KeyText = ""  # the server's Ed25519 public key (base64)
    clients_online: Annotated[list[Name], msgspec.Meta(max_length=MAX_LISTED)] = []
    clients_online_count: Count = 0
    participants: Annotated[list[Name], msgspec.Meta(max_length=MAX_LISTED)] = []
    reported: Annotated[list[Name], msgspec.Meta(max_length=MAX_LISTED)] = []
    accuracy: Annotated[list[float], msgspec.Meta(max_length=256)] | None = None
    rejected_total: dict[Short, Count] = {}
    time: float = 0.0
    training: TrainingSettings = TrainingSettings()


class _Head(msgspec.Struct):
    v: int


_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def nesting_depth(payload: bytes) -> int:
    """Deepest bracket nesting outside strings: checked before parsing so no parser recursion
    limit is ever what stops a hostile message."""
    depth = deepest = 0
    for b in _STRING.sub(b"", payload).translate(None, _NOT_BRACKETS):
        if b == 0x5B or b == 0x7B:  # [ {
            depth += 1
            deepest = max(deepest, depth)
        elif b == 0x5D or b == 0x7D:  # ] }
            depth -= 1
    return deepest


def decode(payload: bytes, cls: type[T], max_bytes: int = MAX_CONTROL_BYTES) -> T:
    """The strict loader: `payload` as a validated `cls`, or MessageError with a reason code."""
    kind = cls.__struct_config__.tag or cls.__name__.lower()
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise MessageError("malformed_json", f"{kind}: payload is not bytes")
    if len(payload) > max_bytes:
        raise MessageError("oversized", f"{len(payload)}-byte {kind} message, the limit is {max_bytes}")
    raw = payload if isinstance(payload, (bytes, bytearray)) else bytes(payload)
    # no deeper than its brackets: a message with at most MAX_DEPTH of them (an update's header has two) skips the scan
    if raw.count(b"{") + raw.count(b"[") > MAX_DEPTH and nesting_depth(raw) > MAX_DEPTH:
        raise MessageError("too_deep", f"{kind} message nests deeper than {MAX_DEPTH} levels")
    try:
        head = msgspec.json.decode(payload, type=_Head)
    except msgspec.DecodeError as e:
        raise MessageError("malformed_json", f"{kind}: {_short(e)}") from None
    except (msgspec.ValidationError, RecursionError) as e:
        raise MessageError("malformed_json", f"{kind}: no integer wire version 'v' ({_short(e)})") from None
    if head.v != (expected := wire_version(cls)) and head.v not in cls.also_reads:
        raise MessageError("bad_version", f"{kind} message of wire version {head.v}, this build speaks {expected}")
    try:
        return msgspec.json.decode(payload, type=cls)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
        raise MessageError(f"invalid_{kind}", _short(e)) from None


@functools.cache
def wire_version(cls: type[Message]) -> int:
    """The version `cls` is sent with (its `v` default): VERSION, or the message's own where its layout changed."""
    return next(f.default for f in msgspec.structs.fields(cls) if f.name == "v")


def _short(e: Exception) -> str:
    return str(e)[:200]


def finite_or_none(x: float | None) -> float | None:
    """Device readings that JSON cannot carry (NaN from a failed sensor) travel as null."""
    return x if x is None or math.isfinite(x) else None


# -- scale-out: coordinator <-> aggregator workers and site relays (docs/scale.md) --------------------
MAX_PLAN_BYTES = 16 << 20  # a round plan lists every participant (and its key): 100k fit
MAX_ROUND_CLIENTS = 100_000
MAX_RECEIPT_BYTES = 8 * 1024
NormValue = Annotated[float, msgspec.Meta(ge=0, le=1e300)]
Bound = Annotated[float, msgspec.Meta(gt=0, le=1e300)]


class BoundSettings(msgspec.Struct, kw_only=True, frozen=True):
    """The coordinator's update-norm bound (nefl/aggregation/robust.py NormBound), so every worker applies the same."""

    max_norm: Bound | None = None
    relative: Bound | None = None
    adaptive_k: Bound | None = None
    mode: Literal["reject", "clip"] = "reject"
    window: Annotated[int, msgspec.Meta(ge=1, le=10_000)]
    warmup: Annotated[int, msgspec.Meta(ge=1, le=10_000)]


class ScreenSettings(msgspec.Struct, kw_only=True, frozen=True):
    """The coordinator's centre check (nefl/aggregation/config.py AggregationConfig), so every worker screens
    its share of the updates the same way."""

    centre_check: bool
    min_agree: Annotated[float, msgspec.Meta(ge=0, le=1)]
    max_norm_ratio: Annotated[float, msgspec.Meta(ge=1, le=1e6)]
    min_cover: Annotated[int, msgspec.Meta(ge=3, le=1_000_000)]
    hold: Annotated[int, msgspec.Meta(ge=1, le=MAX_ROUND_CLIENTS)]
    sketch: Annotated[int, msgspec.Meta(ge=16, le=1 << 24)]


class WorkerRound(Stamped, frozen=True, kw_only=True, tag="worker_round", tag_field="type"):
    """Coordinator -> workers, retained, signed: everything a worker needs to check and sum round
    `round`'s updates as the coordinator would (who trains what, pinned device keys, the norm bound
    with its reference norms and adaptive history), and which workers own multi-chunk updates."""

    federation: Name
    run: Name
    round: Round
    profile: dict[str, Any]
    profile_hash: Short
    assignments: Annotated[dict[Name, Submodel], msgspec.Meta(max_length=MAX_ROUND_CLIENTS)]
    keys: Annotated[dict[Name, KeyText], msgspec.Meta(max_length=MAX_ROUND_CLIENTS)] = {}
    references: Annotated[list[NormValue], msgspec.Meta(max_length=256)]  # weight norm per submodel
    norms: Annotated[list[Annotated[list[NormValue], msgspec.Meta(max_length=10_000)]], msgspec.Meta(max_length=256)]
    bound: BoundSettings
    screen: ScreenSettings
    deadline_s: Seconds
    max_update_bytes: Annotated[int, msgspec.Meta(ge=1024, le=1 << 34)]
    chunk_bytes: Annotated[int, msgspec.Meta(ge=8192, le=1 << 28)]
    owners: Annotated[list[Name], msgspec.Meta(max_length=1024)] = []  # workers of the shared group, sorted


class RoundClose(Stamped, frozen=True, tag="round_close", tag_field="type"):
    """Coordinator -> workers, signed: round `round` is over, publish your partial."""

    federation: Name
    run: Name
    round: Round


class WorkerStatus(Message, frozen=True, tag="worker_status", tag_field="type"):
    """Worker/relay -> coordinator, retained, signed by the worker's key; the broker publishes the "offline"
    one (signed in advance) as its last will. `seq` stamps the connection, as a client status's does."""

    state: Literal["online", "offline"]
    role: Literal["worker", "relay"] = "worker"
    seq: Count = 0


class Receipt(Message, frozen=True, kw_only=True, tag="receipt", tag_field="type"):
    """Worker -> coordinator, signed: one update accepted into the worker's partial (outcome "accepted",
    with its sample count, its norm and the client's round metrics) or refused (outcome = the reason code
    the server would have counted; `attributed`: the update carried the client's own signature, so the
    client, not a forger, sent what was refused)."""

    run: Name
    round: Round
    client: Name | None = None  # None: the message named no usable client
    outcome: Short
    detail: Reason = ""
    late: bool = False  # a stale update of an earlier round (the server's late_updates)
    attributed: bool = False
    nbytes: Count = 0
    samples: Count = 0
    norm: NormValue | None = None
    metrics: Annotated[dict[Short, float | int | bool | Reason], msgspec.Meta(max_length=64)] = {}


MAX_RECEIPTS = 64  # receipts in one batch


class ReceiptBatch(Message, frozen=True, kw_only=True, tag="receipts", tag_field="type"):
    """Worker -> coordinator, signed once: the receipts of the updates it judged within its linger (a few ms).
    One signature, one publish and one acknowledgement per batch rather than per update: per update they
    would be a large share of a worker's CPU under a fleet's stream. Each receipt is judged on its own."""

    receipts: Annotated[list[Receipt], msgspec.Meta(min_length=1, max_length=MAX_RECEIPTS)]


MAX_RECEIPT_BATCH_BYTES = MAX_RECEIPTS * MAX_RECEIPT_BYTES


class PartialSummary(Message, frozen=True, kw_only=True, tag="partial_summary", tag_field="type"):
    """Worker -> coordinator, signed: what its partial NeFedAvg of round `round` holds (and which of its clients'
    updates its centre check left out); the group sums
    travel as chunked safetensors (kind "partial") whose chunks hash to `digest`."""

    run: Name
    round: Round
    weights: Annotated[list[NormValue], msgspec.Meta(max_length=256)]
    updates: Annotated[list[Count], msgspec.Meta(max_length=256)]
    clients: Annotated[list[Name], msgspec.Meta(max_length=MAX_ROUND_CLIENTS)] = []
    dropped: Annotated[dict[Name, Short], msgspec.Meta(max_length=MAX_ROUND_CLIENTS)] = {}  # by the worker's centre check
    digest: Hex64 | None = None  # None when it holds no update (no tensors follow)


# -- model rollout: aggregator -> devices that follow it (docs/deploy.md) --------------------------------
MAX_RELEASE_BYTES = 4 << 20  # a release carries the export's manifest and one root per file
MAX_FILES = 256  # a file's position in its release is the `submodel` field of its wire chunks
Version = Annotated[int, msgspec.Meta(ge=1, le=2**31)]
FileName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")]  # never a path
Millis = Annotated[float, msgspec.Meta(ge=0, le=1e9)]


class ReleaseFile(msgspec.Struct, kw_only=True, frozen=True):
    """One file of a release. Its wire chunks (kind "file", nefl/protocol/wire.py) carry the same Merkle root in
    their header, and each chunk's proof ties its data to `digest`: the device checks every chunk against the
    signed root as it arrives, drops a forged or corrupted one alone, and resumes from the chunks it staged."""

    name: FileName
    sha256: Hex64  # the whole file, as the manifest names it
    size: Annotated[int, msgspec.Meta(ge=1, le=1 << 34)]
    digest: Hex64  # the BLAKE3 Merkle root of the file's chunks of `Release.chunk_bytes` (nefl/protocol/merkle.py)


class Release(Message, frozen=True, kw_only=True, tag="release", tag_field="type"):
    """Server -> devices, retained on deploy/release/{version}, signed: one exported ladder, where it
    came from (checkpoint, round, weights), its manifest (per submodel: sha256, sizes, accuracy; the
    parity reference) and how its files travel (chunk i of a file is bytes [i*chunk_bytes, (i+1)*chunk_bytes)).
    Version RELEASE_VERSION: a follower built for version 2 refuses it with `bad_version` (docs/protocol.md)."""

    v: int = RELEASE_VERSION
    federation: Name
    version: Version
    created: Short
    source_checkpoint: Reason = ""
    source_round: Round | None = None
    source_state_sha256: Hex64 | None = None
    chunk_bytes: Annotated[int, msgspec.Meta(ge=1024, le=1 << 28)]
    manifest: Manifest
    files: Annotated[list[ReleaseFile], msgspec.Meta(min_length=1, max_length=MAX_FILES)]

    def __post_init__(self) -> None:
        by_name = {f.name: f for f in self.files}
        if len(by_name) != len(self.files):
            raise ValueError("file names repeat")
        parity = self.manifest.parity
        named = [(e.file, e.sha256) for e in self.manifest.submodels] + [(parity.file, parity.sha256)]
        for name, sha in named:
            if name is None or name not in by_name or by_name[name].sha256 != sha:
                raise ValueError(f"the manifest names {name or 'no parity file'}, which the release does not carry with that sha256")

    def chunks(self, f: ReleaseFile) -> int:
        """How many wire chunks carry file `f`."""
        return math.ceil(f.size / self.chunk_bytes)

    def file(self, name: str) -> tuple[int, ReleaseFile]:
        """(position, file): the position is what the file's wire chunks carry as `submodel`."""
        return next((i, f) for i, f in enumerate(self.files) if f.name == name)


class Rollout(Message, frozen=True, kw_only=True, tag="rollout", tag_field="type"):
    """Server -> devices, retained on deploy/rollout, signed: which version each device should run.
    `seq` only grows, so an older rollout replayed is refused; a device goes back to an older version
    only when the version it runs is in `revoked` (the operator's signed rollback)."""

    federation: Name
    seq: Annotated[int, msgspec.Meta(ge=1, le=2**53)]
    stable: Version | None = None
    canary: Version | None = None
    canary_devices: Annotated[list[Name], msgspec.Meta(max_length=MAX_ROUND_CLIENTS)] = []
    revoked: Annotated[list[Version], msgspec.Meta(max_length=4096)] = []
    reason: Reason = ""  # why the last change: published, promoted, rolled back because ...
    time: float = 0.0

    def __post_init__(self) -> None:
        if (self.canary is None) != (not self.canary_devices):
            raise ValueError("a canary version and its devices go together")
        if {self.stable, self.canary} & set(self.revoked):
            raise ValueError("a revoked version cannot be stable or canary")

    def target(self, client: str) -> int | None:
        """The version `client` should run."""
        return self.canary if self.canary is not None and client in self.canary_devices else self.stable


class VersionStats(msgspec.Struct, kw_only=True, frozen=True):
    """Requests one version answered on a device: since the swap to it, or its last window before the next."""

    version: Version
    requests: Count = 0
    errors: Count = 0  # answered 5xx
    p50_ms: Millis | None = None
    p95_ms: Millis | None = None


class Refusal(msgspec.Struct, kw_only=True, frozen=True):
    version: Version | None = None
    reason: Reason


class DeployReport(Message, frozen=True, kw_only=True, tag="deploy_report", tag_field="type"):
    """Device -> server, retained on deploy/status/{client}, signed by the device key it names in `key`. The
    last will is such a report too, state "offline", signed in advance for the connection it names in
    `connection`: it closes that connection's reports, and a replayed will of an earlier connection closes nothing."""

    client: Name
    state: Literal["waiting", "staging", "serving", "offline"]
    federation: Name | None = None
    key: KeyText = ""
    version: Version | None = None  # serving now
    previous: Version | None = None  # kept on disk for a rollback
    target: Version | None = None  # what the newest rollout asks of this device
    health: Literal["ok", "failing", "unknown"] = "unknown"
    current: VersionStats | None = None  # the serving version, since the swap
    before: VersionStats | None = None  # the version before, over its last requests
    event: Reason = ""  # the last swap, refusal or rollback, in words
    refused: Annotated[list[Refusal], msgspec.Meta(max_length=32)] = []  # versions this device will not run, and why
    fetched_bytes: Count = 0  # downloaded for the serving version
    release_bytes: Count = 0  # that release's files together
    submodels: Annotated[list[Submodel], msgspec.Meta(max_length=256)] = []  # 0-based, of the serving version
    swap_ms: Millis | None = None  # requests waited this long for the last swap
    time: float = 0.0  # the device's clock: a report older than the newest seen is a replay
    connection: Count = 0  # the stamp of the MQTT connection it was sent on (nefl/protocol/mqtt.py next_stamp); 0: unknown


# -- Flower (aggregator/flower.py <-> edge_client/flower.py, docs/flower.md) ---------------------------
# Each rides as JSON bytes under one key of a Flower message's ConfigRecord (nefl/protocol/flower.py); the tensors
# ride in the message's ArrayRecord. Flower's transport is not the broker, but its bytes are no more trusted.


class FlowerJoin(Message, frozen=True, kw_only=True, tag="flower_join", tag_field="type"):
    """Strategy -> node (a query message): the run the node is asked to join, and how a simulated node
    cuts its shard of the dataset as `aggregator simulate` does (a device's data is its own)."""

    profile: Name
    method: Name
    profile_hash: Short
    dataset: Short
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**31)]
    non_iid: Annotated[float, msgspec.Meta(gt=0, le=1e6)] | None = None  # Dirichlet alpha; None = IID
    max_samples: Annotated[int, msgspec.Meta(ge=1, le=10**9)] | None = None
    training: TrainingSettings = TrainingSettings()


class FlowerHello(Message, frozen=True, kw_only=True, tag="flower_hello", tag_field="type"):
    """Node -> strategy: what it can train now, as an MQTT device announces it, and the paper tier of a
    simulated node (None: a device, whose tier is its bound)."""

    announce: Announce
    tier: Submodel | None = None


class FlowerTask(Message, frozen=True, kw_only=True, tag="flower_task", tag_field="type"):
    """Strategy -> node: train (or evaluate) `submodel` (0-based) of `round` from the arrays in the same
    message. Buffered mode: `round` numbers the task (the reply names it) and `version` is the model version
    the arrays are (None: a round's task)."""

    kind: Literal["train", "evaluate"]
    round: Round
    submodel: Submodel
    lr: Lr
    epochs: Epochs
    batch_size: BatchSize
    profile_hash: Short
    version: Round | None = None


class FlowerResult(Message, frozen=True, kw_only=True, tag="flower_result", tag_field="type"):
    """Node -> strategy: what a task came to. A train reply's delta rides in the message's ArrayRecord and
    `hello` is the node's fresh announce (its load may have changed); an evaluation's is its score."""

    client: Name
    round: Round
    submodel: Submodel
    samples: Annotated[int, msgspec.Meta(ge=1, le=10**9)]  # trained on, or evaluated
    loss: Annotated[float, msgspec.Meta(ge=0, le=1e9)]
    accuracy: Annotated[float, msgspec.Meta(ge=0, le=1)]
    seconds: Annotated[float, msgspec.Meta(ge=0, le=7 * 86400)]
    hello: FlowerHello | None = None
