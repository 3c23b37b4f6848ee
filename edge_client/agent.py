"""The device side of a federation as pure logic: messages in, publishes and training out.

`Agent` holds the client's state machine (which server run it follows, the task it holds, the
weights it is collecting, what it last uploaded) and talks to the world only through a `Transport`
(publish / subscribe) and a `Device` (plan, train). The MQTT shell in edge_client/join.py feeds it
messages and the clock; the unit tests feed it messages with fakes of both.

Everything from the broker is untrusted: server messages must carry the pinned server key's
signature (nefl/protocol/signing.py), weights must hash to what the signed task names, and any message
that fails is dropped with a counted reason; nothing inbound can end the agent.

Which key and which run: the server key comes from --server-key, from a join token (which names its
fingerprint), or, on trust on first use, from the first running federation that sends this device a
task (a status alone, replayed or forged, pins nothing). Every signed server message names its run
incarnation and sequence number: the agent follows the newest incarnation it has seen (remembered per
server key across restarts), refuses older ones, and ends only with a run it took part in.
"""

from __future__ import annotations

import logging
import secrets
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from edge_client.device import Device
from edge_client.select import Selection
from nefl.support.fsio import atomic_write_text
from nefl.protocol.messages import (FINAL_REFUSALS, MAX_STATUS_BYTES, Announce, AnnounceRefusal, Control, Decline,
                                   MessageError, Sent, ServerStatus, Stamped, Task, TrainingSettings, UpdateRefusal,
                                   message_type, refusal_hint)
from nefl.protocol.mqtt import Transport
from nefl.nested.profile import ProfileError, parse_profile
from nefl.protocol.signing import (KeyPin, Signer, parse_public_key, public_key_arg, split_signed, status_message, verify,
                                   verify_self_signed)
from nefl.nested.state import Layout
from nefl.protocol.tokens import fingerprint, parse_token, proof
from nefl.protocol.topics import Topics
from nefl.nested.train import OutOfTime
from nefl.protocol.wire import DEFAULT_CHUNK_BYTES, MAX_HEADER_BYTES, Reassembler, WireError, encode, parse_chunk

UPLOAD_SHARE = 0.2  # of the time left before a round's deadline, kept for the upload
REPLAN_S = 5.0  # an idle device re-probes this often and re-announces when what it can train changed
LIVE = ("waiting", "training", "evaluating")  # states of a running federation (first use trusts no other)
MAX_CANDIDATES = 8  # server keys seen on first use, before one of them sends this device a task
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentConfig:
    client_id: str
    federation: str = "default"
    max_submodel: int = 1000  # the operator's cap (1-based); below it each round picks what fits
    fp16: bool = False
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    server_key: str | None = None  # pinned aggregator public key (base64 or file); None: trust on first use
    pin_file: Path | None = None  # where a first-use key is remembered
    device_key: Signer | None = None  # this device's key: signs its announces, declines, statuses, notices and update headers
    join_token: str | None = None  # `aggregator enroll`'s one-time token: enrols the device key, names the server key
    run_file: Path | None = None  # the newest run incarnation seen, per server key (older runs are refused)
    replan_s: float = REPLAN_S
    task_budget_s: float | None = None  # buffered mode: seconds one task may take here (None: the server's task bound)


def model_bytes_bound(layout: Layout, k: int) -> int:
    """Most bytes an honest fp32 safetensors payload of submodel k's weights can take."""
    shapes = layout.sub_shapes[k]
    return 4 * sum(s.numel() for s in shapes.values()) + 256 * len(shapes) + 4096


def _label(task: Task) -> str:
    """How the device's log names a task: its round, or in buffered mode its number and base version."""
    return f"task {task.round} (version {task.version})" if task.mode == "buffered" else f"round {task.round}"


class Agent:
    def __init__(self, cfg: AgentConfig, transport: Transport, device: Device,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg, self.transport, self.device, self.clock = cfg, transport, device, clock
        self.topics = Topics(cfg.federation)
        self.pin = KeyPin(public_key_arg(cfg.server_key) if cfg.server_key else None, cfg.pin_file)
        self.token = parse_token(cfg.join_token) if cfg.join_token else None  # (server key fingerprint, secret)
        if self.token and self.pin.text and fingerprint(self.pin.text) != self.token[0]:
            raise ValueError(f"the join token names server key {self.token[0]}, but --server-key (or the key pinned in "
                             f"{cfg.pin_file}) is {fingerprint(self.pin.text)}: use this federation's token, or delete "
                             "that pin file if the key in it was trusted by mistake")
        self.candidates: dict[str, ServerStatus] = {}  # first use: key -> its newest live status
        self.incarnation = self._remembered_incarnation()  # refuse runs older than this
        self.stamp: tuple[int, int] = (self.incarnation, -1)  # (incarnation, seq) of the newest signed status
        self.layout: Layout | None = None
        self.profile_hash: str | None = None
        self.training = TrainingSettings()  # the server's batch size, local epochs and round timeout
        self.selection: Selection | None = None
        self.promised = 0  # the bound (1-based) of the latest announce: tasks at or below it are kept...
        self.promised_deadline = 0.0  # ...when they leave at least the round time it was planned for
        self._planned_deadline = 0.0
        self.run_id: str | None = None  # the server run whose signed status we follow
        self.server_seen = False  # a trusted server status has arrived (for "no server" diagnostics)
        self.foreign_key: str | None = None  # a status signed by another key than the pinned one arrived
        self.held: dict[str, bytes] = {}  # signed messages that arrived before the status they depend on
        self.task: Task | None = None
        self.buffered = False  # the newest task came from a buffered-mode server (no rounds: its own time budget)
        self.task_since = 0.0
        self.last_task: tuple[str, int] = ("", 0)  # (server run id, round) of the last task taken
        self.last_upload: tuple[tuple[str, int], list[bytes]] = (("", 0), [])  # kept for a resend after a broker restart
        self.model_sub: int | None = None
        self.models_in = Reassembler(max_bytes=1, timeout_s=1)  # sized by each task: no task, no buffering
        self.weights: dict[str, torch.Tensor] | None = None  # the current task's verified weights
        self.ended = False
        self.said_not_joined = ""  # the run whose end was logged as not ours
        self.refused: str | None = None  # why the server refused this device for good (join then exits)
        self.said_refused = ""  # the reason of the last refusal logged (a retry under it is not logged again)
        self.dropped: Counter[str] = Counter()
        self.updates_refused: Counter[str] = Counter()  # buffered mode: this device's updates the server did not take
        self.session = secrets.token_hex(4)  # announces are numbered within it (Announce.seq)
        self.seq = 0
        self.planned_at = -float("inf")

    # -- connection ---------------------------------------------------------------------------------
    def subscriptions(self) -> list[str]:
        me = self.cfg.client_id
        subs = [self.topics.task(me), self.topics.refusal(me), self.topics.control, self.topics.server_status]
        return subs + ([self.topics.model_all(self.model_sub)] if self.model_sub is not None else [])

    def on_connected(self, seq: int = 0) -> None:
        """(Re)connected (the connection stamped `seq`): say we are here; a first connect announces once the
        profile is planned."""
        for topic in self.subscriptions():
            self.transport.subscribe(topic, qos=1)
        self.transport.publish(self.topics.status(self.cfg.client_id), status_message(self.cfg.device_key, "online", seq),
                               qos=1, retain=True)
        if self.selection is not None:
            self._announce()

    # -- inbound --------------------------------------------------------------------------------------
    def dispatch(self, topic: str, payload: bytes) -> None:
        """The trust boundary: any message is handled, held, or dropped with a counted reason."""
        if not payload:
            return  # a retained message being cleared
        try:
            self._route(topic, payload)
        except (MessageError, WireError) as e:
            self._drop(e.reason, f"{topic}: {e.detail}")
        except Exception:  # a bug must not let one message end the agent: count it, keep the trace
            self._drop("internal_error", traceback.format_exc(limit=3).strip().replace("\n", " | "))

    def _route(self, topic: str, payload: bytes) -> None:
        if topic == self.topics.server_status:
            self._on_status(payload)
        elif topic == self.topics.control:
            self._on_signed(topic, payload, Control, self._on_control)
        elif topic == self.topics.task(self.cfg.client_id):
            self._on_signed(topic, payload, Task, self._take_task)
        elif topic == self.topics.refusal(self.cfg.client_id):
            parts = split_signed(payload)
            if parts is not None and message_type(parts[0]) == "update_refusal":
                self._on_signed(topic, payload, UpdateRefusal, self._on_update_refusal)
            else:
                self._on_signed(topic, payload, AnnounceRefusal, self._on_refusal)
        elif self.model_sub is not None and topic.startswith(self.topics.model_all(self.model_sub)[:-1]):
            self._on_model_chunk(payload)

    def _drop(self, reason: str, detail: str) -> None:
        """Count and say why; a flood of one reason is logged at 1, 2, 4, 8, ... occurrences."""
        self.dropped[reason] += 1
        n = self.dropped[reason]
        if n & (n - 1) == 0:
            log.warning(f"dropped a message ({reason}, {n} so far): {detail[:600]}", extra={"reason": reason})

    def _on_signed(self, topic: str, payload: bytes, cls: type[Stamped], handle: Callable) -> None:
        """Verify against the pinned key and the current run; hold it until a status names the run. On first
        use, a task signed by one of the candidate keys (for that key's run) pins that key."""
        if self.pin.key is None:
            found = self._candidate_for(payload)
            if found is None:
                self.held[topic] = payload  # the newest one per topic; replayed once a status makes sense of it
                return
            key, status = found
            msg = cls.from_json(verify(payload, parse_public_key(key)))
            if msg.federation != self.cfg.federation or msg.run != status.run or msg.incarnation != status.incarnation:
                raise MessageError("wrong_run", f"{type(msg).__name__} of {msg.federation}/{msg.run}, that key's run "
                                                f"is {status.run}")
            if isinstance(msg, AnnounceRefusal):
                self._on_refusal(msg, trusted=False)  # said, never obeyed: it does not make the key trusted
            if not isinstance(msg, Task):
                return  # nothing but a task (this device chosen by that run) makes a first-use key trusted
            self._pin(key, f"its run {status.run} sent this device a task")
            self._adopt(status)
        elif self.run_id is None:
            self.held[topic] = payload
            return
        else:
            msg = cls.from_json(verify(payload, self.pin.key))
            if msg.federation == self.cfg.federation and msg.incarnation > self.incarnation:
                # a newer run of the pinned server whose status has not reached this device yet (a replayed old
                # status came first, or the task overtook it): taken once that status is adopted
                self.held[topic] = payload
                return
            if msg.federation != self.cfg.federation or msg.run != self.run_id or msg.incarnation != self.incarnation:
                raise MessageError("stale_run" if msg.incarnation < self.incarnation else "wrong_run",
                                   f"{type(msg).__name__} of {msg.federation}/{msg.run} (incarnation {msg.incarnation}), "
                                   f"following {self.cfg.federation}/{self.run_id} (incarnation {self.incarnation})")
        handle(msg)

    def _candidate_for(self, payload: bytes) -> tuple[str, ServerStatus] | None:
        """The candidate key (and its status) that signed `payload`, if any."""
        for key, status in self.candidates.items():
            try:
                verify(payload, parse_public_key(key))
            except MessageError:
                continue
            return key, status
        return None

    def _on_status(self, payload: bytes) -> None:
        if split_signed(payload) is None:
            if ServerStatus.from_json(payload, MAX_STATUS_BYTES).state == "offline":  # the broker's last will
                log.warning("the aggregator went offline; waiting for it to come back")
                return
            raise MessageError("unsigned", "server status without a signature")
        if self.pin.key is None:
            self._first_use(payload)
            return
        try:
            body = verify(payload, self.pin.key)
        except MessageError as e:
            raise MessageError(e.reason, self._wrong_key(payload, e.detail)) from None
        status = ServerStatus.from_json(body, MAX_STATUS_BYTES)
        if status.federation != self.cfg.federation or status.run is None:
            raise MessageError("wrong_run", f"status of federation {status.federation}, joined {self.cfg.federation}")
        if status.incarnation < self.incarnation:
            raise MessageError("stale_run", f"status of run incarnation {status.incarnation}, this device saw "
                                            f"{self.incarnation} (an old run replayed)")
        if status.stamp() < self.stamp:
            raise MessageError("replayed", f"status #{status.seq} of incarnation {status.incarnation}, newer one seen: "
                                           f"#{self.stamp[1]} of {self.stamp[0]}")
        self._adopt(status)

    def _adopt(self, status: ServerStatus) -> None:
        """Follow `status`'s run (a newer incarnation replaces the old one, remembered across restarts)."""
        if not self.server_seen or status.run != self.run_id:
            log.info(f"aggregator found: federation {status.federation}, run {status.run} (incarnation "
                     f"{status.incarnation}), {status.state}, round {status.round}/{status.rounds}")
        if status.incarnation > self.incarnation:
            self._remember_incarnation(status.incarnation)
        self.stamp, self.incarnation, self.run_id, self.server_seen = status.stamp(), status.incarnation, status.run, True
        self.training = status.training
        self._adopt_profile(status)
        held, self.held = self.held, {}
        for topic, message in held.items():
            self.dispatch(topic, message)

    def _wrong_key(self, payload: bytes, detail: str) -> str:
        """Why a status failed the pinned key, and the fix for where that key came from; remembers a
        self-consistent foreign key so the shell's "no aggregator" warning can say one answers."""
        try:
            _, other = verify_self_signed(payload, lambda body: ServerStatus.from_json(body, MAX_STATUS_BYTES).key)
        except MessageError:
            return detail
        self.foreign_key = other
        says = f"status signed by key {other}, not the pinned {self.pin.text}"
        if self.pin.source == "given":
            return (f"{says} of --server-key: pass what `aggregator key` prints on that server, if it is yours "
                    "(else another process poses as this federation's aggregator)")
        return (f"{says} remembered in {self.pin.pin_file}: if the aggregator's key was really replaced, delete the "
                "file or pass --server-key")

    def _first_use(self, payload: bytes) -> None:
        """No key pinned. With a join token: pin the key it names. Otherwise remember the key as a candidate
        (only a live status of this federation counts), plan from its profile, and pin it once its run sends
        this device a task: a replayed or forged status alone pins nothing."""
        body, key = verify_self_signed(payload, lambda b: ServerStatus.from_json(b, MAX_STATUS_BYTES).key)
        status = ServerStatus.from_json(body, MAX_STATUS_BYTES)
        if status.federation != self.cfg.federation or status.run is None:
            raise MessageError("wrong_run", f"status of federation {status.federation}, joined {self.cfg.federation}")
        if self.token is not None:
            if fingerprint(key) != self.token[0]:
                raise MessageError("wrong_server_key", f"status signed by server key {fingerprint(key)}, the join "
                                                       f"token names {self.token[0]}")
            self._pin(key, "the join token names it", first_use=False)
            self._on_status(payload)
            return
        if status.state not in LIVE:
            raise MessageError("not_live", f"a {status.state} status: first use trusts only a running federation")
        if key not in self.candidates and len(self.candidates) >= MAX_CANDIDATES:
            raise MessageError("too_many_keys", f"{len(self.candidates)} server keys claim federation {status.federation}")
        old = self.candidates.get(key)
        if old is not None and status.stamp() < old.stamp():
            raise MessageError("replayed", f"an older status of candidate key {fingerprint(key)}")
        if old is None:
            others = ", ".join(fingerprint(k) for k in self.candidates)
            log.warning(f"server key {fingerprint(key)} claims federation {status.federation} (run {status.run}); "
                        "trusted once its run sends this device a task"
                        + (f". Other keys claim it too: {others} -- pass --server-key or a join token" if others else ""))
        self.candidates[key] = status
        self.training, self.server_seen = status.training, True
        self._adopt_profile(status)
        held, self.held = self.held, {}
        for topic, message in held.items():
            self.dispatch(topic, message)

    def _pin(self, key: str, why: str, first_use: bool = True) -> None:
        """Remember the server key; trust on first use warns, a key the join token names is simply noted."""
        self.pin.learn(key)
        self.candidates.clear()
        self.incarnation = self._remembered_incarnation()
        self.stamp = (self.incarnation, -1)
        if not first_use:
            log.info(f"server key {fingerprint(key)}: {why}; remembered in {self.pin.pin_file}")
            return
        log.warning(f"trusting server key {key} (fingerprint {fingerprint(key)}) on first use: {why}; remembered in "
                    f"{self.pin.pin_file}. Check the fingerprint with `aggregator key`, or pass --server-key")

    def _remembered_incarnation(self) -> int:
        """The newest run incarnation this device saw under the pinned key (0: none, or another key's)."""
        f, key = self.cfg.run_file, self.pin.text
        if f is None or key is None:
            return 0
        try:
            fp, number = f.read_text().split()
            return int(number) if fp == fingerprint(key) else 0
        except (OSError, ValueError):
            return 0

    def _remember_incarnation(self, incarnation: int) -> None:
        if self.cfg.run_file is not None and self.pin.text is not None:
            self.cfg.run_file.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.cfg.run_file, f"{fingerprint(self.pin.text)} {incarnation}\n")

    def _adopt_profile(self, status: ServerStatus) -> None:
        if not status.profile_hash or status.profile_hash == self.profile_hash or status.profile is None:
            return
        try:
            layout = Layout.build(parse_profile(status.profile), status.method or None)
        except (ProfileError, KeyError, TypeError, ValueError) as e:
            raise MessageError("bad_profile", f"cannot use the server's profile ({e})") from None
        self.layout, self.profile_hash, self.selection = layout, layout.profile.hash, None
        log.info(f"profile {layout.profile.name} ({layout.num_submodels} submodels, {layout.method.name})")
        self.plan()

    def _on_control(self, msg: Control) -> None:
        """The end of the run this device follows, which ends the device only if it trained in that run: an
        end replayed from an earlier run (or one this device never took part in) leaves it waiting."""
        if msg.event != "end":
            return
        if self.last_task[0] == msg.run:
            self.ended = True
        elif self.said_not_joined != msg.run:
            self.said_not_joined = msg.run
            if self.said_refused:
                log.info(f"run {msg.run} of federation {msg.federation} ended; the server refused this device "
                         f"({self.said_refused}) and took nothing from it")
            else:
                log.info(f"run {msg.run} of federation {msg.federation} ended; this device took no task in it, so it "
                         "stays for the next run")

    def _on_refusal(self, msg: AnnounceRefusal, trusted: bool = True) -> None:
        """The server refused our announce: say what to do, once per reason. A final reason (revoked, a bad,
        spent or expired token) ends the device, but only when the refused announce was signed by this device's
        key (an announce forged under our id is refused too, and must not stop us) and the refusal by the pinned
        server key: a device with neither pin nor token (`trusted` False: a key it has only seen in a status) says
        the refusal and keeps trying, as anyone could run a server that refuses it."""
        me, key = self.cfg.client_id, self.cfg.device_key
        if msg.client != me:
            raise MessageError("client_mismatch", f"refusal of {msg.client!r} on {me!r}'s topic")
        final = msg.reason in FINAL_REFUSALS
        if final and (key is None or msg.key != key.public_text):
            raise MessageError("not_our_announce", f"refusal ({msg.reason}) of an announce signed by "
                                                   f"{msg.key[:12] or 'no key'}..., not by this device's key")
        said = refusal_hint(msg.reason, me) or "".join(c if c.isprintable() else "?" for c in msg.hint)
        if final and trusted:
            self.refused = msg.reason
            log.error(f"the server refused this device ({msg.reason}): {said}", extra={"reason": msg.reason})
        elif self.said_refused != msg.reason:
            self.said_refused = msg.reason
            log.warning(f"the server refused this device's announce ({msg.reason}): {said}; still trying"
                        + ("" if trusted else " (a server whose key this device has not pinned: not obeyed)"),
                        extra={"reason": msg.reason})

    def _on_update_refusal(self, msg: UpdateRefusal) -> None:
        """Buffered mode: the server did not take this device's update of a task, and says why (its next task
        comes anyway); counted, and logged once per reason and then at 2, 4, 8, ... of it."""
        if msg.client != self.cfg.client_id:
            raise MessageError("client_mismatch", f"refusal of {msg.client!r} on {self.cfg.client_id!r}'s topic")
        self.updates_refused[msg.reason] += 1
        n = self.updates_refused[msg.reason]
        if n & (n - 1) == 0:
            log.warning(f"task {msg.round}: the server refused this device's update of submodel {msg.submodel + 1} "
                        f"({msg.reason}; trained from version {msg.version}, the newest is {msg.current}; {n} so far)",
                        extra={"round": msg.round, "submodel": msg.submodel + 1, "reason": msg.reason})

    def _task_time(self, task: Task) -> float:
        """Seconds this task may take: the round's deadline (sync), or this device's own budget within the server's
        bound (buffered)."""
        own = self.cfg.task_budget_s
        return min(own, task.deadline_s) if task.mode == "buffered" and own is not None else task.deadline_s

    def _idle_time(self) -> float:
        """The task time an idle device plans for: the server's round timeout, or in buffered mode (its last task's)
        this device's own budget within it."""
        own, bound = self.cfg.task_budget_s, self.training.round_timeout
        return min(own, bound) if self.buffered and own is not None else bound

    def _take_task(self, task: Task) -> None:
        """Remember a new task and subscribe to its submodel's (retained) weights, or decline it."""
        r, k = task.round, task.submodel
        key = (task.run, r)
        if key == self.last_task and self.last_upload[0] == key:
            # the task is still open after a reconnect (the broker may have lost our upload in a restart), or the
            # server asks for it (it never reached the server: on `resend/`, which no shared subscription reads);
            # resending is safe, the server drops chunks it already has
            topic = self.topics.resend if task.resend else self.topics.update
            self._publish_update(self.last_upload[1], topic(self.cfg.client_id))
            log.info(f"round {r}: " + ("the server asked for the update again" if task.resend else "task redelivered")
                     + ", resent it", extra={"round": r, "submodel": k + 1})
            return
        if task.resend:
            return  # a resend request for an upload this device has not made (yet): nothing to resend
        if key == self.last_task or (key[0] == self.last_task[0] and r < self.last_task[1]):
            return  # a retained task seen again after a reconnect
        if self.layout is None or task.profile_hash != self.profile_hash or k >= self.layout.num_submodels:
            raise MessageError("bad_task", f"round {r}: task for profile {task.profile_hash} submodel {k + 1}, "
                                           f"following profile {self.profile_hash}")
        if task.model_bytes > model_bytes_bound(self.layout, k):
            raise MessageError("bad_task", f"round {r}: {task.model_bytes}-byte weights exceed submodel {k + 1}'s size")
        # a task is kept unless the device truly cannot train it now: no hysteresis margin for k. One at or
        # below the announced bound, with the round time the bound was planned for, is a promise: training fits
        # itself to the time left, so only memory that is no longer there breaks it
        time_s, self.buffered = self._task_time(task), task.mode == "buffered"
        promised = k < self.promised and time_s >= self.promised_deadline
        current = self.selection.index if self.selection is not None and self.selection.index is not None else -1
        self.plan(time_s, hold=max(current, k))
        if self._cannot_keep(k) if promised else not self._allows(k):
            why = f"--max-submodel {self.cfg.max_submodel}" if self.selection is None else self.selection.reason
            self._decline(task, f"submodel {k + 1} does not fit now ({why})")
            return
        self.task, self.task_since, self.weights = task, self.clock(), None
        # buffer exactly one honest copy of the weights, for as long as the round may last
        room = task.model_bytes + MAX_HEADER_BYTES + 8  # one message may carry the whole payload
        self.models_in = Reassembler(max_bytes=room, max_buffered=task.model_bytes, timeout_s=time_s)
        if self.model_sub is not None and self.model_sub != k:
            self.transport.unsubscribe(self.topics.model_all(self.model_sub))
        self.model_sub = k
        self.transport.subscribe(self.topics.model_all(k), qos=1)  # again: the retained chunks are redelivered

    def _decline(self, task: Task, why: str) -> None:
        """Tell the server this one task will not be trained (it stops waiting for us), and never train it."""
        r, k = task.round, task.submodel
        log.info(f"declining round {r}: {why}", extra={"round": r, "submodel": k + 1, "reason": why[:300]})
        self.last_task = (task.run, r)
        key = self.cfg.device_key
        msg = Decline(client=self.cfg.client_id, federation=self.cfg.federation, run=task.run, round=r, submodel=k,
                      reason=why[:300], key="" if key is None else key.public_text)
        self.transport.publish(self.topics.decline(self.cfg.client_id),
                               msg.to_json() if key is None else key.sign(msg.to_json()), qos=1)

    def _on_model_chunk(self, payload: bytes) -> None:
        """Weights count only when they are what the signed task names (digest, round, submodel)."""
        task = self.task
        if task is None or self.weights is not None:
            return
        h = parse_chunk(payload).header  # checked before a byte is buffered: forged chunks cost nothing
        if h.kind != "model" or (h.round, h.submodel, h.digest) != (task.model_round, task.submodel, task.model_digest):
            raise MessageError("model_mismatch", f"weights for round {h.round} submodel {h.submodel + 1} "
                                                 f"do not match the signed task")
        done = self.models_in.feed(payload)
        if done is not None:
            self.weights = done.tensors

    # -- planning and training ------------------------------------------------------------------------
    def can_train(self) -> int:
        """The bound (1-based) this device promises now: every submodel at or below it fits; 0 when
        nothing does. Per-submodel fits need not be a prefix (a predicted time off for one submodel), and
        the server assigns anything under the bound."""
        sel = self.selection
        if sel is None:
            return self.cfg.max_submodel
        if not sel.fits:
            return sel.submodel or 0
        return next((i for i, f in enumerate(sel.fits) if not f.fits), len(sel.fits))

    def _cannot_keep(self, k: int) -> bool:
        """Whether a promised task (0-based submodel k) cannot be trained now: k no longer fits the memory
        there is (the re-announce went out first). Time alone never breaks a promise: training takes as
        many batches as the round's time allows, and declines only if not even one step fits."""
        sel = self.selection
        if sel is None:
            return False
        if sel.fits:
            return sel.fits[k].memory_ok is False or sel.fits[k].capped
        return sel.binding != "deadline" and (sel.index is None or k > sel.index)

    def _allows(self, k: int) -> bool:
        """Whether 0-based submodel k fits now (by its own row of the selection: fits are per submodel)."""
        if self.selection is None:
            return k < self.cfg.max_submodel
        if self.selection.fits:
            return self.selection.fits[k].fits
        return self.selection.index is not None and k <= self.selection.index

    def plan(self, deadline_s: float | None = None, hold: int | None = None) -> bool:
        """Re-select from a fresh probe (the paper's dynamic setting) for the training time a round of
        `deadline_s` leaves; re-announce when the bound it promises changed. A larger submodel than the one held
        must fit with a margin (no flip-flop between rounds). Returns whether it announced."""
        if self.layout is None:
            return False
        if hold is None and self.selection is not None:
            hold = -1 if self.selection.index is None else self.selection.index
        self._planned_deadline = deadline_s or self._idle_time()
        budget = self._planned_deadline * (1 - UPLOAD_SHARE)
        sel = self.device.plan(self.layout, self.training, budget, self.cfg.max_submodel, hold)
        self.planned_at = self.clock()
        first = self.selection is None
        self.selection = sel
        changed = first or self.can_train() != self.promised
        if changed:
            self._announce()
        return changed

    def _announce(self) -> None:
        """Tell the server what this device can train now (0: nothing fits this round) and why."""
        sel, can = self.selection, self.can_train()
        key = self.cfg.device_key
        self.seq += 1
        self.promised, self.promised_deadline = can, self._planned_deadline
        msg = Announce(client=self.cfg.client_id, samples=max(1, self.device.samples), max_submodel=can,
                       selection="" if sel is None else sel.reason[:300], device=self.device.summary(),
                       key="" if key is None else key.public_text, session=self.session, seq=self.seq,
                       token="" if key is None or self.token is None else
                       proof(self.token[1], self.cfg.federation, self.cfg.client_id, key.public_text))
        payload = msg.to_json() if key is None else key.sign(msg.to_json())
        self.transport.publish(self.topics.announce(self.cfg.client_id), payload, qos=1, retain=True)
        log.info(f"announced {self.device.samples} samples, submodel <= {can}" + ("" if sel is None else f": {sel.reason}"),
                 extra={"submodel": can, **({} if sel is None else {"reason": sel.reason[:300]})})

    def tick(self) -> None:
        """Called by the shell between messages: give up a task past its deadline, train when ready;
        without a task, re-probe now and then so that what it announced follows the device's load."""
        task = self.task
        if task is None:
            if self.clock() - self.planned_at >= self.cfg.replan_s:
                self.plan()
            return
        elapsed, time_s = self.clock() - self.task_since, self._task_time(task)
        if elapsed > time_s:
            log.warning(f"round {task.round}: weights did not arrive before the deadline; skipping",
                        extra={"round": task.round, "submodel": task.submodel + 1, "reason": "deadline"})
            self.task, self.last_task = None, (task.run, task.round)
            return
        if self.weights is None:
            return
        self.task, self.last_task = None, (task.run, task.round)
        weights, self.weights = self.weights, None
        self._train_and_upload(task, weights, (time_s - elapsed) * (1 - UPLOAD_SHARE))

    def _train_and_upload(self, task: Task, start: dict[str, torch.Tensor], budget_s: float) -> None:
        r, k = task.round, task.submodel
        try:
            res = self.device.train(self.layout, task, start, budget_s)
        except OutOfTime as e:  # not even one step fits the time left: the server need not wait for us
            self._decline(task, str(e))
            return
        except ValueError as e:  # weights that do not fit the submodel: a server/profile mismatch
            log.error(f"round {r}: cannot train submodel {k + 1}: {e}", extra={"round": r, "submodel": k + 1})
            self._decline(task, f"cannot train submodel {k + 1}: {e}")
            return
        why = {"selection": self.selection.reason[:300]} if self.selection else {}
        msgs, header = encode(res.delta, kind="update", federation=self.cfg.federation, round=r, submodel=k,
                      client=self.cfg.client_id, dtype="fp16" if self.cfg.fp16 else "fp32", samples=res.num_samples,
                      metrics={"loss": round(res.loss, 4), "train_acc": round(res.accuracy, 4),
                               "train_s": round(res.seconds, 2), **res.metrics, **why},
                      chunk_bytes=self.cfg.chunk_bytes,
                      sign=None if self.cfg.device_key is None else self.cfg.device_key.sign)
        self._publish_update(msgs, self.topics.update(self.cfg.client_id))
        self.last_upload = (self.last_task, msgs)
        self._notify_sent(task, header.digest)
        cut = f", {res.metrics['steps']} steps (time budget {budget_s:.0f}s)" if res.metrics.get("budget_cut") else ""
        log.info(f"{_label(task)}: trained submodel {k + 1} on {res.num_samples} samples in {res.seconds:.1f}s{cut} "
                 f"(loss {res.loss:.3f}), uploading {sum(map(len, msgs))} bytes in {len(msgs)} chunks",
                 extra={"round": r, "submodel": k + 1})
        self.plan()  # the next round's choice, from the device's state now

    def _publish_update(self, msgs: list[bytes], topic: str) -> None:
        for m in msgs:
            self.transport.publish(topic, m, qos=1)

    def _notify_sent(self, task: Task, digest: str) -> None:
        """Tell the server (directly: never a shared subscription) that the update is out, so that one lost on
        the way costs a resend, not the round."""
        notice = Sent(client=self.cfg.client_id, run=task.run, round=task.round, submodel=task.submodel,
                      digest=digest).to_json()
        key = self.cfg.device_key
        self.transport.publish(self.topics.sent(self.cfg.client_id), notice if key is None else key.sign(notice), qos=1)
