"""The one path from an update chunk on the broker to a federation's aggregate, shared by
`aggregator serve` (aggregator/server.py) and its workers and relays (aggregator/worker.py).

Size cap, header parse, the device's signature (once per update: every chunk repeats the signed header),
QoS 1 redelivery, identity and round checks, each chunk's hash against the signed Merkle root, then
reassembly and the Federation's shape / finite / norm checks: whoever runs it, an update is judged
the same way. Raises WireError, MessageError or Rejected with the reason the caller counts. A refusal of
an update for what its participant signed (its header, or a payload whose every chunk matched the signed
root) also tells the Federation, which then stops holding the round for that participant. A forger cannot
do that to it: a header of its own fails the signature, and a copied header with forged chunk data fails
the chunk's proof, which is not held against the participant.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from aggregator.federation import Rejected, Update
from nefl.protocol.signing import parse_public_key
from nefl.protocol.wire import PAYLOAD_REASONS, Assembled, Chunk, ChunkHeader, Reassembler, WireError


class UpdateEngine(Protocol):
    """What judges an update after the wire: a round (aggregator/federation.py Federation) or buffered mode's
    versions (aggregator/versions.py Versions)."""

    def check_header(self, topic_client: str, header: ChunkHeader) -> int: ...

    def refused(self, client: str, index: int, reason: str) -> None: ...

    def accept(self, u: Update) -> None: ...

class DeviceKeys:
    """Parsed device public keys, by their text: each key is parsed once, not once per chunk."""

    def __init__(self, pins: Callable[[str], str | None]) -> None:
        self._pins = pins
        self._parsed: dict[str, Ed25519PublicKey] = {}

    def __call__(self, client: str) -> Ed25519PublicKey | None:
        text = self._pins(client)
        if text is None:
            return None
        if text not in self._parsed:
            self._parsed[text] = parse_public_key(text)
        return self._parsed[text]


def take_update(fed: UpdateEngine, reasm: Reassembler, keys: DeviceKeys, client: str, payload: bytes,
                max_message: int) -> Assembled | None:
    """Feed one chunk from `update/{client}`; the verified update once its last chunk arrived (already
    folded into `fed`'s aggregate), else None. A refused header raises only on chunk 0, so an update
    is counted once, not once per chunk."""
    if len(payload) > max_message:  # peers use our chunk size; allow slack, refuse floods
        raise WireError("oversized", f"{len(payload)}-byte message, the limit is {max_message}")
    # a device whose key is pinned signs its update's header (round, submodel, the chunks' Merkle root)
    key = keys(client)
    chunk = reasm.parse(payload, key)
    if reasm.is_duplicate(chunk):
        return None
    try:
        return _judge(fed, reasm, client, chunk)
    except (Rejected, WireError) as e:
        # only a fault in the signed bytes is the participant's own: a chunk's index, proof and data are not
        # signed, so anyone who copied its header off the broker can make a chunk fail its proof
        if key is not None and (isinstance(e, Rejected) or e.reason in PAYLOAD_REASONS):
            fed.refused(client, chunk.header.round, e.reason)
        raise


def _judge(fed: UpdateEngine, reasm: Reassembler, client: str, chunk: Chunk) -> Assembled | None:
    try:
        fed.check_header(client, chunk.header)
    except Rejected:
        if chunk.index == 0:
            raise
        return None
    done = reasm.feed(chunk)
    if done is not None:
        fed.accept(Update.from_wire(client, done))
    return done
