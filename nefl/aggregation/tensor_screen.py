"""Every tensor an update carries judged by its size, per named tensor, against a reference no attacker moves.

The centre check's vote (nefl/aggregation/centre_check.py) sees a sketch of the round's shared core and its size
clip the whole update, so a poison in one small tensor (the classifier's bias, a batch-norm running variance, a
step size) hides in the rest. Here each named tensor of an update is measured on its own, as its per-element RMS
(its L2 norm / sqrt(elements)): a nested submodel uploads a corner of a shared tensor, and per element the corners
of different widths compare, as the copies of a per-submodel tensor (its batch norm, its step sizes) of different
submodels do. So every update that carries tensor `name` adds one size to the tensor's pool, whatever its width.

The reference of a tensor is a median, the lower one of an even count (as the step bound's: half the copies cannot
raise it):
- a shared tensor at least `min_cover` of the round's updates carry: the median of the round's sizes and the
  tensor's history, the update's own size included (a minority of attackers moves a median by at most their count
  of ranks, toward the honest sizes' edge, never past it);
- a shared tensor fewer carry (a depth-only block, or a round of two): the median of the other updates' sizes and
  the history, never the update's own size (a lone copy would be its own reference), once that pool holds
  `min_cover` - 1 sizes (as many others as a well-covered tensor has);
- a per-submodel tensor (batch norm, step sizes): the median over the round's updates of the same submodel once
  `min_cover` of them carry it. A copy fewer updates move is left to the step bound at commit
  (nefl/aggregation/step_bound.py), which judges its committed step against the same layer's copies in the other
  submodels and the history, never alone, in log space for running variances: judged here too against those, a
  submodel's batch norm first trained after the others settled (its running statistics move from their initial
  values, several times the settled copies' steps) would be cut twice, here and at commit.
No reference (no clip) in warm-up. The history holds, per shared tensor, one entry per committed round in which at
least `min_cover` updates carried it: that round's median size (`step_window` rounds). A lone or paired copy never
enters it, so an attacker alone on a tensor cannot ratchet it, and a minority cannot move an entry past the honest
sizes.

A tensor above `tensor_clip` x its reference is scaled to that bound (per-layer norm clipping to the median, Sun et
al. 2019; FLAME's adaptive clipping). Optional server-side Gaussian noise (`tensor_noise` x the reference per
element, after clipping) is the weak DP of the same paper; off by default.

Cost per update: one batched norm over its tensors and, per tensor, an insertion into a sorted list and a median
over the round's sizes and history (Python, O(updates) per tensor); memory: one Python float per tensor and update of
the round (about 4 KiB per resnet20 update beside its 16 KiB sketch), and `step_window` floats per tensor across
rounds. The history moves on where rounds commit (the server, the coordinator of workers); a worker's screen judges
from its round alone.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from nefl.aggregation.config import AggregationConfig
from nefl.aggregation.step_bound import load_history, middle

Sizes = dict[str, tuple[float, float]]  # tensor name -> (per-element RMS, squared L2 norm) of one update's tensor


def measure(delta: Mapping[str, torch.Tensor]) -> Sizes:
    """Each non-empty tensor's per-element RMS and squared norm (float64 from one batched float32 norm; a norm that
    overflows float32 is inf, and so clipped to zero)."""
    names = [n for n, t in delta.items() if t.numel()]
    if not names:
        return {}
    norms = torch.stack(torch._foreach_norm([delta[n] for n in names])).double().tolist()
    return {n: (norm / math.sqrt(delta[n].numel()), norm * norm) for n, norm in zip(names, norms)}


class TensorSizes:
    """One round's sizes per shared tensor and per copy of a per-submodel tensor, and the references they give
    (module docstring)."""

    def __init__(self, history: Mapping[str, Iterable[float]], per_submodel: frozenset[str],
                 cfg: AggregationConfig) -> None:
        self.history = {n: list(h) for n, h in history.items()}
        self.per_submodel, self.cfg = per_submodel, cfg
        self.values: dict[tuple[str, int], list[float]] = {}  # per (name, submodel or -1 if shared): sizes so far, sorted

    def _key(self, name: str, k: int) -> tuple[str, int]:
        return name, k if name in self.per_submodel else -1

    def add(self, k: int, sizes: Sizes) -> None:
        """One update's (of submodel k) sizes join the round's."""
        for name, (size, _) in sizes.items():
            bisect.insort(self.values.setdefault(self._key(name, k), []), size)

    def reference(self, name: str, k: int, own: float) -> float:
        """The size tensor `name` of an update of submodel k of size `own` (already added) is judged against; inf
        where this check leaves it to the step bound (a thin per-submodel copy) or in warm-up."""
        values, least = self.values.get(self._key(name, k), []), self.cfg.min_cover
        if name in self.per_submodel:
            return middle(values) if len(values) >= least else math.inf
        if len(values) < least:  # thin: the others and the history, never itself (as many others as well covered)
            i = bisect.bisect_left(values, own)
            values, least = values[:i] + values[i + 1:], least - 1
        pool = [*values, *self.history.get(name, ())]
        return middle(pool) if len(pool) >= least else math.inf

    def bounds(self, k: int, sizes: Sizes) -> dict[str, float]:
        """Per tensor of an update of submodel k (its `sizes`, added), its reference."""
        return {name: self.reference(name, k, size) for name, (size, _) in sizes.items()}

    def medians(self) -> dict[str, float]:
        """The round's median size of each shared tensor at least `min_cover` updates carried: its history entries."""
        return {n: middle(v) for (n, k), v in self.values.items() if k < 0 and len(v) >= self.cfg.min_cover}


def clip_factors(sizes: Sizes, references: Mapping[str, float], clip: float) -> dict[str, float]:
    """The factor each tensor above `clip` x its reference is scaled by to meet it (tensors within are left out)."""
    return {n: clip * references[n] / size for n, (size, _) in sizes.items() if size > clip * references[n]}


def clipped_norm(sizes: Sizes, factors: Mapping[str, float]) -> float:
    """The update's L2 norm once its tensors are scaled by `factors`."""
    return math.sqrt(sum(sq * f * f for n, (_, sq) in sizes.items() if (f := factors.get(n, 1.0))))


def add_noise(delta: Mapping[str, torch.Tensor], references: Mapping[str, float], multiplier: float,
              gen: torch.Generator) -> None:
    """N(0, (multiplier x reference)^2) on every element of each tensor with a finite reference, in place."""
    for name in sorted(delta):
        ref = references.get(name, math.inf)
        if math.isfinite(ref) and ref > 0:
            t = delta[name]
            t.add_(torch.randn(t.shape, generator=gen, dtype=t.dtype), alpha=multiplier * ref)


class SizeHistory:
    """Per tensor name, the committed rounds' median sizes (module docstring); kept by the pipeline across rounds
    and in the checkpoint."""

    def __init__(self, names: Iterable[str], per_submodel: frozenset[str], cfg: AggregationConfig) -> None:
        self.cfg, self.per_submodel = cfg, per_submodel
        self.history: dict[str, deque[float]] = {n: deque(maxlen=cfg.step_window) for n in names}

    def begin(self) -> TensorSizes:
        """A round's sizes, judged against the history as it stands."""
        return TensorSizes(self.history, self.per_submodel, self.cfg)

    def commit(self, sizes: TensorSizes) -> None:
        """The round's state was committed: its well-covered tensors' medians join the history."""
        for name, median in sizes.medians().items():
            if name in self.history and math.isfinite(median):
                self.history[name].append(median)

    def state_dict(self) -> dict[str, Any]:
        return {"history": {n: list(h) for n, h in self.history.items() if h}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resumed server keeps its references; refuses a history that is not finite sizes per known tensor."""
        load_history(self.history, state, "tensor-size")
