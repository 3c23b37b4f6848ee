"""NeFedAvg: the one place where submodel updates become the new global state.

Consistent tensors: each element is averaged over exactly the updates whose submodel contains it
(width prefix and block present); an element nobody covered keeps its value. Inconsistent tensors:
FedAvg within each submodel, untouched when nobody trained it. Updates are deltas
(trained - received), so averaging deltas equals the paper's averaging of weights.

The aggregator streams: each update is summed into its submodel's group, a contiguous buffer of
exactly the update's shapes, so add() is one dense add per tensor (no strided writes into corners of
the global tensors) and memory is O(sum of submodel sizes), at most K models, however many clients
report. finalize() folds the K groups into the global tensors once per round. Two partial aggregates
merge exactly (group sums and weights add), which is what hierarchical / multi-site aggregation needs.
"""

from __future__ import annotations

import math

import torch

from nefl.choices import check_choice
from nefl.settings import Weighting
from nefl.state import GlobalState, Layout, corner, tensor_mismatch
from nefl.tensors import first_non_finite, ring

# uniform: every update counts once, as the paper; samples: an update counts its client's sample count


class UpdateError(ValueError):
    """An update that does not fit its submodel (names, shapes, dtype or values)."""


def _count_shape(shape: torch.Size) -> tuple[int, ...]:
    """Coverage only varies along the output/input channel dims; kernels are never sliced."""
    return tuple(shape[:2]) + (1,) * max(0, len(shape) - 2)


class NeFedAvg:
    def __init__(self, layout: Layout, weighting: Weighting = "uniform") -> None:
        check_choice(Weighting, weighting, "NeFedAvg weighting")
        self.layout = layout
        self.weighting = weighting
        # per submodel: weighted sum of its updates (every tensor it uploads) and the total weight
        self.groups: list[dict[str, torch.Tensor]] = [{} for _ in range(layout.num_submodels)]
        self.weights = torch.zeros(layout.num_submodels, dtype=torch.float64)
        self.updates = [0] * layout.num_submodels
        self._finalized = False

    def validate(self, k: int, delta: dict[str, torch.Tensor]) -> None:
        """Reject anything that is not exactly submodel k's upload, before touching the sums."""
        self.check_shapes(k, delta)
        bad = first_non_finite(delta)
        if bad is not None:
            raise UpdateError(f"{bad}: non-finite values")

    def check_shapes(self, k: int, delta: dict[str, torch.Tensor]) -> None:
        """`validate` without the value scan, for tensors whose values were already proven finite
        (the wire decoder checks every payload it decodes)."""
        self._check_open()
        if not 0 <= k < self.layout.num_submodels:
            raise UpdateError(f"submodel index {k} out of range 0..{self.layout.num_submodels - 1}")
        problem = tensor_mismatch(delta, self.layout.upload_shapes(k), f"submodel {k + 1}")
        if problem:
            raise UpdateError(problem)
        for n, t in delta.items():
            if not t.is_floating_point():
                raise UpdateError(f"{n}: dtype {t.dtype} is not floating point")

    def add(self, k: int, delta: dict[str, torch.Tensor], num_samples: int = 1, *, owned: bool = False) -> None:
        self.validate(k, delta)
        self.add_validated(k, delta, num_samples, owned=owned)

    def add_validated(self, k: int, delta: dict[str, torch.Tensor], num_samples: int = 1, *,
                      owned: bool = False) -> None:
        """`add` for a caller that ran `validate` itself (the server validates before bounding the
        norm, and a clipped delta is the validated one scaled): the finite checks are not repeated.
        owned=True hands the tensors over (an update just decoded off the wire, dropped after this
        call): the first update of a submodel becomes its group sum in place instead of a copy, and
        later ones may be summed into; the caller must not use them afterwards."""
        self._check_open()
        w = float(num_samples) if self.weighting == "samples" else 1.0
        if w <= 0:
            raise UpdateError(f"sample count must be positive, got {num_samples}")
        group = self.groups[k]
        if group:
            names = list(group)
            torch._foreach_add_([group[n] for n in names], [delta[n].to(torch.float32) for n in names], alpha=w)
        else:
            if owned and all(t.dtype == torch.float32 for t in delta.values()):
                group.update(delta)
            else:
                group.update((n, t.to(torch.float32, copy=True)) for n, t in delta.items())
            if w != 1.0:
                torch._foreach_mul_(list(group.values()), w)
        self.weights[k] += w
        self.updates[k] += 1

    def merge(self, other: "NeFedAvg") -> None:
        """Fold another partial aggregate (same layout) into this one."""
        self._check_open()
        other._check_open()
        if other.layout.global_shapes != self.layout.global_shapes or other.weighting != self.weighting:
            raise ValueError("cannot merge aggregates of different profiles or weightings")
        for group, theirs in zip(self.groups, other.groups):
            for n, t in theirs.items():
                if n in group:
                    group[n] += t
                else:
                    group[n] = t.clone()
        self.weights += other.weights
        self.updates = [a + b for a, b in zip(self.updates, other.updates)]

    def add_noise(self, std: float, generator: torch.Generator) -> None:
        """DP-FedAvg: N(0, std^2) on every element of every group sum that has updates (std = noise
        multiplier x clip norm; one client changes one group by at most the clip norm). finalize
        divides by coverage, so an element's noise ends up std * sqrt(groups covering it) / coverage.
        Call once per round, after the last add or merge and before finalize."""
        if self.weighting != "uniform":
            raise ValueError("DP noise needs weighting='uniform': 'samples' scales a client's influence by its sample count")
        if not (math.isfinite(std) and std >= 0):
            raise ValueError(f"noise std must be a finite number >= 0, got {std!r}")
        for k, group in enumerate(self.groups):
            if self.updates[k] == 0:
                continue
            for n in sorted(group):  # fixed order: the same generator seed gives the same noise
                t = group[n]
                t.add_(torch.randn(t.shape, generator=generator, dtype=t.dtype), alpha=std)

    @property
    def total_updates(self) -> int:
        return sum(self.updates)

    def coverage(self, name: str) -> torch.Tensor:
        """Per element of consistent tensor `name`: the total weight of the updates that contain it.
        Shaped (out, in, 1, 1...): coverage varies only along the channel dims, kernels are never sliced."""
        shape = self.layout.global_shapes[name]
        cover = torch.zeros(_count_shape(shape), dtype=torch.float32)
        for k, group in enumerate(self.groups):
            if name in group:
                cover[corner(_count_shape(group[name].shape))] += float(self.weights[k])
        return cover

    def _consistent_update(self, name: str, old: torch.Tensor) -> torch.Tensor:
        """`old` plus the average delta where covered; an uncovered element is `old`'s element bit
        for bit (old + 0 would turn -0.0 into +0.0, so the digest of untouched weights would change).

        Nested corners (every ladder the kit derives) take the fast path: the largest group sum
        becomes the output buffer, the smaller ones are added into its corners, and each ring between
        two consecutive corners is divided by its own coverage, a scalar. No global-size scratch
        tensors, no coverage tensor, no select."""
        held = sorted(((self.groups[k][name], float(self.weights[k])) for k in range(self.layout.num_submodels)
                       if name in self.groups[k]), key=lambda gw: gw[0].numel(), reverse=True)
        if not held:
            return old.clone()
        shapes = [g.shape for g, _ in held]
        if not all(all(i <= o for i, o in zip(inner, outer)) for outer, inner in zip(shapes, shapes[1:])):
            return self._general_update(name, old)
        acc = held[0][0]
        for g, _ in held[1:]:
            acc[corner(g.shape)] += g
        covered = 0.0
        for i, (_, w) in enumerate(held):
            covered += w
            inner = shapes[i + 1] if i + 1 < len(held) else None
            for region in ring(shapes[i], inner):
                acc[region] /= covered
        acc += old[corner(acc.shape)]
        if acc.shape == old.shape:
            return acc.to(old.dtype)
        new = old.clone()
        new[corner(acc.shape)] = acc
        return new

    def _general_update(self, name: str, old: torch.Tensor) -> torch.Tensor:
        """Any set of corners (a hand-written ladder whose widths are not monotone in its depth)."""
        total = torch.zeros(self.layout.global_shapes[name], dtype=torch.float32)
        for g in self.groups:
            if name in g:
                total[corner(g[name].shape)] += g[name]
        cover = self.coverage(name)
        new = total.div_(cover.clamp_min(1e-12)).add_(old)
        return torch.where(cover > 0, new.to(old.dtype), old)

    def finalize(self, state: GlobalState) -> GlobalState:
        """New global state; `state` (the one the deltas were computed from) is not modified. The group
        sums become the new tensors in place, so an aggregate is finalized once; a new round takes a
        new NeFedAvg."""
        self._check_open()
        consistent = {n: self._consistent_update(n, old) for n, old in state.consistent.items()}
        inconsistent = []
        for k, old_k in enumerate(state.inconsistent):
            w, group = float(self.weights[k]), self.groups[k]
            inconsistent.append({
                n: group[n].div_(w).add_(old).to(old.dtype) if w > 0 and n in group else old.clone()
                for n, old in old_k.items()
            })
        self._finalized = True
        return GlobalState(consistent, inconsistent)

    def _check_open(self) -> None:
        if self._finalized:
            raise RuntimeError("this NeFedAvg was finalized (its sums became the new state): start a new one")
