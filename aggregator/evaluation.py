"""Server-side evaluation of every submodel, each with its own BN and step sizes (design fact 7)."""

from __future__ import annotations

import torch

from nefl.data import BatchLoader, load_dataset
from nefl.state import GlobalState, Layout, load_module_state
from nefl.train import evaluate, recompute_bn_stats


class Evaluator:
    """Holds the test split (and, for static-BN methods, calibration images) in memory once."""

    def __init__(self, layout: Layout, dataset: str, max_samples: int | None = None, data_root: str | None = None,
                 calibration_samples: int = 2000) -> None:
        self.layout = layout
        self.test = load_dataset(dataset, data_root, train=False)
        self.n = min(len(self.test), max_samples or len(self.test))
        self.calib = None
        if layout.method.static_bn:  # HeteroFL: BN statistics recomputed on training data before eval
            train = load_dataset(dataset, data_root, train=True)
            self.calib = (train, torch.arange(min(len(train), calibration_samples)))

    def accuracy(self, state: GlobalState) -> list[float]:
        out = []
        for k in range(self.layout.num_submodels):
            model = self.layout.module(k)
            load_module_state(model, state.extract(self.layout, k))
            if self.calib is not None:
                recompute_bn_stats(model, BatchLoader(self.calib[0], self.calib[1], 256, False, False, 0))
            acc, _ = evaluate(model, BatchLoader(self.test, torch.arange(self.n), 500, False, False, 0))
            out.append(round(acc, 4))
        return out
