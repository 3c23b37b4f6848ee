"""FLTrust's root updates: the server's own small, clean training set, and the update it trains on it
for one submodel (nefl/aggregation/fltrust.py FLTrust compares each client's update with it).

The root set is the last `samples` images of a dataset's test split (`--root-data`, the evaluation
dataset unless told otherwise): the server holds that split anyway. When it is the evaluation's own
split, evaluation scores the rest (`split_root`), so no score is on an image the server trained on. The root
update trains the round's submodel from the round's starting state with the clients' optimiser, lr and
local epochs, so its size is that of an honest update trained on as many samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aggregator.gatedata import make_gate
from aggregator.statsdata import ServerStatistics
from nefl.aggregation.config import AggregationConfig
from nefl.aggregation.gate import Gate
from nefl.nested.data import ArrayDataset, BatchLoader
from nefl.nested.state import GlobalState, Layout
from nefl.support.settings import DEFAULT_ROOT_SAMPLES
from nefl.support.threads import spare_cores
from nefl.nested.train import TrainConfig, local_train


def split_root(test: ArrayDataset, samples: int) -> tuple[ArrayDataset, ArrayDataset]:
    """(what evaluation scores, the root set): the root set is the last `samples` images, left out of
    evaluation so the server's scores are not on images it trained on."""
    if not 1 <= samples < len(test):
        raise ValueError(f"--root-samples must be in 1..{len(test) - 1} (smaller than the test split), got {samples}")
    cut = len(test) - samples
    return (ArrayDataset(test.images[:cut], test.labels[:cut], test.info),
            ArrayDataset(test.images[cut:], test.labels[cut:], test.info))


def held_out(test: ArrayDataset, layout: Layout, agg: AggregationConfig, device: str = "cpu"
             ) -> tuple[ArrayDataset, Gate | None, ServerStatistics | None]:
    """(what evaluation scores, the held-out gate under `agg.gate`, the server's running statistics under
    `agg.server_stats` where the layout has any): each takes the last images of `test`, the gate's first, left out of
    evaluation as the root set is."""
    gate = statistics = None
    if agg.gate:
        test, gate_set = split_root(test, agg.gate_samples)
        gate = make_gate(layout, gate_set, agg)
    if agg.server_stats and layout.stats:
        test, stats_set = split_root(test, agg.stats_samples)
        statistics = ServerStatistics(layout, stats_set, device)
    return test, gate, statistics


@dataclass
class RootUpdates:
    """Callable (state, submodel, round) -> the server's delta of that submodel on its root set."""

    layout: Layout
    data: ArrayDataset
    train: TrainConfig
    rounds: int
    samples: int = DEFAULT_ROOT_SAMPLES
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self) -> None:
        self.indices = torch.arange(max(0, len(self.data) - self.samples), len(self.data))
        self.modules: dict[int, torch.nn.Module] = {}

    def __call__(self, state: GlobalState, k: int, index: int) -> dict[str, torch.Tensor]:
        if k not in self.modules:
            self.modules[k] = self.layout.module(k).to(self.device)
        loader = BatchLoader(self.data, self.indices, self.train.batch_size, shuffle=True, augment=True,
                             seed=self.seed * 7919 + index * 31 + k)
        cfg = self.train.for_round(max(0, index - 1), self.rounds)
        with spare_cores():  # one training run, not a stream of small operations (nefl/support/threads.py)
            return local_train(self.modules[k], state.extract(self.layout, k), loader, cfg,
                               upload=self.layout.upload_shapes(k), device=self.device).delta
