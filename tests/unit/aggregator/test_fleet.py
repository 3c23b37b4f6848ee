"""The emulated fleet (speeds, budgets, vanishing devices, simulated time), buffered mode's task assignment, and short
buffered and synchronous runs on it."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from aggregator.cli import app
from collections import Counter, deque

from aggregator.fleet import EventQueue, Fleet, FleetConfig, assign_task, steer_task
from nefl.aggregation.config import AggregationConfig
from nefl.aggregation.pipeline import Robustness
from nefl.aggregation.staleness import StalenessConfig
from nefl.nested.data import SYSTEM_FASHION_MNIST_DIR

COSTS = [0.2, 0.45, 0.65, 0.85, 1.0]


def test_speeds_spread_1x_to_the_slowest_and_budgets_bound_the_submodel() -> None:
    fleet = Fleet.build(FleetConfig(slowest=10.0, budget=3.0), COSTS, [2] * 11, seed=0)
    assert fleet.multipliers[0] == 1.0 and fleet.multipliers[-1] == pytest.approx(10.0)
    bounds = [fleet.bound(d) for d in range(11)]
    assert bounds == sorted(bounds, reverse=True) and bounds[0] == 4 and bounds[-1] == 0
    assert all(fleet.task_s(d, bounds[d]) <= fleet.task_budget_s for d in range(10))  # the slowest: at least submodel 1


def test_a_vanished_device_is_away_until_it_returns_and_loses_the_task_it_was_training() -> None:
    fleet = Fleet.build(FleetConfig(vanish=0.5, away_s=100.0, load_jitter=0.0, time_budget_s=2000.0), COSTS, [3, 3],
                        seed=1)
    leaves, back = fleet.away[0][0]
    assert 0 in fleet.online(leaves - 1e-6) and 0 not in fleet.online(leaves) and 0 in fleet.online(back)
    assert fleet.next_return(leaves) == min(s[1] for d in (0, 1) for s in fleet.away[d] if s[0] <= leaves < s[1])
    assert fleet.start(0, 4, 0, now=leaves - 1.0).vanishes  # it leaves 1 s into a 3 s task
    assert not fleet.start(0, 4, 0, now=leaves - 4.0).vanishes  # the task ends before it leaves


def test_vanishing_is_a_hazard_per_time_so_short_tasks_are_lost_less_often() -> None:
    cfg = FleetConfig(slowest=1.0, vanish=0.05, away_s=50.0, load_jitter=0.0, time_budget_s=400_000.0)
    fleet = Fleet.build(cfg, COSTS, [1, 10], seed=3)  # device 0's tasks take 1 s, device 1's 10 s
    rate = 0.0513 / 60.0  # -ln(1 - 0.05) per minute
    for d in (0, 1):
        online_s = cfg.time_budget_s - sum(b - a for a, b in fleet.away[d])
        assert 0.8 / rate < online_s / len(fleet.away[d]) < 1.25 / rate  # mean online time: 1 / hazard

    def lost(d: int) -> float:
        starts = [7.0 * i for i in range(int(cfg.time_budget_s / 7.0)) if d in fleet.online(7.0 * i)]
        return sum(fleet.start(d, 4, 0, now=t).vanishes for t in starts) / len(starts)

    assert 0.4 * rate < lost(0) < 2.5 * rate and lost(1) > 4 * lost(0)  # a task 10x as long: about 10x as often lost


def test_the_same_seed_gives_both_modes_the_same_availability() -> None:
    a = Fleet.build(FleetConfig(mode="buffered"), COSTS, [2] * 5, seed=4)
    b = Fleet.build(FleetConfig(mode="sync"), COSTS, [2] * 5, seed=4)
    a.start(0, 4, 0, now=0.0)  # drawing tasks does not move availability
    assert a.away == b.away and any(a.away)


def test_steering_gives_each_task_the_submodel_within_the_bound_given_least_recently() -> None:
    recent: deque[int] = deque(maxlen=20)
    picks = []
    for _ in range(60):  # per step: three fast devices (bound 4), one slow (bound 0)
        picks += [steer_task(4, recent) for _ in range(3)] + [steer_task(0, recent)]
    late = Counter(picks[-20:])
    assert set(late) == set(range(5)) and max(late.values()) - min(late.values()) <= 2  # the surplus evens coverage
    assert steer_task(0, deque([0, 0, 0], maxlen=4)) == 0  # never above the bound
    assert steer_task(2, deque([0, 2], maxlen=4)) == 1 and steer_task(4, deque(maxlen=4)) == 4  # ties: the largest


def test_buffered_assignment_trains_the_bound_and_every_starved_submodel_within_it() -> None:
    given, lag = [0] * 5, 3
    fast, slow = [], []
    for version in range(30):  # one fast device (bound 4) and one slow (bound 1) start a task per version
        fast.append(assign_task(4, given, version, lag))
        slow.append(assign_task(1, given, version, lag))
    assert set(fast + slow) == set(range(5)) and set(slow) == {0, 1}  # every submodel keeps being trained
    assert max(range(5), key=fast.count) == 4  # the fast device trains its largest most
    assert all(29 - g <= lag for g in given)  # none waits longer than the lag and a turn


def test_events_pop_in_time_order_ties_as_pushed() -> None:
    q = EventQueue()
    for t, p in [(5.0, "a"), (1.0, "b"), (5.0, "c"), (0.5, "d")]:
        q.push(t, p)
    assert [q.pop()[1] for _ in range(len(q))] == ["d", "b", "a", "c"]


@pytest.mark.skipif(not SYSTEM_FASHION_MNIST_DIR.exists(), reason="needs apt-get install dataset-fashion-mnist")
@pytest.mark.parametrize("mode", ["buffered", "sync"])
def test_a_short_run_commits_versions_from_every_submodel(mode: str) -> None:
    import torch

    from aggregator.fleet_sim import FleetSimulator
    from aggregator.simulate import SimConfig

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on a loaded 2-core machine wait on each other

    # the version mechanics: no centre check, and the devices' running statistics (the server's cost a forward pass of
    # 512 images per submodel at each of the run's many commits)
    cfg = SimConfig("resnet8-fmnist-w", clients=6, per_round=3, max_samples_per_client=32, eval_samples=32, seed=2,
                    robustness=Robustness(aggregation=AggregationConfig(centre_check=False, server_stats=False)))
    fleet = FleetConfig(mode=mode, time_budget_s=40.0, eval_every_s=40.0, vanish=0.1)
    try:
        result = FleetSimulator(cfg, fleet, StalenessConfig(buffer_size=3, max_staleness=2)).run()
    finally:
        torch.set_num_threads(threads)
    assert [line["t"] for line in result.curve] == [0.0, 40.0]
    assert len(result.commits) >= 5 and [c["version"] for c in result.commits] == list(range(1, len(result.commits) + 1))
    trained = [sum(c["submodels"][k] for c in result.commits) for k in range(5)]
    assert all(trained), trained
    staleness = [s for c in result.commits for s in c["staleness"]]
    if mode == "sync":
        assert set(staleness) == {0}
    else:
        assert max(staleness) <= 2 and max(staleness) > 0 and all(len(c["staleness"]) == 3 for c in result.commits)
    assert result.commits[-1]["t"] <= 40.0 and result.commits[-1]["cpu_s"] > 0
    assert sum(result.device_tasks.values()) == result.tasks
    if mode == "buffered":  # every device in flight: the fastest starts again as it uploads, the slowest seldom
        assert result.device_tasks[0] > 2 * result.device_tasks[5], result.device_tasks


def test_buffered_mode_refuses_a_robust_rule_in_one_line() -> None:
    result = CliRunner().invoke(app, ["simulate", "--profile", "resnet8-fmnist-w", "--mode", "buffered",
                                      "--aggregator", "median"])
    assert result.exit_code == 2 and "buffered mode weighs each by its staleness" in result.output
