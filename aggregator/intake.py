"""The one path from an update chunk on the broker to a federation's aggregate, shared by
`aggregator serve` (aggregator/server.py) and its workers and relays (aggregator/worker.py).

Size cap, header parse, the device's signature, QoS 1 redelivery, identity and round checks, then
reassembly and the Federation's shape / finite / norm checks: whoever runs it, an update is judged
the same way. Raises WireError, MessageError or Rejected with the reason the caller counts. A refusal of
an update that carried its participant's own signature also tells the Federation, which then stops
holding the round for that participant (a forger cannot do that to it: its chunks fail the signature).
"""

from __future__ import annotations

from collections.abc import Callable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from aggregator.federation import Federation, Rejected, Update
from nefl.signing import parse_public_key, verify
from nefl.wire import Assembled, ChunkHeader, Reassembler, WireError, parse_chunk, split_chunk


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


def take_update(fed: Federation, reasm: Reassembler, keys: DeviceKeys, client: str, payload: bytes,
                max_message: int) -> Assembled | None:
    """Feed one chunk from `update/{client}`; the verified update once its last chunk arrived (already
    folded into `fed`'s aggregate), else None. A refused header raises only on chunk 0, so an update
    is counted once, not once per chunk."""
    if len(payload) > max_message:  # peers use our chunk size; allow slack, refuse floods
        raise WireError("oversized", f"{len(payload)}-byte message, the limit is {max_message}")
    header, _ = parse_chunk(payload)
    key = keys(client)
    if key is not None:  # a device whose key is pinned signs every chunk header (round, submodel, sha256)
        verify(split_chunk(payload)[0], key)
    if reasm.is_duplicate(header):
        return None
    try:
        return _judge(fed, reasm, client, header, payload)
    except (Rejected, WireError) as e:
        if key is not None:
            fed.refused(client, header.round, e.reason)
        raise


def _judge(fed: Federation, reasm: Reassembler, client: str, header: ChunkHeader, payload: bytes) -> Assembled | None:
    try:
        fed.check_header(client, header)
    except Rejected:
        if header.index == 0:
            raise
        return None
    done = reasm.feed(payload)
    if done is not None:
        fed.accept(Update.from_wire(client, done))
    return done
