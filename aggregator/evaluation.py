"""Evaluation of every submodel, each with its own BN and step sizes (design fact 7), for the server
and the simulator alike: one path, so a simulated accuracy and a served one mean the same thing.

Static-BN methods (HeteroFL) never upload BN statistics; they are recomputed on training images
before each evaluation. The recomputed statistics are written into the global state, because they
are the ones the scored model used: a checkpoint or an ONNX export without them would carry the
statistics of the initial weights.
"""

from __future__ import annotations

from typing import Callable

import torch

from nefl.nested.data import ArrayDataset, BatchLoader, load_dataset
from nefl.nested.state import GlobalState, Layout, load_module_state, module_state
from nefl.nested.train import evaluate, recompute_bn_stats
from nefl.support.threads import spare_cores

CHUNK = 500  # images scored between progress calls (one batch): a stop waits for one batch at most
Progress = Callable[[int, int, int], None]  # (submodel index, images scored, images in all)


class Evaluator:
    """Holds the test split (and, for static BN, a seeded sample of calibration images) in memory once."""

    def __init__(self, layout: Layout, test: ArrayDataset, calibration: ArrayDataset | None = None,
                 max_samples: int | None = None, calibration_samples: int = 2000, seed: int = 0,
                 device: str = "cpu") -> None:
        self.layout, self.test, self.device = layout, test, device
        self.n = min(len(test), max_samples or len(test))
        self.calib: BatchLoader | None = None
        if layout.method.static_bn:
            if calibration is None:
                raise ValueError(f"method {layout.method.name} recomputes BN statistics: give calibration images")
            order = torch.randperm(len(calibration), generator=torch.Generator().manual_seed(seed))
            self.calib = BatchLoader(calibration, order[:calibration_samples], 256, False, False, 0)
        self.modules = [layout.module(k).to(device) for k in range(layout.num_submodels)]

    @classmethod
    def for_dataset(cls, layout: Layout, dataset: str, max_samples: int | None = None, data_root: str | None = None,
                    calibration_samples: int = 2000, seed: int = 0, test: ArrayDataset | None = None) -> "Evaluator":
        """The server's evaluator on `dataset`'s test split (or `test`, a part of it); loads the training
        split only when static BN needs it."""
        train = load_dataset(dataset, data_root, train=True) if layout.method.static_bn else None
        test = test if test is not None else load_dataset(dataset, data_root, train=False)
        return cls(layout, test, train, max_samples, calibration_samples, seed)

    def samples(self, max_samples: int | None = None) -> int:
        """How many test images `accuracy(state, max_samples)` scores."""
        return min(self.n if max_samples is None else max_samples, len(self.test))

    def accuracy(self, state: GlobalState, max_samples: int | None = None, threads: int | None = None,
                 progress: Progress | None = None) -> list[float]:
        """Top-1 of every submodel on the first `max_samples` test images (default: the evaluator's);
        static-BN statistics are recalibrated into `state` first. `threads`: torch's threads for the calling
        thread (default: the cores no other process keeps busy, for an evaluation on the thread that runs the rounds)."""
        if threads is not None:  # an evaluation beside the rounds: a budget of its own (OpenMP's count is per thread)
            torch.set_num_threads(threads)
            return self._accuracy(state, self.samples(max_samples), progress)
        with spare_cores():  # a served federation's ingest runs on one thread (nefl/support/threads.py); this is one large job
            return self._accuracy(state, self.samples(max_samples), progress)

    def _accuracy(self, state: GlobalState, n: int, progress: Progress | None) -> list[float]:
        out = []
        for k, model in enumerate(self.modules):
            if self.calib is not None:  # static BN: the recomputed statistics are its (never uploaded) local tensors
                recalibrate(self.layout, model, state, k, self.calib, self.layout.local, self.device)
            else:
                load_module_state(model, state.extract(self.layout, k))
            correct = 0
            for start in range(0, n, CHUNK):
                if progress is not None:
                    progress(k, start, n)
                idx = torch.arange(start, min(n, start + CHUNK))
                acc, _ = evaluate(model, BatchLoader(self.test, idx, 500, False, False, 0), self.device)
                correct += round(acc * len(idx))
            out.append(round(correct / n, 4))
        return out


def recalibrate(layout: Layout, model: torch.nn.Module, state: GlobalState, k: int, batches: BatchLoader,
                names: frozenset[str], device: str = "cpu") -> None:
    """Submodel k of `state` loaded into `model` (its module), its batch-norm statistics recomputed as exact batch
    statistics over `batches`, and those of them named in `names` written back into `state`."""
    load_module_state(model, state.extract(layout, k))
    recompute_bn_stats(model, batches, device)
    trained = module_state(model)
    for name in names & state.inconsistent[k].keys():
        state.inconsistent[k][name] = trained[name].detach().cpu().clone()
