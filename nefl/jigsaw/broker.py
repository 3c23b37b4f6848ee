"""The module exchange over an MQTT broker: FedJigsaw's `ModuleExchange` between real devices.

Each device is the source of its own modules. It announces their metadata (retained, `jigsaw/meta/{id}`),
answers a neighbour's fetch (`jigsaw/fetch/{id}`) with the module's parameters on the borrower's own topic
(`jigsaw/module/{borrower}`, the kit's chunked safetensors wire, kind "module"), takes trained copies back
(`jigsaw/return/{id}`, kind "return") and, when the coordinator opens the next round, averages them (Eq. 2).
Control messages are signed JSON; the wire headers are signed once per payload and name the chunks'
Merkle root (nefl/protocol/wire.py). Peers' keys come from the coordinator's signed plan.

Everything that arrives is hostile: `handle` checks the signature against the sender's key, the sender
against the topology, the round against the current one, a payload's size against the module's metadata and
its tensors' names and shapes, finiteness, and a returned copy's distance from the source's own module
against `norm_bound` x that module's norm (the paper's limitations section: a borrower can poison a source).
Anything refused is counted by reason and dropped; `handle` never raises.

Threads: the connection's inbox is drained by one thread that calls `handle`; the client step runs on
another and blocks in `fetch` until the module arrives or `fetch_timeout_s` passes (PeerUnavailable: the
caller masks that peer for the round). One lock guards the state.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from nefl.jigsaw.screen import ReturnScreen
from nefl.jigsaw.symbio import MetadataBroadcast, ModuleFetch, ModuleReturn, aggregate_returns, refusal, state_bytes
from nefl.jigsaw.zoo import BaseArch, ModuleMeta, build_module
from nefl.nested.state import module_state
from nefl.protocol import signing
from nefl.protocol.messages import MessageError, decode
from nefl.protocol.mqtt import QOS, Transport
from nefl.protocol.signing import Signer
from nefl.protocol.topics import Topics
from nefl.protocol.wire import Reassembler, WireError, encode, parse_header, split_chunk

MAX_META_BYTES = 64 * 1024
SLACK_BYTES = 64 * 1024  # safetensors header room above a module's tensor bytes


class PeerUnavailable(RuntimeError):
    """A source did not send the module in time: mask it for this round."""

    def __init__(self, source: int) -> None:
        super().__init__(f"client {source} did not answer in time")
        self.source = source


@dataclass(frozen=True)
class Peer:
    index: int
    client_id: str
    key: Ed25519PublicKey


def expected_shapes(meta: ModuleMeta) -> dict[str, torch.Size]:
    """The tensors a module of this metadata has (what an honest payload of it carries)."""
    return {k: v.shape for k, v in module_state(build_module(meta)).items()}


def payload_bound(shapes: dict[str, torch.Size]) -> int:
    """The most bytes an honest fp32 payload of a module with these tensors takes."""
    return 4 * sum(s.numel() for s in shapes.values()) + SLACK_BYTES


def largest_module_bytes(bases: list[BaseArch]) -> int:
    """The cap on any module payload of a federation whose devices build these base architectures."""
    return max(payload_bound(expected_shapes(m)) for b in bases for m in b.metas(0))


class BrokerExchange:
    """One device's side of the exchange: its own modules (`store`), its neighbours' announcements and the
    copies of its modules that come back. `begin_round` closes the previous round (Eq. 2 at this source)."""

    def __init__(self, topics: Topics, me: int, peers: dict[int, Peer], links: list[list[int]], signer: Signer,
                 transport: Transport, store: dict[str, dict[str, torch.Tensor]], chunk_bytes: int,
                 fetch_timeout_s: float, norm_bound: float, max_module_bytes: int,
                 clock: Callable[[], float] = time.monotonic, screen: ReturnScreen | None = None) -> None:
        self.topics, self.me, self.peers, self.links, self.signer = topics, me, peers, links, signer
        self.transport, self.store, self.chunk_bytes = transport, store, chunk_bytes
        self.fetch_timeout_s, self.norm_bound, self.clock = fetch_timeout_s, norm_bound, clock
        self.screen = screen  # judges each module's returns together when a round closes; None: plain Eq. 2
        self.by_id = {p.client_id: p for p in peers.values()}
        self.my_id = peers[me].client_id
        self.cond = threading.Condition()
        self.round = -1  # the open round: fetches and returns of another one are refused
        self.active: set[int] = set(peers)
        self.metadata: dict[int, list[ModuleMeta]] = {}
        self.own_meta: dict[int, ModuleMeta] = {}
        self.held: list[tuple[int, ModuleFetch]] = []  # fetches for a round this source has not opened yet
        self.arrived: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {}  # (round, source, position) -> module
        self.waiting: dict[tuple[int, int], tuple[int, dict[str, torch.Size]]] = {}  # (source, position) -> round, shapes
        self.returned: dict[str, list[tuple[int, int, dict[str, torch.Tensor]]]] = defaultdict(list)  # key -> (borrower, n, state)
        self.sent_back: list[int] = []  # sources of the copies this device returned in the open round
        self.heard = 0  # copies of this source's modules that arrived from peers in the open round, refused ones too
        self.rejected: Counter[str] = Counter()
        self.traffic: Counter[str] = Counter()
        own_bound = max((payload_bound({k: v.shape for k, v in st.items()}) for st in store.values()), default=SLACK_BYTES)
        self.returns_in = Reassembler(max_bytes=own_bound, timeout_s=600, max_pending=max(2, len(store)),
                                      max_buffered=own_bound * max(2, len(store)))
        self.modules_in = Reassembler(max_bytes=max_module_bytes, timeout_s=600, max_pending=2)

    def subscriptions(self) -> list[str]:
        t, me = self.topics, self.my_id
        return [t.jigsaw("meta", "+"), t.jigsaw("fetch", me), t.jigsaw("module", me), t.jigsaw("return", me)]

    # -- ModuleExchange -------------------------------------------------------------------------------

    def broadcast(self, msg: MetadataBroadcast) -> None:
        """Retained, so a neighbour that connects later still reads it."""
        with self.cond:
            self.own_meta = {m.position: m for m in msg.modules}
            self.metadata[self.me] = list(msg.modules)
        self._publish(self.topics.jigsaw("meta", self.my_id), self.signer.sign(msg.to_json()), "metadata_out", retain=True)

    def catalogue(self, client: int) -> list[ModuleMeta]:
        """The modules the active neighbours announced, each once (the simulator's order: by neighbour)."""
        with self.cond:
            seen: dict[str, ModuleMeta] = {}
            for j in self.links[client] if client < len(self.links) else ():
                for m in self.metadata.get(j, []) if j in self.active else ():
                    seen.setdefault(m.key, m)
            return list(seen.values())

    def fetch(self, req: ModuleFetch) -> dict[str, torch.Tensor]:
        """The module's parameters for round `req.round`: from the own store, or asked of the source and waited
        for until `fetch_timeout_s` (then PeerUnavailable)."""
        if req.source == self.me:
            with self.cond:
                return {k: v.clone() for k, v in self.store[f"c{self.me}.m{req.position}"].items()}
        key = (req.round, req.source, req.position)
        with self.cond:
            if key in self.arrived:  # asked again in the same round (a chain assembled anew after a peer was masked)
                return {k: v.clone() for k, v in self.arrived[key].items()}
            meta = next((m for m in self.metadata.get(req.source, []) if m.position == req.position), None)
            if meta is None or req.source not in self.active:
                raise PeerUnavailable(req.source)
            self.waiting[(req.source, req.position)] = (req.round, expected_shapes(meta))
        self._publish(self.topics.jigsaw("fetch", self.peers[req.source].client_id), self.signer.sign(req.to_json()),
                      "fetch_out")
        deadline = self.clock() + self.fetch_timeout_s
        with self.cond:
            while key not in self.arrived:
                left = deadline - self.clock()
                if left <= 0:
                    self.waiting.pop((req.source, req.position), None)
                    raise PeerUnavailable(req.source)
                self.cond.wait(min(left, 0.5))
            return {k: v.clone() for k, v in self.arrived[key].items()}

    def give_back(self, msg: ModuleReturn, state: dict[str, torch.Tensor]) -> None:
        """A trained copy to its source: kept here for an own module, else sent (kind "return", signed header)."""
        if msg.source == self.me:
            with self.cond:
                self._accept_return(self.me, msg.round, msg.position, state)
            return
        peer = self.peers[msg.source]
        for chunk in encode(state, kind="return", federation=self.topics.federation, round=msg.round,
                            submodel=msg.position, client=self.my_id, samples=msg.samples, chunk_bytes=self.chunk_bytes,
                            sign=self.signer.sign).messages:
            self._publish(self.topics.jigsaw("return", peer.client_id), chunk, "return_out")
        with self.cond:
            self.sent_back.append(msg.source)

    # -- rounds ---------------------------------------------------------------------------------------

    def begin_round(self, r: int, active: set[int], expected: int, grace_s: float) -> dict[str, int]:
        """Close the open round: wait up to `grace_s` for the `expected` copies peers said they sent, average
        every borrowed module's copies (Eq. 2), then open round r and answer the fetches held for it. Returns
        how many copies each module got."""
        deadline = self.clock() + grace_s
        with self.cond:
            while self.heard < expected and self.clock() < deadline:
                self.cond.wait(min(0.2, max(0.0, deadline - self.clock())))
            counts = self._aggregate()
            self.round, self.active = r, set(active) | {self.me}
            self.sent_back, self.heard = [], 0
            self.arrived.clear()
            held, self.held = [h for h in self.held if h[1].round == r], [h for h in self.held if h[1].round > r]
        for borrower, req in held:
            self._serve(borrower, req)
        return counts

    def _aggregate(self) -> dict[str, int]:
        counts = {}
        for key, copies in self.returned.items():
            ordered = [(b == self.me, st) for b, _, st in sorted(copies, key=lambda c: (c[0], c[1]))]  # the simulator's order
            self.store[key] = aggregate_returns(self.screen, key, self.store[key], ordered, self.rejected)
            counts[key] = len(copies)
        self.returned.clear()
        return counts

    # -- inbound: the trust boundary ------------------------------------------------------------------

    def handle(self, topic: str, payload: bytes) -> None:
        """One message from the broker: acted on, or counted under its reason and dropped. Never raises."""
        parsed = self.topics.jigsaw_of(topic)
        if parsed is None or parsed[1] is None or not payload:
            return
        kind, client = parsed
        try:
            if kind == "meta":
                self._on_meta(client, bytes(payload))
            elif kind == "fetch" and client == self.my_id:
                self._on_fetch(bytes(payload))
            elif kind == "module" and client == self.my_id:
                self._on_module(payload)
            elif kind == "return" and client == self.my_id:
                self._on_return(payload)
        except (MessageError, WireError) as e:
            self._reject(e.reason)
        except Exception:  # a hostile payload must not reach past the boundary, whatever it trips
            self._reject("malformed")

    def _reject(self, reason: str) -> None:
        with self.cond:
            self.rejected[reason] += 1

    def _sender(self, client_id: str) -> Peer:
        peer = self.by_id.get(client_id)
        if peer is None:
            raise MessageError("unknown_peer", f"{client_id} is not in the plan")
        return peer

    def _on_meta(self, client_id: str, payload: bytes) -> None:
        peer = self._sender(client_id)
        self._count_in("metadata_in", len(payload))
        msg = decode(signing.verify(payload, peer.key), MetadataBroadcast, MAX_META_BYTES)
        if msg.client != peer.index or any(m.source != peer.index for m in msg.modules):
            raise MessageError("foreign_module", f"{client_id} announced modules of another source")
        with self.cond:
            self.metadata[peer.index] = list(msg.modules)
            self.cond.notify_all()

    def _on_fetch(self, payload: bytes) -> None:
        self._count_in("fetch_in", len(payload))
        unsigned = signing.split_signed(payload)
        if unsigned is None:
            raise MessageError("unsigned", "fetch carries no signature")
        req = decode(unsigned[0], ModuleFetch)
        borrower = self.peers.get(req.client)
        if borrower is None:
            raise MessageError("unknown_peer", f"client {req.client} is not in the plan")
        signing.verify(payload, borrower.key)
        if req.source != self.me or req.position not in self.own_meta or borrower.index not in self.links[self.me]:
            raise MessageError("not_a_neighbour", f"client {req.client} may not fetch module {req.position} here")
        with self.cond:
            if req.round > self.round:
                if len(self.held) < 4 * len(self.own_meta) * len(self.peers):
                    self.held.append((borrower.index, req))
                return
            if req.round < self.round:
                raise MessageError("stale_round", f"fetch for round {req.round}, round {self.round} is open")
        self._serve(borrower.index, req)

    def _serve(self, borrower: int, req: ModuleFetch) -> None:
        with self.cond:  # a QoS 1 redelivery is answered again: the borrower's Reassembler drops the duplicate
            state = self.store[f"c{self.me}.m{req.position}"]
            chunks = encode(state, kind="module", federation=self.topics.federation, round=req.round,
                            submodel=req.position, client=self.my_id, samples=0, chunk_bytes=self.chunk_bytes,
                            sign=self.signer.sign).messages
        for chunk in chunks:
            self._publish(self.topics.jigsaw("module", self.peers[borrower].client_id), chunk, "module_out")

    def _assembled(self, inbox: Reassembler, payload: bytes, kind: str, size_bound: Callable[[Peer, int], int]):
        """The verified tensors once the last chunk of a payload from a known peer arrives; each chunk's header is
        signed by that peer and its payload no larger than `size_bound(peer, position)` (from the metadata)."""
        head = split_chunk(payload)[0]
        peer = self._sender(parse_header(head).client)
        chunk = inbox.parse(payload, key=peer.key)
        h = chunk.header
        if h.kind != kind or h.client != peer.client_id:
            raise WireError("wrong_kind", f"a {h.kind} payload on the {kind} topic")
        if h.size > size_bound(peer, h.submodel):
            raise WireError("oversized", f"{h.size}-byte {kind} payload of module {h.submodel} from {peer.client_id}, "
                                         f"its metadata allow {size_bound(peer, h.submodel)}")
        return peer, inbox.feed(chunk)

    def _module_bound(self, peer: Peer, position: int) -> int:
        with self.cond:
            want = self.waiting.get((peer.index, position))
        if want is None:
            raise MessageError("unrequested", f"module {position} of {peer.client_id} was not asked for")
        return payload_bound(want[1])

    def _return_bound(self, peer: Peer, position: int) -> int:
        with self.cond:
            own = self.store.get(f"c{self.me}.m{position}")
        if own is None:
            raise MessageError("unknown_module", f"{peer.client_id} returned a module this source does not have")
        return payload_bound({k: v.shape for k, v in own.items()})

    def _on_module(self, payload: bytes) -> None:
        self._count_in("module_in", len(payload))
        peer, done = self._assembled(self.modules_in, payload, "module", self._module_bound)
        if done is None:
            return
        h = done.header
        with self.cond:
            want = self.waiting.get((peer.index, h.submodel))
            if want is None or want[0] != h.round:
                raise MessageError("unrequested", f"module {h.submodel} of {peer.client_id} for round {h.round} was not asked for")
            if {k: v.shape for k, v in done.tensors.items()} != want[1]:
                raise MessageError("shape_mismatch", f"module {h.submodel} of {peer.client_id} has other tensors than announced")
            del self.waiting[(peer.index, h.submodel)]
            self.arrived[(h.round, peer.index, h.submodel)] = {k: v.clone() for k, v in done.tensors.items()}
            self.cond.notify_all()

    def _on_return(self, payload: bytes) -> None:
        self._count_in("return_in", len(payload))
        peer, done = self._assembled(self.returns_in, payload, "return", self._return_bound)
        if done is None:
            return
        h = done.header
        with self.cond:
            if peer.index not in self.links[self.me]:
                raise MessageError("not_a_neighbour", f"{peer.client_id} returned a module it could not borrow")
            if h.round != self.round:
                raise MessageError("stale_round", f"copy for round {h.round}, round {self.round} is open")
            self.heard += 1
            self.cond.notify_all()
            self._accept_return(peer.index, h.round, h.submodel, {k: v.clone() for k, v in done.tensors.items()})

    def _accept_return(self, borrower: int, r: int, position: int, state: dict[str, torch.Tensor]) -> None:
        """Under the lock: the copy joins the source's average unless `refusal` finds a reason."""
        key = f"c{self.me}.m{position}"
        reason = refusal(self.store.get(key), state, self.norm_bound)
        if reason is not None:
            self.rejected[reason] += 1
            return
        self.returned[key].append((borrower, len(self.returned[key]), state))
        self.cond.notify_all()

    # -- outbound -------------------------------------------------------------------------------------

    def _publish(self, topic: str, payload: bytes, kind: str, retain: bool = False) -> None:
        self.transport.publish(topic, payload, qos=QOS, retain=retain)
        with self.cond:
            self.traffic[kind] += len(payload)

    def _count_in(self, kind: str, n: int) -> None:
        with self.cond:
            self.traffic[kind] += n

    def take_counters(self) -> tuple[dict[str, int], dict[str, int]]:
        """(rejected, traffic) since the last call, for the round's report."""
        with self.cond:
            out = dict(self.rejected), dict(self.traffic)
            self.rejected.clear()
            self.traffic.clear()
        return out


def module_bytes(store: dict[str, dict[str, torch.Tensor]]) -> int:
    """What sending every module of this store once costs (the whole-model comparison)."""
    return sum(state_bytes(st) for st in store.values())
