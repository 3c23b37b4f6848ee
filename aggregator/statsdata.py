"""The server's own batch-norm running statistics (AggregationConfig.server_stats; nefl/aggregation/pipeline.py
applies them at commit): every submodel's, recomputed on each candidate state as exact batch statistics over
`stats_samples` held-out images of the evaluation's test split (after the gate's, left out of what evaluation scores,
like FLTrust's root set: aggregator/rootdata.py split_root). Running statistics are estimates of the activations'
mean and variance, not learned parameters, so the server needs no device's word for them: whatever a device uploads
for them is merged and then overwritten.

Before that, the server fine-tunes every submodel of the candidate on the same images with their labels
(AggregationConfig.finetune_epochs, `finetune`): the clients' merged step then passes through training on clean
images, which unlearns what those images do not exercise (a backdoor's trigger path; docs/security.md, "The server
fine-tunes at commit").

The same images, with their labels, judge the classifier's rows (AggregationConfig.classifier_rows): `features` gives
each submodel's penultimate features of a candidate, for nefl/aggregation/coordinate.py's choose_rows."""

from __future__ import annotations

import torch

from aggregator.evaluation import recalibrate
from nefl.aggregation.nefedavg import NeFedAvg
from nefl.nested.data import ArrayDataset, BatchLoader
from nefl.nested.state import GlobalState, Layout, load_module_state
from nefl.nested.train import local_train
from nefl.support.settings import TrainConfig
from nefl.support.threads import spare_cores

FINETUNE_BATCH = 16  # the fine-tuning's batch size: 32 steps a pass over the 512 images


def head_names(layout: Layout) -> tuple[str, str] | None:
    """The classifier's (weight, bias) names: the last linear layer of the submodels, where both tensors are shared by
    every submodel's nesting (consistent); None for a model without one."""
    linear = [n for n, m in layout.module(0).named_modules() if isinstance(m, torch.nn.Linear)]
    if not linear:
        return None
    names = (f"{linear[-1]}.weight", f"{linear[-1]}.bias")
    shared = all(n in layout.global_shapes and n not in layout.inconsistent and n not in layout.local for n in names)
    return names if shared else None


class ServerStatistics:
    """Callable (state) -> None: the running statistics of every submodel in `state` recomputed in place; and
    `features`, the classifier's inputs on the same images."""

    def __init__(self, layout: Layout, data: ArrayDataset, device: str = "cpu") -> None:
        self.layout, self.device = layout, device
        self.data = data
        self.batches = BatchLoader(data, torch.arange(len(data)), 256, False, False, 0)
        self.finetuned = 0  # commits fine-tuned so far: each one's batches are shuffled with its own seed
        self.labels = data.labels  # in the batches' order (no shuffle)
        self.modules: dict[int, torch.nn.Module] = {}
        self.head = head_names(layout)

    def _module(self, k: int) -> torch.nn.Module:
        """Submodel k's module, built once and reused at every commit."""
        if k not in self.modules:
            self.modules[k] = self.layout.module(k).to(self.device)
        return self.modules[k]

    def __call__(self, state: GlobalState) -> None:
        with spare_cores():
            for k in range(self.layout.num_submodels):
                recalibrate(self.layout, self._module(k), state, k, self.batches, self.layout.stats, self.device)

    def finetune(self, state: GlobalState, lr: float, epochs: int) -> dict[str, torch.Tensor]:
        """Every submodel of `state` trained `epochs` passes over the server's images at `lr` (shuffled, augmented, as a
        device trains), and their deltas merged into `state` in place by NeFedAvg, as a round of one device per submodel
        would be; returns the step this took on the consistent tensors."""
        self.finetuned += 1
        merged, config = NeFedAvg(self.layout), TrainConfig(lr=lr, local_epochs=epochs)
        with spare_cores():
            for k in range(self.layout.num_submodels):
                batches = BatchLoader(self.data, None, FINETUNE_BATCH, True, True, 1000 * self.finetuned + k)
                trained = local_train(self._module(k), state.extract(self.layout, k), batches, config,
                                      upload=self.layout.upload_shapes(k), device=self.device)
                merged.add_validated(k, trained.delta)
        new = merged.finalize(state)
        step = {n: new.consistent[n] - t for n, t in state.consistent.items()}
        state.consistent.update(new.consistent)
        state.inconsistent[:] = new.inconsistent
        return step

    @torch.no_grad()
    def features(self, state: GlobalState) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Every submodel's input to the classifier on the server's images (one tensor each, in order) and their
        labels: the submodel of `state` as committed, its running statistics included."""
        assert self.head is not None
        head = self.head[0].removesuffix(".weight")
        out: list[torch.Tensor] = []
        with spare_cores():
            for k in range(self.layout.num_submodels):
                model = self._module(k)
                load_module_state(model, state.extract(self.layout, k))
                got: list[torch.Tensor] = []
                hook = model.get_submodule(head).register_forward_hook(lambda _m, i, _o: got.append(i[0].cpu()))
                try:
                    model.eval()
                    for x, _ in self.batches:
                        model(x.to(self.device))
                finally:
                    hook.remove()
                out.append(torch.cat(got))
        return out, self.labels
