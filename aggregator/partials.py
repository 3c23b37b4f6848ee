"""Partial aggregates across processes: a worker's NeFedAvg as tensors + a typed summary, and the
coordinator's side of its workers and site relays (round plans, receipts, checked merge, losses).

NeFedAvg is a weighted sum and a total weight per submodel group, so partials merge exactly:
the coordinator adds the workers' group sums (float32, the same dtype NeFedAvg sums in) and their
float64 weights, then finalizes once. Only the order of float32 additions differs from one process
summing every update, which docs/scale.md bounds. A worker that dies loses only the updates it
held; they are counted in the round's metrics, and the round closes with everybody else's.

Workers and relays are authenticated: every message on `worker/{id}/...` must be signed by the key the
operator authorised for that id (aggregator/enrolment.py), or it is a counted rejection. And a partial is
believed only as far as the coordinator can check it against the receipts it saw (`check_partial`).
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
from aggregator.intake import DeviceKeys
from nefl.aggregation.aggregate import UpdateError, Weighting, update_weight
from nefl.aggregation.nefedavg import NeFedAvg, as_mergeable
from nefl.protocol.messages import (MAX_PLAN_BYTES, MAX_RECEIPT_BATCH_BYTES, BoundSettings, PartialSummary, Receipt, ReceiptBatch, RoundClose,
                           ScreenSettings, StatusBook, WorkerRound, WorkerStatus)
from nefl.nested.profile import Profile
from nefl.aggregation.robust import NormBound, update_norm
from nefl.aggregation.config import AggregationConfig
from nefl.protocol.signing import Signer, verify
from nefl.nested.state import Layout
from nefl.protocol.topics import Topics
from nefl.protocol.wire import Assembled, Reassembler, WireError

log = logging.getLogger("aggregator.server")
MAX_WORKERS = 1024  # workers and relays of one federation (a hostile id flood stops here)
NORM_SLACK = 1e-4  # relative: float32 sums and float64 norms of the same numbers differ by ~1e-6


@dataclass(frozen=True)
class Held:
    """What an (authenticated) accepted receipt told the coordinator about one update a worker holds."""

    worker: str
    submodel: int
    weight: float  # what the update counts for in its group (uniform: 1; samples: its sample count)
    norm: float  # its L2 norm as the worker's bound measured it (<= the bound, checked on receipt)


def check_partial(layout: Layout, summary: PartialSummary, tensors: dict[str, torch.Tensor], held: dict[str, Held],
                  worker: str, weighting: Weighting = "uniform") -> tuple[NeFedAvg, dict[str, float]]:
    """A worker's partial as a NeFedAvg, and the norms of its kept updates that the adaptive bound may
    record; WireError("bad_partial") unless the partial is what the receipts the coordinator saw allow:
    it names only clients the worker receipted, each submodel's count and weight are exactly those of
    its kept updates, the tensors are exactly a NeFedAvg of the layout's, and each group sum's norm is
    at most the weighted sum of its updates' receipted norms (triangle inequality, so no group carries
    more than its updates; each receipted norm was checked against the bound on arrival). A group of
    one update reveals that update: its norm is recomputed from the sum; in larger groups the receipted
    norms are recorded as bounded above by the bound and, together, below by the sum."""
    mine = {c: h for c, h in held.items() if h.worker == worker}
    unknown = sorted(set(summary.clients) - set(mine))
    if unknown:
        raise WireError("bad_partial", f"{worker}'s partial names {unknown[:5]}, which it sent no accepted receipt for")
    if not set(summary.dropped) <= set(summary.clients):
        raise WireError("bad_partial", "the summary drops clients it does not name")
    kept = [c for c in summary.clients if c not in summary.dropped]
    num = layout.num_submodels
    counts, weights = [0] * num, [0.0] * num
    for c in kept:
        counts[mine[c].submodel] += 1
        weights[mine[c].submodel] += mine[c].weight
    if len(summary.updates) != num or list(summary.updates) != counts:
        raise WireError("bad_partial", f"{worker}'s partial counts {list(summary.updates)} updates per submodel, its "
                                       f"receipts {counts}")
    if len(summary.weights) != num or not all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
                                                for a, b in zip(summary.weights, weights)):
        raise WireError("bad_partial", f"{worker}'s partial weighs its submodels {list(summary.weights)}, its receipts {weights}")
    try:
        agg = NeFedAvg.from_partial(layout, weights, counts, tensors, weighting)
    except UpdateError as e:
        raise WireError("bad_partial", str(e)) from None
    norms = {}
    for k in range(num):
        members = [c for c in kept if mine[c].submodel == k]
        if not members:
            continue
        got = update_norm(agg.groups[k])
        allowed = math.fsum(mine[c].weight * mine[c].norm for c in members)
        if not got <= allowed * (1 + NORM_SLACK) + 1e-12:
            raise WireError("bad_partial", f"{worker}'s submodel {k + 1} sum has norm {got:.4g}, more than its "
                                           f"{len(members)} update(s) can add up to ({allowed:.4g})")
        if len(members) == 1:
            norms[members[0]] = got / mine[members[0]].weight
        else:
            norms.update((c, mine[c].norm) for c in members)
    return agg, norms


def partial_bytes_limit(layout: Layout) -> int:
    """The largest honest partial: every submodel's upload in float32, plus safetensors headers."""
    numel = sum(math.prod(s) for k in range(layout.num_submodels) for s in layout.upload_shapes(k).values())
    return 4 * numel + (1 << 20)


def plan_bound(bound: NormBound) -> BoundSettings:
    return BoundSettings(max_norm=bound.max_norm, relative=bound.relative, adaptive_k=bound.adaptive_k,
                         mode=bound.mode, window=bound.window, warmup=bound.warmup)


def plan_screen(cfg: AggregationConfig) -> ScreenSettings:
    return ScreenSettings(centre_check=cfg.centre_check, min_agree=cfg.min_agree, max_norm_ratio=cfg.max_norm_ratio,
                          min_cover=cfg.min_cover, hold=cfg.hold, sketch=cfg.sketch)


@dataclass
class _Delivery:
    """What one worker sent for the closing round: its summary, its reassembled tensors, and the two
    checked and joined into a NeFedAvg once the tensors' digest is the one the summary names."""

    summary: PartialSummary | None = None
    assembled: Assembled | None = None
    agg: NeFedAvg | None = None
    norms: dict[str, float] = field(default_factory=dict)  # what its kept updates may add to the bound's history
    refused: bool = False  # the partial failed its checks: nothing to wait for


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
    worker_keys: Callable[[str], str | None] = lambda w: None  # the key the operator authorised for a worker id
    device_keys: Callable[[str], str | None] = lambda c: None  # pinned device keys, for the round plan
    stamp: Callable[[], dict[str, int]] = dict  # the incarnation and next sequence number of a signed message
    roles: dict[str, str] = field(default_factory=dict)  # online worker id -> "worker" | "relay"
    held: dict[str, Held] = field(default_factory=dict)  # client -> what the receipt of its update said
    late: int = 0
    seen: set[str] = field(default_factory=set)  # workers ever online
    _deliveries: dict[str, _Delivery] = field(default_factory=dict)
    _statuses: StatusBook = field(default_factory=StatusBook)  # each worker's newest signed status
    _run: str = ""
    _round: int = 0
    _plan: WorkerRound | None = None

    def __post_init__(self) -> None:
        self.reasm = Reassembler(max_bytes=partial_bytes_limit(self.fed.layout), timeout_s=self.timeout_s, max_pending=1)
        self._keys = DeviceKeys(self.worker_keys)

    # -- inbound ----------------------------------------------------------------------------------
    def handle(self, worker: str, kind: str, payload: bytes) -> None:
        """One message of worker `worker`; raises MessageError / WireError / Rejected like any handler.
        Nothing is read before its signature checks out against the key authorised for that id."""
        key = self._keys(worker)
        if key is None:
            raise Rejected("unauthorised_worker", f"{kind} from {worker}, which has no authorised key "
                                                  f"(`aggregator enroll {worker} --worker --public-key KEY`)")
        if kind == "partial":
            self._partial_chunk(worker, key, payload)
            return
        if not payload and kind == "status":
            return  # a retained status cleared
        body = verify(payload, key)
        if kind == "status":
            self._status(worker, WorkerStatus.from_json(body))
        elif not self.fed.aggregator.mergeable:
            raise Rejected("not_mergeable", f"{kind} from {worker}: the {self.fed.aggregator.name} aggregator merges no partials")
        elif kind == "receipt":
            for rc in ReceiptBatch.from_json(body, MAX_RECEIPT_BATCH_BYTES).receipts:
                try:  # one bad receipt is counted on its own; the rest of the batch stands
                    self._receipt(worker, rc)
                except Rejected as e:
                    self.reject(e.reason, worker, str(e))
        elif kind == "summary":
            summary = PartialSummary.from_json(body, MAX_PLAN_BYTES)
            if summary.run == self._run and summary.round == self._round:
                self._deliveries.setdefault(worker, _Delivery()).summary = summary
                self._try_assemble(worker, None)

    def _status(self, worker: str, status: WorkerStatus) -> None:
        if not self._statuses.newer(worker, status.seq, status.state):
            return
        if status.state == "online":
            if worker not in self.roles and len(self.roles) >= MAX_WORKERS:
                raise Rejected("too_many_workers", f"{len(self.roles)} workers online already")
            self.roles[worker] = status.role
            if status.role == "worker" and len(self.seen) < MAX_WORKERS:
                self.seen.add(worker)
        elif self.roles.pop(worker, None) == "worker" and self._plan is not None:
            # a dead owner would swallow the multi-chunk updates forwarded to it: re-plan without it
            self._plan = msgspec.structs.replace(self._plan, owners=self._owners(), **self.stamp())
            self.publish(self.topics.workers_round, self.signer.sign(self._plan.to_json()), True)

    def _receipt(self, worker: str, rc: Receipt) -> None:
        r = self.fed.round
        if rc.run != self._run:
            raise Rejected("wrong_run", f"worker {worker}: a receipt of run {rc.run}, this is {self._run}")
        if rc.outcome != "accepted":
            self.late += rc.late
            if rc.attributed and rc.client:  # the client's own signed update was refused: don't wait for it
                self.fed.refused(rc.client, rc.round, rc.outcome)
            self.reject(rc.outcome, rc.client or "?", f"(worker {worker}) {rc.detail}")
            return
        if r is None or rc.round != r.index or rc.client not in r.assignments:
            raise Rejected("stale_receipt", f"worker {worker} accepted {rc.client} for round {rc.round}")
        if rc.client in self.held or (rc.client in r.received and rc.client not in r.deferred):
            raise Rejected("duplicate_update", f"{rc.client} reported twice (worker {worker} and "
                                               f"{self.held[rc.client].worker if rc.client in self.held else 'the coordinator'})")
        k = r.assignments[rc.client]
        bound, _ = self.fed.guard.limit(k, self.fed.weight_norm(k))
        if rc.norm is None or rc.samples < 1 or rc.norm > bound * (1 + NORM_SLACK):
            raise Rejected("bad_receipt", f"worker {worker} accepted {rc.client} with norm {rc.norm} and {rc.samples} "
                                          f"samples; the bound is {bound:.4g}")
        self.held[rc.client] = Held(worker, k, update_weight(self.fed.weighting, rc.samples), rc.norm)
        log.info(f"round {r.index}: update from {rc.client} accepted by {worker}",
                 extra={"round": r.index, "client": rc.client, "worker": worker})
        r.received.add(rc.client)
        r.client_metrics[rc.client] = {**rc.metrics, "worker": worker}
        self.fed.bytes_in += rc.nbytes

    def _partial_chunk(self, worker: str, key: Any, payload: bytes) -> None:
        if len(payload) > self.chunk_bytes * 4:
            raise WireError("oversized", f"{len(payload)}-byte partial chunk from {worker}")
        chunk = self.reasm.parse(payload, key)  # the signed header names the chunks' Merkle root: the sums are covered
        header = chunk.header
        if header.kind != "partial" or header.client != worker or header.federation != self.topics.federation:
            raise Rejected("bad_partial", f"a {header.kind} message of {header.client} on {worker}'s partial topic")
        if header.round != self._round:
            return  # a partial of a round already closed without it
        done = self.reasm.feed(chunk)
        if done is not None:
            self._try_assemble(worker, done)

    def _try_assemble(self, worker: str, done: Assembled | None) -> None:
        d = self._deliveries.setdefault(worker, _Delivery())
        d.assembled = done or d.assembled
        s = d.summary
        if s is None or d.agg is not None or d.refused:
            return
        if s.digest is not None and (d.assembled is None or d.assembled.header.digest != s.digest):
            return
        try:
            d.agg, d.norms = check_partial(self.fed.layout, s, d.assembled.tensors if s.digest else {}, self.held,
                                           worker, self.fed.weighting)
        except WireError:
            d.refused = True
            raise

    def workers_seen(self) -> int:
        """Workers that have been online at least once (a later death does not hold rounds back)."""
        return len(self.seen)

    # -- rounds -----------------------------------------------------------------------------------
    def open(self, run: str, layout: Layout, announce: bool = True) -> None:
        """A new round: publish the plan every worker checks updates against (retained: a late worker gets it).
        announce=False where no worker or relay is authorised (plain `serve`): nobody could use the plan, which
        names every participant's key; `announce` publishes it once one is."""
        self._run, self._round = run, self.fed.round.index
        self.held, self._deliveries, self.late = {}, {}, 0
        self.reasm.discard_rounds_before(self._round)
        if announce:
            self.announce(layout)

    def announce(self, layout: Layout) -> None:
        """Publish the open round's plan."""
        r, fed, run = self.fed.round, self.fed, self._run
        keys = {c: k for c in r.assignments if (k := self.device_keys(c)) is not None}
        plan = WorkerRound(
            federation=self.topics.federation, run=run, round=r.index, profile=self.profile.to_dict(),
            profile_hash=layout.profile.hash, assignments=dict(r.assignments), keys=keys,
            references=[fed.weight_norm(k) if k in r.assignments.values() else 0.0 for k in range(layout.num_submodels)],
            norms=[fed.guard.recent(k) for k in range(layout.num_submodels)], bound=plan_bound(fed.robustness.bound),
            screen=plan_screen(fed.robustness.aggregation),
            deadline_s=fed.round_timeout, max_update_bytes=self.max_update_bytes, chunk_bytes=self.chunk_bytes,
            owners=self._owners(), **self.stamp())
        self.publish(self.topics.workers_round, self.signer.sign(plan.to_json()), True)
        self._plan = plan

    def _owners(self) -> list[str]:
        return sorted(w for w, role in self.roles.items() if role == "worker")

    def close(self, pump: Callable[[float], None]) -> dict[str, Any]:
        """Ask for every partial, wait for those of the online workers and of every worker that holds an
        update of the round (or the timeout), check and merge them into the round's aggregate, then fold in
        the updates this process held back (resends no worker had); returns the round's worker facts.
        Updates a worker accepted but never delivered are taken out of the round's reported set and
        counted as lost."""
        t0 = time.monotonic()
        r = self.fed.round
        if not self.roles and not self.held:
            self.fed.fold_deferred(set())
            return {}  # no worker or relay in this federation: nothing to ask for
        close = RoundClose(federation=self.topics.federation, run=self._run, round=self._round, **self.stamp())
        self.publish(self.topics.workers_close, self.signer.sign(close.to_json()), False)
        deadline = t0 + self.timeout_s
        awaited = set(self.roles) | {h.worker for h in self.held.values()}
        while time.monotonic() < deadline:  # an online worker that has not delivered: wait (a dead one never will)
            if all((d := self._deliveries.get(w)) is not None and (d.agg is not None or d.refused) for w in awaited):
                break
            pump(deadline)
        merged, clients = [], set()
        for w, d in sorted(self._deliveries.items()):
            if d.agg is not None:
                as_mergeable(self.fed.agg).merge(d.agg)
                self.fed.agg.dropped.update(d.summary.dropped)
                clients.update(d.summary.clients)
                r.norms.update(d.norms)
                merged.append(w)
        lost = sorted(c for c in self.held if c not in clients and c not in r.deferred)
        for c in lost:
            r.received.discard(c)
            r.client_metrics.pop(c, None)
        self.fed.fold_deferred(clients)
        lost_workers = sorted({self.held[c].worker for c in lost})
        if lost:
            log.warning(f"round {self._round}: {len(lost)} update(s) lost with worker(s) {', '.join(lost_workers)}",
                        extra={"round": self._round})
        refused = sorted(w for w, d in self._deliveries.items() if d.refused)
        self._round, self._plan = -1, None  # partials arriving from now on belong to no round
        return {"workers": {"merged": merged, "lost_workers": lost_workers, "lost_updates": len(lost), "lost_clients": lost,
                            **({"refused_partials": refused} if refused else {}),
                            "collect_s": round(time.monotonic() - t0, 3)}}
