"""Federation state without any networking: who is connected, who trains what this round, and the
streaming aggregate of the updates that arrived.

The server feeds it verified messages and the clock; it answers "accepted" or raises Rejected with
a reason code. Keeping this free of MQTT makes the round rules testable and keeps memory O(model):
an accepted update is folded into NeFedAvg at once and dropped.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from nefl.aggregate import NeFedAvg, UpdateError
from nefl.state import GlobalState, Layout


class Rejected(ValueError):
    """An inbound message refused for `reason`; logged and counted, never fatal."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass
class ClientInfo:
    client_id: str
    max_submodel: int  # 0-based, already clipped to the profile
    samples: int
    device: dict[str, Any] = field(default_factory=dict)
    online: bool = True
    selection: str = ""  # the device's own reason for its current max_submodel


@dataclass
class RoundState:
    index: int
    assignments: dict[str, int]  # client -> 0-based submodel
    deadline: float
    started: float
    received: set[str] = field(default_factory=set)
    client_metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    declined: dict[str, str] = field(default_factory=dict)  # client -> its reason


def state_digest(state: GlobalState) -> str:
    """sha256 over every tensor (name, dtype, shape, bytes): equal digests mean bit-identical weights."""
    h = hashlib.sha256()
    for name, t in sorted(state.flat().items()):
        t = t.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Federation:
    def __init__(self, layout: Layout, state: GlobalState, federation: str, clients_per_round: int,
                 min_clients: int, round_timeout: float, weighting: str = "uniform", seed: int = 0) -> None:
        if min_clients < 1 or clients_per_round < min_clients:
            raise ValueError("need 1 <= --min-clients <= --clients-per-round")
        self.layout, self.state, self.name = layout, state, federation
        self.clients_per_round, self.min_clients, self.round_timeout = clients_per_round, min_clients, round_timeout
        self.weighting = weighting
        self.clients: dict[str, ClientInfo] = {}
        self.round: RoundState | None = None
        self.agg: NeFedAvg | None = None
        self.rejected: Counter[str] = Counter()
        self.bytes_in = 0
        self._rng = random.Random(seed)

    # -- membership ---------------------------------------------------------------------------
    def announce(self, client_id: str, body: dict[str, Any]) -> ClientInfo:
        """Register or refresh a client from its announce message (already JSON-decoded, untrusted)."""
        try:
            max_sub = int(body["max_submodel"]) - 1  # announced 1-based, like the CLI
            samples = int(body["samples"])
        except (KeyError, TypeError, ValueError):
            raise Rejected("malformed_announce", "announce needs integer max_submodel and samples") from None
        if max_sub < -1 or samples < 1:  # announced 0: the device cannot train anything right now
            raise Rejected("malformed_announce", f"max_submodel {max_sub + 1} / samples {samples} out of range")
        device = body.get("device") if isinstance(body.get("device"), dict) else {}
        selection = str(body.get("selection", ""))[:200]
        info = ClientInfo(client_id, min(max_sub, self.layout.num_submodels - 1), samples, device, selection=selection)
        self.clients[client_id] = info
        r = self.round
        if r is not None and client_id in r.assignments and client_id not in r.received \
                and info.max_submodel < r.assignments[client_id]:
            # the device no longer fits its assigned submodel: don't hold the round for it
            del r.assignments[client_id]
            r.declined[client_id] = info.selection or f"can train submodel <= {info.max_submodel + 1} now"
        return info

    def set_online(self, client_id: str, online: bool) -> None:
        if client_id in self.clients:
            self.clients[client_id].online = online

    def available(self) -> list[str]:
        return sorted(c for c, info in self.clients.items() if info.online and info.max_submodel >= 0)

    # -- rounds -------------------------------------------------------------------------------
    def open_round(self, index: int, now: float | None = None) -> RoundState:
        """Pick participants among online clients; each trains the largest submodel it announced."""
        now = time.monotonic() if now is None else now
        pool = self.available()
        chosen = sorted(self._rng.sample(pool, min(self.clients_per_round, len(pool))))
        self.round = RoundState(index, {c: self.clients[c].max_submodel for c in chosen}, now + self.round_timeout, now)
        self.agg = NeFedAvg(self.layout, self.weighting)
        return self.round

    def check_header(self, topic_client: str, header: dict[str, Any]) -> int:
        """Identity and round checks before the payload is even hashed; returns the submodel."""
        r = self.round
        if header["kind"] != "update":
            raise Rejected("wrong_kind", f"{header['kind']!r} message on an update topic")
        if header["federation"] != self.name:
            raise Rejected("wrong_federation", f"federation {header['federation']!r}, this is {self.name!r}")
        if header["client"] != topic_client:
            raise Rejected("client_mismatch", f"payload says client {header['client']!r}, topic says {topic_client!r}")
        if r is None or header["round"] != r.index:
            raise Rejected("stale_round", f"round {header['round']}, open round is {r.index if r else None}")
        if topic_client not in r.assignments:
            raise Rejected("unassigned", f"{topic_client} is not a participant of round {r.index}")
        if header["submodel"] != r.assignments[topic_client]:
            raise Rejected("submodel_mismatch",
                           f"update for submodel {header['submodel'] + 1}, assigned {r.assignments[topic_client] + 1}")
        if topic_client in r.received:
            raise Rejected("duplicate_update", f"{topic_client} already reported round {r.index}")
        return header["submodel"]

    def accept(self, topic_client: str, header: dict[str, Any], delta: dict[str, torch.Tensor], nbytes: int) -> None:
        k = self.check_header(topic_client, header)
        if header["samples"] < 1:
            raise Rejected("bad_samples", f"sample count {header['samples']}")
        try:
            self.agg.add(k, delta, header["samples"])
        except UpdateError as e:
            raise Rejected("tensor_mismatch", str(e)) from None
        self.round.received.add(topic_client)
        metrics = header["metrics"]
        self.round.client_metrics[topic_client] = {
            "submodel": k + 1, "bytes": nbytes, "samples": header["samples"],
            **{m: v for m, v in metrics.items() if isinstance(v, (int, float))},
            **({"selection": metrics["selection"][:200]} if isinstance(metrics.get("selection"), str) else {}),
        }
        self.bytes_in += nbytes

    def reject(self, reason: str) -> None:
        self.rejected[reason] += 1

    def complete(self, now: float | None = None) -> bool:
        """Quorum reached and every participant reported, or the deadline passed."""
        r = self.round
        now = time.monotonic() if now is None else now
        everyone = len(r.received) >= len(r.assignments) and len(r.received) >= self.min_clients
        return everyone or now >= r.deadline

    def close_round(self) -> dict[str, Any]:
        """Fold the aggregate into the global state (only with quorum); returns the round's facts."""
        r, agg = self.round, self.agg
        quorum = len(r.received) >= self.min_clients
        if quorum:
            self.state = agg.finalize(self.state)
        facts = {
            "round": r.index, "quorum": quorum, "participants": sorted(r.assignments),
            "assigned": {c: k + 1 for c, k in sorted(r.assignments.items())},
            "reported": sorted(r.received), "declined": r.declined, "updates_per_submodel": list(agg.updates),
            "clients": r.client_metrics,
        }
        self.round, self.agg = None, None
        return facts
