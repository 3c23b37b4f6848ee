"""Federation state without any networking: who is connected, who trains what this round, and the
streaming aggregate of the updates that arrived.

The server feeds it verified messages and the clock; it answers "accepted" or raises Rejected with
a reason code. Keeping this free of MQTT makes the round rules testable and keeps memory O(model):
an accepted update is folded into NeFedAvg at once and dropped.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import random
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from aggregator.assignment import Assignment, Candidate, coverage_order, get_policy
from aggregator.rejected import Rejected
from nefl.aggregation.aggregate import ReferenceUpdate, RoundAggregate, Weighting
from nefl.aggregation.gate import Gate
from nefl.aggregation.pipeline import Pipeline, Robustness, Statistics
from nefl.aggregation.robust import UpdateGuard, UpdateRejected, reference_norm
from nefl.aggregation.step_bound import StepBound
from nefl.aggregation.update_check import UpdateError, check_update
from nefl.nested.checkpoint import UPDATES_TOTAL_KEY
from nefl.nested.state import GlobalState, Layout
from nefl.nested.tensors import byte_view
from nefl.protocol.messages import Announce, Decline, DeviceSummary
from nefl.protocol.wire import Assembled, ChunkHeader

log = logging.getLogger(__name__)


@dataclass
class ClientInfo:
    client_id: str
    max_submodel: int  # 0-based, already clipped to the profile
    samples: int
    device: DeviceSummary = field(default_factory=DeviceSummary)
    online: bool = True
    selection: str = ""  # the device's own reason for its current max_submodel
    last_seen: float = 0.0  # monotonic time of its last announce or status change
    announces: list[float] = field(default_factory=list)  # times of its recent announces (rate limit)
    sequence: tuple[str, int] = ("", 0)  # (session, seq) of the newest announce taken


@dataclass(frozen=True)
class ClientLimits:
    """Per-client bounds: what one device id can make the server remember and do."""

    max_clients: int = 10_000  # client table size; offline clients are evicted first
    forget_after_s: float = 3600.0  # an offline client is forgotten after this long
    announces_per_minute: int = 30  # honest devices announce on changes, a few times per round


@dataclass(frozen=True)
class Update:
    """A complete update as the round engine judges it: who sent it, for which task, and its tensors."""

    client: str
    round: int
    submodel: int
    samples: int
    delta: dict[str, torch.Tensor]
    nbytes: int
    metrics: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_wire(cls, client: str, done: Assembled) -> Update:
        h = done.header
        return cls(client, h.round, h.submodel, h.samples, done.tensors, done.nbytes, h.metrics)


@dataclass
class RoundState:
    index: int
    assignments: dict[str, int]  # client -> 0-based submodel
    deadline: float
    started: float
    received: set[str] = field(default_factory=set)
    client_metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    declined: dict[str, str] = field(default_factory=dict)  # client -> its reason
    refused: dict[str, str] = field(default_factory=dict)  # participant -> why its own (signed) update was refused
    norms: dict[str, float] = field(default_factory=dict)  # client -> its accepted update's norm
    # accepted here while workers take the round's updates (a resend): folded at close unless a worker had it
    deferred: dict[str, tuple[int, dict[str, torch.Tensor], int]] = field(default_factory=dict)
    waited: str | None = None  # the participant `complete` last found the round waiting for


def state_digest(state: GlobalState) -> str:
    """sha256 over every tensor (name, dtype, shape, bytes): equal digests mean bit-identical weights."""
    h = hashlib.sha256()
    for name, t in sorted(state.flat().items()):
        h.update(_digest_prefix(name, t.dtype, t.shape))
        h.update(byte_view(t.cpu()))  # the buffer itself where contiguous, not a copy
    return h.hexdigest()


@functools.lru_cache(maxsize=8192)
def _digest_prefix(name: str, dtype: torch.dtype, shape: torch.Size) -> bytes:
    """What precedes a tensor's bytes in `state_digest`: the same few hundred names every round."""
    return f"{name}|{dtype}|{tuple(shape)}|".encode()


class Federation:
    def __init__(self, layout: Layout, state: GlobalState, federation: str, clients_per_round: int,
                 min_clients: int, round_timeout: float, weighting: Weighting = "uniform", seed: int = 0,
                 limits: ClientLimits = ClientLimits(), robustness: Robustness = Robustness(), offline_grace_s: float = 10.0,
                 assignment: Assignment = "coverage", tiers: Mapping[str, int] | None = None,
                 trained_updates: Sequence[int] | None = None, warn_untrained_after: int = 3,
                 reference: ReferenceUpdate | None = None, rule_seed: int | None = None,
                 rule_secret: bytes | None = None, gate: Gate | None = None,
                 statistics: Statistics | None = None) -> None:
        """`robustness`, `weighting`, `reference` (the server's root updates), `rule_seed` (the rule's draws,
        stable across restarts; default `seed`) and `rule_secret` (a server's: the draws then come from it, not the
        seed), `gate` and `statistics` (the server's held-out checks and running statistics) make the aggregation
        pipeline (nefl/aggregation/pipeline.py)."""
        if min_clients < 1 or clients_per_round < min_clients:
            raise ValueError("need 1 <= --min-clients <= --clients-per-round")
        self.layout, self.state, self.name = layout, state, federation
        self.clients_per_round, self.min_clients, self.round_timeout = clients_per_round, min_clients, round_timeout
        self.limits = limits
        self.offline_grace_s = offline_grace_s
        self.aggregator = Pipeline(layout, robustness, weighting, reference, seed if rule_seed is None else rule_seed,
                                   rule_secret, gate, statistics)
        self._bounded: dict[int, int] = {}  # submodel -> its tensors the step bound scaled down this round
        self._reference: dict[int, float] = {}  # submodel -> norm of its current weights, once per round
        self.clients: dict[str, ClientInfo] = {}
        # last status per client id, announced or not (retained statuses and announces arrive in any
        # order); bounded like the client table, oldest entries first out
        self.presence: OrderedDict[str, bool] = OrderedDict()
        self.defer_direct = False  # workers take the round's updates: hold what arrives here until their partials
        self.round: RoundState | None = None
        self.agg: RoundAggregate | None = None
        self.rejected: Counter[str] = Counter()
        self.bytes_in = 0
        self._rng = random.Random(seed)
        self._assign = get_policy(assignment)
        self.assignment = assignment
        self.tiers = dict(tiers or {})  # fixed tiers (the simulator's); a server client's tier is its bound
        # committed updates per submodel, all rounds
        self.trained_updates = self._update_counts([0] * layout.num_submodels if trained_updates is None else trained_updates)
        self.untrained_rounds = [0] * layout.num_submodels  # consecutive rounds without a committed update
        self.warn_untrained_after = warn_untrained_after

    @property
    def robustness(self) -> Robustness:
        return self.aggregator.robustness

    @property
    def weighting(self) -> Weighting:
        """What an update counts for in its group: the aggregation's, the one source (workers' receipts weigh by it)."""
        return self.aggregator.weighting

    @property
    def guard(self) -> UpdateGuard:
        """The update bound, checked on every update at intake."""
        return self.aggregator.guard

    @property
    def steps(self) -> StepBound | None:
        """The step bound at commit (with the centre check); its history is checkpointed."""
        return self.aggregator.steps

    # -- checkpoint ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint's metadata needs, besides the weights, to resume this federation: the adaptive bound's
        history, the step bound's (with its anchors) and the tensor sizes', the committed updates per submodel (under
        the meta keys older checkpoints use)."""
        sizes = self.aggregator.sizes
        return {"update_guard": self.guard.state_dict(),
                **({"step_bound": self.steps.state_dict()} if self.steps is not None else {}),
                **({"tensor_sizes": sizes.state_dict()} if sizes is not None else {}),
                UPDATES_TOTAL_KEY: list(self.trained_updates)}

    def load_state_dict(self, meta: Mapping[str, Any]) -> None:
        """Resume from a checkpoint's metadata; a part it lacks (an older checkpoint) stays as it was."""
        if meta.get(UPDATES_TOTAL_KEY) is not None:
            self.trained_updates = self._update_counts(meta[UPDATES_TOTAL_KEY])
        if "update_guard" in meta:
            self.guard.load_state_dict(meta["update_guard"])
        if "step_bound" in meta and self.steps is not None:
            self.steps.load_state_dict(meta["step_bound"])
        if "tensor_sizes" in meta and self.aggregator.sizes is not None:
            self.aggregator.sizes.load_state_dict(meta["tensor_sizes"])

    def _update_counts(self, counts: Sequence[int]) -> list[int]:
        if len(counts) != self.layout.num_submodels:
            raise ValueError(f"{len(counts)} update counts for {self.layout.num_submodels} submodels: "
                             "the checkpoint belongs to another profile")
        return list(counts)

    # -- membership ---------------------------------------------------------------------------
    def announce(self, client_id: str, msg: Announce, now: float | None = None) -> ClientInfo:
        """Register or refresh a client from its (schema-checked, still untrusted) announce."""
        now = time.monotonic() if now is None else now
        if msg.client != client_id:
            raise Rejected("client_mismatch", f"announce says client {msg.client!r}, topic says {client_id!r}")
        old = self.clients.get(client_id) or self._admit(client_id, now)
        if msg.session and old.sequence[0] == msg.session and msg.seq < old.sequence[1]:
            raise Rejected("stale_announce", f"announce {msg.seq} arrived after announce {old.sequence[1]}")
        recent = [t for t in old.announces if now - t < 60.0]
        if len(recent) >= self.limits.announces_per_minute:
            raise Rejected("rate_limited", f"more than {self.limits.announces_per_minute} announces a minute")
        # only later rounds read it: a task the device already holds is refused by a Decline, never by an
        # announce, which may have been sent before that task existed
        info = ClientInfo(client_id, min(msg.max_submodel - 1, self.layout.num_submodels - 1), msg.samples, msg.device,
                          online=old.online, selection=msg.selection, last_seen=now, announces=[*recent, now],
                          sequence=(msg.session, msg.seq))
        self.clients[client_id] = info
        return info

    def decline(self, client_id: str, msg: Decline) -> None:
        """The device will not train its task of the open round: stop waiting for it in this round."""
        r = self.round
        if msg.client != client_id:
            raise Rejected("client_mismatch", f"decline says client {msg.client!r}, topic says {client_id!r}")
        if r is None or msg.round != r.index or r.assignments.get(client_id) != msg.submodel or client_id in r.received:
            raise Rejected("stale_decline", f"decline of round {msg.round} submodel {msg.submodel + 1}, which is not "
                                            f"{client_id}'s open task")
        del r.assignments[client_id]
        r.declined[client_id] = msg.reason or "declined"

    def _admit(self, client_id: str, now: float) -> ClientInfo:
        """A table slot for a new client: forget long-offline clients, then the longest-offline one."""
        self.forget_offline(now)
        if len(self.clients) >= self.limits.max_clients:
            offline = [c for c, i in self.clients.items() if not i.online and not self._in_round(c)]
            if not offline:
                raise Rejected("client_table_full", f"{len(self.clients)} clients known and online")
            del self.clients[min(offline, key=lambda c: self.clients[c].last_seen)]
        return ClientInfo(client_id, -1, 1, online=self.presence.get(client_id, False), last_seen=now)

    def _in_round(self, client_id: str) -> bool:
        return self.round is not None and client_id in self.round.assignments

    def forget_offline(self, now: float | None = None) -> list[str]:
        """Drop clients offline for longer than the limit (never a participant of the open round)."""
        now = time.monotonic() if now is None else now
        gone = [c for c, i in self.clients.items()
                if not i.online and now - i.last_seen > self.limits.forget_after_s and not self._in_round(c)]
        for c in gone:
            del self.clients[c]
        return gone

    def forget(self, client_id: str, why: str) -> None:
        """Drop a client (its enrolment was revoked or expired): not drawn again, not waited for this round."""
        self.clients.pop(client_id, None)
        self.presence.pop(client_id, None)
        r = self.round
        if r is not None and client_id in r.assignments and client_id not in r.received:
            del r.assignments[client_id]
            r.declined[client_id] = why

    def set_online(self, client_id: str, online: bool, now: float | None = None) -> None:
        """A client's status message: only a device that said "online" (and has not gone) is picked. The
        presence table is bounded; ids that never announced go first, so a flood of statuses under made-up
        ids cannot push the known clients out."""
        self.presence[client_id] = online
        self.presence.move_to_end(client_id)
        if len(self.presence) > self.limits.max_clients:
            stranger = next((c for c in self.presence if c not in self.clients), None)
            self.presence.pop(stranger if stranger is not None else next(iter(self.presence)))
        if client_id in self.clients:
            info = self.clients[client_id]
            info.online, info.last_seen = online, time.monotonic() if now is None else now

    def available(self) -> list[str]:
        return sorted(c for c, info in self.clients.items() if info.online and info.max_submodel >= 0)

    # -- rounds -------------------------------------------------------------------------------
    def open_round(self, index: int, now: float | None = None) -> RoundState:
        """Pick participants among online clients; the assignment policy gives each a submodel
        within the bound it announced."""
        now = time.monotonic() if now is None else now
        pool = self.available()
        chosen = sorted(self._rng.sample(pool, min(self.clients_per_round, len(pool))))
        bounds = {c: self.clients[c].max_submodel for c in chosen}
        assigned = self._assign([Candidate(c, m, self.tiers.get(c, m)) for c, m in bounds.items()],
                                coverage_order(self.trained_updates), self._rng)
        self.round = RoundState(index, {c: assigned[c] for c in chosen}, now + self.round_timeout, now)
        self._reference = {}
        self.agg = self.aggregator.begin_round(self.state, self.round.assignments, index, self.weight_norm)
        return self.round

    def adopt_round(self, index: int, assignments: dict[str, int], references: Sequence[float],
                    now: float | None = None) -> RoundState:
        """An aggregator worker's round: the coordinator's plan (who trains what, the weight norm each
        submodel's relative bound compares against) instead of its own draw, so the checks match."""
        now = time.monotonic() if now is None else now
        self.round = RoundState(index, dict(assignments), now + self.round_timeout, now)
        self._reference = {k: float(v) for k, v in enumerate(references) if v > 0}
        self.agg = self.aggregator.begin_round(self.state, self.round.assignments, index, self.weight_norm)
        return self.round

    def weight_norm(self, k: int) -> float:
        """Norm of submodel k's weights at the round's start (what relative bounds compare with), once a round:
        on the first ask, that of every submodel the round assigns, one after another (asked one by one as
        each submodel's first update arrived, each computation would run cold between updates)."""
        if k not in self._reference:
            wanted = {k, *(self.round.assignments.values() if self.round is not None else ())}
            for j in sorted(wanted - self._reference.keys()):
                self._reference[j] = reference_norm(self.state, self.layout, j)
        return self._reference[k]

    def check_header(self, topic_client: str, header: ChunkHeader) -> int:
        """Identity and round checks before the payload is even hashed; returns the submodel."""
        if header.kind != "update":
            raise Rejected("wrong_kind", f"{header.kind!r} message on an update topic")
        if header.federation != self.name:
            raise Rejected("wrong_federation", f"federation {header.federation!r}, this is {self.name!r}")
        if header.client != topic_client:
            raise Rejected("client_mismatch", f"payload says client {header.client!r}, topic says {topic_client!r}")
        return self._check_task(topic_client, header.round, header.submodel)

    def _check_task(self, client: str, index: int, k: int) -> int:
        """An update must answer this client's task of the open round, once; returns the submodel."""
        r = self.round
        if r is None or index != r.index:
            raise Rejected("stale_round", f"round {index}, open round is {r.index if r else None}")
        if client not in r.assignments:
            raise Rejected("unassigned", f"{client} is not a participant of round {r.index}")
        if k != r.assignments[client]:
            raise Rejected("submodel_mismatch", f"update for submodel {k + 1}, assigned {r.assignments[client] + 1}")
        if client in r.received:
            raise Rejected("duplicate_update", f"{client} already reported round {r.index}")
        return k

    def refused(self, client: str, index: int, reason: str) -> None:
        """A participant's own (signed) update for this round was refused: the round stops waiting for it.
        A later valid update from it still counts."""
        r = self.round
        if r is not None and r.index == index and client in r.assignments and client not in r.received:
            r.refused.setdefault(client, reason)

    def accept(self, u: Update) -> None:
        """Shapes, norm bound, then into the round's aggregate (or held back, see `defer_direct`); raises
        Rejected with the reason."""
        k = self._check_task(u.client, u.round, u.submodel)
        if u.samples < 1:
            raise Rejected("bad_samples", f"sample count {u.samples}")
        try:
            # the wire decoder proved every value finite; the norm bound would refuse NaN/inf anyway
            check_update(self.layout, k, u.delta, values=False)
            delta, norm, clipped = self.guard.check(k, u.delta, self.weight_norm(k))
            if self.defer_direct:
                self.round.deferred[u.client] = (k, delta, u.samples)
            else:
                self.agg.add_validated(k, delta, u.samples, client=u.client, owned=True)
        except UpdateError as e:
            raise Rejected("tensor_mismatch", str(e)) from None
        except UpdateRejected as e:
            raise Rejected(e.reason, str(e)) from None
        r = self.round
        r.received.add(u.client)
        r.norms[u.client] = norm
        metrics = u.metrics
        r.client_metrics[u.client] = {
            "submodel": k + 1, "bytes": u.nbytes, "samples": u.samples, "norm": round(norm, 6), "clipped": clipped,
            **{m: v for m, v in metrics.items() if isinstance(v, (int, float))},
            **({"selection": metrics["selection"][:200]} if isinstance(metrics.get("selection"), str) else {}),
        }
        self.bytes_in += u.nbytes

    def fold_deferred(self, merged: set[str]) -> list[str]:
        """Fold the updates held back this round into the aggregate, except those a worker's merged partial
        holds already (a resend whose first copy reached a worker after all); returns the ones folded."""
        r, folded = self.round, []
        for c, (k, delta, samples) in sorted(r.deferred.items()):
            if c not in merged:
                self.agg.add_validated(k, delta, samples, client=c, owned=True)
                folded.append(c)
        r.deferred.clear()
        return folded

    def reject(self, reason: str) -> None:
        self.rejected[reason] += 1

    def gone_offline(self) -> list[str]:
        """Participants that have not reported and whose last status says offline."""
        r = self.round
        return sorted(c for c in r.assignments if c not in r.received and not (c in self.clients and self.clients[c].online))

    def waiting_for(self, now: float | None = None) -> list[str]:
        """Participants that may still report: not reported, and online or offline for less than the
        grace period (a broker restart sends every device's last will, and the devices come back)."""
        now = time.monotonic() if now is None else now
        return [c for c in self.round.assignments if self._waits_for(c, now)]

    def _waits_for(self, client: str, now: float) -> bool:
        r, info = self.round, self.clients.get(client)
        if client not in r.assignments or client in r.received or client in r.refused:  # a decline leaves assignments
            return False
        return info is not None and (info.online or now - info.last_seen < self.offline_grace_s)

    def complete(self, now: float | None = None) -> bool:
        """Every participant still online reported, or the deadline passed: a participant whose last
        will says offline (and stays offline for the grace period) does not hold the round. Asked after
        every message: the participant it waited for last time is checked first, so a call costs O(1) until
        that one reports (a scan of all participants per message made a round of N devices cost O(N^2))."""
        r = self.round
        now = time.monotonic() if now is None else now
        if now >= r.deadline:
            return True
        if r.waited is None or not self._waits_for(r.waited, now):
            r.waited = next((c for c in r.assignments if self._waits_for(c, now)), None)
        return r.waited is None

    def close_round(self) -> dict[str, Any]:
        """Fold the aggregate into the global state (only with quorum); returns the round's facts.
        The adaptive bound remembers the norms of the updates the rule kept, once they are committed."""
        r, agg = self.round, self.agg
        quorum = len(r.received) >= self.min_clients
        held = agg.held_bytes
        problem = self._commit(agg) if quorum else "no quorum"
        kept = sorted(c for c in r.received if c not in agg.dropped) if problem is None else []
        for c in kept:
            if c in r.norms:
                self.guard.record(r.assignments[c], c, r.norms[c])
        self._count_training(r.index, self._per_submodel(kept))
        facts = {
            "round": r.index, "quorum": quorum, "committed": problem is None, "not_committed": problem,
            "participants": sorted(r.assignments),
            "assigned": {c: k + 1 for c, k in sorted(r.assignments.items())},
            "reported": sorted(r.received), "declined": r.declined,
            **({"refused": dict(sorted(r.refused.items()))} if r.refused else {}),
            "went_offline": self.gone_offline(), "updates_per_submodel": self._per_submodel(r.received),
            UPDATES_TOTAL_KEY: list(self.trained_updates), "clients": r.client_metrics,
            "aggregator": agg.name, "aggregate_held_bytes": held, **agg.facts(),
            **({"steps_bounded": {k + 1: n for k, n in sorted(self._bounded.items())}} if self._bounded else {}),
        }
        self._bounded = {}
        self.round, self.agg = None, None
        return facts

    def _per_submodel(self, clients: Iterable[str]) -> list[int]:
        """How many of these participants' updates each submodel got this round."""
        counts = [0] * self.layout.num_submodels
        for c in clients:
            counts[self.round.assignments[c]] += 1
        return counts

    def _count_training(self, index: int, committed: list[int]) -> None:
        """Cumulative updates per submodel, and a warning while one goes untrained: its weights stay
        as initialised, and an export would ship a submodel at chance accuracy."""
        for k, n in enumerate(committed):
            self.trained_updates[k] += n
            self.untrained_rounds[k] = 0 if n else self.untrained_rounds[k] + 1
        stale = [k + 1 for k, n in enumerate(self.untrained_rounds) if n >= self.warn_untrained_after]
        if stale:
            fix = "" if self.assignment == "coverage" else "use --assignment coverage, or "
            log.warning("submodel(s) %s untrained for %d+ rounds under --assignment %s: %sadd devices that can "
                        "train them%s", ", ".join(map(str, stale)), self.warn_untrained_after, self.assignment, fix,
                        self._why_untrainable(max(stale)), extra={"round": index})

    def _why_untrainable(self, submodel: int) -> str:
        """What the online devices that cannot train `submodel` (1-based) said binds them, and the fix
        when it is the deadline: the operator should read "the deadline", not only "add devices"."""
        reasons = sorted({f"{c}: {i.selection}" for c, i in self.clients.items()
                          if i.online and i.selection and i.max_submodel + 1 < submodel})
        if not reasons:
            return ""
        hint = " (or raise --round-timeout: the deadline binds)" if any("deadline binds" in r for r in reasons) else ""
        return f"{hint}; devices say {'; '.join(reasons[:3])}" + (f"; and {len(reasons) - 3} more" if len(reasons) > 3 else "")

    def _commit(self, agg: RoundAggregate) -> str | None:
        """Make the aggregate the new state unless it is not finite and bounded; returns why not."""
        done = self.aggregator.commit(agg, self.state)
        self._bounded = done.bounded
        if done.state is not None:
            self.state = done.state
        return done.problem
