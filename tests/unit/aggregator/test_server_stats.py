"""The server's own running statistics (AggregationConfig.server_stats, aggregator/statsdata.py): at commit every
submodel's batch-norm running statistics are recomputed on the server's images, so whatever a device uploads for
them never reaches the committed state, and every other tensor commits as before."""

from __future__ import annotations

import pytest
import torch

from aggregator.simulate import ServerSide, SimConfig
from aggregator.statsdata import ServerStatistics
from nefl.aggregation.config import AggregationConfig
from nefl.aggregation.pipeline import Pipeline, Robustness
from nefl.nested.data import SYSTEM_FASHION_MNIST_DIR, ArrayDataset, get_dataset_info
from nefl.nested.profile import load_profile
from nefl.nested.state import GlobalState, Layout, load_module_state
from tests.harness.helpers import aligned_deltas

LAYOUT = Layout.build(load_profile("resnet8-fmnist-w"))
TASKS = {"a": 0, "b": 1, "c": 2}


def images(n: int = 64) -> ArrayDataset:
    g = torch.Generator().manual_seed(1)
    return ArrayDataset(torch.randint(0, 256, (n, 1, 28, 28), generator=g, dtype=torch.uint8),
                        torch.zeros(n, dtype=torch.long), get_dataset_info("fashion-mnist"))


def commit(pipeline: Pipeline, state: GlobalState, stats_step: float) -> GlobalState:
    """One round of TASKS: small seeded steps on every tensor, the shared ones in one direction (so the centre check
    keeps all three); each running statistic moved by `stats_step` x itself (1000: a device's poison)."""
    agg = pipeline.begin_round(state, TASKS, 1)
    for client, delta in aligned_deltas(LAYOUT, state, TASKS, 0.001).items():
        k = TASKS[client]
        for n in LAYOUT.stats & delta.keys():
            delta[n] = stats_step * state.inconsistent[k][n].abs()
        agg.add_validated(k, delta, 10, client=client)
    done = pipeline.commit(agg, state)
    assert done.problem is None
    return done.state


def batch_statistics(state: GlobalState, k: int, data: ArrayDataset) -> dict[str, torch.Tensor]:
    """Brute force: submodel k in train mode over all of `data` at once, each batch norm's input mean and unbiased
    variance per channel, by forward hooks."""
    model = LAYOUT.module(k)
    load_module_state(model, state.extract(LAYOUT, k))
    model.train()
    out: dict[str, torch.Tensor] = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            def hook(_m: torch.nn.Module, args: tuple[torch.Tensor], name: str = name) -> None:
                x = args[0].double()
                out[f"{name}.running_mean"], out[f"{name}.running_var"] = x.mean((0, 2, 3)), x.var((0, 2, 3))
            m.register_forward_pre_hook(hook)
    mean, std = (torch.tensor(v).view(1, -1, 1, 1) for v in (data.info.mean, data.info.std))
    with torch.no_grad():
        model((data.images.float() / 255 - mean) / std)
    return out


def test_the_servers_statistics_replace_the_devices_and_nothing_else_changes() -> None:
    state, data = GlobalState.init(LAYOUT, seed=0), images()
    # the rows' choice and the fine-tuning are tested in test_classifier_rows and test_finetune
    rows_off = Robustness(aggregation=AggregationConfig(classifier_rows=False, finetune_epochs=0))
    server = Pipeline(LAYOUT, rows_off, statistics=ServerStatistics(LAYOUT, data))
    honest = commit(server, state, 0.01)
    poisoned = commit(Pipeline(LAYOUT, rows_off, statistics=ServerStatistics(LAYOUT, data)), state, 1000.0)
    plain = commit(Pipeline(LAYOUT), state, 0.01)  # the devices' statistics merged, as before
    assert LAYOUT.stats and not (LAYOUT.stats & set(server.steps.names))  # the step bound leaves them to the server
    for k in range(LAYOUT.num_submodels):
        for n, t in honest.inconsistent[k].items():
            assert torch.equal(t, poisoned.inconsistent[k][n]), (k, n)  # what a device sent for them does not count
            if n not in LAYOUT.stats:
                assert torch.equal(t, plain.inconsistent[k][n]), (k, n)
        want = batch_statistics(honest, k, data)
        for n in LAYOUT.stats & honest.inconsistent[k].keys():
            torch.testing.assert_close(honest.inconsistent[k][n].double(), want[n], rtol=1e-4, atol=1e-5)
    for n, t in honest.consistent.items():
        assert torch.equal(t, plain.consistent[n]) and torch.equal(t, poisoned.consistent[n])


def test_a_checkpoint_of_the_devices_statistics_resumes_with_the_servers() -> None:
    """A step bound that judged the running statistics (history and anchors) loads into one that leaves them out."""
    state, data = GlobalState.init(LAYOUT, seed=0), images()
    before = Pipeline(LAYOUT)
    commit(before, state, 0.01)
    saved = before.steps.state_dict()
    assert any(n in LAYOUT.stats for n in saved["history"]) and any(a[1] in LAYOUT.stats for a in saved["anchors"])
    after = Pipeline(LAYOUT, statistics=ServerStatistics(LAYOUT, data))
    after.steps.load_state_dict(saved)
    assert {n: list(h) for n, h in after.steps.history.items() if h} == {
        n: h for n, h in saved["history"].items() if n not in LAYOUT.stats}
    assert set(after.steps.anchor.past) == {(k, n) for k, n, _ in saved["anchors"] if n not in LAYOUT.stats}


@pytest.mark.skipif(not SYSTEM_FASHION_MNIST_DIR.exists(), reason="needs apt-get install dataset-fashion-mnist")
def test_the_simulator_holds_the_servers_images_out_of_evaluation() -> None:
    on = ServerSide.build(SimConfig("resnet8-fmnist-w"), "cpu")
    off = ServerSide.build(SimConfig("resnet8-fmnist-w", robustness=Robustness(
        aggregation=AggregationConfig(server_stats=False))), "cpu")
    assert on.statistics is not None and off.statistics is None
    assert len(on.test) == len(off.test) - AggregationConfig().stats_samples
    assert on.statistics.batches.num_samples == AggregationConfig().stats_samples
