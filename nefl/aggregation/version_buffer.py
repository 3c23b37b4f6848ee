"""Buffered asynchronous NeFedAvg: the server's newest version and the buffer of updates that makes the next one.

Each update is a delta against the version its device trained from (its base); at commit every element moves by
server_lr x sum_i w_i s_i delta_i / sum_i w_i s_i over the buffered updates whose submodel covers it (w_i: the
weighting's weight, s_i: the staleness weight of nefl/aggregation/staleness.py), which is NeFedAvg
(nefl/aggregation/nefedavg.py) with weights w_i s_i: with staleness 0 and K = a round's updates it is the
synchronous round. With normalise="coverage" the divisor is sum_i w_i instead (NeFedAvg with weights w_i of the
deltas s_i delta_i), so stale updates shorten the step as well as tilt it. The update bound and the state check of the synchronous path apply; rules and checks that
judge a round's participants together are refused (`buffered_refusal`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from nefl.aggregation.aggregate import update_weight
from nefl.aggregation.nefedavg import NeFedAvg
from nefl.aggregation.pipeline import Pipeline, Robustness
from nefl.aggregation.robust import UpdateRejected, reference_norm
from nefl.aggregation.staleness import StalenessConfig
from nefl.aggregation.update_check import UpdateError, check_update
from nefl.nested.state import GlobalState


def buffered_refusal(robustness: Robustness) -> str | None:
    """Why buffered mode cannot run with these settings, in one line; None: it can."""
    agg = robustness.aggregation
    if agg.rule != "nefedavg":
        return (f"--aggregator {agg.rule} weighs a round's updates alike and needs them together; buffered mode "
                "weighs each by its staleness: use --aggregator nefedavg")
    if agg.centre_check:
        return ("the centre check votes among a round's participants, which buffered mode does not have: "
                "give --no-centre-check (the update bound and the state check still apply)")
    if robustness.dp_noise_multiplier > 0:
        return "DP noise's accountant assumes sampled rounds; buffered mode's arrivals are not: drop --dp-noise-multiplier"
    return None


@dataclass(frozen=True)
class Offer:
    """What the buffer made of one update."""

    staleness: int  # versions between its base and the current one
    reason: str | None = None  # why it was refused ("stale", "future-version", "invalid", "norm-bound"); None: taken


@dataclass(frozen=True)
class VersionCommit:
    """One commit of the buffer."""

    version: int  # the current version after it (unchanged when `problem`)
    problem: str | None  # why the new state was not committed (the buffer is dropped)
    staleness: list[int] = field(default_factory=list)  # of each update in the buffer, in arrival order
    submodels: list[int] = field(default_factory=list)  # updates per submodel
    held_bytes: int = 0  # the buffer's tensor memory at commit
    cpu_s: float = 0.0  # the commit's CPU time (finalize and checks)


@dataclass
class _Taken:
    client: str
    submodel: int
    norm: float
    staleness: int
    arrived: float


class VersionBuffer:
    """The newest version (`state`, `version`) and the updates buffered against it."""

    def __init__(self, pipeline: Pipeline, cfg: StalenessConfig, state: GlobalState, version: int = 0) -> None:
        problem = buffered_refusal(pipeline.robustness)
        if problem is not None:
            raise ValueError(problem)
        self.pipeline, self.cfg, self.state, self.version = pipeline, cfg, state, version
        self._agg = NeFedAvg(pipeline.layout, pipeline.weighting)
        self._taken: list[_Taken] = []

    def __len__(self) -> int:
        return len(self._taken)

    def offer(self, k: int, delta: dict[str, torch.Tensor], base: int, samples: int = 1, *, client: str = "",
              now: float = 0.0) -> Offer:
        """Take an update of submodel k trained from version `base` into the buffer, or say why not."""
        tau = self.version - base
        reason = self.cfg.refusal(self.version, base)
        if reason is not None:
            return Offer(tau, reason)
        try:
            check_update(self.pipeline.layout, k, delta)
            w = update_weight(self.pipeline.weighting, samples)
        except UpdateError:
            return Offer(tau, "invalid")
        guard = self.pipeline.guard
        ref = reference_norm(self.state, self.pipeline.layout, k) if guard.bound.relative is not None else None
        try:
            delta, norm, _ = guard.check(k, delta, ref)
        except UpdateRejected:
            return Offer(tau, "norm-bound")
        s = self.cfg.weight(tau)
        # "coverage": s scales the delta and the element's divisor stays sum w; "staleness": s joins the weight
        scale, weight = (self.cfg.server_lr * s, w) if self.cfg.normalise == "coverage" else (self.cfg.server_lr, w * s)
        if scale != 1.0:
            delta = {n: t * scale for n, t in delta.items()}
        self._agg.add_weighted(k, delta, weight)
        self._taken.append(_Taken(client, k, norm, tau, now))
        return Offer(tau)

    def due(self, now: float) -> bool:
        """The buffer holds K updates, or its oldest has waited the commit time bound."""
        if len(self._taken) >= self.cfg.buffer_size:
            return True
        after = self.cfg.commit_after_s
        return bool(self._taken) and after is not None and now - self._taken[0].arrived >= after

    def commit(self) -> VersionCommit:
        """The buffer's new version (through the pipeline's commit: finalize, state check); an empty buffer is none."""
        if not self._taken:
            return VersionCommit(self.version, "the buffer is empty")
        t0 = time.process_time()
        held = self._agg.held_bytes
        done = self.pipeline.commit(self._agg, self.state)
        if done.state is not None:
            self.state, self.version = done.state, self.version + 1
            for t in self._taken:
                self.pipeline.guard.record(t.submodel, t.client, t.norm)
        counts = [0] * self.pipeline.layout.num_submodels
        for t in self._taken:
            counts[t.submodel] += 1
        out = VersionCommit(self.version, done.problem, [t.staleness for t in self._taken], counts, held,
                            time.process_time() - t0)
        self._agg = NeFedAvg(self.pipeline.layout, self.pipeline.weighting)
        self._taken = []
        return out
