"""`aggregator serve --mode buffered` without networking: which task each device gets, which updates the version
buffer takes (and the reason code of each refusal, which the device is told), and each commit's facts.

There are no rounds. A device that can train and holds no task of the newest version gets one: the submodel the
emulated fleet's coverage rule gives it (aggregator/fleet.py `Coverage`: within its announced bound, the submodel
given the fewest of the last tasks), trained from the newest version. A task is numbered (its
number is the Task's and the update header's `round`) and the server keeps the version it named, so the base
version an update is weighed with is the one the server signed, never one the device claims. Updates go into
`VersionBuffer` (nefl/aggregation/version_buffer.py: staleness-weighted NeFedAvg, the update bound, the state check),
which commits a version when it holds K updates or its oldest waited `commit_after_s`.

`Versions` has `check_header`, `refused` and `accept` as the round engine has, so aggregator/intake.py's one path
(size cap, signature, chunk proofs, reassembly) serves both modes.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aggregator.federation import Federation, Update
from aggregator.fleet import Coverage, CoverageConfig
from aggregator.rejected import Rejected
from nefl.aggregation.staleness import StalenessConfig
from nefl.aggregation.version_buffer import VersionBuffer
from nefl.nested.checkpoint import UPDATES_TOTAL_KEY
from nefl.protocol.messages import Decline
from nefl.protocol.wire import ChunkHeader

log = logging.getLogger(__name__)

OPEN_PER_CLIENT = 8  # a device's newest tasks whose updates are still taken (it answers one at a time)
# a resumed run numbers its tasks from the checkpoint's next number plus this: an update of a task the run before
# gave after its last commit never answers one of the new run's (each commit is checkpointed, and a version sees at
# most K updates taken, one task per device at a time and a refusal or decline per task, far fewer than this)
RESUME_TASK_GAP = 100_000


@dataclass(frozen=True)
class Issued:
    """A task given to one device."""

    number: int  # the Task's `round`, which its update names
    client: str
    submodel: int
    version: int  # the model version it trains from


@dataclass(frozen=True)
class Refusal:
    """An update that was not taken, what the device is told."""

    client: str
    task: Issued
    current: int
    reason: str


class Versions:
    """The buffered server's state: the federation (membership, bounds, the pipeline), the version buffer, the tasks
    out and the coverage history (which submodels the last tasks trained)."""

    def __init__(self, fed: Federation, cfg: StalenessConfig, version: int = 0, rule: CoverageConfig = CoverageConfig(),
                 coverage: Mapping[str, Any] | None = None, next_task: int = 1) -> None:
        self.fed, self.cfg = fed, cfg
        self.buffer = VersionBuffer(fed.aggregator, cfg, fed.state, version)  # raises ValueError for refused settings
        self.coverage = Coverage(fed.layout.num_submodels, rule, version, coverage)
        self.next_task = next_task
        self.open: dict[str, OrderedDict[int, Issued]] = {}  # client -> its open tasks, oldest first
        self.refusals: list[Refusal] = []  # refusals not yet told, for the transport to send
        self._contributors: list[str] = []  # the buffered updates' clients, in arrival order
        self._client_metrics: dict[str, dict[str, Any]] = {}

    @property
    def version(self) -> int:
        return self.buffer.version

    # -- tasks --------------------------------------------------------------------------------------
    def wanting(self) -> list[str]:
        """Online devices able to train that hold no task of the newest version: they get one now."""
        out = []
        for c in self.fed.available():
            tasks = self.open.get(c)
            if not tasks or next(reversed(tasks.values())).version < self.version:
                out.append(c)
        return out

    def issue(self, client: str) -> Issued:
        """A task for `client` from the newest version: the coverage rule within its announced bound."""
        bound = self.fed.clients[client].max_submodel
        k = self.coverage.pick(bound, self.version)
        task = Issued(self.next_task, client, k, self.version)
        self.next_task += 1
        tasks = self.open.setdefault(client, OrderedDict())
        tasks[task.number] = task
        while len(tasks) > OPEN_PER_CLIENT:
            tasks.popitem(last=False)
        return task

    def decline(self, client: str, msg: Decline) -> None:
        """The device will not train this task (it re-announced what it can first): it gets another."""
        if msg.client != client:
            raise Rejected("client_mismatch", f"decline says client {msg.client!r}, topic says {client!r}")
        tasks = self.open.get(client, {})
        if msg.round not in tasks or tasks[msg.round].submodel != msg.submodel:
            raise Rejected("stale_decline", f"decline of task {msg.round}, which is not {client}'s open task")
        del tasks[msg.round]

    def forget(self, client: str) -> None:
        """A device gone from the table (revoked, forgotten): its tasks are not answered any more."""
        self.open.pop(client, None)

    # -- the intake's engine (aggregator/intake.py) ---------------------------------------------------
    def check_header(self, topic_client: str, header: ChunkHeader) -> int:
        """Identity and task checks before the payload is hashed; returns the submodel."""
        if header.kind != "update":
            raise Rejected("wrong_kind", f"{header.kind!r} message on an update topic")
        if header.federation != self.fed.name:
            raise Rejected("wrong_federation", f"federation {header.federation!r}, this is {self.fed.name!r}")
        if header.client != topic_client:
            raise Rejected("client_mismatch", f"payload says client {header.client!r}, topic says {topic_client!r}")
        return self._task(topic_client, header.round, header.submodel).submodel

    def _task(self, client: str, number: int, k: int) -> Issued:
        task = self.open.get(client, {}).get(number)
        if task is None:
            raise Rejected("unassigned", f"task {number} is not an open task of {client}")
        if k != task.submodel:
            raise Rejected("submodel_mismatch", f"update for submodel {k + 1}, task {number} is submodel {task.submodel + 1}")
        return task

    def refused(self, client: str, index: int, reason: str) -> None:
        """A device's own signed update failed a check: its task is settled, and the device is told."""
        task = self.open.get(client, {}).pop(index, None)
        if task is not None:
            self.refusals.append(Refusal(client, task, self.version, reason))

    def accept(self, u: Update, now: float | None = None) -> None:
        """Into the version buffer, or Rejected with its reason ("stale", "future-version", "invalid",
        "norm-bound", "bad_samples"); the task is settled either way."""
        task = self._task(u.client, u.round, u.submodel)
        if u.samples < 1:
            raise Rejected("bad_samples", f"sample count {u.samples}")
        offer = self.buffer.offer(task.submodel, u.delta, task.version, u.samples, client=u.client,
                                  now=time.monotonic() if now is None else now)
        if offer.reason is not None:
            raise Rejected(offer.reason, f"task {task.number} trained from version {task.version}, the newest is "
                                         f"{self.version} (staleness {offer.staleness}, bound {self.cfg.max_staleness})")
        del self.open[u.client][task.number]
        self._contributors.append(u.client)
        self._client_metrics[f"{u.client}#{task.number}"] = {
            "client": u.client, "submodel": task.submodel + 1, "version": task.version, "staleness": offer.staleness,
            "samples": u.samples, "bytes": u.nbytes,
            **{m: v for m, v in u.metrics.items() if isinstance(v, (int, float))}}
        self.fed.bytes_in += u.nbytes

    # -- commits --------------------------------------------------------------------------------------
    def due(self, now: float | None = None) -> bool:
        return self.buffer.due(time.monotonic() if now is None else now)

    def commit(self) -> dict[str, Any]:
        """Commit the buffer (it is emptied either way); the version's facts for its metrics line."""
        done = self.buffer.commit()
        committed = done.problem is None
        if committed:
            self.fed.state = self.buffer.state
            self.fed.trained_updates = [a + b for a, b in zip(self.fed.trained_updates, done.submodels)]
        else:
            log.warning(f"the buffer of {len(done.staleness)} updates was NOT committed, version {done.version} stays: "
                        f"{done.problem}")
        facts = {
            "round": done.version, "version": done.version, "mode": "buffered", "committed": committed,
            "not_committed": done.problem, "reported": sorted(set(self._contributors)),
            "staleness": done.staleness, "updates_per_submodel": done.submodels,
            UPDATES_TOTAL_KEY: list(self.fed.trained_updates), "clients": self._client_metrics,
            "aggregator": "nefedavg", "aggregate_held_bytes": done.held_bytes, "commit_cpu_s": round(done.cpu_s, 4),
        }
        self._contributors, self._client_metrics = [], {}
        return facts

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of buffered mode besides the federation's own (the buffer is not kept: a resumed
        run starts with an empty one, and the devices whose updates it held train again)."""
        return {"mode": "buffered", "version": self.version, "coverage": self.coverage.state_dict(),
                "next_task": self.next_task}

    @classmethod
    def resumed(cls, fed: Federation, cfg: StalenessConfig, version: int, rule: CoverageConfig,
                meta: dict[str, Any]) -> Versions:
        """From a checkpoint's metadata (`state_dict`'s keys; an empty buffer), or fresh at `version` without them."""
        if meta.get("mode") != "buffered":
            return cls(fed, cfg, version, rule)
        return cls(fed, cfg, version, rule, meta.get("coverage"), int(meta["next_task"]) + RESUME_TASK_GAP)
