"""NeFedAvg: the one place where submodel updates become the new global state.

Consistent tensors: each element is averaged over exactly the updates whose submodel contains it
(width prefix and block present); an element nobody covered keeps its value. Inconsistent tensors:
FedAvg within each submodel, untouched when nobody trained it. Updates are deltas
(trained - received), so averaging deltas equals the paper's averaging of weights.

The aggregator streams: add() touches only the update's own corner of each tensor, memory is
O(model) however many clients report, and two partial aggregates merge exactly (sums and counts
add), which is what hierarchical / multi-site aggregation needs.
"""

from __future__ import annotations

import torch

from nefl.state import GlobalState, Layout, all_finite, corner, tensor_mismatch


class UpdateError(ValueError):
    """An update that does not fit its submodel (names, shapes, dtype or values)."""


def _count_shape(shape: torch.Size) -> tuple[int, ...]:
    """Coverage only varies along the output/input channel dims; kernels are never sliced."""
    return tuple(shape[:2]) + (1,) * max(0, len(shape) - 2)


class NeFedAvg:
    def __init__(self, layout: Layout, weighting: str = "uniform") -> None:
        if weighting not in ("uniform", "samples"):
            raise ValueError("weighting must be 'uniform' (as the paper) or 'samples'")
        self.layout = layout
        self.weighting = weighting
        self.sums = {n: torch.zeros(s) for n, s in layout.global_shapes.items() if n not in layout.inconsistent}
        self.counts = {n: torch.zeros(_count_shape(t.shape)) for n, t in self.sums.items()}
        self.isums: list[dict[str, torch.Tensor]] = [{} for _ in range(layout.num_submodels)]
        self.iweights = torch.zeros(layout.num_submodels, dtype=torch.float64)
        self.updates = [0] * layout.num_submodels

    def validate(self, k: int, delta: dict[str, torch.Tensor]) -> None:
        """Reject anything that is not exactly submodel k's upload, before touching the sums."""
        if not 0 <= k < self.layout.num_submodels:
            raise UpdateError(f"submodel index {k} out of range 0..{self.layout.num_submodels - 1}")
        problem = tensor_mismatch(delta, self.layout.upload_shapes(k), f"submodel {k + 1}")
        if problem:
            raise UpdateError(problem)
        for n, t in delta.items():
            if not t.is_floating_point():
                raise UpdateError(f"{n}: dtype {t.dtype} is not floating point")
            if not all_finite(t):
                raise UpdateError(f"{n}: non-finite values")

    def add(self, k: int, delta: dict[str, torch.Tensor], num_samples: int = 1) -> None:
        self.validate(k, delta)
        w = float(num_samples) if self.weighting == "samples" else 1.0
        if w <= 0:
            raise UpdateError(f"sample count must be positive, got {num_samples}")
        isum = self.isums[k]
        for n, t in delta.items():
            t = t.to(torch.float32)
            if n in self.layout.inconsistent:
                if n in isum:
                    isum[n].add_(t, alpha=w)
                else:
                    isum[n] = t * w
            else:
                self.sums[n][corner(t.shape)].add_(t, alpha=w)
                self.counts[n][corner(_count_shape(t.shape))] += w
        self.iweights[k] += w
        self.updates[k] += 1

    def merge(self, other: "NeFedAvg") -> None:
        """Fold another partial aggregate (same layout) into this one."""
        if other.layout.global_shapes != self.layout.global_shapes or other.weighting != self.weighting:
            raise ValueError("cannot merge aggregates of different profiles or weightings")
        for n in self.sums:
            self.sums[n] += other.sums[n]
            self.counts[n] += other.counts[n]
        for k, isum in enumerate(other.isums):
            for n, t in isum.items():
                if n in self.isums[k]:
                    self.isums[k][n] += t
                else:
                    self.isums[k][n] = t.clone()
        self.iweights += other.iweights
        self.updates = [a + b for a, b in zip(self.updates, other.updates)]

    @property
    def total_updates(self) -> int:
        return sum(self.updates)

    def finalize(self, state: GlobalState) -> GlobalState:
        """New global state; `state` (the one the deltas were computed from) is not modified."""
        consistent = {}
        for n, old in state.consistent.items():
            cnt = self.counts[n]
            mean = torch.where(cnt > 0, self.sums[n] / cnt.clamp_min(1e-12), torch.zeros(()))
            consistent[n] = (old.to(torch.float32) + mean).to(old.dtype)
        inconsistent = []
        for k, old_k in enumerate(state.inconsistent):
            w = float(self.iweights[k])
            new_k = {}
            for n, old in old_k.items():
                if w > 0 and n in self.isums[k]:
                    new_k[n] = (old.to(torch.float32) + self.isums[k][n] / w).to(old.dtype)
                else:
                    new_k[n] = old.clone()
            inconsistent.append(new_k)
        return GlobalState(consistent, inconsistent)
