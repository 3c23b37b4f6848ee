"""The round driver's background evaluation (a served run): the round is checkpointed and its line written at
commit, a copy of the committed state is scored beside the next round, and the scores attach to their round later."""

import threading
import time

from aggregator.evaluation import Evaluator
from aggregator.federation import Federation, Update
from aggregator.rounds import RoundDriver, RoundHooks, RunPlan
from nefl.nested.checkpoint import load_checkpoint, read_metrics
from nefl.nested.data import BatchLoader
from nefl.nested.state import GlobalState, Layout
from nefl.nested.train import TrainConfig, local_train
from nefl.protocol.messages import Announce
from tests.harness.helpers import FULL, tiny_profile
from tests.harness.tiny_data import blobs

PROFILE = tiny_profile([(0.5, 0.5, FULL), (1.0, 1.0, FULL)], in_ch=1)
DATA = blobs(64)


class GatedEvaluator(Evaluator):
    """Scores only once its gate opens: an evaluation that takes as long as a test wants."""

    def __init__(self, layout: Layout) -> None:
        super().__init__(layout, DATA)
        self.gate = threading.Event()

    def accuracy(self, state, max_samples=None, threads=None, progress=None):
        assert self.gate.wait(30)
        return super().accuracy(state, max_samples, threads, progress)


def _federation() -> Federation:
    layout = Layout.build(PROFILE, "nefl")
    fed = Federation(layout, GlobalState.init(layout, seed=0), "t", 2, 1, 60)
    for c in ("a", "b"):
        fed.set_online(c, True)
        fed.announce(c, Announce(client=c, max_submodel=2, samples=len(DATA)))
    return fed


def _train_round(driver: RoundDriver, index: int) -> dict:
    fed = driver.fed
    opened = driver.open_round(index)
    for c, k in fed.round.assignments.items():
        res = local_train(fed.layout.module(k), fed.state.extract(fed.layout, k), BatchLoader(DATA, None, 32, True, False, index),
                          TrainConfig(), upload=fed.layout.upload_shapes(k))
        fed.accept(Update(c, index, k, res.num_samples, res.delta, 0))
    return driver.close_round(opened)


def _attach_all(driver: RoundDriver) -> list[dict]:
    lines, deadline = [], time.monotonic() + 30
    while driver.evaluating():
        assert time.monotonic() < deadline
        if (line := driver.poll()) is not None:
            lines.append(line)
        time.sleep(0.01)
    return lines


def test_round_is_checkpointed_before_its_evaluation_and_scores_attach_later(tmp_path) -> None:
    fed = _federation()
    evaluator = GatedEvaluator(fed.layout)
    attached: list[dict] = []
    hooks = RoundHooks()
    hooks.evaluated = attached.append
    driver = RoundDriver(fed, hooks, RunPlan(2, background_eval=True), evaluator, tmp_path)
    facts = _train_round(driver, 1)
    committed = fed.state.clone()
    # committed and on disk while round 1 is still being scored: a stop now names round 1
    assert "accuracy" not in facts and driver.evaluating() and driver.checkpointed == 1
    assert load_checkpoint(tmp_path, PROFILE).meta["round"] == 1
    assert [m["round"] for m in read_metrics(tmp_path)] == [1] and "accuracy" not in read_metrics(tmp_path)[0]
    _train_round(driver, 2)  # the next round trains meanwhile, on the live state; round 1's copy stays as committed
    assert driver.checkpointed == 2 and driver.poll() is None
    evaluator.gate.set()
    lines = _attach_all(driver)
    assert [(line["round"], line["evaluated"]) for line in lines] == [(1, True), (2, True)]
    assert lines[0]["accuracy"] == Evaluator(fed.layout, DATA).accuracy(committed)
    assert lines[1]["accuracy"] == Evaluator(fed.layout, DATA).accuracy(fed.state) == driver.accuracy
    assert attached == lines
    merged = read_metrics(tmp_path)  # one line per round, the scores merged in
    assert [m["round"] for m in merged] == [1, 2]
    assert [m["accuracy"] for m in merged] == [lines[0]["accuracy"], lines[1]["accuracy"]]
    assert all(m["committed"] for m in merged)


def test_of_evaluations_due_meanwhile_only_the_newest_waits(tmp_path) -> None:
    fed = _federation()
    evaluator = GatedEvaluator(fed.layout)
    driver = RoundDriver(fed, RoundHooks(), RunPlan(3, background_eval=True), evaluator, tmp_path)
    driver.evaluate_start()  # round 0 runs and blocks
    for index in (1, 2, 3):
        _train_round(driver, index)
    evaluator.gate.set()
    assert [line["round"] for line in _attach_all(driver)] == [0, 3]  # the last round is always scored
    assert [m["round"] for m in read_metrics(tmp_path)] == [0, 1, 2, 3]


def test_in_line_evaluation_is_unchanged_without_background(tmp_path) -> None:
    fed = _federation()
    driver = RoundDriver(fed, RoundHooks(), RunPlan(1), Evaluator(fed.layout, DATA), tmp_path)
    facts = _train_round(driver, 1)
    assert facts["accuracy"] == load_checkpoint(tmp_path, PROFILE).meta["accuracy"] and not driver.evaluating()


def test_a_stop_gives_up_the_evaluation_and_keeps_the_checkpoint(tmp_path) -> None:
    fed = _federation()
    evaluator = GatedEvaluator(fed.layout)
    driver = RoundDriver(fed, RoundHooks(), RunPlan(2, background_eval=True), evaluator, tmp_path)
    _train_round(driver, 1)
    running = driver.evaluation
    running.cancelled.set()  # as stop_evaluating does, before the first batch is scored
    evaluator.gate.set()
    driver.stop_evaluating()
    assert not running.thread.is_alive() and running.result is None and running.error is None
    assert not driver.evaluating() and driver.poll() is None and driver.checkpointed == 1
    assert [("accuracy" in m) for m in read_metrics(tmp_path)] == [False]
