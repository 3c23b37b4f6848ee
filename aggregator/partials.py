"""Partial aggregates across processes: a worker's NeFedAvg as tensors + a typed summary, and the
coordinator's side of its workers and site relays (round plans, receipts, exact merge, losses).

NeFedAvg is a weighted sum and a total weight per submodel group, so partials merge exactly:
the coordinator adds the workers' group sums (float32, the same dtype NeFedAvg sums in) and their
float64 weights, then finalizes once. Only the order of float32 additions differs from one process
summing every update, which docs/scale.md bounds. A worker that dies loses only the updates it
held; they are counted in the round's metrics, and the round closes with everybody else's.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from aggregator.federation import Federation, Rejected
from nefl.aggregate import NeFedAvg, UpdateError
from nefl.messages import (MAX_PLAN_BYTES, MAX_RECEIPT_BYTES, BoundSettings, PartialSummary, Receipt, RoundClose,
                           ScreenSettings, WorkerRound, WorkerStatus)
from nefl.profile import Profile
from nefl.robust import NormBound, reference_norm
from nefl.robust_aggregate import AggregationConfig
from nefl.signing import Signer
from nefl.state import Layout
from nefl.topics import Topics
from nefl.wire import Assembled, Reassembler, WireError, parse_chunk

log = logging.getLogger("aggregator.server")
MAX_WORKERS = 1024  # workers and relays of one federation (a hostile id flood stops here)


def partial_from(layout: Layout, summary: PartialSummary, tensors: dict[str, torch.Tensor]) -> NeFedAvg:
    """A worker's partial back as a NeFedAvg, refusing anything that is not exactly what a NeFedAvg of
    `layout` could hold, or whose counts disagree with the clients it names."""
    if not set(summary.dropped) <= set(summary.clients):
        raise WireError("bad_partial", "the summary drops clients it does not name")
    if sum(summary.updates) + len(summary.dropped) != len(summary.clients):
        raise WireError("bad_partial", f"{sum(summary.updates)} updates kept and {len(summary.dropped)} dropped, "
                                       f"but {len(summary.clients)} clients")
    try:
        return NeFedAvg.from_partial(layout, list(summary.weights), list(summary.updates), tensors)
    except UpdateError as e:
        raise WireError("bad_partial", str(e)) from None


def partial_bytes_limit(layout: Layout) -> int:
    """The largest honest partial: every submodel's upload in float32, plus safetensors headers."""
    numel = sum(math.prod(s) for k in range(layout.num_submodels) for s in layout.upload_shapes(k).values())
    return 4 * numel + (1 << 20)


def plan_bound(bound: NormBound) -> BoundSettings:
    return BoundSettings(max_norm=bound.max_norm, relative=bound.relative, adaptive_k=bound.adaptive_k,
                         mode=bound.mode, window=bound.window, warmup=bound.warmup)


def plan_screen(cfg: AggregationConfig) -> ScreenSettings:
    return ScreenSettings(centre_check=cfg.centre_check, min_cos=cfg.min_cos, max_norm_ratio=cfg.max_norm_ratio,
                          min_cover=cfg.min_cover, hold=cfg.hold, sketch=cfg.sketch)


@dataclass
class _Delivery:
    """What one worker sent for the closing round: its summary, its reassembled tensors, and the two
    checked and joined into a NeFedAvg once the tensors' digest is the one the summary names."""

    summary: PartialSummary | None = None
    assembled: Assembled | None = None
    agg: NeFedAvg | None = None


@dataclass
class WorkerPool:
    """The coordinator's side of workers and relays. The server's main thread calls `handle` for every
    `worker/{id}/{kind}` message, `open` after publishing a round's tasks and `close` before closing it."""

    fed: Federation
    profile: Profile
    topics: Topics
    signer: Signer
    publish: Callable[[str, bytes, bool], None]
    reject: Callable[[str, str, str], None]  # (reason, client, why): the server's counted rejection
    chunk_bytes: int
    max_update_bytes: int
    timeout_s: float = 30.0
    roles: dict[str, str] = field(default_factory=dict)  # online worker id -> "worker" | "relay"
    held: dict[str, str] = field(default_factory=dict)  # client -> worker that accepted its update this round
    late: int = 0
    seen: set[str] = field(default_factory=set)  # workers ever online
    _deliveries: dict[str, _Delivery] = field(default_factory=dict)
    _run: str = ""
    _round: int = 0
    _plan: WorkerRound | None = None

    def __post_init__(self) -> None:
        self.reasm = Reassembler(max_bytes=partial_bytes_limit(self.fed.layout), timeout_s=self.timeout_s, max_pending=1)

    # -- inbound ----------------------------------------------------------------------------------
    def handle(self, worker: str, kind: str, payload: bytes) -> None:
        """One message of worker `worker`; raises MessageError / WireError / Rejected like any handler."""
        if kind == "status":
            status = WorkerStatus.from_json(payload) if payload else None
            if status is not None and status.state == "online":
                if worker not in self.roles and len(self.roles) >= MAX_WORKERS:
                    raise Rejected("too_many_workers", f"{len(self.roles)} workers online already")
                self.roles[worker] = status.role
                if status.role == "worker" and len(self.seen) < MAX_WORKERS:
                    self.seen.add(worker)
            elif self.roles.pop(worker, None) == "worker" and self._plan is not None:
                # a dead owner would swallow the multi-chunk updates forwarded to it: re-plan without it
                self._plan = msgspec.structs.replace(self._plan, owners=self._owners())
                self.publish(self.topics.workers_round, self.signer.sign(self._plan.to_json()), True)
        elif not self.fed.aggregator.mergeable:
            raise Rejected("not_mergeable", f"{kind} from {worker}: the {self.fed.aggregator.name} aggregator merges no partials")
        elif kind == "receipt":
            self._receipt(worker, Receipt.from_json(payload, MAX_RECEIPT_BYTES))
        elif kind == "summary":
            summary = PartialSummary.from_json(payload, MAX_PLAN_BYTES)
            if summary.run == self._run and summary.round == self._round:
                self._deliveries.setdefault(worker, _Delivery()).summary = summary
                self._try_assemble(worker, None)
        elif kind == "partial":
            self._partial_chunk(worker, payload)

    def _receipt(self, worker: str, rc: Receipt) -> None:
        r = self.fed.round
        if rc.outcome != "accepted":
            self.late += rc.late
            self.reject(rc.outcome, rc.client or "?", f"(worker {worker}) {rc.detail}")
            return
        if r is None or rc.round != r.index or rc.client not in r.assignments:
            raise Rejected("stale_receipt", f"worker {worker} accepted {rc.client} for round {rc.round}")
        if rc.client in self.held or rc.client in r.received:
            raise Rejected("duplicate_update", f"{rc.client} reported twice (worker {worker} and "
                                               f"{self.held.get(rc.client, 'the coordinator')})")
        self.held[rc.client] = worker
        norm = rc.metrics.get("norm")
        if isinstance(norm, (int, float)) and not isinstance(norm, bool) and math.isfinite(norm) and norm >= 0:
            r.norms[rc.client] = float(norm)
        log.info(f"round {r.index}: update from {rc.client} accepted by {worker}",
                 extra={"round": r.index, "client": rc.client, "worker": worker})
        r.received.add(rc.client)
        r.client_metrics[rc.client] = {**rc.metrics, "worker": worker}
        self.fed.bytes_in += rc.nbytes

    def _partial_chunk(self, worker: str, payload: bytes) -> None:
        if len(payload) > self.chunk_bytes * 4:
            raise WireError("oversized", f"{len(payload)}-byte partial chunk from {worker}")
        header = parse_chunk(payload).header
        if header.kind != "partial" or header.client != worker or header.federation != self.topics.federation:
            raise Rejected("bad_partial", f"a {header.kind} message of {header.client} on {worker}'s partial topic")
        if header.round != self._round:
            return  # a partial of a round already closed without it
        done = self.reasm.feed(payload)
        if done is not None:
            self._try_assemble(worker, done)

    def _try_assemble(self, worker: str, done: Assembled | None) -> None:
        d = self._deliveries.setdefault(worker, _Delivery())
        d.assembled = done or d.assembled
        s = d.summary
        if s is None or d.agg is not None:
            return
        if s.digest is None:
            d.agg = partial_from(self.fed.layout, s, {})
        elif d.assembled is not None and d.assembled.header.digest == s.digest:
            d.agg = partial_from(self.fed.layout, s, d.assembled.tensors)

    def workers_seen(self) -> int:
        """Workers that have been online at least once (a later death does not hold rounds back)."""
        return len(self.seen)

    # -- rounds -----------------------------------------------------------------------------------
    def open(self, run: str, layout: Layout) -> None:
        """Publish the round plan every worker checks updates against (retained: a late worker gets it)."""
        r, fed = self.fed.round, self.fed
        self._run, self._round = run, r.index
        self.held, self._deliveries, self.late = {}, {}, 0
        self.reasm.discard_rounds_before(r.index)
        plan = WorkerRound(
            federation=self.topics.federation, run=run, round=r.index, profile=self.profile.to_dict(),
            profile_hash=layout.profile.hash, assignments=dict(r.assignments),
            keys={c: fed.keys[c] for c in r.assignments if c in fed.keys},
            references=[reference_norm(fed.state, layout, k) if k in r.assignments.values() else 0.0
                        for k in range(layout.num_submodels)],
            norms=[fed.guard.recent(k) for k in range(layout.num_submodels)], bound=plan_bound(fed.robustness.bound),
            screen=plan_screen(fed.robustness.aggregation),
            deadline_s=fed.round_timeout, max_update_bytes=self.max_update_bytes, chunk_bytes=self.chunk_bytes,
            owners=self._owners())
        self.publish(self.topics.workers_round, self.signer.sign(plan.to_json()), True)
        self._plan = plan

    def _owners(self) -> list[str]:
        return sorted(w for w, role in self.roles.items() if role == "worker")

    def close(self, pump: Callable[[float], None]) -> dict[str, Any]:
        """Ask for every partial, wait for the online workers' (or the timeout), merge them into the
        round's aggregate; returns the round's worker facts. Updates a worker accepted but never
        delivered are taken out of the round's reported set and counted as lost."""
        t0 = time.monotonic()
        if not self.roles and not self.held:
            return {}  # no worker or relay in this federation: nothing to ask for
        close = RoundClose(federation=self.topics.federation, run=self._run, round=self._round)
        self.publish(self.topics.workers_close, self.signer.sign(close.to_json()), False)
        deadline = t0 + self.timeout_s
        while time.monotonic() < deadline:  # an online worker that has not delivered: wait (a dead one never will)
            if all(self._deliveries.get(w, _Delivery()).agg is not None for w in self.roles):
                break
            pump(deadline)
        r, merged, clients = self.fed.round, [], set()
        for w, d in sorted(self._deliveries.items()):
            if d.agg is not None:
                self.fed.agg.merge(d.agg)
                self.fed.agg.dropped.update(d.summary.dropped)
                clients.update(d.summary.clients)
                merged.append(w)
        lost = sorted(c for c, w in self.held.items() if c not in clients)
        for c in lost:
            r.received.discard(c)
            r.client_metrics.pop(c, None)
        lost_workers = sorted({self.held[c] for c in lost})
        if lost:
            log.warning(f"round {self._round}: {len(lost)} update(s) lost with worker(s) {', '.join(lost_workers)}",
                        extra={"round": self._round})
        self._round, self._plan = -1, None  # partials arriving from now on belong to no round
        return {"workers": {"merged": merged, "lost_workers": lost_workers, "lost_updates": len(lost), "lost_clients": lost,
                            "collect_s": round(time.monotonic() - t0, 3)}}
