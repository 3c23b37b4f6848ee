"""`aggregator serve --mode buffered`: buffered asynchronous NeFedAvg over MQTT, beside the rounds of
aggregator/server.py and around the pure state of aggregator/versions.py.

The newest version's weights of every submodel stay retained on the broker (wire kind "model", their round the
version). A device that can train and holds no task of the newest version gets a signed task (Task version 3,
mode "buffered": its number, the submodel of the coverage rule, the version it trains from); it trains for its own
time budget and uploads, and gets its next task when its update arrives. An update that is not taken ("stale",
"unassigned", "norm-bound", ...) is answered with a signed `UpdateRefusal` on the device's refusal topic. Whenever
the buffer holds K updates (or its oldest waited --commit-after), the version is committed: checkpoint, metrics
line (version, staleness of each update, per submodel), the new weights out, and a task for every device that
holds none of the newest version (a device still training finishes its task, which counts with its staleness).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from aggregator.enrolment import Enrolment
from aggregator.intake import DeviceKeys, take_update
from aggregator.resends import Resends
from aggregator.server import MqttTransport, Server, Start
from aggregator.versions import Issued, Versions
from nefl.nested.train import TrainConfig
from nefl.protocol.messages import Task, UpdateRefusal
from nefl.protocol.wire import encode

log = logging.getLogger(__name__)

TICK_S = 0.2  # the loop's look at tasks, refusals and the commit bound between inbox turns


class BufferedTransport(MqttTransport):
    """The versions' weights and tasks out, their updates in, and the refusals told."""

    versions: Versions

    def publish_version(self) -> None:
        """Every submodel's weights of the newest version, retained (replacing the version before)."""
        v, fed = self.versions.version, self.fed
        with self.link.client.batched():
            for k in range(fed.layout.num_submodels):
                old = self._published.get(k)
                model = self._published[k] = encode(fed.state.slices(fed.layout, k), kind="model", federation=fed.name,
                                                    round=v, submodel=k, client="server",
                                                    chunk_bytes=self.cfg.chunk_bytes)
                for i, m in enumerate(model.messages):
                    self.link.publish(self.topics.model_chunk(k, i), m, retain=True)
                for i in range(len(model.messages), len(old.messages) if old is not None else 0):
                    self.link.retain(self.topics.model_chunk(k, i))

    def give_tasks(self) -> None:
        """A task of the newest version for every device able to train that holds none."""
        for c in self.versions.wanting():
            task = self.versions.issue(c)
            self.link.publish(self.topics.task(c), self._buffered_task(task), retain=True)
            self.observer.task_given(c, task.submodel, task.version)
            log.info(f"task {task.number}: {c} trains submodel {task.submodel + 1} from version {task.version}",
                     extra={"client": c, "submodel": task.submodel + 1})

    def _buffered_task(self, task: Issued) -> bytes:
        model = self._published[task.submodel]
        return self.link.signer.sign(Task(
            federation=self.fed.name, run=self.link.run_id, round=task.number, mode="buffered", version=task.version,
            submodel=task.submodel, lr=self.train_cfg.lr_at(task.version, self.cfg.rounds), epochs=self.cfg.local_epochs,
            batch_size=self.cfg.batch_size, profile_hash=self.fed.layout.profile.hash, deadline_s=self.cfg.round_timeout,
            chunks=len(model.messages), model_digest=model.header.digest, model_bytes=model.header.size,
            **self.link.stamp()).to_json())

    def tell_refusals(self) -> None:
        """Each refused update's device hears why (signed, on its refusal topic)."""
        refusals, self.versions.refusals = self.versions.refusals, []
        for r in refusals:
            msg = UpdateRefusal(client=r.client, federation=self.fed.name, run=self.link.run_id, round=r.task.number,
                                submodel=r.task.submodel, version=r.task.version, current=r.current, reason=r.reason,
                                **self.link.stamp())
            self.link.tell(self.topics.refusal(r.client), self.link.signer.sign(msg.to_json()))

    def update(self, client: str, payload: bytes) -> None:
        t0 = time.perf_counter()
        done = take_update(self.versions, self.reasm, self.keys, client, payload, self.cfg.chunk_bytes * 4)
        if done is not None:
            self.tally.aggregate_s += time.perf_counter() - t0
            self.observer.update_accepted(client)
            log.info(f"task {done.header.round}: update from {client} (submodel {done.header.submodel + 1}, "
                     f"{done.nbytes} bytes), buffer {len(self.versions.buffer)}/{self.versions.cfg.buffer_size}",
                     extra={"client": client, "submodel": done.header.submodel + 1})

    def republish(self) -> None:
        """After a (re)connect: the newest weights and each device's newest open task."""
        with self.link.client.batched():
            for k, model in self._published.items():
                for i, m in enumerate(model.messages):
                    self.link.retain(self.topics.model_chunk(k, i), m)
            for c, tasks in self.versions.open.items():
                if tasks:
                    self.link.retain(self.topics.task(c), self._buffered_task(next(reversed(tasks.values()))))

    def version_facts(self) -> dict[str, Any]:
        """The transport's facts since the last commit, for the version's metrics line; the tally starts again."""
        rejected, self.round_rejects = dict(self.round_rejects), Counter()
        t = self.tally
        facts = {"bytes_out": self.link.bytes_out - t.bytes_out, "bytes_in": self.fed.bytes_in - t.bytes_in,
                 "rejected": rejected, "inbox_dropped": self.link.conn.inbox_dropped,
                 "duplicates_dropped": self.reasm.duplicates, "aggregate_s": round(t.aggregate_s, 4)}
        self.tally = type(t)(time.monotonic(), self.link.bytes_out, self.fed.bytes_in)
        return facts

    def recorded(self, facts: dict[str, Any], checkpoint_s: float) -> None:
        self.observer.checkpoint_saved(checkpoint_s)
        self.observer.metrics_line(facts)
        log.info(f"version {facts['version']} committed after {facts['wall_s']}s: {len(facts['staleness'])} updates "
                 f"from {', '.join(facts['reported'])}, staleness {facts['staleness']}, per submodel "
                 f"{facts['updates_per_submodel']}, rejected {facts['rejected']}"
                 + (f", accuracy {facts['accuracy']}" if "accuracy" in facts else ""), extra={"round": facts["version"]})


class BufferedServer(Server):
    """`Server` with versions instead of rounds: the same link, control plane, enrolment, intake, evaluation,
    checkpoints and dashboard."""

    def _transport(self, enrol: Enrolment, keys: DeviceKeys, resends: Resends, start: Start,
                   train_cfg: TrainConfig) -> MqttTransport:
        self.versions = Versions.resumed(self.fed, self.cfg.staleness, start.next_round - 1, self.cfg.coverage,
                                         start.meta)
        self.control.take_decline = self.versions.decline
        transport = BufferedTransport(self.cfg, self.fed, self.link, self.topics, self.control, enrol, keys, resends,
                                      self.observer, start.profile, train_cfg, self.pump, start.next_round)
        transport.versions = self.versions
        return transport

    def _meta(self) -> dict[str, Any]:
        return self.versions.state_dict()

    def _can_close(self) -> bool:
        return self.versions.due()  # a commit as soon as the buffer holds K: never more than K in one version

    def _republish(self) -> None:
        self.control.publish_status("training")
        self.rounds.republish()

    def run(self) -> None:
        rounds: BufferedTransport = self.rounds  # type: ignore[assignment]
        self.link.conn.start()
        if self.versions.version == 0 and (start := self.driver.evaluate_start()) is not None:
            self.observer.metrics_line(start)
        self.link.retain(self.topics.control)  # forget an earlier run's "end"
        if self.versions.version < self.cfg.rounds:
            self.wait_for_clients()
        rounds.publish_version()
        self.control.publish_status("training")
        rounds.version_facts()  # the first version's tally starts now
        started = time.monotonic()
        while self.versions.version < self.cfg.rounds:
            self.pump(time.monotonic() + TICK_S)
            rounds.tell_refusals()
            if self.versions.due():
                started = self._commit(rounds, started)
            if self.versions.version < self.cfg.rounds:
                rounds.give_tasks()
        self.finish_evaluations()
        self.finish()

    def _commit(self, rounds: BufferedTransport, started: float) -> float:
        """Commit the buffer; a committed version is checkpointed, recorded and published. Returns when the next
        version's time starts."""
        facts = self.versions.commit()
        if not facts["committed"]:
            rounds.reject("not_committed", "buffer", str(facts["not_committed"]))
            return started
        rounds.next_round = self.versions.version + 1
        facts.update(rounds.version_facts())
        facts["enrolment"] = self.control.round_closed(facts)
        rounds.publish_version()
        self.driver.record(self.versions.version, facts, started)
        return time.monotonic()


def buffered_refusal_line(cfg_workers: int, remote_workers: bool, assignment: str) -> str | None:
    """What of the server's own settings buffered mode refuses, in one line (the aggregation's: version_buffer's
    `buffered_refusal`); None: nothing."""
    if cfg_workers or remote_workers:
        return ("--workers/--remote-workers split a round's updates among processes; buffered mode folds each update "
                "into one buffer in this process: drop them")
    if assignment != "coverage":
        return (f"--assignment {assignment} picks among a round's participants; buffered mode gives each task by its "
                "own coverage rule (docs/operations.md): drop --assignment")
    return None
