"""The one round loop of `aggregator serve` and `aggregator simulate`: open the round (participants,
assignment), let the transport collect the updates, close it (the aggregator's rule, the commit
check, DP noise), checkpoint, write the metrics line and evaluate.

A served run evaluates beside the rounds (RunPlan.background_eval): the committed state is checkpointed
and its metrics line written at once, then a copy of it is scored on a thread of its own while the next
round trains; the scores arrive as a follow-up line of that round (`"evaluated": true`, merged into the
round's line by `read_metrics`). The simulator evaluates in line, before the checkpoint, so its runs stay
reproducible and its lines whole.

The two commands differ only in how a round's tasks reach the clients and their updates come back:
MQTT for the server (aggregator/server.py), training in-process for the simulator
(aggregator/simulate.py). Everything else runs here, so every server option (bounds, clipping, DP,
robust rules) also runs in the simulator, and a simulated round's metrics line has the server's fields.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from aggregator.evaluation import Evaluator
from aggregator.federation import Federation, state_digest
from nefl.aggregation.robust import DPAccountant
from nefl.nested.checkpoint import append_metrics, save_checkpoint
from nefl.nested.state import GlobalState

log = logging.getLogger(__name__)


class RoundHooks:
    """What the driver tells the world a round's tasks travel through; the defaults do nothing."""

    def round_facts(self, facts: dict[str, Any]) -> dict[str, Any]:
        """The transport's own facts for the round's metrics line (the round is closed)."""
        return {}

    def evaluating(self) -> None:
        """The driver is about to evaluate the new state."""

    def evaluated(self, line: dict[str, Any]) -> None:
        """A background evaluation's line (a round's scores, after its own line) is written."""

    def scores(self, state: GlobalState, samples: int | None) -> dict[str, Any]:
        """Scores of the new state beside the evaluator's accuracy (the simulator's backdoor success)."""
        return {}

    def recorded(self, facts: dict[str, Any], checkpoint_s: float) -> None:
        """The round's checkpoint is committed and its metrics line written."""


class RoundTransport(RoundHooks, ABC):
    """How a round's tasks reach clients and their updates reach the Federation, inside `run_round`."""

    @abstractmethod
    def collect(self, fed: Federation, index: int) -> None:
        """Deliver the open round's tasks and feed every update to `fed.accept` until `fed.complete()`."""


@dataclass(frozen=True)
class OpenRound:
    """A round the driver opened and has not closed yet."""

    index: int
    started: float  # time.monotonic() when it opened
    start_digest: str  # the state the round started from


@dataclass(frozen=True)
class RunPlan:
    """What the driver does around the rounds."""

    rounds: int
    eval_every: int = 1  # evaluate after every N-th round (0: only after the last); always after the last
    eval_samples: int | None = None  # test images per evaluation (None: the evaluator's)
    final_eval_samples: int | None = None  # test images after the last round (None: eval_samples)
    dp_delta: float = 1e-5  # the delta of the reported (epsilon, delta)-DP
    background_eval: bool = False  # evaluate on a thread beside the next round (static-BN methods never: see below)
    progress_every_s: float = 10.0  # a background evaluation's progress line, at most this often (and per submodel)


def score_line(evaluator: Evaluator, transport: RoundHooks, state: GlobalState, samples: int | None,
               **evaluate: Any) -> dict[str, Any]:
    """A state's scores as a round's line has them: top-1 per submodel, worst, average, the images scored, and
    what the transport adds (the simulator's backdoor success); `evaluate`: Evaluator.accuracy's threads, progress."""
    acc = evaluator.accuracy(state, samples, **evaluate)
    return {"accuracy": acc, "worst": min(acc), "avg": round(sum(acc) / len(acc), 4),
            "eval_samples": evaluator.samples(samples), **transport.scores(state, samples)}


class Cancelled(Exception):
    """An evaluation given up (the run stops)."""


class Evaluation:
    """One evaluation on a thread of its own, of a state nobody else writes (a copy of the committed one)."""

    def __init__(self, index: int, run: Callable[[], dict[str, Any]], cancelled: threading.Event) -> None:
        """`cancelled`: what `run` looks at between batches, raising Cancelled once it is set."""
        self.index, self.started, self.cancelled = index, time.monotonic(), cancelled
        self.result: dict[str, Any] | None = None
        self.error: BaseException | None = None
        # a daemon: a crash on the main thread does not wait for the scores (the checkpoint is already on disk)
        self.thread = threading.Thread(target=self._run, args=(run,), name=f"evaluate-round-{index}", daemon=True)
        self.thread.start()

    def _run(self, run: Callable[[], dict[str, Any]]) -> None:
        try:
            self.result = run()
        except Cancelled:
            pass
        except BaseException as e:  # reported on the main thread, which attaches the result
            self.error = e

    def done(self) -> bool:
        return not self.thread.is_alive()


class RoundDriver:
    """Runs rounds of one Federation over one RoundTransport; commits every round to `checkpoint_dir` and
    appends its metrics line to `metrics_dir`/metrics.jsonl (no files when `checkpoint_dir` is None:
    a simulation that only reports). A round loop that is not the driver's (Flower's strategy loop,
    aggregator/flower.py) calls `open_round` and `close_round` around its own delivery of the tasks."""

    def __init__(self, fed: Federation, transport: RoundHooks, plan: RunPlan, evaluator: Evaluator | None,
                 checkpoint_dir: str | Path | None, metrics_dir: str | Path | None = None,
                 meta: Callable[[], dict[str, Any]] = dict, checkpointed: int = 0) -> None:
        """`checkpointed`: the round the checkpoint it starts from holds (0: none)."""
        self.fed, self.transport, self.plan, self.evaluator = fed, transport, plan, evaluator
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.metrics_dir = Path(metrics_dir) if metrics_dir else self.checkpoint_dir
        self.meta = meta  # extra checkpoint metadata (the simulator's dataset, say)
        self.accuracy: list[float] | None = None  # the newest scores; a round's checkpoint holds those known at its commit
        self.checkpointed = checkpointed  # the newest round whose checkpoint is on disk
        # static-BN methods write recomputed statistics into the state they score, which must be the live one
        self.background = plan.background_eval and evaluator is not None and not fed.layout.method.static_bn
        self.evaluation: Evaluation | None = None  # the one running
        self._waiting: tuple[int, GlobalState, int | None] | None = None  # the newest one due meanwhile
        self._digested: tuple[GlobalState, tuple[int, ...], str] | None = None  # (state, its tensors, its digest)

    def evaluate_start(self) -> dict[str, Any] | None:
        """Round 0: the initial state's accuracy (learning curves start at the initialisation)."""
        if self.evaluator is None or not self.plan.eval_every:
            return None
        facts = {"round": 0, **({} if self.background else self._scores(self.plan.eval_samples)),
                 "start_sha256": self.digest()}
        if self.metrics_dir is not None:
            self.metrics_dir.mkdir(parents=True, exist_ok=True)
            append_metrics(self.metrics_dir, facts)
        if self.background:  # the line first, so the lines stay in round order; its scores follow
            self._evaluate_later(0, self.plan.eval_samples)
        else:
            log.info(f"round 0 accuracy {self.accuracy}")
        return facts

    def run_round(self, index: int) -> dict[str, Any]:
        opened = self.open_round(index)
        self.transport.collect(self.fed, index)
        return self.close_round(opened)

    def open_round(self, index: int) -> OpenRound:
        """Participants and their submodels (`fed.round.assignments`) for round `index`."""
        t0, start_digest = time.monotonic(), self.digest()
        self.fed.open_round(index)
        return OpenRound(index, t0, start_digest)

    def close_round(self, opened: OpenRound) -> dict[str, Any]:
        """Aggregate what arrived, evaluate (or start evaluating), checkpoint and record the round; its facts."""
        fed, plan, index = self.fed, self.plan, opened.index
        t_close = time.perf_counter()
        facts = fed.close_round()
        facts["close_s"] = round(time.perf_counter() - t_close, 4)
        facts["start_sha256"] = opened.start_digest
        facts.update(self.transport.round_facts(facts))
        if not facts["committed"] and facts["quorum"]:
            log.info(f"round {index} NOT committed, the previous weights stay: {facts['not_committed']}")
        rb = fed.robustness
        if rb.dp_noise_multiplier > 0:
            q = min(1.0, fed.clients_per_round / max(1, len(fed.clients)))
            facts["dp_epsilon"] = DPAccountant(rb.dp_noise_multiplier, q, plan.dp_delta).epsilon(index)
        return self.record(index, facts, opened.started)

    def record(self, index: int, facts: dict[str, Any], started: float) -> dict[str, Any]:
        """Evaluate (or start evaluating), checkpoint and record the state committed as round (or buffered mode's
        version) `index`, with its `facts`; `started`: when it began (monotonic). Returns the facts."""
        fed, plan = self.fed, self.plan
        last = index == plan.rounds
        due = self.evaluator is not None and (last or (plan.eval_every and index % plan.eval_every == 0))
        samples = (plan.final_eval_samples or plan.eval_samples) if last else plan.eval_samples
        if due and not self.background:
            self.transport.evaluating()
            facts.update(self._scores(samples))
        facts["wall_s"] = round(time.monotonic() - started, 3)  # up to the commit: the saved line and the appended one agree
        t_ckpt = time.perf_counter()
        if self.checkpoint_dir is not None:
            save_checkpoint(self.checkpoint_dir, fed.state, fed.layout,
                            {"round": index, "rounds": plan.rounds, "federation": fed.name, "accuracy": self.accuracy,
                             "state_sha256": self.digest(), **fed.state_dict(), **self.meta()},
                            metrics=facts)
            # on disk now: a stop that lands while the line is appended (after it is readable, before its fsync
            # returns) names this round, whose line --resume restores anyway
            self.checkpointed = index
            append_metrics(self.metrics_dir, facts)
        self.transport.recorded(facts, time.perf_counter() - t_ckpt)
        if due and self.background:
            self._evaluate_later(index, samples)
        return facts

    # -- background evaluation (main thread: the evaluation thread only computes) ----------------------------
    def poll(self) -> dict[str, Any] | None:
        """Attach a finished evaluation to its round (its line, the hooks, the log) and start the one due
        meanwhile; the line attached, if any."""
        e = self.evaluation
        if e is None or not e.done():
            return None
        self.evaluation = None
        if self._waiting is not None:
            self._start(*self._waiting)
            self._waiting = None
        if e.error is not None:
            raise RuntimeError(f"evaluating round {e.index} failed") from e.error
        line = e.result
        self.accuracy = line["accuracy"]
        if self.metrics_dir is not None:
            self.metrics_dir.mkdir(parents=True, exist_ok=True)
            append_metrics(self.metrics_dir, line)
        log.info(f"round {e.index} accuracy {line['accuracy']} ({line['eval_samples']:,} images, {line['eval_s']:.1f} s)",
                 extra={"round": e.index})
        self.transport.evaluated(line)
        return line

    def evaluating(self) -> bool:
        """An evaluation runs or waits."""
        return self.evaluation is not None or self._waiting is not None

    def stop_evaluating(self, timeout_s: float = 30.0) -> None:
        """Give up the running evaluation and the waiting one (the run stops): the thread ends within a batch, so
        the process does not exit under torch's feet."""
        self._waiting = None
        if (e := self.evaluation) is not None:
            e.cancelled.set()
            e.thread.join(timeout_s)
            self.evaluation = None

    def _evaluate_later(self, index: int, samples: int | None) -> None:
        """Score a copy of the current state on a thread; one at a time, and of those due meanwhile only the newest
        waits (the last round's is always the newest)."""
        job = (index, self.fed.state.clone(), samples)  # the next round replaces or writes the live tensors
        if self.evaluation is None:
            self._start(*job)
            return
        if self._waiting is not None:
            log.info(f"round {self._waiting[0]} is not evaluated: round {self.evaluation.index}'s evaluation still runs "
                     f"and round {index}'s is newer (a smaller --eval-samples keeps up)")
        self._waiting = job

    def _start(self, index: int, state: GlobalState, samples: int | None) -> None:
        evaluator, every = self.evaluator, self.plan.progress_every_s
        n, submodels = evaluator.samples(samples), self.fed.layout.num_submodels
        said = [0.0, -1]  # when the last progress line was logged, and for which submodel
        cancelled = threading.Event()

        def progress(k: int, done: int, total: int) -> None:
            if cancelled.is_set():
                raise Cancelled
            now = time.monotonic()
            if k != said[1] or now - said[0] >= every:
                said[:] = [now, k]
                log.info(f"evaluating round {index}: submodel {k + 1}/{submodels}, {done:,}/{total:,} images",
                         extra={"round": index})

        def run() -> dict[str, Any]:
            t0 = time.monotonic()
            line = score_line(evaluator, self.transport, state, samples, threads=max(1, (os.cpu_count() or 2) // 2),
                              progress=progress)
            return {"round": index, "evaluated": True, **line, "eval_s": round(time.monotonic() - t0, 3)}

        log.info(f"evaluating round {index} on {n:,} test images beside the rounds", extra={"round": index})
        self.evaluation = Evaluation(index, run, cancelled)

    def digest(self) -> str:
        """state_digest of the current state, once per state: a round's checkpoint and the next round's start
        name the same weights (a resnet18 state is 45 MB of sha256). A tensor replaced changes its id (the cache
        holds the state, so no id is reused meanwhile), one written in place its version counter."""
        state = self.fed.state
        versions = tuple(x for t in state.flat().values() for x in (id(t), t._version))
        if self._digested is None or self._digested[0] is not state or self._digested[1] != versions:
            self._digested = (state, versions, state_digest(state))
        return self._digested[2]

    def _scores(self, samples: int | None) -> dict[str, Any]:
        line = score_line(self.evaluator, self.transport, self.fed.state, samples)
        self.accuracy = line["accuracy"]
        return line
