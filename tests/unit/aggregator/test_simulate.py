import json
import random

import pytest
import torch
from typer.testing import CliRunner

from aggregator.assignment import paper_window
from aggregator.cli import app
from nefl.nested.checkpoint import UPDATES_TOTAL_KEY
from aggregator.simulate import SimConfig, check_device, simulated_federation
from nefl.nested.population import client_ids, tier_bound, tier_of
from nefl.nested.checkpoint import load_checkpoint
from nefl.nested.data import SYSTEM_FASHION_MNIST_DIR
from nefl.nested.profile import load_profile
from nefl.aggregation.config import AggregationConfig
from nefl.nested.state import Layout


def _choices(client: int, clients: int = 100) -> list[int]:
    """What a client of the paper's 5 equal tiers may pick among 5 submodels."""
    tier = tier_of(client, clients, 5)
    return list(paper_window(tier, tier_bound(tier, 5)))


def test_paper_tiers() -> None:
    """100 clients, 5 submodels: tier 1 picks among 0.2-0.6, tier 3 among all, tier 5 among 0.6-1."""
    assert _choices(0) == [0, 1, 2]
    assert _choices(20) == [0, 1, 2, 3]
    assert _choices(59) == [0, 1, 2, 3, 4]
    assert _choices(60) == [1, 2, 3, 4]
    assert _choices(99) == [2, 3, 4]
    counts = [sum(1 for c in range(100) if tier_of(c, 100, 5) == t) for t in range(5)]
    assert counts == [20] * 5


def test_simulated_federation_replays_the_paper_draws_of_the_old_round_loop() -> None:
    """The simulator's earlier loop: one seeded RNG samples participants, then each draws uniformly
    from its tier's window. Driving Federation with the paper policy must draw the same, so seeded
    results stay comparable across the change."""
    cfg = SimConfig("resnet8-fmnist-w", clients=20, per_round=5, seed=3)
    fed = simulated_federation(Layout.build(load_profile(cfg.profile)), cfg, [300] * cfg.clients)
    ids, rng = client_ids(cfg.clients), random.Random(cfg.seed)
    for r in range(10):
        old = {ids[c]: rng.choice(_choices(c, cfg.clients)) for c in sorted(rng.sample(range(cfg.clients), cfg.per_round))}
        assert fed.open_round(r, now=0.0).assignments == old
        fed.close_round()


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(1200)  # a few minutes on 2 quiet cores; margin for a machine loaded by other jobs
@pytest.mark.skipif(not SYSTEM_FASHION_MNIST_DIR.exists(), reason="needs apt-get install dataset-fashion-mnist")
def test_short_simulation_trains_every_submodel_on_real_fashion_mnist(tmp_path) -> None:
    out = tmp_path / "run"
    result = CliRunner().invoke(app, [
        "simulate", "--profile", "resnet8-fmnist-w", "--dataset", "fashion-mnist", "--clients", "10",
        "--per-round", "10", "--rounds", "6", "--local-epochs", "2", "--max-samples-per-client", "300", "--eval-every", "3",
        "--eval-samples", "500", "--final-eval-samples", "2000", "--seed", "0", "--out", str(out), "--threads", "1",
    ])  # one thread: two threads on a loaded 2-core machine wait on each other (one round took over 10 minutes)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(7))  # round 0: the initial state's accuracy
    assert "accuracy" in rows[3] and "accuracy" not in rows[4]
    rows = rows[1:]
    final = rows[-1]
    assert final["eval_samples"] == 2000 and len(final["accuracy"]) == 5
    # chance is 0.1; 6 short rounds land at about 0.35-0.55 (float summation order moves it a point or so)
    assert min(final["accuracy"]) > 0.25 and final["avg"] > 0.4, final["accuracy"]
    assert final["worst"] == min(final["accuracy"])
    assert all(r["committed"] and r["rejected"] == {} for r in rows), "the server's guard refused an honest update"
    # without attackers the vote still leaves out an honest update that points against most of the round (in
    # late rounds, when updates get small and diverse): only a few, and only for lack of agreement
    dropped = [(c, r["agreement"][c]) for r in rows for c in r.get("dropped", {})]
    assert len(dropped) <= 0.1 * 10 * len(rows), dropped
    assert all(share < AggregationConfig().min_agree for _, share in dropped), dropped
    ck = load_checkpoint(out / "checkpoint")
    assert ck.meta["round"] == 6 and ck.meta["accuracy"] == final["accuracy"]
    # the checkpoint counts the updates aggregated; the metrics count those received, the dropped ones too
    received = [sum(n) for n in zip(*(r["updates_per_submodel"] for r in rows))]
    assert all(a <= b for a, b in zip(ck.meta[UPDATES_TOTAL_KEY], received))
    assert sum(received) - sum(ck.meta[UPDATES_TOTAL_KEY]) == len(dropped)
    assert "worst" in result.output and "avg" in result.output


def test_bad_inputs_exit_with_a_message(tmp_path) -> None:
    r = CliRunner().invoke(app, ["simulate", "--profile", "no-such", "--rounds", "1"])
    assert r.exit_code == 2 and "no such profile" in r.output
    r = CliRunner().invoke(app, ["simulate", "--profile", "resnet20-fmnist-w", "--clients", "2", "--per-round", "3"])
    assert r.exit_code == 2
    r = CliRunner().invoke(app, ["simulate", "--profile", "resnet20-fmnist-w", "--method", "magic"])
    assert r.exit_code == 2 and "unknown method" in r.output
    r = CliRunner().invoke(app, ["simulate", "--profile", "resnet8-fmnist-w", "--device", "tpu9"])
    assert r.exit_code == 2 and "unknown device" in r.output
    r = CliRunner().invoke(app, ["simulate", "--profile", "resnet8-fmnist-w", "--assignment", "magic"])
    assert r.exit_code == 2 and "'coverage', 'largest', 'paper'" in r.output


def test_device_errors_name_the_fix(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA GPU.*--device cpu"):
        check_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="only 1 CUDA GPU"):
        check_device("cuda:3")
    assert check_device("cpu") == torch.device("cpu")


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.skipif(not SYSTEM_FASHION_MNIST_DIR.exists(), reason="needs apt-get install dataset-fashion-mnist")
def test_the_attack_suite_runs_every_server_option_in_the_simulator(tmp_path) -> None:
    """The simulator runs the server's round driver: attackers are drawn, the default centre check drops
    their flipped updates (or, where the honest updates agree too weakly for the vote to act, cuts them to size),
    DP and robust rules are the server's options, metrics lines have its fields."""
    common = ["simulate", "--profile", "resnet8-fmnist-w", "--clients", "10", "--per-round", "10", "--rounds", "2",
              "--max-samples-per-client", "64", "--eval-every", "0", "--final-eval-samples", "200", "--threads", "1",
              "--batch-size", "16"]
    out = tmp_path / "flip"
    r = CliRunner().invoke(app, [*common, "--attack", "scaled-flip", "--attackers", "0.2", "--out", str(out)])
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    attackers = set(rows[0]["attackers"])
    assert len(attackers) == 2 and set(rows[0]["dropped"]) >= attackers, rows
    # after the server's fine-tuning, round 2's honest updates (4 steps each) can agree too weakly for the vote to act
    # on the last arrivals; then the size bounds cut a flip (docs/security.md, "The server fine-tunes at commit")
    for row in rows:
        cut = set(row["dropped"]) | set(row.get("tensors_clipped") or {}) | set(row.get("clipped") or {})
        assert cut >= attackers, row
    for row in rows:  # the vote may also drop honest outliers, never a majority, and only those short of agreement
        honest_dropped = set(row["dropped"]) - attackers
        assert 2 * len(honest_dropped) < 10 - len(attackers), row
        assert all(row["agreement"][c] < AggregationConfig().min_agree for c in row["dropped"]), row
    assert all(row["aggregator"] == "nefedavg" and row["committed"] for row in rows)
    out = tmp_path / "median-dp"
    r = CliRunner().invoke(app, [*common, "--aggregator", "median", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["aggregator"] == "median"
    r = CliRunner().invoke(app, [*common, "--aggregator", "median", "--dp-noise-multiplier", "1", "--max-update-norm", "1",
                                 "--clip"])
    assert r.exit_code == 2 and "DP noise is calibrated to plain NeFedAvg" in r.output
    out = tmp_path / "dp"
    r = CliRunner().invoke(app, [*common, "--dp-noise-multiplier", "0.5", "--max-update-norm", "5", "--clip", "--out", str(out)])
    assert r.exit_code == 0, r.output
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["dp_epsilon"] > 0 and "agreement" not in last  # DP turns the centre check off


@pytest.mark.skipif(not SYSTEM_FASHION_MNIST_DIR.exists(), reason="needs apt-get install dataset-fashion-mnist")
def test_the_gate_is_the_servers_in_the_simulator() -> None:
    """`simulate --gate`: the federation judges commits on gate_samples test images that evaluation no longer scores."""
    from aggregator.simulate import ServerSide
    from nefl.aggregation.pipeline import Robustness

    plain = ServerSide.build(SimConfig("resnet8-fmnist-w"), "cpu")
    cfg = SimConfig("resnet8-fmnist-w", robustness=Robustness(aggregation=AggregationConfig(gate=True)))
    gated = ServerSide.build(cfg, "cpu")
    assert plain.gate is None and gated.gate is not None
    assert len(gated.test) == len(plain.test) - AggregationConfig().gate_samples
    fed = simulated_federation(gated.layout, cfg, [10] * cfg.clients, gated.reference, gated.gate)
    assert fed.aggregator.gate is gated.gate
    scores = gated.gate.scores(fed.state, [0])[0]  # per-image loss and error on every gate image
    assert scores.loss.shape == scores.wrong.shape == (AggregationConfig().gate_samples,)
    assert torch.isfinite(scores.loss).all() and set(scores.wrong.tolist()) <= {0.0, 1.0}
