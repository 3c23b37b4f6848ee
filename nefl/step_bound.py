"""A per-tensor bound on the committed step of the per-submodel tensors (batch norm, step sizes).

A submodel's inconsistent tensors are averaged over that submodel's updates only, so in a round of a
few devices on several submodels each copy is moved by a single update: no vote or statistic can judge
it, and the size clip bounds a whole update, where batch-norm statistics are most of the norm. An
update of -weights then moves gamma, running variances and step sizes by up to -1 x themselves.

So each copy's step (new - old of submodel k's tensor `name`) is measured per element, as its RMS, and
bounded by `k` x the median of a pool: the RMS steps of the same tensor's other copies this round (the
other submodels' batch norm of the same layer: peers of the same round, honest while most copies are)
and the tensor's history, one entry per earlier round that moved at least `peers` copies, that round's
median over its copies. A copy above the bound is scaled down to it. The history is never built from a
lone copy or a pair (which one update decides), so an attacker that is the only trainer of a submodel
cannot ratchet it; it moves only while it controls most copies of a round. Warm-up: no bound until the
pool holds `peers` sizes (round 1 already, when `peers` submodels trained). Honest steps are clipped when
one copy's step exceeds `k` x the median of its peers and history, e.g. a submodel trained for the first
time after the others settled; it then moves at most `k` x the typical step per round.

Running variances must stay positive: their steps are taken in log space (new / old), so the
committed value is old x exp(bounded step), positive and finite whatever the update said.

It runs where a round's candidate state is committed (aggregator/federation.py), with the centre check,
so `serve`, the coordinator of `--workers` and `simulate` all apply it, under any rule. Cost: one pass
over the per-submodel tensors at commit, no update held. Consistent tensors are not covered: their
outer rings, covered by a lone update too, are bounded only by the centre check's size clip (and by the
robust rules' thin-cell bound); docs/security.md has what that leaves.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

import torch

from nefl.settings import AggregationConfig
from nefl.state import GlobalState, Layout

POSITIVE = ("running_var",)  # tensors a valid model keeps > 0: bounded in log space
_TINY = 1e-30  # a non-positive running variance counts as this before its log


def positive(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in POSITIVE


def _step(name: str, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The step of one copy in float64: the difference, or the log ratio for a positive tensor."""
    old, new = old.double(), new.double()
    return new.clamp_min(_TINY).log() - old.log() if positive(name) else new - old


def _apply(name: str, old: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    out = old.double() * step.exp() if positive(name) else old.double() + step
    return out.to(old.dtype)


def rms(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t)) / math.sqrt(max(1, t.numel()))


class StepBound:
    """The bound's history across rounds, one per inconsistent tensor name (all submodels' copies)."""

    def __init__(self, layout: Layout, cfg: AggregationConfig) -> None:
        self.names = sorted(layout.inconsistent - layout.local)
        self.k, self.peers, self.window = cfg.step_k, cfg.min_cover, cfg.step_window
        self.history: dict[str, deque[float]] = {n: deque(maxlen=self.window) for n in self.names}
        self._pending: dict[str, float] = {}  # this round's medians, for the history once the round commits

    def limit(self, name: str, sizes: list[float]) -> float:
        """k x the median of this round's copies' sizes and the tensor's history; inf during warm-up."""
        pool = [*sizes, *self.history[name]]
        return self.k * statistics.median(pool) if len(pool) >= self.peers else math.inf

    def apply(self, old: GlobalState, new: GlobalState) -> dict[int, int]:
        """Bound every moved copy of `new` in place (the round's candidate); returns how many tensors of each
        submodel were scaled down. A positive tensor's copy is also rebuilt from its log step when a value
        went non-positive or non-finite."""
        bounded: dict[int, int] = {}
        self._pending = {}
        for name in self.names:
            copies = []
            for k, (o, n) in enumerate(zip(old.inconsistent, new.inconsistent)):
                if name in o and not torch.equal(o[name], n[name]):
                    step = _step(name, o[name], n[name])
                    copies.append((k, step, rms(step)))
            if not copies:
                continue
            sizes = [s for _, _, s in copies if math.isfinite(s)]
            limit = self.limit(name, sizes)
            for k, step, size in copies:
                invalid = positive(name) and not bool((new.inconsistent[k][name] > 0).all())
                if size > limit or not math.isfinite(size) or invalid:
                    step = torch.nan_to_num(step, nan=0.0, posinf=0.0, neginf=0.0)
                    size = rms(step)
                    if size > limit:
                        step = step * (limit / size)
                        bounded[k] = bounded.get(k, 0) + 1
                    new.inconsistent[k][name] = _apply(name, old.inconsistent[k][name], step)
            if len(sizes) >= self.peers:
                self._pending[name] = statistics.median(sizes)
        return bounded

    def commit(self) -> None:
        """The round's state was committed: its medians (rounds with enough copies) join the history."""
        for name, size in self._pending.items():
            self.history[name].append(size)
        self._pending = {}

    def state_dict(self) -> dict[str, Any]:
        return {"history": {n: list(h) for n, h in self.history.items() if h}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resumed server keeps its bounds; refuses a history that is not finite sizes per known tensor."""
        history = state.get("history") if isinstance(state, dict) else None
        if not isinstance(history, dict) or not all(
                n in self.history and isinstance(h, list) and all(type(x) in (int, float) and math.isfinite(x) and x >= 0
                                                                  for x in h) for n, h in history.items()):
            raise ValueError("the checkpoint's step-bound history is not finite step sizes per per-submodel tensor: "
                             "resume with the profile the checkpoint was written with")
        for n, h in history.items():
            self.history[n] = deque((float(x) for x in h), maxlen=self.window)
