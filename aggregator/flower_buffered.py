"""Buffered asynchronous NeFedAvg on Flower: `NeFLStrategy` with versions instead of rounds (run config
`mode = "buffered"`).

Flower's round loop (`Strategy.start`: send to all, wait for all) is not used; the strategy drives the Grid's
message API itself. Every node able to train holds one train task: its submodel from `Versions.issue` (the
buffered server's assignment within the node's announced bound, aggregator/versions.py), the arrays of the
newest version, the task number and version in its `FlowerTask`. Replies are pulled as they come; each goes
through the same `Versions.accept` as `aggregator serve --mode buffered` (the VersionBuffer's staleness-weighted
NeFedAvg, the update bound, the stale bound with its reason code), and the node that replied gets its next task
from the newest version at once. When the buffer holds K updates (or its oldest waited `commit-after-s`) the
version is committed and the RoundDriver evaluates, checkpoints and writes its metrics line. The run ends after
`num_rounds` committed versions.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from aggregator.buffered_serve import buffered_refusal_line
from aggregator.evaluation import Evaluator
from aggregator.federation import Federation, Rejected
from aggregator.flower import FlowerSettings, NeFLStrategy, refuse_error, round_metrics
from aggregator.rounds import RunPlan
from aggregator.versions import Issued, Versions
from nefl.aggregation.version_buffer import buffered_refusal
from nefl.nested.train import TrainConfig
from nefl.protocol.flower import read_state, records, state_arrays, tensor_arrays
from nefl.protocol.messages import FlowerJoin, MessageError

log = logging.getLogger(__name__)

POLL_S = 0.2  # between pulls that brought no reply
ADMIT_EVERY_S = 5.0  # how often nodes that connected (or left) since are looked for


@dataclass(frozen=True)
class Sent:
    """A train task out: the node it went to and when."""

    node: int
    task: Issued
    at: float


def buffered_flower_refusal(fed: Federation, settings: FlowerSettings) -> str | None:
    """Why buffered mode cannot run with these settings, in one line; None: it can."""
    if settings.fraction_evaluate > 0:
        return ("fraction-evaluate scores a round's model on the nodes; buffered mode has no rounds and the server "
                "scores every eval-every versions: set fraction-evaluate = 0")
    return buffered_refusal(fed.robustness) or buffered_refusal_line(0, False, fed.assignment)


class BufferedStrategy(NeFLStrategy):
    """NeFLStrategy's nodes, messages and checks; Versions' tasks, buffer and commits (module docstring)."""

    def __init__(self, fed: Federation, join: FlowerJoin, train: TrainConfig, plan: RunPlan,
                 evaluator: Evaluator | None = None, out: str | Path | None = None,
                 settings: FlowerSettings = FlowerSettings(mode="buffered"), seed: int = 0) -> None:
        problem = buffered_flower_refusal(fed, settings)
        if problem is not None:
            raise ValueError(f"mode buffered refuses this: {problem}")
        super().__init__(fed, join, train, plan, evaluator, out, settings, seed)
        self.versions = Versions(fed, settings.staleness)
        self.driver.meta = lambda: self.versions.state_dict()
        self.sent: dict[str, Sent] = {}  # Flower message id -> the task it carries
        self._weights: dict[int, ArrayRecord] = {}  # submodel -> its arrays of the newest version
        self._rejected_before: Counter[str] = Counter()  # the federation's refusal counts at the last commit

    def _assigned(self, cid: str, task: int) -> int | None:
        issued = self.versions.open.get(cid, {}).get(task)
        return None if issued is None else issued.submodel

    # -- the loop -----------------------------------------------------------------------------------
    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Keep every node training until `num_rounds` versions are committed; Flower's Result (one train
        MetricRecord per committed version)."""
        if evaluate_fn is not None:
            raise ValueError("buffered mode scores each version with the kit's evaluator (eval-every): no evaluate_fn")
        if initial_arrays is not self._arrays:
            self.fed.state = read_state(initial_arrays, self.fed.layout)
            self.versions = Versions(self.fed, self.settings.staleness)
        self.summary()
        result = Result()
        self.admit_nodes(grid)
        self._started = True
        self.driver.evaluate_start()
        started = admitted = idle_since = time.monotonic()
        while self.versions.version < num_rounds:
            now = time.monotonic()
            if now - admitted >= ADMIT_EVERY_S:
                self._readmit(grid)
                admitted = now
            self._expire(now)
            self._give_tasks(grid, num_rounds)
            if not self.sent:  # nobody can train: wait for a node, up to the task timeout
                if now - idle_since > self.settings.round_timeout:
                    log.warning(f"no node could train for {self.settings.round_timeout:.0f} s: stopping at version "
                                f"{self.versions.version}")
                    break
                time.sleep(POLL_S)
                continue
            idle_since = now
            replies = list(grid.pull_messages(list(self.sent)))
            for reply in replies:
                self._reply(reply)
                if self.versions.due():
                    started = self._commit(result, started)
                    if self.versions.version >= num_rounds:
                        break
            if not replies:
                time.sleep(POLL_S)
        result.arrays = state_arrays(self.fed.state)
        return result

    def _readmit(self, grid: Grid) -> None:
        """New nodes join; the tasks of nodes that left are given up."""
        before = dict(self.nodes)
        self.admit_nodes(grid)
        for node, cid in before.items():
            if node not in self.nodes:
                self.versions.forget(cid)
                self.sent = {m: s for m, s in self.sent.items() if s.node != node}

    def _expire(self, now: float) -> None:
        """A task unanswered for round-timeout seconds is given up (counted "timeout"); its node gets another."""
        for mid, s in list(self.sent.items()):
            if now - s.at > self.settings.round_timeout:
                del self.sent[mid]
                self._refuse(s.task, Rejected("timeout", f"no reply in {self.settings.round_timeout:.0f} s"))

    def _give_tasks(self, grid: Grid, num_rounds: int) -> None:
        """A task of the newest version for every node able to train that holds none."""
        busy = {s.node for s in self.sent.values()}
        able = set(self.fed.available())
        out: list[tuple[Message, Sent]] = []
        now = time.monotonic()
        for node, cid in sorted(self.nodes.items()):
            if node in busy or cid not in able:
                continue
            task = self.versions.issue(cid)
            out.append((self._message(node, task, num_rounds), Sent(node, task, now)))
        if out:
            for mid, (_, sent) in zip(grid.push_messages([m for m, _ in out]), out):
                if mid:  # a message Flower could not push is not waited for
                    self.sent[mid] = sent

    def _message(self, node: int, task: Issued, num_rounds: int) -> Message:
        """A train message: the task (its number, submodel, version) and its submodel's arrays of that version."""
        k = task.submodel
        if k not in self._weights:
            self._weights[k] = tensor_arrays(self.fed.state.extract(self.fed.layout, k))
        lr = self.train.lr_at(task.version, num_rounds)
        content = records(self._flower_task("train", task.number, k, lr, task.version), self._weights[k])
        return Message(content=content, dst_node_id=node, message_type=MessageType.TRAIN, group_id=str(task.version))

    # -- replies and commits ------------------------------------------------------------------------
    def _reply(self, reply: Message) -> None:
        """One train reply into the buffer, or refused with its reason (counted, never raised); its task is
        settled either way and its node gets the next task."""
        sent = self.sent.pop(reply.metadata.reply_to_message_id, None)
        if sent is None:
            self._count("unknown_reply", f"a reply to no task out, from node {reply.metadata.src_node_id}")
            return
        try:
            refuse_error(reply)
            update, node, hello = self._update(reply)
            if node != sent.node:
                raise Rejected("client_mismatch", f"task {sent.task.number} went to node {sent.node}, node {node} answers")
            self.versions.accept(update)
        except (Rejected, MessageError) as e:
            self._refuse(sent.task, e)
            return
        self._reannounce(update.client, node, hello)

    def _refuse(self, task: Issued, e: Rejected | MessageError) -> None:
        self.versions.refused(task.client, task.number, e.reason)
        self.versions.refusals.clear()  # a Flower node is not told: it gets its next task
        self._count(e.reason, f"task {task.number} of {task.client}: {e}")

    def _count(self, reason: str, why: str) -> None:
        self.fed.reject(reason)
        log.info(f"refused {reason}: {why}")

    def _commit(self, result: Result, started: float) -> float:
        """Commit the buffer: the version is evaluated, checkpointed and recorded (its facts in `history` and
        in Flower's Result); returns when the next version's time starts."""
        facts = self.versions.commit()
        if not facts["committed"]:
            self._count("not_committed", str(facts["not_committed"]))
            return started
        version = self.versions.version
        self._weights.clear()
        losses = [m["loss"] for m in facts["clients"].values() if "loss" in m]
        rejected = Counter(self.fed.rejected)
        facts.update({"rejected": dict(rejected - self._rejected_before),
                      "train_loss": sum(losses) / len(losses) if losses else None})
        self._rejected_before = rejected
        self.driver.record(version, facts, started)
        self.history.append(facts)
        result.train_metrics_clientapp[version] = round_metrics(facts)
        log.info(f"version {version} committed: staleness {facts['staleness']} from {facts['reported']}, "
                 f"per submodel {facts['updates_per_submodel']}, rejected {facts['rejected']}"
                 + (f", accuracy {facts['accuracy']}" if "accuracy" in facts else ""))
        return time.monotonic()
