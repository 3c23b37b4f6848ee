"""The server's control plane: who may take part, and what the server says about itself.

Device enrolment (pins, tokens, revocations and expiries), the devices' signed statuses (an id invited to
enrol has its status held until its enrolling announce), announces, declines and upload notices, each
believed only under the key pinned for its id; and the server's own signed, retained status, mirrored
in status.json. The round's data (models, tasks, updates, workers) travels through aggregator/server.py.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import paho.mqtt.client as mqtt

from aggregator.enrolment import Enrolment
from aggregator.federation import Federation, Rejected
from aggregator.intake import DeviceKeys
from aggregator.link import Link
from aggregator.metrics import Observer
from aggregator.refusals import RefusalLimit
from aggregator.resends import Resends
from nefl.nested.profile import Profile
from nefl.protocol.messages import (MAX_LISTED, REFUSAL_HINTS, Announce, AnnounceRefusal, ClientStatus, Decline, Sent,
                                    ServerStatus, StatusBook, TrainingSettings, refusal_hint)
from nefl.protocol.signing import split_signed, verify, verify_self_signed
from nefl.protocol.topics import Topics
from nefl.support.fsio import atomic_write_text

STATUS_FILE = "status.json"
PENDING_STATUSES = 1_000  # statuses of ids invited to enrol, kept until their enrolling announce (oldest out)

log = logging.getLogger("aggregator.server")


class ControlPlane:
    """Enrolment and the devices' control messages, judged under their pinned keys (each handler raises
    Rejected or MessageError with the reason the server counts), and the server's own status."""

    def __init__(self, fed: Federation, link: Link, topics: Topics, enrol: Enrolment, keys: DeviceKeys, observer: Observer,
                 resends: Resends, profile: Profile, training: TrainingSettings, rounds: int, status_every: float,
                 out: Path, progress: Callable[[], tuple[int, list[float] | None]]) -> None:
        """`progress`: the last finished round and the newest accuracy, for a status while no round is open."""
        self.fed, self.link, self.topics, self.enrol, self.observer, self.resends = fed, link, topics, enrol, observer, resends
        self.keys = keys  # the pinned device keys, parsed (shared with the update intake)
        self._statuses = StatusBook()  # each enrolled client's newest signed status
        self._pending: OrderedDict[str, bytes] = OrderedDict()  # statuses of ids not enrolled (yet)
        self._presence_changed = False  # who is online or able to train changed since the last status
        self._status_at = 0.0  # monotonic time of the last published status
        self._status_every, self._status_file, self._progress = status_every, out / STATUS_FILE, progress
        self.refusals = RefusalLimit()
        self.take_decline = fed.decline  # what a verified decline settles: the open round's task (buffered: its own)
        # what every status repeats: the run, its profile and its training settings
        self._fixed = dict(federation=fed.name, run=link.run_id, rounds=rounds, profile=profile.to_dict(),
                           method=fed.layout.method.name, profile_hash=fed.layout.profile.hash,
                           key=link.signer.public_text, training=training)

    # -- the server's status ----------------------------------------------------------------------
    def status(self, state: str) -> ServerStatus:
        r, online = self.fed.round, self.fed.available()
        done, accuracy = self._progress()
        return ServerStatus(
            state=state, **self._fixed, round=r.index if r else done, clients_online=online[:MAX_LISTED],
            clients_online_count=len(online), participants=sorted(r.assignments)[:MAX_LISTED] if r else [],
            reported=sorted(r.received)[:MAX_LISTED] if r else [], accuracy=accuracy,
            rejected_total=dict(self.fed.rejected), time=time.time(), **self.link.stamp(),
        )

    def publish_status(self, state: str) -> mqtt.MQTTMessageInfo:
        """Signed and retained on the broker, and mirrored (unsigned, readable) in status.json."""
        status = self.status(state)
        self._presence_changed, self._status_at = False, time.monotonic()
        self.observer.status(status)
        body = status.to_json()
        info = self.link.retain(self.topics.server_status, self.link.signer.sign(body))
        self._status_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self._status_file, msgspec.json.format(body, indent=1).decode())
        return info

    def heartbeat(self) -> None:
        """The status at once when who is online or able to train changed, else at least every `status_every`
        seconds (`aggregator status` and the devices stay true)."""
        if self._presence_changed or (self._status_at and time.monotonic() - self._status_at >= self._status_every):
            self.publish_status("training" if self.fed.round else "waiting")

    # -- enrolment --------------------------------------------------------------------------------
    def check_enrolment(self) -> None:
        """The operator's enrolment changes and expired pins: their ids are forgotten, not waited for."""
        r = self.fed.round
        for c in self.enrol.reload():
            self.fed.forget(c, "its device key was revoked or replaced")
            self._statuses.forget(c)
            self._presence_changed = True
            if self.enrol.key(c) is None:  # revoked: the device hears it now, not at its next announce
                self.refuse(c, "revoked", self.enrol.unpinned[c])
            else:
                self.observer.client_gone(c, "key replaced")
        for c in self.enrol.expire(set(r.assignments) if r else set()):
            log.info(f"{c}: its first-use pin expired without it ever training", extra={"client": c})
            self.fed.forget(c, "pin expired")
            self._statuses.forget(c)

    # -- devices' messages ------------------------------------------------------------------------
    def announce(self, client: str, payload: bytes) -> None:
        info = self.fed.announce(client, self._open_announce(client, payload))
        self.observer.client_changed(info)
        self._presence_changed = True
        why = f" ({info.selection})" if info.selection else ""
        log.info(f"client {client} announced: submodel <= {info.max_submodel + 1}, {info.samples} samples{why}",
                 extra={"client": client, "submodel": info.max_submodel + 1})

    def _open_announce(self, client: str, payload: bytes) -> Announce:
        """A device signs its announce with the key it names: check that, then that the key may speak for the
        id (enrolment). An id that cannot be enrolled is refused before any signature is checked."""
        parts = split_signed(payload)
        msg = Announce.from_json(payload if parts is None else parts[0])
        self._judge(client, "", lambda: self.enrol.precheck(client, msg.token))
        if parts is None:
            self._judge(client, "", lambda: self.enrol.admit(client, "", msg.token))
            return msg
        body, key = verify_self_signed(payload, lambda b: Announce.from_json(b).key)
        msg = Announce.from_json(body)
        new = self.enrol.key(client) is None
        self._judge(client, key, lambda: self.enrol.admit(client, key, msg.token))
        if new and client in self._pending and self.enrol.key(client) is not None:
            self.client_status(client, self._pending.pop(client))  # its status came before its enrolment
        return msg

    def _judge(self, client: str, key: str, check: Callable[[], None]) -> None:
        """An enrolment check; its refusal is also told to the device (`key`: the verified key of the refused
        announce, "" before any signature was checked)."""
        try:
            check()
        except Rejected as e:
            if e.reason in REFUSAL_HINTS:
                self.refuse(client, e.reason, key)
            raise

    def refuse(self, client: str, reason: str, key: str) -> None:
        """A signed `AnnounceRefusal` on the device's own topic, within the rate limit (aggregator/refusals.py)."""
        if reason == "revoked":
            self.observer.client_gone(client, "revoked")
        if not self.refusals.allow(client, reason):
            return
        msg = AnnounceRefusal(client=client, federation=self.fed.name, run=self.link.run_id, reason=reason, key=key,
                      hint=refusal_hint(reason, client), **self.link.stamp())
        self.link.tell(self.topics.refusal(client), self.link.signer.sign(msg.to_json()))

    def pinned_body(self, client: str, payload: bytes) -> bytes:
        """The body of a device's message, signed by the key pinned for its id (so nobody else can speak, or
        decline a task, for it); an id without a pin (an unsigned device under open enrolment) sends it as is."""
        key = self.keys(client)
        if key is not None:
            return verify(payload, key)
        parts = split_signed(payload)
        return payload if parts is None else parts[0]

    def client_status(self, client: str, payload: bytes) -> None:
        """A device's status: signed by its pinned key, newer than the last one. Under open enrolment an id
        without a pin is trusted as before; under closed enrolment its status waits for its enrolment."""
        key = self.keys(client)
        if key is None:
            if not self.enrol.open:
                self._hold_status(client, payload)
                return
            parts = split_signed(payload) if payload else None
            body = payload if parts is None else parts[0]
            online = bool(body) and ClientStatus.from_json(body).state == "online"
        else:
            status = ClientStatus.from_json(verify(payload, key))
            if not self._statuses.newer(client, status.seq, status.state):
                return
            online = status.state == "online"
        self.fed.set_online(client, online)
        self.observer.client_changed(self.fed.clients.get(client))
        self._presence_changed = True

    def _hold_status(self, client: str, payload: bytes) -> None:
        """The status of an id invited to enrol (a token was issued for it), kept until its first announce; any
        other id's is refused."""
        if not self.enrol.expects(client):
            raise Rejected("not_enrolled", f"status of {client}, which is not enrolled")
        self._pending[client] = payload
        self._pending.move_to_end(client)
        if len(self._pending) > PENDING_STATUSES:
            gone, _ = self._pending.popitem(last=False)
            raise Rejected("not_enrolled", f"status of {gone}, which never enrolled")

    def sent(self, client: str, payload: bytes) -> None:
        """A device's notice that its update is out: the round then waits at most `resend_after` for it. Moot once
        the round has the update (here it arrives before its notice, on the same connection): then it is not even
        verified, a signature check per device and round that changes nothing."""
        r = self.fed.round
        if r is not None and (client in r.received or client in r.refused):
            return
        msg = Sent.from_json(self.pinned_body(client, payload))
        if msg.client != client:
            raise Rejected("client_mismatch", f"notice of {msg.client!r} on {client!r}'s topic")
        if r is not None and msg.run == self.link.run_id and msg.round == r.index and client in r.assignments:
            self.resends.notice(client)

    def decline(self, client: str, payload: bytes) -> None:
        msg = Decline.from_json(self.pinned_body(client, payload))
        if msg.federation != self.fed.name or msg.run != self.link.run_id:
            raise Rejected("stale_decline", f"decline for {msg.federation}/{msg.run}, this is "
                                            f"{self.fed.name}/{self.link.run_id}")
        self.take_decline(client, msg)
        self.link.retain(self.topics.task(client))  # its task is settled
        log.info(f"round {msg.round}: {client} declined submodel {msg.submodel + 1} ({msg.reason or 'no reason given'}); "
                 "the round no longer waits for it", extra={"round": msg.round, "client": client})

    # -- rounds -----------------------------------------------------------------------------------
    def round_closed(self, facts: dict[str, Any]) -> dict[str, Any]:
        """The enrolment's facts for the round's metrics line; once the round is in its checkpoint, a pin of an
        id that trained never expires."""
        if facts["committed"]:
            self.enrol.trained([c for c in facts["reported"] if c not in facts.get("dropped", {})])
        return {"open": self.enrol.open, "pinned": len(self.enrol.pins), "untrained_open_pins": self.enrol.unproven()}
