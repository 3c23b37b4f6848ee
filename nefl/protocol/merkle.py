"""The BLAKE3 Merkle tree over a payload's chunks: the one integrity check of everything the wire carries.

A payload cut into chunks (nefl/protocol/wire.py) is named by the root of a binary tree whose leaves are the
chunks' BLAKE3 hashes (leaves and inner nodes hashed under different derive-key contexts, so a leaf is never
taken for a node); pairs hash together, an odd last node moves up as is. A chunk's proof is the sibling hashes
from its leaf to the root, so one chunk is checked alone against a signed root: on arrival (wire.check_chunk)
and again from a device's disk when a download resumes (edge_client/store.py). Stdlib and blake3 only.
"""

from __future__ import annotations

import math

from blake3 import blake3

HASH_BYTES = 32
_LEAF = "nefl-edge 2026-12 wire chunk leaf"
_NODE = "nefl-edge 2026-12 wire chunk node"


def cut(payload: bytes | bytearray | memoryview, chunk: int) -> list[memoryview]:
    """The chunks of `payload`: chunk i is payload[i * chunk:][:chunk]; an empty payload is one empty chunk."""
    view = memoryview(payload)
    return [view[i * chunk:(i + 1) * chunk] for i in range(max(1, math.ceil(len(view) / chunk)))]


def payload_root(payload: bytes | bytearray | memoryview, chunk: int) -> bytes:
    """The root that names `payload` cut in chunks of `chunk` bytes (what wire.frame puts in the header)."""
    return merkle_root([leaf(p) for p in cut(payload, chunk)])


def leaf(data: bytes | memoryview) -> bytes:
    return blake3(data, derive_key_context=_LEAF).digest()


def _node(left: bytes, right: bytes) -> bytes:
    return blake3(left + right, derive_key_context=_NODE).digest()


def merkle_levels(leaves: list[bytes]) -> list[list[bytes]]:
    """Every level of the tree, leaves first, root last."""
    levels = [leaves]
    while len(levels[-1]) > 1:
        below = levels[-1]
        levels.append([_node(below[i], below[i + 1]) if i + 1 < len(below) else below[i] for i in range(0, len(below), 2)])
    return levels


def merkle_root(leaves: list[bytes]) -> bytes:
    """The root over these leaves (a whole file re-checked from disk, leaf by leaf)."""
    return merkle_levels(leaves)[-1][0]


def merkle_proof(levels: list[list[bytes]], index: int) -> bytes:
    """The sibling hashes from chunk `index` up to the root (none where a node has no sibling)."""
    out = []
    for level in levels[:-1]:
        if index ^ 1 < len(level):
            out.append(level[index ^ 1])
        index //= 2
    return b"".join(out)


def proof_length(index: int, count: int) -> int:
    """How many hashes the proof of chunk `index` of `count` holds."""
    n = 0
    while count > 1:
        n += (index ^ 1) < count
        index, count = index // 2, (count + 1) // 2
    return n


def merkle_root_of(data: bytes | memoryview, index: int, count: int, proof: bytes | memoryview) -> bytes:
    """The root that chunk `index` (of `count`) with this proof hashes up to."""
    h = leaf(data)
    j = 0
    while count > 1:
        if (index ^ 1) < count:
            sib = bytes(proof[j * HASH_BYTES:(j + 1) * HASH_BYTES])
            h = _node(sib, h) if index & 1 else _node(h, sib)
            j += 1
        index, count = index // 2, (count + 1) // 2
    return h
