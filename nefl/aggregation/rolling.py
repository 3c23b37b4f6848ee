"""Sub-model extraction and aggregation over index windows: FedRolex's rolling windows, HeteroFL's prefixes.

A window gives, per dimension of a global tensor, the indices a submodel keeps (None keeps the whole
dimension). FedRolex (Alam et al. 2022) rolls each layer's window of kept channels by one index per
round; HeteroFL is the same with the window fixed at the prefix. Aggregation is NeFedAvg's element-wise
rule generalised from prefixes to arbitrary windows: every element is averaged over exactly the updates
whose window covers it, and an element no update covered keeps its previous value.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nefl.aggregation.aggregate import coverage_mean

IndexWindow = tuple[torch.Tensor | None, ...]  # one entry per dimension (nefl.aggregation.aggregate.Window without slices)


def rolled_window(size: int, keep: int, offset: int) -> torch.Tensor:
    """`keep` consecutive indices of a dimension of `size`, starting at `offset`, wrapping around."""
    if not 1 <= keep <= size:
        raise ValueError(f"need 1 <= keep <= size, got keep={keep}, size={size}")
    return (torch.arange(keep) + offset) % size


def extract(tensor: torch.Tensor, window: IndexWindow) -> torch.Tensor:
    """The submodel's tensor: the global tensor's elements at the window's indices."""
    for dim, idx in enumerate(window):
        if idx is not None:
            tensor = tensor.index_select(dim, idx)
    return tensor.clone()


def extract_state(state: dict[str, torch.Tensor], windows: dict[str, IndexWindow]) -> dict[str, torch.Tensor]:
    return {name: extract(state[name], windows[name]) for name in windows}


def aggregate_windows(
    global_state: dict[str, torch.Tensor], updates: Sequence[tuple[dict[str, torch.Tensor], dict[str, IndexWindow]]],
) -> dict[str, torch.Tensor]:
    """New global state: each element the mean of the updated values of the submodels covering it;
    uncovered elements (and tensors no update carries) keep their value (nefl/aggregation/aggregate.py's rule)."""
    return {name: coverage_mean(old, [(windows[name], values[name] - extract(old, windows[name]), 1.0)
                                      for values, windows in updates if name in windows])
            for name, old in global_state.items()}
