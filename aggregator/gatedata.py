"""The held-out gate's data side (nefl/aggregation/gate.py holds its statistics): per-image cross-entropy
and 0/1 error of a submodel on the server's gate set, the last `gate_samples` images of the evaluation's
test split (left out of what evaluation scores, like FLTrust's root set: aggregator/rootdata.py
split_root), all of them for every state."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nefl.aggregation.gate import Gate, Scores
from nefl.aggregation.config import AggregationConfig
from nefl.nested.data import ArrayDataset, BatchLoader
from nefl.nested.state import GlobalState, Layout, load_module_state
from nefl.support.threads import spare_cores


class GateScores:
    """Callable (state, k) -> per-image loss and error of submodel k on the gate set (eval mode)."""

    def __init__(self, layout: Layout, data: ArrayDataset, device: str = "cpu") -> None:
        self.layout, self.data, self.device = layout, data, device
        self.modules: dict[int, torch.nn.Module] = {}

    @torch.no_grad()
    def __call__(self, state: GlobalState, k: int) -> Scores:
        if k not in self.modules:
            self.modules[k] = self.layout.module(k).to(self.device)
        model = self.modules[k]
        load_module_state(model, state.extract(self.layout, k))
        model.eval()
        loss, wrong = [], []
        with spare_cores():
            for x, y in BatchLoader(self.data, torch.arange(len(self.data)), 256, False, False, 0):
                logits, y = model(x.to(self.device)), y.to(self.device)
                loss.append(F.cross_entropy(logits, y, reduction="none").cpu())
                wrong.append((logits.argmax(1) != y).float().cpu())
        return Scores(torch.cat(loss), torch.cat(wrong))


def make_gate(layout: Layout, data: ArrayDataset, cfg: AggregationConfig) -> Gate:
    return Gate(GateScores(layout, data), z=cfg.gate_z, margin=cfg.gate_margin, error_margin=cfg.gate_error_margin)
