"""`aggregator worker`: one of several processes that share a federation's update stream.

Workers subscribe to `$share/{group}/nefl/{federation}/update/+`, so the broker hands each update
message to one of them. Each checks it exactly as the server would (aggregator/intake.py: size,
signature, identity, round, shapes, finite values, the norm bound of the coordinator's plan), folds
it into its own partial NeFedAvg, tells the coordinator (a receipt), and at round close publishes
the partial (aggregator/partials.py) for the coordinator to merge. Everything it sends the coordinator
is signed with its own key (`--key`, default in the federation's key directory), which the operator
authorises on the coordinator (`aggregator enroll ID --worker --public-key KEY`; `serve --workers N` does it
for the workers it starts).

Chunks of one update reach one worker (docs/scale.md): an update sent in one message trivially
does; for a multi-chunk update the round plan names an owner per client (a stable hash over the
plan's sorted worker list), and a worker handed a chunk it does not own forwards it, once, to the
owner's forward topic. Threads as in the server: paho only enqueues, the main thread owns the state.
The command line is in aggregator/scale_cli.py.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import secrets
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch._dynamo  # noqa: F401  building the plan's layout imports it on first use: seconds, paid before "online"
import typer

from aggregator.federation import Federation, Rejected, Robustness
from aggregator.intake import DeviceKeys, take_update
from aggregator.keys import KeyDir
from nefl.aggregation.nefedavg import as_mergeable
from nefl.support.cli_options import ENV_PASSWORD, ENV_USERNAME
from nefl.support.heap import freeze_startup, keep_freed_memory
from nefl.protocol.messages import (MAX_PLAN_BYTES, MAX_RECEIPTS, MessageError, PartialSummary, Receipt, ReceiptBatch, RoundClose,
                           WorkerRound, WorkerStatus)
from nefl.protocol.mqtt import QOS, BrokerSettings, Connection
from nefl.nested.profile import parse_profile
from nefl.aggregation.robust import NormBound
from nefl.aggregation.config import AggregationConfig
from nefl.protocol.signing import Signer, parse_public_key, verify
from nefl.nested.state import GlobalState, Layout
from nefl.support.threads import one_per_process
from nefl.protocol.topics import WORKER_GROUP, Topics, check_name
from nefl.protocol.wire import Reassembler, WireError, encode, parse_chunk

log = logging.getLogger("aggregator.worker")
EARLY_MESSAGES = 10_000  # update chunks held while their round's plan is on its way


@dataclass(frozen=True)
class WorkerConfig:
    federation: str = "default"
    worker_id: str = "worker-1"
    # a device that joins the group (mosquitto's acl_file grants any subscription) takes its share of updates
    # away: the broker drops them for want of read access, or hands them to it. Name it as a secret on a broker
    # devices reach; `serve --workers N` draws one per run
    group: str = WORKER_GROUP
    shared: bool = True  # False: a lone worker (or a relay) takes update/+ itself
    server_key: str | None = None  # verify the coordinator's round plans and close requests
    receipt_linger_s: float = 0.02  # a receipt waits this long for others to share its signature and publish


def owner_of(client: str, owners: list[str]) -> str | None:
    """The worker that assembles `client`'s multi-chunk updates this round (None: no owner list)."""
    if not owners:
        return None
    h = int.from_bytes(hashlib.sha256(client.encode()).digest()[:8], "big")
    return owners[h % len(owners)]


class Worker:
    """Checks and sums the updates it is handed; the coordinator's plan says what is valid."""

    role = "worker"

    def __init__(self, cfg: WorkerConfig, upstream: BrokerSettings, key: Signer) -> None:
        self.cfg = cfg
        self.topics = Topics(cfg.federation)
        self.me = check_name("worker id", cfg.worker_id)
        self.server_key = parse_public_key(cfg.server_key) if cfg.server_key else None
        self.key = key
        self.up = Connection(upstream, f"nefl-{self.role}-{cfg.federation}-{self.me}",
                             self.topics.worker(self.me, "status"), lambda seq: self.status_message("offline", seq), log)
        self.sources: list[Connection] = [self.up]  # where updates come from
        self.plan: WorkerRound | None = None
        self.layout: Layout | None = None
        self.fed: Federation | None = None
        self.rule_secret = secrets.token_bytes(32)  # its centre check's draws: this process's, sent nowhere
        self.reasm: Reassembler | None = None
        self.pins: dict[str, str] = {}  # the plan's device keys
        self.keys = DeviceKeys(self.pins.get)
        self.incarnation = 0  # the newest incarnation of the coordinator seen (older plans are replays)
        self.sent: set[tuple[str, int]] = set()  # (run, round) partials already published
        self.early: list[tuple[str, bytes, bool]] = []  # updates of a round whose plan has not arrived yet
        self.receipts: list[Receipt] = []  # not yet sent: they go as one signed batch
        self._receipts_since = 0.0  # monotonic time of the oldest of them
        self.bytes_up = 0  # what this process published to the coordinator's broker
        self._up_mark = 0  # bytes_up at the last partial
        self.stopping = False

    # -- plumbing ---------------------------------------------------------------------------------
    def publish_up(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.up.client.publish(topic, payload, qos=QOS, retain=retain)
        self.bytes_up += len(payload)

    def status_message(self, state: str, seq: int) -> bytes:
        """This worker's status for the connection stamped `seq`, signed (the offline one is its last will)."""
        return self.key.sign(WorkerStatus(state=state, role=self.role, seq=seq).to_json())

    def subscriptions(self, conn: Connection) -> list[str]:
        t = self.topics
        subs = [t.workers_round, t.workers_close, t.worker(self.me, "forward")]
        return subs + [t.update_shared(self.cfg.group) if self.cfg.shared else t.update("+")]

    def run(self) -> None:
        for conn in dict.fromkeys(self.sources + [self.up]):
            conn.start()
        while not self.stopping:
            self.step(0.01)

    def step(self, wait_s: float) -> None:
        """Subscribe after (re)connects, then handle what arrived (waiting up to `wait_s` when idle)."""
        busy = False
        for conn in dict.fromkeys([self.up, *self.sources]):
            if conn.just_connected():
                conn.client.subscribe([(t, QOS) for t in self.subscriptions(conn)])
                if conn is self.up:
                    self.publish_up(self.topics.worker(self.me, "status"), self.status_message("online", conn.stamp),
                                    retain=True)
            for _ in range(200):
                try:
                    topic, payload = conn.inbox.get_nowait()
                except queue.Empty:
                    break
                busy = True
                self.route(conn, topic, payload)
        for key in self.reasm.expire() if self.reasm is not None else []:
            self.receipt(key[2], "timeout", f"chunk set of round {key[1]} incomplete after {self.reasm.timeout_s}s")
        if self.receipts and time.monotonic() - self._receipts_since >= self.cfg.receipt_linger_s:
            self.send_receipts()
        if not busy:
            time.sleep(wait_s)

    def route(self, conn: Connection, topic: str, payload: bytes) -> None:
        """The trust boundary: whatever arrives is judged, counted and answered; nothing raises past it."""
        t = self.topics
        if conn in self.sources and (client := t.client_of(topic, "update") or t.client_of(topic, "resend")) is not None:
            self.judged(client, lambda: self.on_update(client, payload, forwarded=False))
        elif conn is self.up and topic == t.workers_round:
            self.judged(None, lambda: self.on_plan(payload))
        elif conn is self.up and topic == t.workers_close:
            self.judged(None, lambda: self.on_close(payload))
        elif conn is self.up and topic == t.worker(self.me, "forward"):
            # the forwarding worker checked the header's client against the update topic
            self.judged(None, lambda: self.on_update(parse_chunk(payload).header.client, payload, forwarded=True))

    def judged(self, client: str | None, handle: Callable[[], None]) -> None:
        """Run a handler; a refusal (or a bug) becomes a receipt with its reason, never an exception."""
        try:
            handle()
        except (MessageError, Rejected, WireError) as e:
            self.receipt(client, e.reason, str(e))
        except Exception:  # a bug must not let one message end the worker: count it, keep the trace
            self.receipt(client, "internal_error", traceback.format_exc(limit=3).strip().replace("\n", " | "))

    def _signed(self, payload: bytes) -> bytes:
        return verify(payload, self.server_key) if self.server_key is not None else payload

    # -- the coordinator's plan and close ---------------------------------------------------------
    def on_plan(self, payload: bytes) -> None:
        if not payload:
            return
        plan = WorkerRound.from_json(self._signed(payload), MAX_PLAN_BYTES)
        if plan.federation != self.cfg.federation:
            raise Rejected("wrong_federation", f"plan of federation {plan.federation!r}")
        if plan.incarnation < self.incarnation:
            raise Rejected("stale_run", f"a plan of incarnation {plan.incarnation}, the coordinator is at {self.incarnation}")
        self.incarnation = plan.incarnation
        if self.plan is not None and (plan.run, plan.round) == (self.plan.run, self.plan.round):
            self.plan = plan  # the open round re-planned (an owner left) or redelivered: keep the partial
            return
        if self.layout is None or self.layout.profile.hash != plan.profile_hash:
            self.layout = Layout.build(parse_profile(plan.profile, "the coordinator's round plan"))
            if self.layout.profile.hash != plan.profile_hash:
                raise Rejected("profile_mismatch", "the plan's profile does not hash to its profile_hash")
            self.fed = None
        b, sc = plan.bound, plan.screen
        robust = Robustness(NormBound(max_norm=b.max_norm, relative=b.relative, adaptive_k=b.adaptive_k, mode=b.mode,
                                      window=b.window, warmup=b.warmup),
                            aggregation=AggregationConfig(centre_check=sc.centre_check, min_agree=sc.min_agree,
                                                          max_norm_ratio=sc.max_norm_ratio, min_cover=sc.min_cover,
                                                          hold=sc.hold, sketch=sc.sketch))
        if self.fed is None or self.fed.robustness != robust:
            # a worker holds no weights: the plan's reference norms stand in for them
            empty = GlobalState({}, [{} for _ in range(self.layout.num_submodels)])
            self.fed = Federation(self.layout, empty, plan.federation, max(1, len(plan.assignments)), 1,
                                  plan.deadline_s, robustness=robust, rule_secret=self.rule_secret)
        self.fed.round_timeout = plan.deadline_s
        self.fed.adopt_round(plan.round, plan.assignments, plan.references)
        self.fed.guard.load_state_dict({"norms": plan.norms})
        self.pins.clear()
        self.pins.update(plan.keys)
        if self.reasm is None or self.reasm.max_bytes != plan.max_update_bytes:
            self.reasm = Reassembler(max_bytes=plan.max_update_bytes, timeout_s=plan.deadline_s, lazy_views=True)
        self.reasm.discard_rounds_before(plan.round)
        self.plan = plan
        early, self.early = self.early, []
        for client, payload, forwarded in early:
            self.judged(client, partial(self.on_update, client, payload, forwarded))
        log.info(f"round {plan.round}: plan of run {plan.run} with {len(plan.assignments)} participants, "
                 f"owners {plan.owners}")

    def on_close(self, payload: bytes) -> None:
        msg = RoundClose.from_json(self._signed(payload))
        if msg.federation != self.cfg.federation or (msg.run, msg.round) in self.sent:
            return
        self.sent.add((msg.run, msg.round))
        p, fed = self.plan, self.fed
        mine = p is not None and fed is not None and fed.round is not None and (p.run, p.round) == (msg.run, msg.round)
        self.publish_partial(msg.run, msg.round, fed if mine else None)
        if mine:
            fed.round = None  # anything arriving now is late for this round

    def publish_partial(self, run: str, index: int, fed: Federation | None) -> None:
        """The partial (possibly empty) for (run, round): the receipts still held, the tensors, then the summary
        naming them (in this order on one connection, so the coordinator has every receipt the summary relies on)."""
        self.send_receipts()
        num = self.layout.num_submodels if self.layout else 0
        summary = PartialSummary(run=run, round=index, weights=[0.0] * num, updates=[0] * num)
        if fed is not None and fed.agg.total_updates:
            agg, r = as_mergeable(fed.agg).partial(), fed.round
            msgs, header = encode(agg.partial_tensors(), kind="partial", federation=self.cfg.federation, round=index, submodel=0,
                          client=self.me, chunk_bytes=self.plan.chunk_bytes, sign=self.key.sign)
            for m in msgs:
                self.publish_up(self.topics.worker(self.me, "partial"), m)
            dropped = fed.agg.dropped
            summary = PartialSummary(run=run, round=index, weights=[float(w) for w in agg.weights], updates=list(agg.updates),
                                     clients=sorted(r.received), dropped=dict(sorted(dropped.items())),
                                     digest=header.digest)
        self.publish_up(self.topics.worker(self.me, "summary"), self.key.sign(summary.to_json()))
        log.info(f"{self.me}: round {index}: partial of {len(summary.clients)} update(s) sent "
                 f"({self.bytes_up - self._up_mark} bytes up since the last one)")
        self._up_mark = self.bytes_up

    # -- updates ----------------------------------------------------------------------------------
    def on_update(self, client: str, payload: bytes, forwarded: bool) -> None:
        if self.fed is None or self.plan is None:
            raise Rejected("stale_round", "no round plan from the coordinator yet")
        header = self.reasm.parse(payload).header
        if header.round > self.plan.round and len(self.early) < EARLY_MESSAGES:
            self.early.append((client, payload, forwarded))  # its plan is on the way: the coordinator sent it first
            return
        if not forwarded and header.count > 1 and self.cfg.shared:
            owner = owner_of(client, self.plan.owners)
            if owner is not None and owner != self.me:
                if header.client != client:
                    raise Rejected("client_mismatch", f"payload says client {header.client!r}, topic says {client!r}")
                self.publish_up(self.topics.worker(owner, "forward"), payload)
                return
        try:
            done = take_update(self.fed, self.reasm, self.keys, client, payload, self.plan.chunk_bytes * 4)
        except (Rejected, WireError) as e:
            r = self.fed.round
            self.receipt(client, e.reason, str(e), late=e.reason == "stale_round" and header.round < self.plan.round,
                         attributed=r is not None and r.refused.get(client) == e.reason)
            return
        if done is not None:
            r = self.fed.round
            self.receipt(client, "accepted", "", nbytes=done.nbytes, metrics=r.client_metrics[client],
                         samples=done.header.samples, norm=r.norms[client])
            log.info(f"{self.me}: round {done.header.round}: update from {client} accepted "
                     f"(submodel {done.header.submodel + 1}, {done.nbytes} bytes)")

    def receipt(self, client: str | None, outcome: str, detail: str, nbytes: int = 0, metrics: dict | None = None,
                late: bool = False, attributed: bool = False, samples: int = 0, norm: float | None = None) -> None:
        """Tell the coordinator what became of an update: it counts rejections and waits for acceptances."""
        r = self.fed.round if self.fed else None
        index = r.index if r else (self.plan.round if self.plan else 0)
        if outcome != "accepted":
            log.info(f"rejected {outcome} from {client or '?'}: {detail}")
        rc = Receipt(run=self.plan.run if self.plan else "none", round=index, client=client, outcome=outcome[:64],
                     detail=detail[:300], late=late, attributed=attributed, nbytes=nbytes, samples=samples, norm=norm,
                     metrics={k: v for k, v in (metrics or {}).items() if isinstance(v, (int, float, str))})
        if not self.receipts:
            self._receipts_since = time.monotonic()
        self.receipts.append(rc)
        if len(self.receipts) >= MAX_RECEIPTS:
            self.send_receipts()

    def send_receipts(self) -> None:
        """The receipts held, as one signed batch."""
        if self.receipts:
            batch, self.receipts = self.receipts, []
            self.publish_up(self.topics.worker(self.me, "receipt"), self.key.sign(ReceiptBatch(receipts=batch).to_json()))

    def stop(self) -> None:
        self.stopping = True
        self.send_receipts()
        for conn in dict.fromkeys([*self.sources, self.up]):
            last = (self.topics.worker(self.me, "status"), self.status_message("offline", self.up.stamp))
            conn.stop(last if conn is self.up else None)


def run_until_signalled(build: Callable[[], Worker]) -> None:
    """Build a worker or relay (a bad option or broker URL: one line, exit code 2), run it until SIGTERM /
    Ctrl-C, then say offline and leave cleanly (exit code 0)."""
    try:
        w = build()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None

    def _term(signum: int, frame: object) -> None:
        w.stopping = True

    signal.signal(signal.SIGTERM, _term)
    one_per_process()
    keep_freed_memory()
    freeze_startup()
    try:
        w.run()
    except KeyboardInterrupt:
        pass
    w.stop()
    log.info(f"{w.role} {w.me} stopped")


def local_worker_ids(n: int, federation: str) -> list[str]:
    return [f"{federation}-w{i + 1}" for i in range(n)]


def start_local_workers(n: int, settings: BrokerSettings, federation: str, server_key: str, keys: KeyDir,
                        log_level: str = "info") -> list[subprocess.Popen]:
    """`aggregator serve --workers N`: N worker processes on this host, sharing the update stream
    (a lone worker takes it unshared, which also works on brokers without shared subscriptions); each
    signs with its key in `keys`, which the caller authorised. Their group name is drawn at random, so a
    device cannot join their shared subscription and make the broker drop its share of the updates."""
    env = {**os.environ, "NEFL_SERVER_KEY": server_key}
    group = f"{WorkerConfig.group}-{secrets.token_hex(8)}"
    if settings.username:
        env.update({ENV_USERNAME: settings.username, ENV_PASSWORD: settings.password or ""})
    tls = [f"--{flag}={value}" for flag, value in (("ca-cert", settings.ca_cert), ("certfile", settings.certfile),
                                                 ("keyfile", settings.keyfile)) if value]
    return [subprocess.Popen([sys.executable, "-c", "from aggregator.cli import app; app()", "worker",
                              "--broker", settings.url, "--federation", federation, "--worker-id", wid,
                              "--key", str(keys.worker_key_path(wid)), "--shared" if n > 1 else "--no-shared",
                              "--group", group, "--log-level", log_level, *tls], env=env)
            for wid in local_worker_ids(n, federation)]
