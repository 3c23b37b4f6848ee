"""The held-out gate's data side (nefl/aggregation/gate.py holds its statistics): per-image cross-entropy of a
submodel on the server's gate set, the last `gate_samples` images of the evaluation's test split (left out of what
evaluation scores, like FLTrust's root set: aggregator/rootdata.py split_root), all of them for every state."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nefl.aggregation.gate import Gate
from nefl.aggregation.config import AggregationConfig
from nefl.nested.data import ArrayDataset, BatchLoader
from nefl.nested.state import GlobalState, Layout, load_module_state
from nefl.support.threads import all_cores


class GateLoss:
    """Callable (state, k) -> per-image loss of submodel k on the gate set (eval mode)."""

    def __init__(self, layout: Layout, data: ArrayDataset, device: str = "cpu") -> None:
        self.layout, self.data, self.device = layout, data, device
        self.modules: dict[int, torch.nn.Module] = {}

    @torch.no_grad()
    def __call__(self, state: GlobalState, k: int) -> torch.Tensor:
        if k not in self.modules:
            self.modules[k] = self.layout.module(k).to(self.device)
        model = self.modules[k]
        load_module_state(model, state.extract(self.layout, k))
        model.eval()
        out = []
        with all_cores():
            for x, y in BatchLoader(self.data, torch.arange(len(self.data)), 256, False, False, 0):
                out.append(F.cross_entropy(model(x.to(self.device)), y.to(self.device), reduction="none").cpu())
        return torch.cat(out)


def make_gate(layout: Layout, data: ArrayDataset, cfg: AggregationConfig) -> Gate:
    return Gate(GateLoss(layout, data), z=cfg.gate_z, margin=cfg.gate_margin)
