"""The federation server: runs rounds over MQTT around the pure round state of aggregator/federation.py
(its command line is aggregator/serve_cli.py).

Threads: paho's network thread only enqueues (topic, payload); the main thread owns all state
(membership, round, aggregate) and does the publishing, aggregation, evaluation and checkpoints.
One consumer means no locks around the federation state and no message is handled twice at once.

Who may speak is decided before what is said is believed: device announces, statuses and upload
notices must carry the signature of the key enrolled for their id (aggregator/enrolment.py), worker
and relay messages that of a key the operator authorised (aggregator/partials.py), and every message
this server signs names its run incarnation and a sequence number, so none replays into another run.

Four parts: `Link` (aggregator/link.py), the connection to the broker and the run's identity; `ControlPlane`
(aggregator/control_plane.py), enrolment, the devices' statuses, announces, declines and upload notices, and
the server's status; `MqttTransport`, a round's models and tasks out and its updates (or the workers'
partials) in, for the round driver of aggregator/rounds.py; and `Server`, which wires them and runs the loop.
"""

from __future__ import annotations

import logging
import secrets
import queue
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from aggregator.assignment import Assignment
from aggregator.control_plane import ControlPlane
from aggregator.enrolment import Enrolment, EnrolmentPolicy
from aggregator.evaluation import Evaluator
from aggregator.fleet import CoverageConfig
from aggregator.federation import ClientLimits, Federation, Rejected, Robustness, RoundState, state_digest
from aggregator.intake import DeviceKeys, take_update
from aggregator.link import Link
from aggregator.metrics import Observer
from aggregator.partials import WorkerPool
from aggregator.resends import Resends
from aggregator.statsdata import ServerStatistics
from nefl.aggregation.gate import Gate
from aggregator.rootdata import DEFAULT_ROOT_SAMPLES, RootUpdates, held_out, split_root
from aggregator.rounds import RoundDriver, RunPlan, RoundTransport
from nefl.aggregation.staleness import StalenessConfig
from nefl.nested.checkpoint import (METRICS_FILE, CheckpointError, has_checkpoint, load_checkpoint, read_metrics,
                                    recovery_hint, replay_metrics)
from nefl.nested.data import load_dataset
from nefl.nested.profile import Profile, load_profile
from nefl.nested.state import GlobalState, Layout
from nefl.nested.train import TrainConfig
from nefl.support.settings import DEFAULT_EVAL_SAMPLES, DEFAULT_PROFILE
from nefl.protocol.messages import VERSION, Control, MessageError, Task, TrainingSettings
from nefl.protocol.mqtt import QOS, BrokerSettings
from nefl.protocol.signing import Signer
from nefl.protocol.topics import Topics
from nefl.protocol.wire import DEFAULT_CHUNK_BYTES, Encoded, Reassembler, WireError, encode, parse_chunk

IDLE_S = (0.005, 0.1)  # seconds between looks at a quiet inbox: the first, and the longest (Server.pump)


@dataclass
class ServeConfig:
    profile: str = DEFAULT_PROFILE
    federation: str = "default"
    rounds: int = 10
    clients_per_round: int = 10
    min_clients: int = 1
    round_timeout: float = 120.0
    join_wait: float = 10.0
    checkpoint_dir: str = "runs/default"
    resume: bool = False
    eval_dataset: str | None = None
    eval_samples: int | None = DEFAULT_EVAL_SAMPLES  # None: the whole test split
    final_eval_samples: int | None = None  # the last round's (None: the whole test split)
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
    # sync: rounds; buffered: a version whenever the buffer holds K updates (aggregator/buffered_serve.py), and
    # `rounds` counts versions
    mode: Literal["sync", "buffered"] = "sync"
    staleness: StalenessConfig = StalenessConfig()
    coverage: CoverageConfig = CoverageConfig()  # buffered: which submodel each task trains


@dataclass
class Start:
    """Where a federation starts: fresh, or the committed checkpoint under --resume."""

    profile: Profile
    layout: Layout
    state: GlobalState
    next_round: int
    meta: dict[str, Any] = field(default_factory=dict)


log = logging.getLogger(__name__)


@dataclass
class RoundTally:
    """A round's own numbers for its metrics line, counted from the moment its models go out."""

    opened: float = 0.0  # monotonic time then
    bytes_out: int = 0  # the link's and the federation's byte counts then
    bytes_in: int = 0
    aggregate_s: float = 0.0  # NeFedAvg time: folding updates in, then finalising
    late: int = 0  # updates of an earlier round
    closed_s: float = 0.0  # from the round's start to its close


class MqttTransport(RoundTransport):
    """The round driver's transport over the broker (aggregator/rounds.py): a round's models and signed tasks out
    (again after a reconnect), the devices' updates in, or the workers' and relays' receipts and partials
    (aggregator/partials.py), overdue updates asked for again, and the round's own facts for its metrics line."""

    def __init__(self, cfg: ServeConfig, fed: Federation, link: Link, topics: Topics, control: ControlPlane,
                 enrol: Enrolment, keys: DeviceKeys, resends: Resends, observer: Observer, profile: Profile,
                 train_cfg: TrainConfig, pump: Callable[[float], None], next_round: int) -> None:
        """`pump`: the server's inbox loop, handling messages until a (monotonic) time or until the round can close."""
        self.cfg, self.fed, self.link, self.topics, self.control = cfg, fed, link, topics, control
        self.enrol, self.keys, self.resends, self.observer, self.train_cfg = enrol, keys, resends, observer, train_cfg
        self.pump, self.next_round = pump, next_round
        self.reasm = Reassembler(max_bytes=cfg.max_update_bytes, timeout_s=cfg.round_timeout, lazy_views=True)
        self.pool = WorkerPool(fed, profile, topics, link.signer, link.publish, self.reject, cfg.chunk_bytes,
                               cfg.max_update_bytes, cfg.worker_timeout, worker_keys=enrol.worker_key,
                               device_keys=enrol.key, stamp=link.stamp)
        self.round_rejects: Counter[str] = Counter()  # rejections since the last round closed
        self.tally = RoundTally()
        self._published: dict[int, Encoded] = {}  # this round's models (their messages, for republishing)
        # this round's signed task per submodel: a task names no client (its topic does), so every participant of
        # a submodel gets the same one, signed once, not once per participant
        self._tasks: dict[int, bytes] = {}
        self._worker_facts: dict[str, Any] = {}
        self.listening_to_workers = False

    # -- out ----------------------------------------------------------------------------------------
    def collect(self, fed: Federation, index: int) -> None:
        """Publish the round's weights and tasks, take updates until the round can close, then merge
        the workers' and relays' partials into its aggregate."""
        self.tally = RoundTally(time.monotonic(), self.link.bytes_out, fed.bytes_in)
        r = fed.round
        self.reasm.discard_rounds_before(index)
        self._published = {}
        with self.link.client.batched():  # the round's opening in one go: one wake of the network thread, not hundreds
            for k in sorted(set(r.assignments.values())):
                model = self._published[k] = encode(fed.state.slices(fed.layout, k), kind="model", federation=fed.name,
                                                    round=index, submodel=k, client="server",
                                                    chunk_bytes=self.cfg.chunk_bytes)
                for i, m in enumerate(model.messages):
                    self.link.publish(self.topics.model_chunk(k, i), m, retain=True)
            # before the tasks: a worker knows the round before its updates come
            self.pool.open(self.link.run_id, fed.layout, announce=self.listening_to_workers)
            self.resends.open_round()
            self._tasks = {k: self._task(index, k) for k in self._published}
            for c, k in r.assignments.items():
                self.link.publish(self.topics.task(c), self._tasks[k], retain=True)
            self.observer.round_opened(index, r.assignments, self.cfg.round_timeout)
            if log.isEnabledFor(logging.INFO):
                log.info(f"round {index}/{self.cfg.rounds} open: " + ", ".join(f"{c}->submodel {k + 1}" for c, k in
                                                                               sorted(r.assignments.items())), extra={"round": index})
            self.control.publish_status("training")
        while not fed.complete():
            self.pump(r.deadline)
        self.tally.closed_s = closed_s = time.monotonic() - r.started
        if len(r.received) < len(r.assignments):
            gone = fed.gone_offline()
            why = f"without waiting for {', '.join(gone)} (went offline)" if gone else "at its deadline"
            log.info(f"round {index} closed {why}, {closed_s:.1f} s after it opened (deadline {self.cfg.round_timeout:g} s): "
                     f"{len(r.received)}/{len(r.assignments)} updates")
        with self.link.client.batched():
            for c in r.assignments:  # a retained task outliving its round would send a restarted client astray
                self.link.retain(self.topics.task(c))
        self._worker_facts = self.pool.close(self.pump)  # merges the workers' and relays' partials into the aggregate
        self.tally.late += self.pool.late

    def _task(self, index: int, k: int, resend: bool = False) -> bytes:
        model = self._published[k]
        return self.link.signer.sign(Task(
            v=VERSION, federation=self.fed.name, run=self.link.run_id, round=index, submodel=k,
            lr=self.train_cfg.lr_at(index - 1, self.cfg.rounds), epochs=self.cfg.local_epochs,
            batch_size=self.cfg.batch_size, profile_hash=self.fed.layout.profile.hash, deadline_s=self.cfg.round_timeout,
            chunks=len(model.messages), model_digest=model.header.digest, model_bytes=model.header.size, resend=resend,
            **self.link.stamp()).to_json())

    def republish(self) -> None:
        """After a (re)connect: the broker may have lost the open round's retained tasks and weights in a restart."""
        r = self.fed.round
        if r is None:
            return
        with self.link.client.batched():
            for k, model in self._published.items():
                for i, m in enumerate(model.messages):
                    self.link.retain(self.topics.model_chunk(k, i), m)
            for c, k in r.assignments.items():
                if c not in r.received:
                    self.link.retain(self.topics.task(c), self._tasks[k])

    def clear_models(self) -> None:
        """The last round's retained weights, off the broker at the end."""
        for k, model in self._published.items():
            for i in range(len(model.messages)):
                self.link.retain(self.topics.model_chunk(k, i))

    # -- in -----------------------------------------------------------------------------------------
    def update(self, client: str, payload: bytes) -> None:
        """The path workers share (aggregator/intake.py); a device's signed chunk under a pinned key
        makes a replayed or re-wrapped update under its id fail there, on any broker."""
        t0 = time.perf_counter()
        try:
            done = take_update(self.fed, self.reasm, self.keys, client, payload, self.cfg.chunk_bytes * 4)
        except Rejected as e:
            self.tally.late += e.reason == "stale_round" and parse_chunk(payload).header.round < self.next_round
            raise
        if done is not None:  # the call that completed an update also validated, bounded and folded it
            self.tally.aggregate_s += time.perf_counter() - t0
            self.observer.update_accepted(client)
            if log.isEnabledFor(logging.INFO):  # not even formatted otherwise: one line per update
                log.info(f"round {done.header.round}: update from {client} (submodel {done.header.submodel + 1}, "
                         f"{done.nbytes} bytes, {done.header.dtype})",
                         extra={"round": done.header.round, "client": client, "submodel": done.header.submodel + 1})

    def expire(self) -> None:
        """Updates whose chunks stopped coming: dropped, and counted."""
        for key in self.reasm.expire():
            self.reject("timeout", key[2], f"chunk set of round {key[1]} incomplete after {self.cfg.round_timeout}s")

    def reject(self, reason: str, client: str, msg: str) -> None:
        self.fed.reject(reason)
        self.round_rejects[reason] += 1
        self.observer.rejected(reason)
        log.info(f"rejected {reason} from {client}: {msg}", extra={"client": client, "reason": reason})

    def worker_subscriptions(self) -> list[str]:
        """Worker topics only while the operator authorised a worker or relay (a plain `serve` does not listen to
        forged receipts)."""
        self.listening_to_workers = self.enrol.has_workers()
        return self.topics.coordinator_subscriptions() if self.listening_to_workers else []

    def housekeeping(self) -> None:
        """Workers the operator authorised since the last look are listened to, and overdue updates asked for."""
        r = self.fed.round
        if self.enrol.has_workers() and not self.listening_to_workers and self.link.conn.connected:
            self.link.client.subscribe([(t, QOS) for t in self.topics.coordinator_subscriptions()])
            self.listening_to_workers = True
            if r is not None:  # the open round's plan, which nobody could use before
                self.pool.announce(self.fed.layout)
        if r is not None:
            self._ask_resends(r)

    def _ask_resends(self, r: RoundState) -> None:
        for c in self.resends.due(r.received | set(r.refused)):
            log.info(f"round {r.index}: {c} sent its update {self.cfg.resend_after:g}s ago and none arrived "
                     f"(lost_to_unknown): asking for a resend", extra={"round": r.index, "client": c})
            self.link.publish(self.topics.task(c), self._task(r.index, r.assignments[c], resend=True), retain=True)

    # -- the round driver's hooks ---------------------------------------------------------------------
    def round_facts(self, facts: dict[str, Any]) -> dict[str, Any]:
        self.next_round = facts["round"] + 1
        rejected, self.round_rejects = dict(self.round_rejects), Counter()
        t = self.tally
        return {
            **self._worker_facts, **self.resends.facts(), "enrolment": self.control.round_closed(facts),
            "bytes_out": self.link.bytes_out - t.bytes_out, "bytes_in": self.fed.bytes_in - t.bytes_in,
            "rejected": rejected, "late_updates": t.late, "inbox_dropped": self.link.conn.inbox_dropped,
            "duplicates_dropped": self.reasm.duplicates, "train_wall_s": round(time.monotonic() - t.opened, 3),
            "closed_s": round(t.closed_s, 3),
            "aggregate_s": round(t.aggregate_s + facts["close_s"], 4),
        }

    def evaluating(self) -> None:
        self.control.publish_status("evaluating")

    def evaluated(self, line: dict[str, Any]) -> None:
        self.observer.metrics_line(line)

    def recorded(self, facts: dict[str, Any], checkpoint_s: float) -> None:
        self.observer.checkpoint_saved(checkpoint_s)
        self.observer.metrics_line(facts)
        log.info(f"round {facts['round']} done in {facts['wall_s']}s (training closed after {facts['closed_s']:.1f}s): "
                 f"reported {facts['reported']}, rejected {facts['rejected']}"
                 + (f", accuracy {facts['accuracy']}" if "accuracy" in facts else ""), extra={"round": facts["round"]})


class Server:
    """Wires one federation's server: the round state (aggregator/federation.py), the link to the broker, the
    control plane (aggregator/control_plane.py), the rounds over MQTT and the round driver (evaluation,
    checkpoints, metrics); runs the inbox loop that feeds them, and the run from its first round to its end."""

    def __init__(self, cfg: ServeConfig, settings: BrokerSettings, start: Start, signer: Signer,
                 enrolment: Enrolment | None = None, incarnation: int = 1, rule_secret: bytes | None = None) -> None:
        """`enrolment`: the registry with its journal (default: none, open as the policy says);
        `incarnation`: this run's number under the server key (aggregator/keys.py counts them);
        `rule_secret`: what the centre check's draws come from (aggregator/keys.py keeps it beside the server key;
        default: a fresh one), never --seed."""
        layout, next_round = start.layout, start.next_round
        self.cfg, self.topics = cfg, Topics(cfg.federation)
        train_cfg = TrainConfig(lr=cfg.lr, batch_size=cfg.batch_size, local_epochs=cfg.local_epochs,
                                schedule=cfg.lr_schedule, warmup_rounds=cfg.warmup_rounds)
        evaluator, root, gate, statistics = _evaluation(cfg, layout, train_cfg)
        self.fed = Federation(layout, start.state, cfg.federation, cfg.clients_per_round, cfg.min_clients,
                              cfg.round_timeout, seed=cfg.seed + next_round, robustness=cfg.robustness, limits=cfg.limits,
                              assignment=cfg.assignment,
                              reference=root, rule_secret=rule_secret or secrets.token_bytes(32), gate=gate,
                              statistics=statistics)
        self.fed.load_state_dict(start.meta)  # the bounds' history and the update counts survive a restart
        self.fed.defer_direct = bool(cfg.workers or cfg.remote_workers)  # what reaches this process then is a resend
        out = Path(cfg.checkpoint_dir)
        # what --http shows (aggregator/metrics.py); a resumed run's charts start with its earlier rounds
        self.observer = Observer(cfg.federation, start.profile.name, layout.num_submodels, cfg.rounds, cfg.round_timeout,
                                 read_metrics(out) if next_round > 1 else [])
        enrol = enrolment or Enrolment(cfg.federation, cfg.enrolment)
        enrol.load_state_dict(start.meta.get("enrolment"), start.meta.get("client_keys"))  # pins survive a restart
        enrol.reload()
        keys, resends = DeviceKeys(enrol.key), Resends(cfg.resend_after)
        self.link = Link(settings, self.topics, signer, incarnation, log)
        training = TrainingSettings(batch_size=cfg.batch_size, local_epochs=cfg.local_epochs, round_timeout=cfg.round_timeout)
        self.control = ControlPlane(self.fed, self.link, self.topics, enrol, keys, self.observer, resends, start.profile,
                                    training, cfg.rounds, cfg.status_every, out,
                                    progress=lambda: (self.rounds.next_round - 1, self.driver.accuracy))
        self.rounds = self._transport(enrol, keys, resends, start, train_cfg)
        self._housekept = 0.0  # monotonic time of the last housekeeping
        plan = RunPlan(cfg.rounds, eval_samples=cfg.eval_samples,
                       final_eval_samples=cfg.final_eval_samples or (len(evaluator.test) if evaluator else None),
                       dp_delta=cfg.dp_delta, background_eval=True)
        self.driver = RoundDriver(self.fed, self.rounds, plan, evaluator, out, checkpointed=next_round - 1,
                                  meta=lambda: {"enrolment": enrol.state_dict(), "incarnation": incarnation,
                                                **self._meta()})

    def _transport(self, enrol: Enrolment, keys: DeviceKeys, resends: Resends, start: Start,
                   train_cfg: TrainConfig) -> MqttTransport:
        """The rounds over MQTT (buffered mode's server gives its own)."""
        return MqttTransport(self.cfg, self.fed, self.link, self.topics, self.control, enrol, keys, resends,
                             self.observer, start.profile, train_cfg, self.pump, start.next_round)

    def _meta(self) -> dict[str, Any]:
        """What the checkpoint keeps of this server's mode besides the federation (buffered mode: its version)."""
        return {}

    # -- inbound (main thread) ------------------------------------------------------------------
    def pump(self, until: float) -> None:
        """Handle inbound messages until `until` (monotonic) or until the round can close. A quiet inbox is looked
        at again after IDLE_S[0], then twice as long each time up to IDLE_S[1]: while updates stream in, each look
        takes the few that came meanwhile, instead of a wake-up of this thread per message (each costs CPU, and
        the handling after it runs from cold caches)."""
        idle = IDLE_S[0]
        conn = self.link.conn
        while (now := time.monotonic()) < until:
            if conn.just_connected():
                self.link.client.subscribe([(t, QOS) for t in self._subscriptions()])
                self._republish()
            if now - self._housekept >= 1.0:
                self._housekeeping()
            try:
                topic, payload = conn.inbox.get_nowait()
            except queue.Empty:
                self.rounds.expire()
                time.sleep(max(0.0, min(idle, until - now)))
                idle = min(IDLE_S[1], 2 * idle)
            else:
                self.handle(topic, payload)
                idle = IDLE_S[0]
            if self._can_close():  # also when quiet: a grace period may end
                return

    def _can_close(self) -> bool:
        """What ends `pump` before its time: the open round can close."""
        return self.fed.round is not None and self.fed.complete()

    def handle(self, topic: str, payload: bytes) -> None:
        """The trust boundary: whatever arrives, a rejection is counted and the loop goes on."""
        t = self.topics
        client = "?"
        try:
            if (client := t.client_of(topic, "update") or t.client_of(topic, "resend")) is not None:
                self.rounds.update(client, payload)
            elif (client := t.client_of(topic, "announce")) is not None:
                if payload:  # an empty retained message clears the announce
                    self.control.announce(client, payload)
            elif (client := t.client_of(topic, "decline")) is not None:
                self.control.decline(client, payload)
            elif (w := t.worker_of(topic)) is not None:
                client = w[0]
                self.rounds.pool.handle(*w, payload)
            elif (client := t.client_of(topic, "status")) is not None:
                self.control.client_status(client, payload)
            elif (client := t.client_of(topic, "sent")) is not None:
                self.control.sent(client, payload)
        except (MessageError, Rejected, WireError) as e:
            self.rounds.reject(e.reason, client or "?", str(e))
        except Exception:  # a bug must not let one message end the federation: count it, keep the trace
            self.rounds.reject("internal_error", client or "?", traceback.format_exc(limit=3).strip().replace("\n", " | "))

    def _subscriptions(self) -> list[str]:
        """Updates come in here unless workers take them (resends always do)."""
        ingest = self.topics.server_subscriptions()
        if self.cfg.workers or self.cfg.remote_workers:
            ingest.remove(self.topics.update("+"))
        return ingest + self.rounds.worker_subscriptions()

    def _republish(self) -> None:
        """After a (re)connect: the broker may have lost retained tasks and weights in a restart."""
        self.control.publish_status("training" if self.fed.round else "waiting")
        self.rounds.republish()

    def _housekeeping(self) -> None:
        """Once a second: the operator's enrolment changes, expired pins, newly authorised workers, overdue
        updates, the status heartbeat (and the status at once when who is online or able to train changed), a finished
        evaluation attached to its round."""
        self._housekept = time.monotonic()
        self.driver.poll()
        self.control.check_enrolment()
        self.rounds.housekeeping()
        self.control.heartbeat()

    # -- the run ----------------------------------------------------------------------------------
    def wait_for_clients(self) -> None:
        """Until clients_per_round can train, or min_clients can and join_wait has passed since the
        first of them arrived (so a first round does not open the moment one device shows up)."""
        self.control.publish_status("waiting")
        first_ready: float | None = None
        said = ""
        while True:
            n = len(self.fed.available())
            if n and first_ready is None:
                first_ready = time.monotonic()
            if self.rounds.pool.workers_seen() < max(self.cfg.workers, self.cfg.remote_workers):  # no first round before they listen
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

    def run(self) -> None:
        self.link.conn.start()
        if self.rounds.next_round == 1 and (start := self.driver.evaluate_start()) is not None:
            self.observer.metrics_line(start)
        self.link.retain(self.topics.control)  # forget an earlier run's "end"
        for index in range(self.rounds.next_round, self.cfg.rounds + 1):
            self.wait_for_clients()
            self.driver.run_round(index)
        self.finish_evaluations()
        self.finish()

    def finish_evaluations(self) -> None:
        """The last scores, with the inbox still served."""
        if self.driver.evaluating():
            self.control.publish_status("evaluating")
        while self.driver.evaluating():  # the last round's scores, with the inbox still served
            self.pump(time.monotonic() + 0.5)
            self.driver.poll()

    def finish(self) -> None:
        end = Control(federation=self.cfg.federation, run=self.link.run_id, event="end", **self.link.stamp())
        self.link.retain(self.topics.control, self.link.signer.sign(end.to_json()))
        self.rounds.clear_models()
        info = self.control.publish_status("finished")  # last, so waiting for it waits for everything before it
        try:
            info.wait_for_publish(5)
        except (RuntimeError, ValueError):
            pass  # broker gone at the very end: the checkpoint and metrics are already on disk
        self.link.conn.stop()  # a disconnect we ask for, not a lost connection
        log.info(f"federation {self.cfg.federation!r} finished after {'version' if self.cfg.mode == 'buffered' else 'round'} "
                 f"{self.cfg.rounds}")


def _evaluation(cfg: ServeConfig, layout: Layout, train_cfg: TrainConfig
                ) -> tuple[Evaluator | None, RootUpdates | None, Gate | None, ServerStatistics | None]:
    """The evaluator and, under FLTrust, the root updates (--root-data, else the evaluation dataset), the gate and
    the server's running statistics; when they use one test split, their images are left out of what evaluation
    scores."""
    root_name = (cfg.root_data or cfg.eval_dataset) if cfg.robustness.aggregation.spec.root_data else None
    test = load_dataset(cfg.eval_dataset, cfg.data_root, train=False) if cfg.eval_dataset else None
    root = None
    if root_name:
        held, root_set = split_root(test if root_name == cfg.eval_dataset else
                                    load_dataset(root_name, cfg.data_root, train=False), cfg.root_samples)
        test = held if root_name == cfg.eval_dataset else test
        root = RootUpdates(layout, root_set, train_cfg, cfg.rounds, cfg.root_samples, cfg.seed)
    agg, gate, statistics = cfg.robustness.aggregation, None, None
    if test is not None:
        test, gate, statistics = held_out(test, layout, agg)
    elif agg.gate:
        log.warning("--gate: the server holds no held-out data; the gate is off (give --eval-dataset)")
    if test is None and agg.server_stats and layout.stats:
        log.warning("the server holds no held-out data: batch norm's running statistics are the devices' merged "
                    "values and nothing is fine-tuned at commit (give --eval-dataset for the server's own, "
                    "docs/security.md)")
    if gate is not None and (cfg.workers or cfg.remote_workers):
        log.warning("--gate with workers: a round merged from partials carries no updates to leave out; a tripped one is refused whole")
    evaluator = Evaluator.for_dataset(layout, cfg.eval_dataset, cfg.eval_samples, cfg.data_root, seed=cfg.seed,
                                      test=test) if test is not None else None
    return evaluator, root, gate, statistics


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
