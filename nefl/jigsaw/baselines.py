"""HeteroFL and FedRolex submodels of a FedJigsaw base architecture (the paper's baselines).

The largest client architecture is the global model; a client trains the width-scaled copy (every hidden
width ceil(C * gamma), input channels and classes kept) whose channels sit at an index window of the
global tensors: the prefix for HeteroFL, a window rolling by one index per round for FedRolex. The
window rule and the aggregation are nefl.aggregation.rolling's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from nefl.aggregation.rolling import IndexWindow, extract_state, rolled_window
from nefl.jigsaw.zoo import BaseArch, ModuleMeta, build_model, peak_bytes
from nefl.nested.train import Batches, TrainConfig, TrainResult, local_train

WIDTH_LEVELS = (1.0, 0.5, 0.25, 0.125)  # HeteroFL's capability levels


def scaled_metas(base: BaseArch, gamma: float) -> list[ModuleMeta]:
    """The submodel's modules: hidden widths ceil(C * gamma); the input and the classes unchanged."""
    metas = base.metas(0)
    out, prev = [], base.input
    for m in metas:
        c = m.d_out[0] if m.kind == "head" else math.ceil(m.d_out[0] * gamma)
        d_out = (c, m.d_out[1], m.d_out[2])
        out.append(ModuleMeta(source=0, position=m.position, type=m.type, d_in=prev, d_out=d_out))
        prev = d_out
    return out


def width_for_budget(base: BaseArch, budget: float, batch_size: int, levels: Sequence[float] = WIDTH_LEVELS) -> float:
    """The widest level whose training-memory estimate fits the client's budget (the narrowest if none does)."""
    fits = [g for g in levels if peak_bytes(scaled_metas(base, g), base.input, batch_size) <= budget]
    return max(fits) if fits else min(levels)


def submodel_windows(base: BaseArch, gamma: float, offset: int) -> dict[str, IndexWindow]:
    """Index windows of every tensor of the width-`gamma` submodel in the global model's state: each
    hidden layer keeps ceil(C * gamma) channels starting at `offset` mod C (0: HeteroFL's prefix)."""
    model = build_model(base.metas(0))
    windows: dict[str, IndexWindow] = {}
    cur: torch.Tensor | None = None  # kept indices of the current activation's channels (None: all)
    for j, (meta, module) in enumerate(zip(base.metas(0), model)):
        hw = meta.d_in[1] * meta.d_in[2]
        for i, layer in enumerate(module):
            name = f"{j}.{i}"
            if isinstance(layer, nn.Conv2d):
                out = rolled_window(layer.out_channels, math.ceil(layer.out_channels * gamma), offset)
                windows[f"{name}.weight"] = (out, cur, None, None)
                cur = out
            elif isinstance(layer, nn.BatchNorm2d):
                for p in ("weight", "bias", "running_mean", "running_var"):
                    windows[f"{name}.{p}"] = (cur,)
            elif isinstance(layer, nn.Linear):
                flat = None if cur is None else (cur[:, None] * hw + torch.arange(hw)).reshape(-1)
                out = None if meta.kind == "head" else rolled_window(layer.out_features, math.ceil(layer.out_features * gamma), offset)
                windows[f"{name}.weight"] = (out, flat)
                windows[f"{name}.bias"] = (out,)
                cur, hw = out, 1
    return windows


@dataclass
class WindowStep:
    values: dict[str, torch.Tensor]  # the trained window, for nefl.aggregation.rolling.aggregate_windows
    windows: dict[str, IndexWindow]
    result: TrainResult
    model: nn.Sequential  # the trained submodel
    cut_seconds: float  # choosing and cutting the window: the method's decision cost


def train_window(global_state: dict[str, torch.Tensor], base: BaseArch, gamma: float, offset: int, batches: Batches,
                 config: TrainConfig) -> WindowStep:
    """A PT client's step: cut the width-`gamma` window at `offset` out of the global state and train it."""
    t0 = time.perf_counter()
    windows = submodel_windows(base, gamma, offset)
    start = extract_state(global_state, windows)
    cut = time.perf_counter() - t0
    model = build_model(scaled_metas(base, gamma))
    res = local_train(model, start, batches, config)
    return WindowStep({k: start[k] + res.delta[k] for k in start}, windows, res, model, cut)
