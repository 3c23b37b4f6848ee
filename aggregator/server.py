"""The federation server: runs rounds over MQTT around the pure round state of aggregator/federation.py
(its command line is aggregator/serve_cli.py).

Threads: paho's network thread only enqueues (topic, payload); the main thread owns all state
(membership, round, aggregate) and does the publishing, aggregation, evaluation and checkpoints.
One consumer means no locks around the federation state and no message is handled twice at once.

Who may speak is decided before what is said is believed: device announces, statuses and upload
notices must carry the signature of the key enrolled for their id (aggregator/enrolment.py), worker
and relay messages that of a key the operator authorised (aggregator/partials.py), and every message
this server signs names its run incarnation and a sequence number, so none replays into another run.
"""

from __future__ import annotations

import logging
import queue
import secrets
import time
import traceback
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import paho.mqtt.client as mqtt

from aggregator.assignment import Assignment
from aggregator.enrolment import Enrolment, EnrolmentPolicy
from aggregator.evaluation import Evaluator
from aggregator.federation import ClientLimits, Federation, Rejected, Robustness, RoundState, state_digest
from aggregator.metrics import Observer
from aggregator.intake import DeviceKeys, take_update
from aggregator.partials import WorkerPool
from aggregator.resends import Resends
from aggregator.rootdata import DEFAULT_ROOT_SAMPLES, RootUpdates, split_root
from aggregator.rounds import RoundDriver, RunPlan, Transport
from nefl.nested.checkpoint import (METRICS_FILE, CheckpointError, has_checkpoint,
                             load_checkpoint, read_metrics, recovery_hint, replay_metrics)
from nefl.support.fsio import atomic_write_text
from nefl.protocol.messages import (MAX_LISTED, Announce, ClientStatus, Control, Decline, MessageError, Sent, ServerStatus, Task,
                           StatusBook, TrainingSettings)
from nefl.protocol.mqtt import QOS, BrokerSettings, Connection
from nefl.nested.profile import Profile, load_profile
from nefl.nested.data import load_dataset
from nefl.aggregation.robust_aggregate import AggregationRule
from nefl.nested.state import GlobalState, Layout
from nefl.protocol.signing import Signer, split_signed, verify, verify_self_signed
from nefl.protocol.topics import Topics
from nefl.nested.train import TrainConfig
from nefl.protocol.wire import DEFAULT_CHUNK_BYTES, Encoded, Reassembler, WireError, encode, parse_chunk

STATUS_FILE = "status.json"
IDLE_S = (0.005, 0.1)  # seconds between looks at a quiet inbox: the first, and the longest (Server.pump)
PENDING_STATUSES = 1_000  # statuses of ids invited to enrol, kept until their enrolling announce (oldest out)


@dataclass
class ServeConfig:
    profile: str = "resnet20-fmnist-w"
    federation: str = "default"
    rounds: int = 10
    clients_per_round: int = 10
    min_clients: int = 1
    round_timeout: float = 120.0
    join_wait: float = 10.0
    checkpoint_dir: str = "runs/default"
    resume: bool = False
    eval_dataset: str | None = None
    eval_samples: int | None = None
    data_root: str | None = None
    local_epochs: int = TrainConfig.local_epochs
    lr: float = TrainConfig.lr
    lr_schedule: str = TrainConfig.schedule
    warmup_rounds: int = TrainConfig.warmup_rounds
    batch_size: int = TrainConfig.batch_size
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    max_update_bytes: int = 64 << 20
    seed: int = 0
    robustness: Robustness = Robustness()
    limits: ClientLimits = ClientLimits()
    enrolment: EnrolmentPolicy = EnrolmentPolicy()
    resend_after: float = Resends.after_s  # a device's notice without its update for this long: ask for a resend
    status_every: float = 15.0  # the signed status is published at least this often (devices tell the current run)
    dp_delta: float = 1e-5
    assignment: Assignment = "coverage"
    init_from: str | None = None  # torchvision state dict (.pth / .safetensors) for the fresh global model
    workers: int = 0  # > 0: updates go to aggregator workers (docs/scale.md), not to this process
    remote_workers: bool = False  # workers started elsewhere (`aggregator worker`) take the updates
    worker_timeout: float = 30.0  # seconds a round close waits for the online workers' partials
    root_data: str | None = None  # FLTrust's root set: this dataset's test split (default: eval_dataset)
    root_samples: int = DEFAULT_ROOT_SAMPLES


@dataclass
class Start:
    """Where a federation starts: fresh, or the committed checkpoint under --resume."""

    profile: Profile
    layout: Layout
    state: GlobalState
    next_round: int
    meta: dict[str, Any] = field(default_factory=dict)


log = logging.getLogger(__name__)


class Server(Transport):
    def __init__(self, cfg: ServeConfig, settings: BrokerSettings, start: Start, signer: Signer,
                 enrolment: Enrolment | None = None, incarnation: int = 1) -> None:
        """`enrolment`: the registry with its journal (default: none, open as the policy says);
        `incarnation`: this run's number under the server key (aggregator/keys.py counts them)."""
        layout, next_round = start.layout, start.next_round
        self.cfg, self.settings, self.profile, self.layout = cfg, settings, start.profile, layout
        self.topics = Topics(cfg.federation)
        self.train_cfg = TrainConfig(lr=cfg.lr, batch_size=cfg.batch_size, local_epochs=cfg.local_epochs,
                                     schedule=cfg.lr_schedule, warmup_rounds=cfg.warmup_rounds)
        self.evaluator, root = self._evaluation(cfg, layout)
        self.fed = Federation(layout, start.state, cfg.federation, cfg.clients_per_round, cfg.min_clients,
                              cfg.round_timeout, seed=cfg.seed + next_round, robustness=cfg.robustness, limits=cfg.limits,
                              assignment=cfg.assignment,
                              aggregator=AggregationRule(layout, cfg.robustness.aggregation, reference=root, seed=cfg.seed))
        self.fed.load_state_dict(start.meta)  # the bounds' history and the update counts survive a restart
        self.next_round = next_round
        self.reasm = Reassembler(max_bytes=cfg.max_update_bytes, timeout_s=cfg.round_timeout, lazy_views=True)
        self.out = Path(cfg.checkpoint_dir)
        # what --http shows (aggregator/metrics.py); a resumed run's charts start with its earlier rounds
        self.observer = Observer(cfg.federation, self.profile.name, layout.num_submodels, cfg.rounds, cfg.round_timeout,
                                 read_metrics(self.out) if next_round > 1 else [])
        self.aggregate_s = 0.0  # this round's NeFedAvg time: folding updates in, then finalising
        self.bytes_out = 0
        self.round_rejects: Counter[str] = Counter()
        self.late = 0
        self.accuracy: list[float] | None = None
        self._published: dict[int, Encoded] = {}  # this round's models (their messages, for republishing)
        # this round's signed task per submodel: a task names no client (its topic does), so every participant of
        # a submodel gets the same one, signed once, not once per participant (200 signatures, 5 ms a round)
        self._tasks: dict[int, bytes] = {}
        self._presence_changed = False  # who is online or able to train changed since the last status
        self.run_id = secrets.token_hex(4)  # tells clients a restarted server's round 3 from the dead one's
        self.incarnation, self._seq = incarnation, 0
        self.signer = signer
        self.enrol = enrolment or Enrolment(cfg.federation, cfg.enrolment)
        self.enrol.load_state_dict(start.meta.get("enrolment"), start.meta.get("client_keys"))  # pins survive a restart
        self.enrol.reload()
        self._keys = DeviceKeys(self.enrol.key)
        self._statuses = StatusBook()  # each enrolled client's newest signed status
        self._pending: OrderedDict[str, bytes] = OrderedDict()  # statuses of ids not enrolled (yet)
        self.resends = Resends(cfg.resend_after)
        self.fed.defer_direct = bool(cfg.workers or cfg.remote_workers)  # what reaches this process then is a resend
        self.conn = Connection(settings, f"nefl-aggregator-{cfg.federation}", self.topics.server_status,
                               ServerStatus(state="offline", federation=cfg.federation).to_json(), log)
        self.client = self.conn.client
        self.pool = WorkerPool(self.fed, self.profile, self.topics, signer, self.publish, self._reject,
                               cfg.chunk_bytes, cfg.max_update_bytes, cfg.worker_timeout, worker_keys=self.enrol.worker_key,
                               device_keys=self.enrol.key, stamp=self._stamp)
        self._worker_facts: dict[str, Any] = {}
        self._listening_to_workers = False
        self._status_at = self._housekept = 0.0  # monotonic times of the last published status and housekeeping
        self.driver = RoundDriver(self.fed, self, RunPlan(cfg.rounds, dp_delta=cfg.dp_delta), self.evaluator, self.out,
                                  meta=lambda: {"enrolment": self.enrol.state_dict(), "incarnation": self.incarnation})

    def _evaluation(self, cfg: ServeConfig, layout: Layout) -> tuple[Evaluator | None, RootUpdates | None]:
        """The evaluator and, under FLTrust, the root updates (--root-data, else the evaluation dataset);
        when both use one test split, the root images are left out of what evaluation scores."""
        root_name = (cfg.root_data or cfg.eval_dataset) if cfg.robustness.aggregation.rule == "fltrust" else None
        test = load_dataset(cfg.eval_dataset, cfg.data_root, train=False) if cfg.eval_dataset else None
        root = None
        if root_name:
            held, root_set = split_root(test if root_name == cfg.eval_dataset else
                                        load_dataset(root_name, cfg.data_root, train=False), cfg.root_samples)
            test = held if root_name == cfg.eval_dataset else test
            root = RootUpdates(layout, root_set, self.train_cfg, cfg.rounds, cfg.root_samples, cfg.seed)
        evaluator = Evaluator.for_dataset(layout, cfg.eval_dataset, cfg.eval_samples, cfg.data_root, seed=cfg.seed,
                                          test=test) if test is not None else None
        return evaluator, root

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.client.publish(topic, payload, qos=QOS, retain=retain)
        self.bytes_out += len(payload)

    def _stamp(self) -> dict[str, int]:
        """The incarnation and the next sequence number, for a message this server signs."""
        self._seq += 1
        return {"incarnation": self.incarnation, "seq": self._seq}

    # -- status ---------------------------------------------------------------------------------
    def status(self, state: str) -> ServerStatus:
        r, online = self.fed.round, self.fed.available()
        return ServerStatus(
            state=state, federation=self.cfg.federation, run=self.run_id, round=r.index if r else self.next_round - 1,
            rounds=self.cfg.rounds, profile=self.profile.to_dict(), method=self.layout.method.name,
            profile_hash=self.layout.profile.hash, key=self.signer.public_text,
            clients_online=online[:MAX_LISTED], clients_online_count=len(online),
            participants=sorted(r.assignments)[:MAX_LISTED] if r else [],
            reported=sorted(r.received)[:MAX_LISTED] if r else [], accuracy=self.accuracy,
            rejected_total=dict(self.fed.rejected), time=time.time(),
            training=TrainingSettings(batch_size=self.cfg.batch_size, local_epochs=self.cfg.local_epochs,
                                      round_timeout=self.cfg.round_timeout), **self._stamp(),
        )

    def publish_status(self, state: str) -> mqtt.MQTTMessageInfo:
        """Signed and retained on the broker, and mirrored (unsigned, readable) in status.json."""
        status = self.status(state)
        self._presence_changed, self._status_at = False, time.monotonic()
        self.observer.status(status)
        body = status.to_json()
        info = self.client.publish(self.topics.server_status, self.signer.sign(body), qos=QOS, retain=True)
        self.out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.out / STATUS_FILE, msgspec.json.format(body, indent=1).decode())
        return info

    # -- inbound (main thread) ------------------------------------------------------------------
    def pump(self, until: float) -> None:
        """Handle inbound messages until `until` (monotonic) or until the round can close. A quiet inbox is looked
        at again after IDLE_S[0], then twice as long each time up to IDLE_S[1]: while updates stream in, each look
        takes the few that came meanwhile, instead of a wake-up of this thread per message (on a shared 2-core VM a
        wake-up cost 30-50 us of CPU, and the handling after it ran slower from cold caches)."""
        idle = IDLE_S[0]
        while (now := time.monotonic()) < until:
            if self.conn.just_connected():
                self.client.subscribe([(t, QOS) for t in self._subscriptions()])
                self._republish()
            if now - self._housekept >= 1.0:
                self._housekeeping()
            try:
                topic, payload = self.conn.inbox.get_nowait()
            except queue.Empty:
                for key in self.reasm.expire():
                    self._reject("timeout", key[2], f"chunk set of round {key[1]} incomplete after {self.cfg.round_timeout}s")
                time.sleep(max(0.0, min(idle, until - now)))
                idle = min(IDLE_S[1], 2 * idle)
            else:
                self.handle(topic, payload)
                idle = IDLE_S[0]
            if self.fed.round is not None and self.fed.complete():  # also when quiet: a grace period may end
                return

    def handle(self, topic: str, payload: bytes) -> None:
        """The trust boundary: whatever arrives, a rejection is counted and the loop goes on."""
        t = self.topics
        client = "?"
        try:
            if (client := t.client_of(topic, "update") or t.client_of(topic, "resend")) is not None:
                self._handle_update(client, payload)
            elif (client := t.client_of(topic, "announce")) is not None:
                if payload:  # an empty retained message clears the announce
                    self._handle_announce(client, self._open_announce(client, payload))
            elif (client := t.client_of(topic, "decline")) is not None:
                self._handle_decline(client, Decline.from_json(self._pinned_body(client, payload)))
            elif (w := t.worker_of(topic)) is not None:
                client = w[0]
                self.pool.handle(*w, payload)
            elif (client := t.client_of(topic, "status")) is not None:
                self._handle_status(client, payload)
            elif (client := t.client_of(topic, "sent")) is not None:
                self._handle_sent(client, payload)
        except (MessageError, Rejected, WireError) as e:
            self._reject(e.reason, client or "?", str(e))
        except Exception:  # a bug must not let one message end the federation: count it, keep the trace
            self._reject("internal_error", client or "?", traceback.format_exc(limit=3).strip().replace("\n", " | "))

    def _subscriptions(self) -> list[str]:
        """Updates come in here unless workers take them (resends always do); worker topics only while the
        operator authorised a worker or relay (a plain `serve` does not listen to forged receipts)."""
        ingest = self.topics.server_subscriptions()
        if self.cfg.workers or self.cfg.remote_workers:
            ingest.remove(self.topics.update("+"))
        self._listening_to_workers = self.enrol.has_workers()
        return ingest + (self.topics.coordinator_subscriptions() if self._listening_to_workers else [])

    def _housekeeping(self) -> None:
        """Once a second: the operator's enrolment changes, expired pins, overdue updates, the status heartbeat
(and the status at once when who is online or able to train changed)."""
        self._housekept = time.monotonic()
        r = self.fed.round
        for c in self.enrol.reload():
            self.fed.forget(c, "its device key was revoked or replaced")
            self._statuses.forget(c)
        for c in self.enrol.expire(set(r.assignments) if r else set()):
            log.info(f"{c}: its first-use pin expired without it ever training", extra={"client": c})
            self.fed.forget(c, "pin expired")
            self._statuses.forget(c)
        if self.enrol.has_workers() and not self._listening_to_workers and self.conn.connected:
            self.client.subscribe([(t, QOS) for t in self.topics.coordinator_subscriptions()])
            self._listening_to_workers = True
            if r is not None:  # the open round's plan, which nobody could use before
                self.pool.announce(self.layout)
        if r is not None:
            self._ask_resends(r)
        if self._presence_changed or (self._status_at and time.monotonic() - self._status_at >= self.cfg.status_every):
            self.publish_status("training" if r else "waiting")  # who is online changed: `aggregator status` stays true

    def _ask_resends(self, r: RoundState) -> None:
        for c in self.resends.due(r.received | set(r.refused)):
            log.info(f"round {r.index}: {c} sent its update {self.cfg.resend_after:g}s ago and none arrived "
                     f"(lost_to_unknown): asking for a resend", extra={"round": r.index, "client": c})
            self.publish(self.topics.task(c), self._task(r.index, r.assignments[c], resend=True), retain=True)

    def _open_announce(self, client: str, payload: bytes) -> Announce:
        """A device signs its announce with the key it names: check that, then that the key may speak for the
        id (enrolment). An id that cannot be enrolled is refused before any signature is checked."""
        parts = split_signed(payload)
        msg = Announce.from_json(payload if parts is None else parts[0])
        self.enrol.precheck(client, msg.token)
        if parts is None:
            self.enrol.admit(client, "", msg.token)
            return msg
        body, key = verify_self_signed(payload, lambda b: Announce.from_json(b).key)
        msg = Announce.from_json(body)
        new = self.enrol.key(client) is None
        self.enrol.admit(client, key, msg.token)
        if new and client in self._pending and self.enrol.key(client) is not None:
            self._handle_status(client, self._pending.pop(client))  # its status came before its enrolment
        return msg

    def _pinned_body(self, client: str, payload: bytes) -> bytes:
        """The body of a device's message, signed by the key pinned for its id (so nobody else can speak, or
        decline a task, for it); an id without a pin (an unsigned device under open enrolment) sends it as is."""
        key = self._keys(client)
        if key is not None:
            return verify(payload, key)
        parts = split_signed(payload)
        return payload if parts is None else parts[0]

    def _handle_status(self, client: str, payload: bytes) -> None:
        """A device's status: signed by its pinned key, newer than the last one. Under open enrolment an id
        without a pin is trusted as before; under closed enrolment its status waits for its enrolment."""
        key = self._keys(client)
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

    def _handle_sent(self, client: str, payload: bytes) -> None:
        """A device's notice that its update is out: the round then waits at most `resend_after` for it. Moot once
        the round has the update (here it arrives before its notice, on the same connection): then it is not even
        verified, a signature check per device and round that changes nothing."""
        r = self.fed.round
        if r is not None and (client in r.received or client in r.refused):
            return
        msg = Sent.from_json(self._pinned_body(client, payload))
        if msg.client != client:
            raise Rejected("client_mismatch", f"notice of {msg.client!r} on {client!r}'s topic")
        if r is not None and msg.run == self.run_id and msg.round == r.index and client in r.assignments:
            self.resends.notice(client)

    def _handle_announce(self, client: str, msg: Announce) -> None:
        info = self.fed.announce(client, msg)
        self.observer.client_changed(info)
        self._presence_changed = True
        why = f" ({info.selection})" if info.selection else ""
        log.info(f"client {client} announced: submodel <= {info.max_submodel + 1}, {info.samples} samples{why}",
                 extra={"client": client, "submodel": info.max_submodel + 1})

    def _handle_decline(self, client: str, msg: Decline) -> None:
        if msg.federation != self.cfg.federation or msg.run != self.run_id:
            raise Rejected("stale_decline", f"decline for {msg.federation}/{msg.run}, this is "
                                            f"{self.cfg.federation}/{self.run_id}")
        self.fed.decline(client, msg)
        self.client.publish(self.topics.task(client), b"", qos=QOS, retain=True)  # its task is settled
        log.info(f"round {msg.round}: {client} declined submodel {msg.submodel + 1} ({msg.reason or 'no reason given'}); "
                 "the round no longer waits for it", extra={"round": msg.round, "client": client})

    def _handle_update(self, client: str, payload: bytes) -> None:
        """The path workers share (aggregator/intake.py); a device's signed chunk under a pinned key
        makes a replayed or re-wrapped update under its id fail there, on any broker."""
        t0 = time.perf_counter()
        try:
            done = take_update(self.fed, self.reasm, self._keys, client, payload, self.cfg.chunk_bytes * 4)
        except Rejected as e:
            self.late += e.reason == "stale_round" and parse_chunk(payload).header.round < self.next_round
            raise
        if done is not None:  # the call that completed an update also validated, bounded and folded it
            self.aggregate_s += time.perf_counter() - t0
            self.observer.update_accepted(client)
            if log.isEnabledFor(logging.INFO):  # not even formatted otherwise: one line per update
                log.info(f"round {done.header.round}: update from {client} (submodel {done.header.submodel + 1}, "
                         f"{done.nbytes} bytes, {done.header.dtype})",
                         extra={"round": done.header.round, "client": client, "submodel": done.header.submodel + 1})

    def _reject(self, reason: str, client: str, msg: str) -> None:
        self.fed.reject(reason)
        self.round_rejects[reason] += 1
        self.observer.rejected(reason)
        log.info(f"rejected {reason} from {client}: {msg}", extra={"client": client, "reason": reason})

    # -- rounds ---------------------------------------------------------------------------------
    def wait_for_clients(self) -> None:
        """Until clients_per_round can train, or min_clients can and join_wait has passed since the
        first of them arrived (so a first round does not open the moment one device shows up)."""
        self.publish_status("waiting")
        first_ready: float | None = None
        said = ""
        while True:
            n = len(self.fed.available())
            if n and first_ready is None:
                first_ready = time.monotonic()
            if self.pool.workers_seen() < max(self.cfg.workers, self.cfg.remote_workers):  # no first round before they listen
                pass
            elif n >= self.cfg.clients_per_round or (
                    n >= self.cfg.min_clients and time.monotonic() - first_ready >= self.cfg.join_wait):
                return
            said = self._say_why_waiting(n, said)
            self.pump(time.monotonic() + 0.5)

    def _say_why_waiting(self, ready: int, said: str) -> str:
        """Log, once per change, who is online but cannot train and why; returns what was said."""
        idle = {c: i.selection or "announced it can train nothing now" for c, i in self.fed.clients.items()
                if i.online and i.max_submodel < 0}
        why = "; ".join(f"{c}: {reason}" for c, reason in sorted(idle.items())[:20])
        text = (f"waiting for clients: {ready} ready of {self.cfg.min_clients} needed"
                + (f"; online but unable to train: {why}" if why else ""))
        if text != said:
            log.info(text)
        return text

    def _republish(self) -> None:
        """After a (re)connect: the broker may have lost retained tasks and weights in a restart."""
        self.publish_status("training" if self.fed.round else "waiting")
        r = self.fed.round
        if r is None:
            return
        with self.client.batched():
            for k, model in self._published.items():
                for i, m in enumerate(model.messages):
                    self.client.publish(self.topics.model_chunk(k, i), m, qos=QOS, retain=True)
            for c, k in r.assignments.items():
                if c not in r.received:
                    self.client.publish(self.topics.task(c), self._tasks[k], qos=QOS, retain=True)

    def _task(self, index: int, k: int, resend: bool = False) -> bytes:
        model, chunks = self._published[k].header, len(self._published[k].messages)
        return self.signer.sign(Task(
            federation=self.cfg.federation, run=self.run_id, round=index, submodel=k,
            lr=self.train_cfg.lr_at(index - 1, self.cfg.rounds), epochs=self.cfg.local_epochs,
            batch_size=self.cfg.batch_size, profile_hash=self.layout.profile.hash, deadline_s=self.cfg.round_timeout,
            chunks=chunks, model_digest=model.digest, model_bytes=model.size, resend=resend,
            **self._stamp()).to_json())

    # -- rounds: the Transport of the shared round driver (aggregator/rounds.py) ---------------------
    def collect(self, fed: Federation, index: int) -> None:
        """Publish the round's weights and tasks, take updates until the round can close, then merge
        the workers' and relays' partials into its aggregate."""
        self._t0 = time.monotonic()
        self.late = 0
        self.aggregate_s = 0.0
        self._out0, self._in0 = self.bytes_out, fed.bytes_in
        r = fed.round
        self.reasm.discard_rounds_before(index)
        self._published = {}
        with self.client.batched():  # the round's opening in one go: one wake of the network thread, not hundreds
            for k in sorted(set(r.assignments.values())):
                model = self._published[k] = encode(fed.state.slices(self.layout, k), kind="model", round=index,
                                                    federation=self.cfg.federation, submodel=k, client="server",
                                                    chunk_bytes=self.cfg.chunk_bytes)
                for i, m in enumerate(model.messages):
                    self.publish(self.topics.model_chunk(k, i), m, retain=True)
            # before the tasks: a worker knows the round before its updates come
            self.pool.open(self.run_id, self.layout, announce=self._listening_to_workers)
            self.resends.open_round()
            self._tasks = {k: self._task(index, k) for k in self._published}
            for c, k in r.assignments.items():
                self.publish(self.topics.task(c), self._tasks[k], retain=True)
            self.observer.round_opened(index, r.assignments, self.cfg.round_timeout)
            if log.isEnabledFor(logging.INFO):
                log.info(f"round {index}/{self.cfg.rounds} open: " + ", ".join(f"{c}->submodel {k + 1}" for c, k in
                                                                               sorted(r.assignments.items())), extra={"round": index})
            self.publish_status("training")
        while not fed.complete():
            self.pump(r.deadline)
        self._closed_s = closed_s = time.monotonic() - r.started
        if len(r.received) < len(r.assignments):
            gone = fed.gone_offline()
            why = f"without waiting for {', '.join(gone)} (went offline)" if gone else "at its deadline"
            log.info(f"round {index} closed {why}, {closed_s:.1f} s after it opened (deadline {self.cfg.round_timeout:g} s): "
                     f"{len(r.received)}/{len(r.assignments)} updates")
        with self.client.batched():
            for c in r.assignments:  # a retained task outliving its round would send a restarted client astray
                self.client.publish(self.topics.task(c), b"", qos=QOS, retain=True)
        self._worker_facts = self.pool.close(self.pump)  # merges the workers' and relays' partials into the aggregate
        self.late += self.pool.late

    def round_facts(self, facts: dict[str, Any]) -> dict[str, Any]:
        self.next_round = facts["round"] + 1
        rejected, self.round_rejects = dict(self.round_rejects), Counter()  # rejections since the last round closed
        if facts["committed"]:  # in this round's checkpoint: a pin of an id that trained never expires
            self.enrol.trained([c for c in facts["reported"] if c not in facts.get("dropped", {})])
        return {
            **self._worker_facts, **self.resends.facts(),
            "enrolment": {"open": self.enrol.open, "pinned": len(self.enrol.pins), "untrained_open_pins": self.enrol.unproven()},
            "bytes_out": self.bytes_out - self._out0, "bytes_in": self.fed.bytes_in - self._in0,
            "rejected": rejected, "late_updates": self.late, "inbox_dropped": self.conn.inbox_dropped,
            "duplicates_dropped": self.reasm.duplicates, "train_wall_s": round(time.monotonic() - self._t0, 3),
            "closed_s": round(self._closed_s, 3),
            "aggregate_s": round(self.aggregate_s + facts["close_s"], 4),
        }

    def evaluating(self) -> None:
        self.publish_status("evaluating")

    def recorded(self, facts: dict[str, Any], checkpoint_s: float) -> None:
        self.accuracy = self.driver.accuracy
        self.observer.checkpoint_saved(checkpoint_s)
        self.observer.metrics_line(facts)
        log.info(f"round {facts['round']} done in {facts['wall_s']}s (training closed after {facts['closed_s']:.1f}s): "
                 f"reported {facts['reported']}, rejected {facts['rejected']}"
                 + (f", accuracy {self.accuracy}" if "accuracy" in facts else ""), extra={"round": facts["round"]})

    def run(self) -> None:
        self.conn.start()
        if self.next_round == 1 and (start := self.driver.evaluate_start()) is not None:
            self.accuracy = self.driver.accuracy
            self.observer.metrics_line(start)
        self.client.publish(self.topics.control, b"", qos=QOS, retain=True)  # forget an earlier run's "end"
        for index in range(self.next_round, self.cfg.rounds + 1):
            self.wait_for_clients()
            self.driver.run_round(index)
        self.finish()

    def finish(self) -> None:
        end = Control(federation=self.cfg.federation, run=self.run_id, event="end", **self._stamp())
        self.client.publish(self.topics.control, self.signer.sign(end.to_json()), qos=QOS, retain=True)
        for k, model in self._published.items():
            for i in range(len(model.messages)):
                self.client.publish(self.topics.model_chunk(k, i), b"", qos=QOS, retain=True)
        info = self.publish_status("finished")  # last, so waiting for it waits for everything before it
        try:
            info.wait_for_publish(5)
        except (RuntimeError, ValueError):
            pass  # broker gone at the very end: the checkpoint and metrics are already on disk
        self.conn.stop()  # a disconnect we ask for, not a lost connection
        log.info(f"federation {self.cfg.federation!r} finished after round {self.cfg.rounds}")


def load_start(cfg: ServeConfig) -> Start:
    """Fresh state, or the checkpoint under --resume; refuses to overwrite or ignore a checkpoint."""
    profile = load_profile(cfg.profile)
    layout = Layout.build(profile)
    ckpt_dir = Path(cfg.checkpoint_dir)
    if cfg.resume:
        if replay_metrics(ckpt_dir):
            log.info(f"restored the last committed round's line to {ckpt_dir / METRICS_FILE} (crash before it was appended)")
        ckpt = load_checkpoint(ckpt_dir, profile)
        if not isinstance(ckpt.meta.get("round"), int):
            raise CheckpointError(f"{ckpt_dir}: checkpoint metadata has no round number; not a federation checkpoint")
        if ckpt.meta.get("state_sha256") not in (None, state_digest(ckpt.state)):
            raise CheckpointError(f"{ckpt_dir}: state does not match the digest in meta.json (corrupt or mixed files); "
                                  f"{recovery_hint(ckpt_dir)}")
        return Start(profile, ckpt.layout, ckpt.state, ckpt.meta["round"] + 1, ckpt.meta)
    if has_checkpoint(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir} already holds a checkpoint: pass --resume, or another --checkpoint-dir")
    if cfg.init_from:
        return Start(profile, layout, GlobalState.pretrained(layout, cfg.init_from, cfg.seed), 1)
    return Start(profile, layout, GlobalState.init(layout, cfg.seed), 1)
