"""The server's fine-tuning at commit (AggregationConfig.finetune_epochs, aggregator/statsdata.py finetune): every
submodel trained on the server's images from the candidate, merged by NeFedAvg, before the running statistics."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aggregator.statsdata import FINETUNE_BATCH, ServerStatistics
from nefl.aggregation.config import AggregationConfig
from nefl.aggregation.pipeline import Pipeline, Robustness
from nefl.nested.data import ArrayDataset, BatchLoader, get_dataset_info
from nefl.nested.profile import load_profile
from nefl.nested.state import GlobalState, Layout, load_module_state
from nefl.nested.train import local_train
from nefl.support.settings import TrainConfig
from tests.harness.helpers import aligned_deltas

LAYOUT = Layout.build(load_profile("resnet8-fmnist-w"))


def images(n: int = 48, seed: int = 3) -> ArrayDataset:
    g = torch.Generator().manual_seed(seed)
    return ArrayDataset(torch.randint(0, 256, (n, 1, 28, 28), generator=g, dtype=torch.uint8),
                        torch.randint(0, 10, (n,), generator=g), get_dataset_info("fashion-mnist"))


def by_hand(state: GlobalState, data: ArrayDataset, lr: float, epochs: int) -> GlobalState:
    """Brute force: each submodel trained as a device trains (the first fine-tuning's batches), then every element
    moved by the mean of the steps of the submodels that hold it, one element group at a time."""
    deltas = [local_train(LAYOUT.module(k), state.extract(LAYOUT, k),
                          BatchLoader(data, None, FINETUNE_BATCH, True, True, 1000 + k),
                          TrainConfig(lr=lr, local_epochs=epochs), upload=LAYOUT.upload_shapes(k)).delta
              for k in range(LAYOUT.num_submodels)]
    consistent = {}
    for n, old in state.consistent.items():
        total, count = torch.zeros(old.shape, dtype=torch.float64), torch.zeros(old.shape, dtype=torch.float64)
        for d in deltas:
            if n in d:
                corner = tuple(slice(0, s) for s in d[n].shape)
                total[corner] += d[n].double()
                count[corner] += 1
        consistent[n] = (old.double() + torch.where(count > 0, total / count.clamp(min=1), 0)).to(old.dtype)
    inconsistent = [{n: (old.double() + deltas[k][n].double()).to(old.dtype) if n in deltas[k] else old
                     for n, old in own.items()} for k, own in enumerate(state.inconsistent)]
    return GlobalState(consistent, inconsistent)


def server_loss(state: GlobalState, data: ArrayDataset, k: int) -> float:
    model = LAYOUT.module(k)
    load_module_state(model, state.extract(LAYOUT, k))
    model.train()  # batch statistics: the comparison does not hinge on the running ones
    with torch.no_grad():
        x, y = next(iter(BatchLoader(data, None, len(data), False, False, 0)))
        return float(F.cross_entropy(model(x), y))


def test_the_fine_tuning_is_nefedavg_of_every_submodel_trained_on_the_servers_images() -> None:
    state, data = GlobalState.init(LAYOUT, seed=0), images()
    tuned = state.clone()
    ServerStatistics(LAYOUT, data).finetune(tuned, 0.05, 1)
    want = by_hand(state, data, 0.05, 1)
    moved = 0
    for have, ref, old in [(tuned.consistent, want.consistent, state.consistent),
                           *zip(tuned.inconsistent, want.inconsistent, state.inconsistent)]:
        assert have.keys() == ref.keys()
        for n, t in have.items():
            if t.is_floating_point():
                torch.testing.assert_close(t, ref[n], rtol=1e-4, atol=1e-5, msg=n)
                moved += int(not torch.equal(t, old[n]))
    assert moved > len(state.consistent)  # it trained: most tensors moved


def test_the_fine_tuning_lowers_every_submodels_loss_on_the_servers_images() -> None:
    state, data = GlobalState.init(LAYOUT, seed=0), images()
    before = [server_loss(state, data, k) for k in range(LAYOUT.num_submodels)]
    ServerStatistics(LAYOUT, data).finetune(state, 0.05, 4)
    after = [server_loss(state, data, k) for k in range(LAYOUT.num_submodels)]
    assert all(a < b for a, b in zip(after, before)), (before, after)


def test_a_bad_learning_rate_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="--finetune-lr"):
        AggregationConfig(finetune_epochs=1, finetune_lr=0.0)


def test_the_commit_fine_tunes_after_the_step_bound_and_only_where_asked() -> None:
    """Off (0 epochs), the commit is the one without it; on, it differs in the shared core, and the step bound's
    history holds the devices' round, not the server's training."""
    state, data = GlobalState.init(LAYOUT, seed=0), images()
    tasks = {"a": 0, "b": 1, "c": 2}
    runs = {}
    for epochs in (0, 1):
        pipeline = Pipeline(LAYOUT, Robustness(aggregation=AggregationConfig(finetune_epochs=epochs)),
                            statistics=ServerStatistics(LAYOUT, data))
        agg = pipeline.begin_round(state, tasks, 1)
        for client, delta in aligned_deltas(LAYOUT, state, tasks, 0.001).items():
            agg.add_validated(tasks[client], delta, 10, client=client)
        done = pipeline.commit(agg, state)
        assert done.problem is None
        runs[epochs] = (done.state, pipeline.steps.state_dict()["history"])
    (off, off_history), (on, on_history) = runs[0], runs[1]
    assert on_history == off_history
    assert any(not torch.equal(on.consistent[n], off.consistent[n]) for n in off.consistent)
