"""The server's own batch-norm running statistics (AggregationConfig.server_stats; nefl/aggregation/pipeline.py
applies them at commit): every submodel's, recomputed on each candidate state as exact batch statistics over
`stats_samples` held-out images of the evaluation's test split (after the gate's, left out of what evaluation scores,
like FLTrust's root set: aggregator/rootdata.py split_root). Running statistics are estimates of the activations'
mean and variance, not learned parameters, so the server needs no device's word for them: whatever a device uploads
for them is merged and then overwritten."""

from __future__ import annotations

import torch

from aggregator.evaluation import recalibrate
from nefl.nested.data import ArrayDataset, BatchLoader
from nefl.nested.state import GlobalState, Layout
from nefl.support.threads import all_cores


class ServerStatistics:
    """Callable (state) -> None: the running statistics of every submodel in `state` recomputed in place."""

    def __init__(self, layout: Layout, data: ArrayDataset, device: str = "cpu") -> None:
        self.layout, self.device = layout, device
        self.batches = BatchLoader(data, torch.arange(len(data)), 256, False, False, 0)
        self.modules: dict[int, torch.nn.Module] = {}

    def __call__(self, state: GlobalState) -> None:
        with all_cores():
            for k in range(self.layout.num_submodels):
                if k not in self.modules:
                    self.modules[k] = self.layout.module(k).to(self.device)
                recalibrate(self.layout, self.modules[k], state, k, self.batches, self.layout.stats, self.device)
