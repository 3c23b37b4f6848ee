"""`aggregator simulate --mode buffered|sync`: a NeFL federation on an emulated heterogeneous fleet
(aggregator/fleet.py), in simulated wall-clock time, buffered asynchronous against synchronous rounds.

Both modes train the same devices (speeds, budgets, shards, vanishings) with the same `local_train` as the round
simulator (aggregator/simulate.py), and merge through one VersionBuffer (nefl/aggregation/version_buffer.py):

  buffered  `in_flight` devices train at once (default: every online device); a device starts a task on the newest
            version, its update arrives when its task ends, and the server commits a version whenever the buffer holds
            K updates (or its time bound passes); the next task goes to an idle online device drawn at random (with
            every device in flight: the device that just sent its update, at once).
  sync      a round draws `concurrency` idle online devices, assigns submodels with the server's coverage policy and
            waits for the slowest or the deadline (a vanished device is waited for until the deadline); its updates,
            all of staleness 0, are one buffer: synchronous NeFedAvg.

The newest version is scored every `eval_every_s` simulated seconds, on one grid for both modes.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from aggregator.assignment import Candidate, assign_coverage, coverage_order
from aggregator.fleet import Coverage, EventQueue, Fleet, FleetConfig, Task
from aggregator.simulate import ServerSide, SimConfig, check_device
from nefl.aggregation.aggregate import tensor_bytes
from nefl.aggregation.pipeline import Pipeline
from nefl.aggregation.staleness import StalenessConfig
from nefl.aggregation.version_buffer import VersionBuffer, VersionCommit
from nefl.nested.checkpoint import append_metrics
from nefl.nested.cost import submodel_cost
from nefl.nested.population import client_batches, partitions, train_seed
from nefl.nested.state import GlobalState
from nefl.nested.train import local_train


@dataclass
class FleetResult:
    """A run on the emulated fleet: its accuracy over simulated time, its commits and refusals."""

    mode: str
    curve: list[dict[str, Any]] = field(default_factory=list)  # {"t", "version", "accuracy", "worst", "avg"}
    commits: list[dict[str, Any]] = field(default_factory=list)  # one per committed version
    refused: Counter[str] = field(default_factory=Counter)  # reason -> updates refused
    tasks: int = 0  # tasks started
    device_tasks: Counter[int] = field(default_factory=Counter)  # device -> tasks it started
    lost: int = 0  # tasks whose device vanished
    seconds: float = 0.0  # real seconds the run took


class FleetSimulator:
    """One run of `mode` on the emulated fleet of `cfg.clients` devices."""

    def __init__(self, cfg: SimConfig, fleet: FleetConfig, staleness: StalenessConfig) -> None:
        self.cfg, self.fleet_cfg = cfg, fleet
        self.device = str(check_device(cfg.device))
        server = ServerSide.build(cfg, self.device)
        self.layout, self.train_set, self.train_cfg = server.layout, server.train, server.train_cfg
        self.evaluator = server.evaluator(server.test, self.device)
        self.parts = partitions(self.train_set, cfg.clients, cfg.non_iid, cfg.seed, cfg.max_samples_per_client)
        self.modules = [self.layout.module(k).to(self.device) for k in range(self.layout.num_submodels)]
        profile = self.layout.profile
        macs = [submodel_cost(profile, s).macs for s in profile.submodels]
        steps = [cfg.local_epochs * max(1, math.ceil(len(p) / cfg.batch_size)) for p in self.parts]
        self.fleet = Fleet.build(fleet, [m / macs[-1] for m in macs], steps, cfg.seed)
        # sync: a round's updates are one buffer of staleness 0 (K: all that arrive; the round closes it)
        buffer_cfg = staleness if fleet.mode == "buffered" else replace(staleness, buffer_size=fleet.concurrency)
        pipeline = Pipeline(self.layout, cfg.robustness, cfg.weighting, seed=cfg.seed, statistics=server.statistics)
        self.buffer = VersionBuffer(pipeline, buffer_cfg, GlobalState.init(self.layout, seed=cfg.seed))
        self.result = FleetResult(fleet.mode)
        self.out = Path(cfg.out) if cfg.out else None
        self._next_eval = 0.0
        self._scored: tuple[int, list[float]] | None = None  # (version, its accuracy): a version is scored once
        self._on_line: Callable[[dict[str, Any]], None] | None = None

    # -- what both modes share ------------------------------------------------------------------------
    def _train(self, task: Task) -> tuple[dict[str, torch.Tensor], int]:
        """The task's delta against its base version (the current one: a task is trained when it starts)."""
        c = self.cfg
        loader = client_batches(self.train_set, self.parts[task.device], c.batch_size,
                                train_seed(c.seed, self.result.tasks, task.device))
        res = local_train(self.modules[task.submodel], self.buffer.state.extract(self.layout, task.submodel), loader,
                          self.train_cfg, upload=self.layout.upload_shapes(task.submodel), device=self.device)
        return res.delta, res.num_samples

    def _begin(self, d: int, k: int, now: float) -> Task:
        """Device d's task of submodel k on the newest version, counted."""
        task = self.fleet.start(d, k, self.buffer.version, now)
        self.result.tasks += 1
        self.result.device_tasks[d] += 1
        self.result.lost += task.vanishes
        return task

    def _offer(self, task: Task, trained: tuple, now: float) -> None:
        delta, samples = trained
        offer = self.buffer.offer(task.submodel, delta, task.base, samples, client=str(task.device), now=now)
        if offer.reason is not None:
            self.result.refused[offer.reason] += 1

    def _commit(self, now: float) -> None:
        done: VersionCommit = self.buffer.commit()
        if done.problem is not None:
            self.result.refused[f"not committed: {done.problem}"] += len(done.staleness)
            return
        line = {"kind": "commit", "t": round(now, 3), "version": done.version, "staleness": done.staleness,
                "submodels": done.submodels, "buffer_bytes": done.held_bytes, "cpu_s": round(done.cpu_s, 6),
                "state_bytes": tensor_bytes(self.buffer.state.flat().values())}
        self.result.commits.append(line)
        self._record(line)

    def _evaluate_until(self, t: float) -> None:
        """Score the newest version at every grid time up to `t` (and the run's budget) not scored yet."""
        end = min(t, self.fleet_cfg.time_budget_s)
        while self._next_eval <= end:
            version = self.buffer.version
            if self._scored is None or self._scored[0] != version:
                self._scored = (version, self.evaluator.accuracy(self.buffer.state, self.cfg.eval_samples))
            acc = self._scored[1]
            line = {"kind": "eval", "t": round(self._next_eval, 3), "version": version, "accuracy": acc,
                    "worst": min(acc), "avg": round(sum(acc) / len(acc), 4)}
            self.result.curve.append(line)
            self._record(line)
            self._next_eval += self.fleet_cfg.eval_every_s

    def _record(self, line: dict[str, Any]) -> None:
        if self.out is not None:
            append_metrics(self.out, line)
        if self._on_line is not None:
            self._on_line(line)

    # -- the two loops --------------------------------------------------------------------------------
    def run(self, on_line: Callable[[dict[str, Any]], None] | None = None) -> FleetResult:
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "metrics.jsonl").unlink(missing_ok=True)
        self._on_line = on_line
        t0 = time.perf_counter()
        if self.fleet_cfg.mode == "buffered":
            self._buffered()
        else:
            self._sync()
        self._evaluate_until(self.fleet_cfg.time_budget_s)
        self.result.seconds = time.perf_counter() - t0
        return self.result

    def _buffered(self) -> None:
        fc, fleet, queue = self.fleet_cfg, self.fleet, EventQueue()
        busy: set[int] = set()
        in_flight = fc.in_flight or len(fleet.multipliers)
        wakes: set[float] = set()  # times a wake-up is queued for
        coverage = Coverage(self.layout.num_submodels, fc.coverage)

        def launch(now: float) -> None:
            idle = [d for d in fleet.online(now) if d not in busy]
            for d in fleet.pick(idle, in_flight - len(busy)):
                task = self._begin(d, coverage.pick(fleet.bound(d), self.buffer.version), now)
                trained = None if task.vanishes else self._train(task)
                busy.add(d)
                queue.push(task.end, (task, trained))
            if len(busy) < in_flight:  # too few devices online: look again when the next one is back
                back = fleet.next_return(now)
                if back is not None and back not in wakes:
                    wakes.add(back)
                    queue.push(back, None)

        launch(0.0)
        while queue:
            now, event = queue.pop()
            if now > fc.time_budget_s:
                break
            self._evaluate_until(now)
            if isinstance(event, tuple):
                task, trained = event
                busy.discard(task.device)
                if trained is not None:
                    self._offer(task, trained, now)
                    if len(self.buffer) == 1 and self.buffer.cfg.commit_after_s is not None:
                        queue.push(now + self.buffer.cfg.commit_after_s, "flush")
            if self.buffer.due(now):
                self._commit(now)
            launch(now)

    def _sync(self) -> None:
        fc, fleet = self.fleet_cfg, self.fleet
        rng = random.Random(self.cfg.seed)
        trained_counts = [0] * self.layout.num_submodels
        now = 0.0
        while now < fc.time_budget_s:
            chosen = fleet.pick(fleet.online(now), fc.concurrency)
            if not chosen:  # nobody online: wait for the first to come back
                now = fleet.next_return(now) or fc.time_budget_s
                continue
            bounds = [Candidate(str(d), fleet.bound(d), fleet.bound(d)) for d in chosen]
            assigned = assign_coverage(bounds, coverage_order(trained_counts), rng)
            deadline = now + fc.deadline * fleet.task_budget_s
            started = [self._begin(d, assigned[str(d)], now) for d in chosen]
            arrive = [t for t in started if not t.vanishes and t.end <= deadline]
            close = max(t.end for t in arrive) if len(arrive) == len(started) else deadline
            if close > fc.time_budget_s:  # the budget ends before the round does
                break
            self._evaluate_until(close - 1e-9)  # the old version serves until the round closes
            updates = [(t, self._train(t)) for t in arrive]
            for t, trained in sorted(updates, key=lambda u: u[0].end):
                self._offer(t, trained, t.end)
                trained_counts[t.submodel] += 1
            if len(self.buffer):
                self._commit(close)
            now = close
