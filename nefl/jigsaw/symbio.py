"""SymbioArchitect: who sees whose modules, the typed messages of the module exchange, and Eq. 2.

Clients broadcast metadata only; a chosen module's parameters are fetched from its source; after local
training every assembled module's new parameters go back to their source, which averages the copies it
received (source-based aggregation, the paper's Eq. 2) and otherwise keeps its module as it was: the
base model is a passive repository that never trains itself.

Everything that would cross a process boundary is a typed, versioned message (nefl.protocol.messages.Message)
and goes through the strict loader, even in the in-process exchange the simulator uses, so a broker
transport only has to move the same bytes (and the tensors, which ride beside the JSON headers).
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Sequence
from typing import Annotated, Literal, Protocol

import msgspec
import torch

from nefl.aggregation.robust import update_norm
from nefl.jigsaw.screen import ReturnScreen, source_average
from nefl.jigsaw.zoo import ModuleMeta
from nefl.nested.tensors import first_non_finite
from nefl.protocol.messages import Message, MessageError, Name, Round, decode

Topology = Literal["full", "ring", "random"]
ClientIndex = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
Position = Annotated[int, msgspec.Meta(ge=0, le=1024)]
MAX_MODULES = 256  # modules one client may advertise


class MetadataBroadcast(Message, frozen=True, tag="jigsaw_metadata", tag_field="type"):
    """Client -> its neighbours: the metadata of every module of its base model (no parameters)."""

    federation: Name
    client: ClientIndex
    modules: Annotated[list[ModuleMeta], msgspec.Meta(max_length=MAX_MODULES)]


class ModuleFetch(Message, frozen=True, tag="jigsaw_fetch", tag_field="type"):
    """Client -> source: send me the current parameters of your module at `position`."""

    federation: Name
    client: ClientIndex
    source: ClientIndex
    round: Round
    position: Position


class ModuleReturn(Message, frozen=True, tag="jigsaw_return", tag_field="type"):
    """Client -> source: my trained copy of your module (the tensors ride beside this header)."""

    federation: Name
    client: ClientIndex
    source: ClientIndex
    round: Round
    position: Position
    samples: Annotated[int, msgspec.Meta(ge=1, le=10**9)]


def neighbours(num_clients: int, topology: Topology = "full", k: int = 2, seed: int = 0) -> list[list[int]]:
    """Each client's neighbours: everyone (the paper's default), the two ring neighbours, or k random
    peers per client (made symmetric, so a module's source also sees its borrowers)."""
    if topology == "full":
        return [[j for j in range(num_clients) if j != i] for i in range(num_clients)]
    if topology == "ring":
        return [sorted({(i - 1) % num_clients, (i + 1) % num_clients} - {i}) for i in range(num_clients)]
    if topology != "random":
        raise ValueError(f"unknown topology {topology!r}: use full, ring or random")
    rng = random.Random(seed)
    links: list[set[int]] = [set() for _ in range(num_clients)]
    for i in range(num_clients):
        for j in rng.sample([j for j in range(num_clients) if j != i], min(k, num_clients - 1)):
            links[i].add(j)
            links[j].add(i)
    return [sorted(s) for s in links]


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def refusal(own: dict[str, torch.Tensor] | None, state: dict[str, torch.Tensor], norm_bound: float | None = None) -> str | None:
    """Why a source refuses a trained copy of its module `own`, or None: other tensors or shapes, non-finite
    values, or (with `norm_bound`) a distance from its own copy above norm_bound x that copy's norm. A borrower
    trains a module for a round or two, so an honest copy stays near its source's; a poisoned one need not."""
    if own is None or set(own) != set(state) or any(own[k].shape != state[k].shape for k in own):
        return "shape_mismatch"
    if first_non_finite(state) is not None:
        return "non_finite"
    if norm_bound is not None and update_norm({k: state[k] - own[k] for k in own}) > norm_bound * update_norm(own):
        return "norm_bound"
    return None


def aggregate_returns(screen: ReturnScreen | None, key: str, sent: dict[str, torch.Tensor],
                      copies: Sequence[tuple[bool, dict[str, torch.Tensor]]], rejected: dict[str, int]) -> dict[str, torch.Tensor]:
    """A module's new parameters from its returns (own?, state) in borrower order: Eq. 2, over the copies the
    screen accepts when there is one (its refusals and clips are counted in `rejected`)."""
    if screen is None:
        return source_average([st for _, st in copies])
    new, verdict = screen.aggregate(key, sent, copies)
    for reason, n in verdict.refused.items():
        rejected[reason] += n
    if verdict.clipped:
        rejected["clipped"] += verdict.clipped
    return new


class ModuleExchange(Protocol):
    """Everything a client step (nefl.jigsaw.client) may do with other clients: announce its modules, read
    its neighbours' announcements, fetch a module's parameters from its source, return a trained copy.
    The simulator's transport is in-process; a broker's moves the same messages."""

    def broadcast(self, msg: MetadataBroadcast) -> None: ...
    def catalogue(self, client: int) -> list[ModuleMeta]: ...
    def fetch(self, req: ModuleFetch) -> dict[str, torch.Tensor]: ...
    def give_back(self, msg: ModuleReturn, state: dict[str, torch.Tensor]) -> None: ...


class InProcessExchange:
    """Every client's module repository in one process. Messages are encoded and re-decoded with the
    strict loader, as over a broker; tensors are counted at float32 size. `aggregate` closes a round."""

    def __init__(self, federation: str, store: dict[str, dict[str, torch.Tensor]], links: Sequence[Sequence[int]] = (),
                 norm_bound: float | None = None, screen: ReturnScreen | None = None) -> None:
        self.federation, self.norm_bound = federation, norm_bound
        self.screen = screen  # judges each module's returns together at `aggregate`; None: plain Eq. 2
        self.store = store  # module key -> parameters, owned by the module's source
        self.links = [list(n) for n in links]  # each client's neighbours (whose broadcasts it receives)
        self.metadata: dict[int, list[ModuleMeta]] = {}
        self.returned: dict[str, list[tuple[bool, dict[str, torch.Tensor]]]] = defaultdict(list)  # key -> (own?, state)
        self.rejected: dict[str, int] = defaultdict(int)
        self.bytes = {"metadata": 0, "fetch": 0, "return": 0}

    def _wire(self, msg: Message, cls: type[Message], local: bool = False) -> Message:
        """The message as the receiver gets it: encoded, counted (unless it stays on the client), decoded strictly."""
        payload = msg.to_json()
        if not local:
            self._count(cls, len(payload))
        return decode(payload, cls)

    def _count(self, cls: type[Message], n: int) -> None:
        kind = {MetadataBroadcast: "metadata", ModuleFetch: "fetch", ModuleReturn: "return"}[cls]
        self.bytes[kind] += n

    def broadcast(self, msg: MetadataBroadcast) -> None:
        """One copy per neighbour; refused (and counted) when it advertises modules of another source."""
        got = self._wire(msg, MetadataBroadcast)
        fan_out = sum(1 for n in self.links if got.client in n)
        self.bytes["metadata"] += len(msg.to_json()) * (fan_out - 1)
        if any(m.source != got.client for m in got.modules):
            self.rejected["foreign_module"] += 1
            return
        self.metadata[got.client] = list(got.modules)

    def catalogue(self, client: int) -> list[ModuleMeta]:
        """The modules `client`'s neighbours announced, each once."""
        seen: dict[str, ModuleMeta] = {}
        for j in self.links[client] if client < len(self.links) else ():
            for m in self.metadata.get(j, []):
                seen.setdefault(m.key, m)
        return list(seen.values())

    def fetch(self, req: ModuleFetch) -> dict[str, torch.Tensor]:
        got = self._wire(req, ModuleFetch, local=req.client == req.source)  # own repository: no traffic
        state = self.store.get(f"c{got.source}.m{got.position}")
        if state is None:
            self.rejected["unknown_module"] += 1
            raise MessageError("unknown_module", f"client {got.source} has no module at position {got.position}")
        if got.client != got.source:
            self.bytes["fetch"] += state_bytes(state)
        return {k: v.clone() for k, v in state.items()}

    def give_back(self, msg: ModuleReturn, state: dict[str, torch.Tensor]) -> None:
        """A trained copy for the source; refused (and counted) when its tensors do not match the
        module's or are not finite: one bad borrower cannot poison a source's module."""
        got = self._wire(msg, ModuleReturn, local=msg.client == msg.source)
        key = f"c{got.source}.m{got.position}"
        reason = refusal(self.store.get(key), state, self.norm_bound)
        if reason is not None:
            self.rejected[reason] += 1
            return
        if got.client != got.source:
            self.bytes["return"] += state_bytes(state)
        self.returned[key].append((got.client == got.source, state))

    def aggregate(self) -> dict[str, int]:
        """Eq. 2 at every source for the modules borrowed this round; returns how many copies each got."""
        counts = {key: len(copies) for key, copies in self.returned.items()}
        for key, copies in self.returned.items():
            self.store[key] = aggregate_returns(self.screen, key, self.store[key], copies, self.rejected)
        self.returned.clear()
        return counts
