"""What the server tells an operator about itself: Prometheus metrics and the dashboard's view.

The Server calls one `Observer` at fixed points: a client announced or changed presence, a round
opened, an update was folded in, a message was refused, a checkpoint was written, a round's metrics
line was written, a status was published. Every number comes from data the server already keeps (the metrics.jsonl
line, ServerStatus, the federation's ClientInfo); nothing is measured twice. The Observer is fed
on the server's main thread and read by the HTTP threads (aggregator/web.py): the dashboard view
sits behind one lock, prometheus_client locks its own values.

Labels stay low-cardinality: `submodel` (a ladder has a handful of rungs) and `reason` (a fixed set
of rejection codes). No metric is labelled by device id: with a fleet of thousands each id would be
its own time series in Prometheus, memory and query cost would grow with the fleet, and the series
of departed devices would linger for the retention period. Per-device detail is on the dashboard
(`/api/state`), capped at MAX_DEVICES rows.
"""

from __future__ import annotations

import threading
import time
from collections import Counter as Tally
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram

from aggregator.federation import ClientInfo
from nefl.protocol.messages import DeviceSummary, ServerStatus

VERSION = 1
MAX_DEVICES = 1000  # dashboard rows; beyond this the longest-unseen device leaves the table
MAX_ROUNDS = 500  # rounds kept for the dashboard's charts
DETAILED_ROUNDS = 30  # the latest rounds sent with their per-client maps; older ones as counts only
SERVER_STATES = ["waiting", "training", "evaluating", "finished", "offline"]
ROUND_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
STEP_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class DeviceRow(msgspec.Struct, kw_only=True):
    """One device as the dashboard shows it (submodels 1-based; 0: can train nothing now)."""

    id: str
    online: bool
    gone: str = ""  # why the server no longer takes this device ("revoked", "key replaced"); "" while it does
    last_seen: float  # unix time of its last announce, status change or accepted update
    device: DeviceSummary
    max_submodel: int
    reason: str  # the device's own words for its max_submodel (which limit binds)
    assigned: int | None = None  # submodel of its latest round
    assigned_round: int | None = None
    last_loss: float | None = None
    last_round: int | None = None  # latest round it reported in


class RoundRow(msgspec.Struct, kw_only=True):
    """One round: its metrics.jsonl line, plus the wall-clock times only a live server saw."""

    round: int
    opened: float | None = None  # unix time; None for rounds read back from metrics.jsonl
    closed: float | None = None
    deadline_s: float | None = None
    participants: int = 0
    reports: int = 0
    declines: int = 0
    # per client, for the latest DETAILED_ROUNDS only: a poll every 2 s stays small with a big fleet
    assigned: dict[str, int] = {}  # client -> submodel (1-based)
    reported: list[str] = []
    declined: dict[str, str] = {}  # client -> its reason
    went_offline: list[str] = []
    quorum: bool | None = None
    committed: bool | None = None
    accuracy: list[float] | None = None
    updates_per_submodel: list[int] = []
    bytes_in: int = 0
    bytes_out: int = 0
    rejected: dict[str, int] = {}
    wall_s: float | None = None
    mode: str = "sync"  # buffered: the row is a committed version (`round` is its number)
    staleness: list[int] = []  # buffered: each committed update's staleness (versions behind), in arrival order


class DashboardState(msgspec.Struct, kw_only=True, tag="dashboard_state", tag_field="type"):
    """GET /api/state: everything the page draws, versioned like every message that leaves a process."""

    v: int = VERSION
    federation: str
    state: str
    round: int
    rounds: int
    profile: str
    submodels: int
    round_timeout: float
    clients_online: int
    clients_ready: int
    rejected_total: dict[str, int]
    devices: list[DeviceRow]
    rounds_history: list[RoundRow]
    open_round: RoundRow | None
    time: float


class ServerMetrics:
    """The aggregator's Prometheus registry (its own, so tests and several servers never share values)."""

    def __init__(self, submodels: int) -> None:
        self.registry = r = CollectorRegistry()
        self.submodels = [str(k + 1) for k in range(submodels)]
        self.rounds = Counter("nefl_rounds_completed", "Rounds closed (committed or not).", registry=r)
        self.committed = Counter("nefl_rounds_committed", "Rounds whose aggregate became the new model.", registry=r)
        self.no_quorum = Counter("nefl_rounds_without_quorum", "Rounds closed with fewer updates than --min-clients.",
                                 registry=r)
        self.round_seconds = Histogram("nefl_round_duration_seconds", "Round wall time, open to checkpoint "
                                       "(the metrics line's wall_s).", buckets=ROUND_BUCKETS, registry=r)
        self.aggregate_seconds = Histogram("nefl_aggregation_seconds", "NeFedAvg time per round: validating, "
                                           "bounding and folding the updates plus finalising the aggregate.",
                                           buckets=STEP_BUCKETS, registry=r)
        self.checkpoint_seconds = Histogram("nefl_checkpoint_seconds", "Time to write and commit a round's checkpoint.",
                                            buckets=STEP_BUCKETS, registry=r)
        self.participants = Counter("nefl_participants", "Tasks handed out, by assigned submodel.", ["submodel"],
                                    registry=r)
        self.updates = Counter("nefl_updates_accepted", "Updates accepted into a round's aggregate, by submodel.",
                               ["submodel"], registry=r)
        self.rejected = Counter("nefl_rejected", "Inbound messages refused (updates, announces, statuses), by reason.",
                                ["reason"], registry=r)
        self.declined = Counter("nefl_tasks_declined", "Tasks a device declined because its submodel no longer fit.",
                                registry=r)
        self.went_offline = Counter("nefl_participants_went_offline", "Participants that went offline before reporting.",
                                    registry=r)
        self.late = Counter("nefl_late_updates", "Updates for an already closed round (dropped).", registry=r)
        self.bytes_in = Counter("nefl_received_bytes", "Update bytes received in rounds.", registry=r)
        self.bytes_out = Counter("nefl_sent_bytes", "Model and task bytes published in rounds.", registry=r)
        self.online = Gauge("nefl_clients_online", "Announced devices whose last status is online.", registry=r)
        self.ready = Gauge("nefl_clients_ready", "Online devices that can train some submodel now.", registry=r)
        self.accuracy = Gauge("nefl_accuracy", "Test accuracy of each submodel after the latest evaluated round.",
                              ["submodel"], registry=r)
        self.trained = Gauge("nefl_submodel_committed_updates", "Updates committed into each submodel over the "
                             "federation's life (resumed runs included).", ["submodel"], registry=r)
        self.starving = Gauge("nefl_submodel_rounds_since_update", "Consecutive closed rounds in which the submodel "
                              "received no committed update (high: it is starving).", ["submodel"], registry=r)
        self.round = Gauge("nefl_round", "The open round, or the last closed one (buffered mode: the newest version).",
                           registry=r)
        self.staleness = Histogram("nefl_update_staleness", "Buffered mode: versions between a committed update's base "
                                   "and the version it was committed into.", buckets=STALENESS_BUCKETS, registry=r)
        self.state = Enum("nefl_server_state", "What the server is doing.", states=SERVER_STATES, registry=r)
        for k in self.submodels:  # every submodel's series exists from the start: a zero is a fact too
            self.participants.labels(k)
            self.updates.labels(k)
            self.starving.labels(k)


class Observer:
    """The one object the Server notifies; keeps the Prometheus metrics and the dashboard's view."""

    def __init__(self, federation: str, profile: str, submodels: int, rounds: int, round_timeout: float,
                 history: Iterable[Mapping[str, Any]] = ()) -> None:
        self.metrics = ServerMetrics(submodels)
        self._lock = threading.Lock()
        self._federation, self._profile, self._submodels = federation, profile, submodels
        self._rounds_planned, self._round_timeout = rounds, round_timeout
        self._state: str = "waiting"
        self._round = 0
        self._devices: OrderedDict[str, DeviceRow] = OrderedDict()  # least recently seen first
        self._online: set[str] = set()
        self._ready: set[str] = set()
        self._history: deque[RoundRow] = deque(maxlen=MAX_ROUNDS)
        self._open: RoundRow | None = None
        self._open_reported: set[str] = set()  # the open round's `reported`, for membership
        self._rejected: Tally[str] = Tally()
        self._since_update = [0] * submodels
        for line in history:  # a resumed server's charts start with the rounds already run
            try:
                self._history.append(_round_row(line, RoundRow(round=int(line.get("round", 0)))))
                self._count_starving(line)
            except (TypeError, ValueError, AttributeError):
                continue  # a line this version cannot read is left out of the charts, not fatal

    # -- events (server main thread) ---------------------------------------------------------------
    def client_changed(self, info: ClientInfo | None) -> None:
        """An announce or a status message touched this client's record (None: not announced yet)."""
        if info is None:
            return
        cid = info.client_id
        with self._lock:
            row = self._devices.pop(cid, None)
            fresh = DeviceRow(id=cid, online=info.online, last_seen=time.time(), device=info.device,
                              max_submodel=info.max_submodel + 1, reason=info.selection)
            if row is not None:
                fresh.assigned, fresh.assigned_round = row.assigned, row.assigned_round
                fresh.last_loss, fresh.last_round = row.last_loss, row.last_round
            self._devices[cid] = fresh
            while len(self._devices) > MAX_DEVICES:
                self._devices.popitem(last=False)
            (self._online.add if info.online else self._online.discard)(cid)
            (self._ready.add if info.online and info.max_submodel >= 0 else self._ready.discard)(cid)
            self.metrics.online.set(len(self._online))
            self.metrics.ready.set(len(self._ready))

    def client_gone(self, cid: str, why: str) -> None:
        """The server no longer takes this device (its enrolment was revoked or replaced): shown as such, never online."""
        with self._lock:
            row = self._devices.get(cid)
            if row is not None:
                row.online, row.gone = False, why
            self._online.discard(cid)
            self._ready.discard(cid)
            self.metrics.online.set(len(self._online))
            self.metrics.ready.set(len(self._ready))

    def round_opened(self, index: int, assignments: Mapping[str, int], deadline_s: float) -> None:
        """Participants and their 0-based submodels, as the tasks were published."""
        for k, n in Tally(assignments.values()).items():  # a labels() lookup per submodel, not per participant
            self.metrics.participants.labels(str(k + 1)).inc(n)
        self.metrics.round.set(index)
        with self._lock:
            self._round = index
            self._open_reported = set()
            self._open = RoundRow(round=index, opened=time.time(), deadline_s=deadline_s, participants=len(assignments),
                                  assigned={c: k + 1 for c, k in assignments.items()})
            for c, k in assignments.items():
                if c in self._devices:
                    self._devices[c].assigned, self._devices[c].assigned_round = k + 1, index

    def task_given(self, client: str, submodel: int, version: int) -> None:
        """Buffered mode: a device got a task of 0-based `submodel` from `version`."""
        self.metrics.participants.labels(str(submodel + 1)).inc()
        with self._lock:
            if client in self._devices:
                self._devices[client].assigned, self._devices[client].assigned_round = submodel + 1, version

    def update_accepted(self, client: str) -> None:
        """An update folded into the open round: the round's progress on the page (counted at close)."""
        with self._lock:
            if self._open is not None and client not in self._open_reported:  # a set: O(1) an update, not O(round)
                self._open_reported.add(client)
                self._open.reported.append(client)
                self._open.reports += 1
            if client in self._devices:  # a device that reports every round is seen every round
                self._devices[client].last_seen = time.time()
                self._devices.move_to_end(client)

    def rejected(self, reason: str) -> None:
        self.metrics.rejected.labels(reason).inc()
        with self._lock:
            self._rejected[reason] += 1

    def checkpoint_saved(self, seconds: float) -> None:
        self.metrics.checkpoint_seconds.observe(seconds)

    def metrics_line(self, line: Mapping[str, Any]) -> None:
        """A line just appended to metrics.jsonl: round 0 (the initial accuracy), a closed round, or a closed
        round's scores that came later (`"evaluated": true`: they fill in its row)."""
        m = self.metrics
        if line.get("accuracy"):
            for k, a in enumerate(line["accuracy"]):
                m.accuracy.labels(str(k + 1)).set(a)
        if line.get("evaluated"):
            with self._lock:
                for row in reversed(self._history):
                    if row.round == line.get("round"):
                        row.accuracy = line["accuracy"]
                        break
            return
        if line.get("round", 0) >= 1:
            m.rounds.inc()
            if line.get("committed"):
                m.committed.inc()
            if line.get("quorum") is False:
                m.no_quorum.inc()
            m.round_seconds.observe(line.get("wall_s", 0.0))
            if "aggregate_s" in line:
                m.aggregate_seconds.observe(line["aggregate_s"])
            for k, n in enumerate(line.get("updates_per_submodel", [])):
                m.updates.labels(str(k + 1)).inc(n)
            for tau in line.get("staleness", []) if line.get("committed") else []:
                m.staleness.observe(tau)
            for k, n in enumerate(line.get("updates_per_submodel_total", [])):
                m.trained.labels(str(k + 1)).set(n)
            m.declined.inc(len(line.get("declined", {})))
            m.went_offline.inc(len(line.get("went_offline", [])))
            m.late.inc(line.get("late_updates", 0))
            m.bytes_in.inc(line.get("bytes_in", 0))
            m.bytes_out.inc(line.get("bytes_out", 0))
        with self._lock:
            if line.get("round", 0) >= 1:
                self._count_starving(line)
            opened = self._open if self._open is not None and self._open.round == line.get("round") else None
            row = _round_row(line, opened or RoundRow(round=int(line.get("round", 0))))
            row.closed = time.time() if opened else None
            self._history.append(row)
            self._open = None if opened else self._open
            for c, stats in (line.get("clients") or {}).items():
                if c in self._devices and isinstance(stats.get("loss"), (int, float)):
                    self._devices[c].last_loss, self._devices[c].last_round = stats["loss"], row.round

    def status(self, status: ServerStatus) -> None:
        """Each published status (waiting, training, evaluating, finished)."""
        self.metrics.state.state(status.state)
        self.metrics.round.set(status.round)
        with self._lock:
            self._state, self._round = status.state, status.round

    # -- reads (HTTP threads) ----------------------------------------------------------------------
    def snapshot(self) -> DashboardState:
        with self._lock:
            return DashboardState(
                federation=self._federation, state=self._state, round=self._round, rounds=self._rounds_planned,
                profile=self._profile, submodels=self._submodels, round_timeout=self._round_timeout,
                clients_online=len(self._online), clients_ready=len(self._ready), rejected_total=dict(self._rejected),
                devices=[msgspec.structs.replace(d) for d in reversed(self._devices.values())],
                rounds_history=[msgspec.structs.replace(r) if i < DETAILED_ROUNDS else
                                msgspec.structs.replace(r, assigned={}, reported=[], declined={}, went_offline=[])
                                for i, r in enumerate(reversed(self._history))][::-1],
                open_round=None if self._open is None else msgspec.structs.replace(self._open, reported=list(self._open.reported)),
                time=time.time())

    def snapshot_json(self) -> bytes:
        return msgspec.json.encode(self.snapshot())

    def _count_starving(self, line: Mapping[str, Any]) -> None:
        committed = line.get("committed", False)
        for k, n in enumerate(line.get("updates_per_submodel", [])[: self._submodels]):
            self._since_update[k] = 0 if committed and n else self._since_update[k] + 1
            self.metrics.starving.labels(str(k + 1)).set(self._since_update[k])


def _round_row(line: Mapping[str, Any], row: RoundRow) -> RoundRow:
    """Fill a round row from its metrics line, whatever an older or partial line lacks."""
    row.quorum, row.committed = line.get("quorum"), line.get("committed")
    row.accuracy = line.get("accuracy")
    row.assigned = dict(line.get("assigned") or row.assigned)
    row.reported = list(line.get("reported", []))
    row.declined = dict(line.get("declined") or {})
    row.went_offline = list(line.get("went_offline", []))
    row.participants, row.reports, row.declines = len(row.assigned), len(row.reported), len(row.declined)
    row.updates_per_submodel = list(line.get("updates_per_submodel", []))
    row.bytes_in, row.bytes_out = int(line.get("bytes_in", 0)), int(line.get("bytes_out", 0))
    row.rejected = dict(line.get("rejected") or {})
    row.wall_s = line.get("wall_s")
    row.mode = str(line.get("mode", "sync"))
    row.staleness = [int(t) for t in line.get("staleness", [])]
    return row



class JigsawMetrics:
    """`aggregator jigsaw-serve --http`: the FedJigsaw coordinator's Prometheus registry, fed one round row at a time
    (nefl/jigsaw/coordinator.py); traffic, rejections and masking are what the devices reported for the round."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.rounds = Counter("nefl_jigsaw_rounds_completed", "FedJigsaw rounds closed.", registry=r)
        self.round = Gauge("nefl_jigsaw_round", "The last closed round.", registry=r)
        self.trained = Gauge("nefl_jigsaw_devices_trained", "Devices that trained a chain in the last round.", registry=r)
        self.module_bytes = Counter("nefl_jigsaw_module_bytes", "Bytes the devices sent and received, by kind "
                                    "(metadata, fetch, module, return; _out sent, _in received).", ["kind"], registry=r)
        self.per_device = Gauge("nefl_jigsaw_bytes_per_device", "Mean bytes a device sent and received in the last "
                                "round (modules, trained copies, fetches, metadata).", registry=r)
        self.whole_model = Gauge("nefl_jigsaw_whole_model_bytes_per_device", "What a device would move in a round by "
                                 "downloading and uploading its whole model instead (the comparison).", registry=r)
        self.borrowed = Counter("nefl_jigsaw_modules_borrowed", "Trained copies returned to their source.", registry=r)
        self.changes = Counter("nefl_jigsaw_chain_changes", "Devices that switched to another chain.", registry=r)
        self.masked = Gauge("nefl_jigsaw_masked_peers", "Peers masked in the last round (no module in time).", registry=r)
        self.rejected = Counter("nefl_jigsaw_rejected", "Inbound messages and modules refused, by reason.", ["reason"],
                                registry=r)

    def record(self, row: Mapping[str, Any]) -> None:
        self.rounds.inc()
        self.round.set(row["round"])
        self.trained.set(row["trained"])
        for kind, n in row["bytes"].items():
            self.module_bytes.labels(kind).inc(n)
        self.per_device.set(row["bytes_per_device"])
        self.whole_model.set(row["whole_model_bytes_per_device"])
        self.borrowed.inc(row["modules_borrowed"])
        self.changes.inc(row["chain_changes"])
        self.masked.set(len(row["masked"]))
        for reason, n in row["rejected"].items():
            self.rejected.labels(reason).inc(n)

    def serve(self, host: str, port: int):
        """/metrics on host:port in a background thread; returns the server (shutdown() stops it)."""
        from prometheus_client import start_http_server

        server, _ = start_http_server(port, host, registry=self.registry)
        return server
