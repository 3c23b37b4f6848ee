"""Who may take part, and who may speak for the aggregator's workers: device pins, one-time join
tokens, revocations, and the worker and relay keys the operator authorised.

The operator's decisions live in a journal in the federation's key directory (aggregator/keys.py),
appended by `aggregator enroll` and `aggregator revoke` and re-read by `serve` whenever it changes, so
they take effect in a running federation. What `serve` decides itself (which device key is pinned to
which id, which tokens are spent, which ids trained) is this registry's state, saved in every
checkpoint. Applying the journal is idempotent: every entry carries its time, a grant never replaces a
newer pin, and a revocation removes the pins made before it.

Enrolment is *open* (trust on first use: the first signed announce pins an id's key, as before) until
the journal grants a device; from then on (or with --no-open-enrolment) an id takes part only once the
operator enrolled it, with a join token its first signed announce proves (nefl/protocol/tokens.py) or with its
key. Open pins are bounded: a rate and a cap on new ones, and those of ids that never trained expire.
A *follower* (`aggregator enroll ID --follower --public-key KEY`) is an id whose model-rollout reports count
(aggregator/rollout.py); it never trains and its grant leaves open enrolment open.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from aggregator.rejected import Rejected
from nefl.protocol.messages import Hex64, KeyText, Name
from nefl.protocol.tokens import check_proof

log = logging.getLogger("aggregator.server")
Role = Literal["device", "worker", "follower"]  # follower: reports on a model rollout, never trains
HowPinned = Literal["open", "token", "key"]


@dataclass(frozen=True)
class EnrolmentPolicy:
    """Who may pin a device key, and how many (docs/security.md, "Enrolment")."""

    open: bool | None = None  # None: open until the journal grants a device (a token or a key)
    require_device_keys: bool = False  # under open enrolment: refuse devices that do not sign
    max_pins: int = 100_000  # device keys remembered (kept past the client table: a pin outlives absence)
    new_pins_per_minute: int = 60  # trust-on-first-use pins
    max_unproven: int = 1_000  # open pins of ids that have not trained yet
    unproven_ttl_s: float = 3600.0  # an open pin of an id that never trained is forgotten after this long
    token_ttl_s: float = 7 * 86400.0  # a join token `aggregator enroll` prints is valid this long


# -- the journal: what `aggregator enroll` and `aggregator revoke` append ------------------------------------
class Grant(msgspec.Struct, kw_only=True, frozen=True, tag="grant", tag_field="op"):
    """A device enrolled with a one-time token (its verifier) or with its key; or a worker/relay's key."""

    v: int = 1
    client: Name
    role: Role = "device"
    created: Annotated[float, msgspec.Meta(ge=0)]
    verifier: Hex64 | None = None
    key: KeyText | None = None
    expires: float | None = None  # wall time; None: never (a key grant)

    def __post_init__(self) -> None:
        if (self.verifier is None) == (self.key is None):
            raise ValueError("a grant carries a token verifier or a key, not both")
        if self.role in ("worker", "follower") and self.key is None:
            raise ValueError(f"a {self.role} is authorised by its key")


class Revoke(msgspec.Struct, kw_only=True, frozen=True, tag="revoke", tag_field="op"):
    v: int = 1
    client: Name
    role: Role = "device"
    time: Annotated[float, msgspec.Meta(ge=0)]


class Spend(msgspec.Struct, kw_only=True, frozen=True, tag="spend", tag_field="op"):
    """`serve` redeemed a join token: the token is spent and the id pinned to the key that proved it, for any
    later `serve` on this key directory, resumed or fresh (a checkpoint alone would re-arm the token)."""

    v: int = 1
    client: Name
    verifier: Hex64
    key: KeyText
    time: Annotated[float, msgspec.Meta(ge=0)]


Entry = Grant | Revoke | Spend
_decode = msgspec.json.Decoder(Entry)


def append(journal: Path, *entries: Entry) -> None:
    """A line per entry, durably, in a file only its owner reads (verifiers let anyone who reads them enrol)."""
    journal.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"".join(msgspec.json.encode(e) + b"\n" for e in entries))
        os.fsync(fd)
    finally:
        os.close(fd)


def read_journal(journal: Path) -> list[Entry]:
    entries = []
    for n, line in enumerate(journal.read_bytes().splitlines(), 1):
        if line.strip():
            try:
                entries.append(_decode.decode(line))
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
                log.error(f"{journal}:{n}: ignored ({e}); `aggregator enroll` / `revoke` write this file")
    return sorted(entries, key=lambda e: e.created if isinstance(e, Grant) else e.time)


@dataclass
class Pin:
    key: str
    since: float  # wall time it was pinned (a revocation removes the pins made before it)
    how: HowPinned
    trained: bool = False  # an update of this id was committed


class Enrolment:
    """The registry the server consults for every announce and every worker message."""

    def __init__(self, federation: str, policy: EnrolmentPolicy = EnrolmentPolicy(), journal: Path | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.federation, self.policy, self.journal, self.clock = federation, policy, journal, clock
        self.pins: dict[str, Pin] = {}
        self.used: set[str] = set()  # verifiers of spent tokens
        self.tokens: dict[str, Grant] = {}  # verifier -> its grant
        self.invited: set[str] = set()  # ids a token was issued for
        self.revoked: dict[str, float] = {}  # device id -> time of its latest revocation
        self.unpinned: dict[str, str] = {}  # the ids whose pin the last reload removed or replaced -> that key
        self.workers: dict[str, str] = {}  # worker / relay id -> its key, from the journal
        self.local_workers: dict[str, str] = {}  # started by `serve --workers` with keys of its own
        self.followers: dict[str, str] = {}  # model-rollout follower id -> its key, from the journal (never trains)
        self.device_grants = False
        self._recent: deque[float] = deque()  # times of recent open pins (the rate)
        self._seen: tuple[int, int] | None = None

    @property
    def open(self) -> bool:
        return self.policy.open if self.policy.open is not None else not self.device_grants

    # -- the journal ------------------------------------------------------------------------------------
    def reload(self) -> list[str]:
        """Apply the journal if it changed; returns the device ids whose pins it removed or replaced."""
        if self.journal is None:
            return []
        try:
            st = self.journal.stat()
        except FileNotFoundError:
            return []
        if (st.st_size, st.st_mtime_ns) == self._seen:
            return []
        self._seen = (st.st_size, st.st_mtime_ns)
        before = {c: p.key for c, p in self.pins.items()}
        self.apply(read_journal(self.journal))
        changed = sorted(c for c, k in before.items() if c not in self.pins or self.pins[c].key != k)
        self.unpinned = {c: before[c] for c in changed}
        return changed

    def apply(self, entries: list[Entry]) -> None:
        workers: dict[str, tuple[str, float]] = {}
        followers: dict[str, tuple[str, float]] = {}
        for e in entries:
            if isinstance(e, Spend):
                self._spent(e)
            elif isinstance(e, Revoke):
                if e.role in ("worker", "follower"):
                    keyed = workers if e.role == "worker" else followers
                    if e.client in keyed and keyed[e.client][1] <= e.time:
                        del keyed[e.client]
                    continue
                self.revoked[e.client] = max(self.revoked.get(e.client, 0.0), e.time)
                pin = self.pins.get(e.client)
                if pin is not None and pin.since <= e.time:
                    del self.pins[e.client]
                    log.warning(f"{e.client}: device key {pin.key[:12]}... revoked by the operator")
            elif e.role == "worker":
                workers[e.client] = (e.key, e.created)
            elif e.role == "follower":
                followers[e.client] = (e.key, e.created)
            else:
                self.device_grants = True
                if e.verifier is not None:
                    self.tokens[e.verifier] = e
                    self.invited.add(e.client)
                    continue
                pin = self.pins.get(e.client)
                if pin is None or pin.since < e.created:
                    self.pins[e.client] = Pin(e.key, e.created, "key", trained=pin is not None and pin.key == e.key and pin.trained)
        self.workers = {w: k for w, (k, _) in workers.items()}
        self.followers = {f: k for f, (k, _) in followers.items()}

    def _spent(self, e: Spend) -> None:
        """A token redeemed by this or an earlier `serve`: spent for good; its pin stands unless revoked since."""
        self.used.add(e.verifier)
        pin = self.pins.get(e.client)
        if self.revoked.get(e.client, -1.0) < e.time and (pin is None or pin.since <= e.time):
            self.pins[e.client] = Pin(e.key, e.time, "token", trained=pin is not None and pin.key == e.key and pin.trained)

    # -- devices ------------------------------------------------------------------------------------------
    def expects(self, client: str) -> bool:
        """Whether `client` may still enrol with a token (its status is worth keeping until it does)."""
        return client in self.invited and client not in self.pins

    def key(self, client: str) -> str | None:
        pin = self.pins.get(client)
        return pin.key if pin is not None else None

    def report_key(self, client: str) -> str | None:
        """The key a model-rollout report of `client` must be signed with: its device pin, or its follower key."""
        return self.key(client) or self.followers.get(client)

    def precheck(self, client: str, proof: str) -> None:
        """Refuse, before any signature is checked, what closed enrolment never admits: an id with no pin
        presenting no token (a flood of made-up ids costs a parse each, not a signature check)."""
        if not proof and not self.open and client not in self.pins:
            raise Rejected("not_enrolled", f"{client} is not enrolled: `aggregator enroll {client}` gives its "
                                           "operator a join token (edge-client join --join-token)")

    def admit(self, client: str, key: str, proof: str = "") -> None:
        """Whether an announce signed by `key` ("" = unsigned; the signature is already verified) may speak
        for `client`; pins the key on a valid token, or on first use under open enrolment. Raises Rejected."""
        pin = self.pins.get(client)
        if proof:
            if pin is not None and pin.key == key:
                return  # enrolled: the device keeps presenting its (spent) proof
            self._redeem(client, key, proof, pin)
            return
        if pin is not None:
            if key != pin.key:
                raise Rejected("key_mismatch" if key else "unsigned",
                               f"{client} is pinned to device key {pin.key[:12]}..., this message "
                               + (f"is signed by {key[:12]}..." if key else "is not signed"))
            return
        if not self.open:
            raise Rejected("not_enrolled", f"{client} is not enrolled: `aggregator enroll {client}` gives its "
                                           "operator a join token (edge-client join --join-token)")
        if client in self.revoked:
            raise Rejected("revoked", f"{client} was revoked; enrol it again with a token")
        if not key:
            if self.policy.require_device_keys:
                raise Rejected("unsigned", f"{client} does not sign its messages and --require-device-keys is on")
            return  # an old, unsigned device under open enrolment: accepted as before, never pinned
        self._pin_on_first_use(client, key)

    def _redeem(self, client: str, key: str, proof: str, pin: Pin | None) -> None:
        if not key:
            raise Rejected("unsigned", f"{client}: a join token needs a signed announce")
        grant = next((g for g in self.tokens.values()
                      if g.client == client and check_proof(g.verifier, proof, self.federation, client, key)), None)
        if grant is None:
            raise Rejected("bad_token", f"{client}: the enrolment proof matches no token issued for this id")
        now = self.clock()
        if self.revoked.get(client, -1.0) >= grant.created:
            raise Rejected("revoked", f"{client} was revoked after this token was issued; `aggregator enroll {client}` "
                                      "issues a new one")
        if grant.verifier in self.used:
            raise Rejected("token_used", f"{client}: that join token was spent already; issue a new one")
        if grant.expires is not None and now > grant.expires:
            raise Rejected("token_expired", f"{client}: the join token expired; issue a new one")
        if pin is None and len(self.pins) >= self.policy.max_pins:
            raise Rejected("too_many_pins", f"{len(self.pins)} device keys pinned")
        spend = Spend(client=client, verifier=grant.verifier, key=key, time=now)
        if self.journal is not None:  # on disk before it takes effect: a crash never re-arms the token
            try:
                append(self.journal, spend)
            except OSError as e:
                log.error(f"{client}: its join token could not be recorded as spent in {self.journal} ({e}); "
                          "enrolment refused until the key directory is writable")
                raise Rejected("journal_unwritable", f"{client}: the server could not record the spent token") from None
        self._spent(spend)
        log.info(f"{client} enrolled with its join token: device key {key[:12]}..."
                 + (f" (rotated from {pin.key[:12]}...)" if pin is not None else ""), extra={"client": client})

    def _pin_on_first_use(self, client: str, key: str) -> None:
        now, p = self.clock(), self.policy
        while self._recent and now - self._recent[0] >= 60.0:
            self._recent.popleft()
        if len(self._recent) >= p.new_pins_per_minute:
            raise Rejected("pin_rate_limited", f"more than {p.new_pins_per_minute} new device keys a minute")
        if len(self.pins) >= p.max_pins or self.unproven() >= p.max_unproven:
            raise Rejected("too_many_pins", f"{self.unproven()} untrained ids pinned on first use, {len(self.pins)} in all")
        self._recent.append(now)
        self.pins[client] = Pin(key, now, "open")

    def unproven(self) -> int:
        return sum(1 for p in self.pins.values() if p.how == "open" and not p.trained)

    def trained(self, clients: list[str]) -> None:
        for c in clients:
            if c in self.pins:
                self.pins[c].trained = True

    def expire(self, keep: set[str] = frozenset()) -> list[str]:
        """Forget open pins of ids that never trained, once older than the policy allows (never `keep`)."""
        now, ttl = self.clock(), self.policy.unproven_ttl_s
        gone = [c for c, p in self.pins.items()
                if p.how == "open" and not p.trained and now - p.since > ttl and c not in keep]
        for c in gone:
            del self.pins[c]
        return gone

    # -- workers and relays --------------------------------------------------------------------------
    def worker_key(self, worker: str) -> str | None:
        return self.local_workers.get(worker) or self.workers.get(worker)

    def has_workers(self) -> bool:
        return bool(self.workers or self.local_workers)

    # -- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"pins": {c: [p.key, p.since, p.how, p.trained] for c, p in sorted(self.pins.items())},
                "used": sorted(self.used)}

    def load_state_dict(self, state: Any, legacy_keys: Any = None) -> None:
        """A checkpoint's registry; `legacy_keys` (an older checkpoint's client_keys) become open pins of
        ids counted as trained, so they do not expire."""
        if isinstance(legacy_keys, dict):
            for c, k in legacy_keys.items():
                if isinstance(c, str) and isinstance(k, str):
                    self.pins[c] = Pin(k, 0.0, "open", trained=True)
        if not isinstance(state, dict):
            return
        for c, rec in (state.get("pins") or {}).items():
            if isinstance(rec, list) and len(rec) == 4 and isinstance(rec[0], str) and isinstance(rec[1], (int, float)) \
                    and rec[2] in ("open", "token", "key"):
                self.pins[c] = Pin(rec[0], float(rec[1]), rec[2], bool(rec[3]))
        self.used.update(v for v in state.get("used") or [] if isinstance(v, str))
