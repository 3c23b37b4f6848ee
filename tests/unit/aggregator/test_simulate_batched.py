"""`SimConfig.batch_clients`: one round of the simulator with the clients of each submodel trained together commits
the state the one-by-one round commits, within float32's order (tests/unit/nested/test_batched.py says why 1e-3)."""

from __future__ import annotations

import pytest
import torch

import aggregator.simulate as simulate
from aggregator.simulate import SimConfig, Simulator
from nefl.aggregation.config import AggregationConfig
from nefl.aggregation.pipeline import Robustness
from nefl.nested.data import SYSTEM_FASHION_MNIST_DIR
from nefl.nested.state import GlobalState, Layout


def _round(batch_clients: bool) -> tuple[GlobalState, GlobalState, dict, Layout]:
    # 10 clients in 5 tiers, each training the largest submodel its tier may: groups of 2 or more, one step each; the
    # server's fine-tuning off, so that the submodels no client trained keep their own tensors
    cfg = SimConfig("resnet20-fmnist-wd", clients=10, per_round=10, rounds=1, eval_every=0, final_eval_samples=100,
                    max_samples_per_client=32, assignment="largest", seed=0, batch_clients=batch_clients,
                    robustness=Robustness(aggregation=AggregationConfig(finetune_epochs=0)))
    sim = Simulator(cfg)
    before = sim.state.clone()
    result = sim.run()
    return before, sim.state, result.rounds[0], sim.layout


def _flat(state: GlobalState, k: int | None, without: frozenset[str] = frozenset()) -> torch.Tensor:
    """The consistent tensors, or submodel k's own, but those named in `without`."""
    tensors = state.consistent if k is None else state.inconsistent[k]
    return torch.cat([tensors[n].reshape(-1).float() for n in sorted(tensors) if n not in without])


@pytest.mark.slow
@pytest.mark.skipif(not SYSTEM_FASHION_MNIST_DIR.exists(), reason="needs apt-get install dataset-fashion-mnist")
def test_batched_round_commits_the_one_by_one_state(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    before, alone, row_alone, layout = _round(False)
    groups = []
    real = simulate.batched_train
    monkeypatch.setattr(simulate, "batched_train", lambda model, start, loaders, *a, **kw: (
        groups.append(len(loaders)), real(model, start, loaders, *a, **kw))[1])
    _, together, row_together, _ = _round(True)
    assert sum(groups) == 10 and min(groups) >= 2  # every client went through the batched path, in groups of its submodel
    assert row_together["committed"] and row_alone["committed"]
    assert row_together["train_loss"] == pytest.approx(row_alone["train_loss"], rel=1e-5)
    # the server recomputes every submodel's running statistics at commit: a trained submodel is one whose others moved
    trained = [k for k in range(5) if bool((_flat(alone, k, layout.stats) != _flat(before, k, layout.stats)).any())]
    assert len(trained) == len(groups)
    for k in [None, *trained]:  # the consistent tensors, then every trained submodel's own (BN, step sizes)
        update = _flat(alone, k) - _flat(before, k)
        assert float((_flat(together, k) - _flat(alone, k)).norm() / update.norm()) < 1e-3
