"""The wire format: tensors as safetensors bytes in bounded chunks, each chunk checkable on arrival.

One MQTT message (wire version 2) =

    b"NEFL" | version (1 byte, 2) | proof hashes (1 byte) | header length (2 bytes) | chunk index (4 bytes)
    | JSON header | Merkle proof (32 bytes per hash) | a slice of the payload

all integers big-endian. The payload is a safetensors file of the whole tensor dict (never a
pickle), or, for kind "file" (dtype "raw"), the bytes of one file of a model release (docs/deploy.md).
The JSON header is the same bytes in every chunk of a payload: it names the payload's size, its
chunk size and count, and `digest`, the root of a BLAKE3 Merkle tree over the chunks
(nefl/protocol/merkle.py). A device signs that header once per update (nefl/protocol/signing.py), so a
receiver verifies one signature per update (a later chunk's header is compared byte for byte with the
verified one), and each chunk's proof ties its data to the signed root: a forged or corrupted chunk is refused on arrival, alone,
and never takes the place of the genuine one. Version 1 (a header with its own signature in every
chunk, one sha256 over the whole payload) is refused with `bad_version`.

BLAKE3 rather than sha256: less CPU per MiB on the aggregator (docs/benchmarks.md, "Ingest profile"), and
NEON on a Raspberry Pi, whose Cortex-A72 has no SHA-256 instructions.

Framing needs no torch: a device on the small install (`edge-client serve --follow`) parses file
chunks with `parse_chunk`; only the tensor functions import torch, when called.

Everything received is untrusted: the Reassembler caps sizes, counts and time, drops QoS 1
redeliveries by (kind, round, client, submodel, digest, chunk index), and raises WireError carrying
a short reason code that the server counts and logs.
"""

from __future__ import annotations

import math
import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal, NamedTuple

import msgspec
import numpy as np

from nefl.nested.tensorfile import DTYPES, PayloadError, decode_tensors, encode_tensors
from nefl.protocol import signing
from nefl.protocol.merkle import HASH_BYTES, cut, leaf, merkle_levels, merkle_proof, merkle_root_of, proof_length
from nefl.protocol.messages import (
    DEFAULT_CHUNK_BYTES,
    Count,
    Hex64,
    Message,
    MessageError,
    Name,
    Reason,
    Round,
    Short,
    Submodel,
    decode,
)

if TYPE_CHECKING:
    import torch


MAGIC = b"NEFL"
WIRE_VERSION = 2
MAX_HEADER_BYTES = 4096
MAX_CHUNKS = 1 << 24
MAX_PROOF = 24  # hashes in the proof of a chunk of a set of at most MAX_CHUNKS
KINDS = ("model", "update", "partial", "file", "module", "return")
_PREFIX = struct.Struct(">4sBBHI")
DATA_ALIGN = 8  # a chunk's data starts this aligned within its message (the header padded; `_aligned`)
# refusals of a complete set whose every chunk hashed up to the signed root: the signer's own bytes
PAYLOAD_REASONS = frozenset({"malformed_payload", "bad_dtype", "non_finite"})


class ChunkHeader(Message, frozen=True):
    """The JSON header every chunk of a payload repeats, byte for byte; parsed by the same strict
    loader as control messages."""

    kind: Literal["model", "update", "partial", "file", "module", "return"]  # partial: a worker's sums
    # (aggregator/partials.py); module, return: a FedJigsaw module to a borrower and its trained copy back to the
    # source (nefl/jigsaw/broker.py), `submodel` the module's position
    federation: Name  # file: one file of release `round` (the version), `submodel` its position in the release
    round: Round
    submodel: Submodel
    client: Name
    digest: Hex64  # root of the BLAKE3 Merkle tree over the payload's chunks (merkle_root)
    dtype: Literal["fp32", "fp16", "raw"]
    samples: Count
    metrics: Annotated[dict[Short, float | int | Reason | None], msgspec.Meta(max_length=32)]
    size: Count
    chunk: Annotated[int, msgspec.Meta(ge=1, le=1 << 30)]  # payload bytes in every chunk but the last
    count: Annotated[int, msgspec.Meta(ge=1, le=MAX_CHUNKS)]


class Chunk(NamedTuple):
    """One parsed message: its header (shared by the set), its index, its proof and its data."""

    header: ChunkHeader
    index: int
    proof: memoryview
    data: memoryview
    head: bytes  # the header's bytes, as signed


class Encoded(NamedTuple):
    """A payload's messages and the header they all carry, as built: its digest and size name the payload (in a
    task, an upload notice, a partial's summary) without parsing a message back."""

    messages: list[bytes]
    header: ChunkHeader


class WireError(ValueError):
    """A rejected message; `reason` is a short code for counters, the message says why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.detail = message


@dataclass
class Assembled:
    """A complete, verified tensor message."""

    header: ChunkHeader
    tensors: dict[str, torch.Tensor]  # float32 views of one flat buffer (nefl.nested.tensors.Tiled), whatever dtype travelled
    nbytes: int  # payload bytes received (what the wire carried, headers excluded)


# -- framing ----------------------------------------------------------------------------------------------
def chunk_room(chunk_bytes: int) -> int:
    """Payload bytes per message when no message may exceed `chunk_bytes` (header and proof at their worst)."""
    room = chunk_bytes - _PREFIX.size - MAX_HEADER_BYTES - MAX_PROOF * HASH_BYTES
    if room < 1024:
        raise ValueError(f"chunk size {chunk_bytes} too small: needs at least "
                         f"{_PREFIX.size + MAX_HEADER_BYTES + MAX_PROOF * HASH_BYTES + 1024} bytes")
    return room


def encode(
    tensors: dict[str, torch.Tensor], *, kind: str, federation: str, round: int, submodel: int, client: str,
    dtype: str = "fp32", samples: int = 0, metrics: dict[str, float] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES, sign: Callable[[bytes], bytes] | None = None,
) -> Encoded:
    """Messages (each at most chunk_bytes long) carrying `tensors`, and their header; `sign` (a device's key) signs
    the header once, which names the chunks' Merkle root, so every chunk's data is covered too."""
    return frame(encode_tensors(tensors, dtype), kind=kind, federation=federation, round=round, submodel=submodel,
                 client=client, dtype=dtype, samples=samples, metrics=metrics, chunk_bytes=chunk_bytes, sign=sign)


def frame(
    payload: bytes | bytearray, *, kind: str, federation: str, round: int, submodel: int, client: str, dtype: str,
    samples: int = 0, metrics: dict[str, float] | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    sign: Callable[[bytes], bytes] | None = None,
) -> Encoded:
    """`payload` (safetensors bytes, or a file's bytes with dtype "raw") cut into messages of at most
    chunk_bytes, and their header; chunk i carries payload[i * chunk_room(chunk_bytes):][:chunk_room(chunk_bytes)]."""
    room = chunk_room(chunk_bytes)
    if math.ceil(len(payload) / room) > MAX_CHUNKS:
        raise ValueError(f"{len(payload)} bytes need more than {MAX_CHUNKS} chunks: raise the chunk size")
    parts = cut(payload, room)
    count = len(parts)
    levels = merkle_levels([leaf(p) for p in parts])
    header = ChunkHeader(kind=kind, federation=federation, round=round, submodel=submodel, client=client,
                         digest=levels[-1][0].hex(), dtype=dtype, samples=samples, metrics=metrics or {},
                         size=len(payload), chunk=room, count=count)
    head = _aligned(header.to_json(), sign)
    if len(head) > MAX_HEADER_BYTES:
        raise ValueError(f"message header is {len(head)} bytes, the limit is {MAX_HEADER_BYTES}: fewer metrics")
    out = []
    for i, part in enumerate(parts):
        proof = merkle_proof(levels, i)
        out.append(b"".join((_PREFIX.pack(MAGIC, WIRE_VERSION, len(proof) // HASH_BYTES, len(head), i), head, proof, part)))
    return Encoded(out, header)


def _aligned(head: bytes, sign: Callable[[bytes], bytes] | None) -> bytes:
    """The header as sent (signed where `sign` is given, which adds signing.SIGNATURE_OVERHEAD bytes), blank
    space before its closing brace making the data start at a multiple of DATA_ALIGN into every chunk (a proof is
    whole 32-byte hashes): a receiver that puts the payload at an aligned address (nefl.protocol.paho_fast.FastClient) then
    decodes float32 tensors that numpy's BLAS reads, whatever the lengths of the header's names and numbers.
    Whitespace is JSON's, so any receiver parses it; within 7 bytes of MAX_HEADER_BYTES the header goes unpadded."""
    size = len(head) + (signing.SIGNATURE_OVERHEAD if sign is not None else 0)
    pad = -(_PREFIX.size + size) % DATA_ALIGN
    if pad and size + pad <= MAX_HEADER_BYTES:
        head = head[:-1] + b" " * pad + b"}"
    return sign(head) if sign is not None else head


def split_chunk(message: bytes | memoryview) -> tuple[bytes, int, memoryview, memoryview]:
    """The raw JSON header (what a device signature covers), the chunk index, the proof and the data slice."""
    view = memoryview(message)
    if len(view) < _PREFIX.size:
        raise WireError("malformed_header", f"message of {len(view)} bytes is too short")
    magic, version, hashes, hlen, index = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise WireError("malformed_header", "not a NEFL message (bad magic)")
    if version != WIRE_VERSION:
        old = "1 (a signature in every chunk)" if version == 0 else str(version)  # v1: a 4-byte header length here
        raise WireError("bad_version", f"chunk of wire version {old}, this build speaks {WIRE_VERSION}: "
                                       "upgrade the sender (`pip install -U nefl-edge`)")
    end = _PREFIX.size + hlen + hashes * HASH_BYTES
    if hlen > MAX_HEADER_BYTES or hashes > MAX_PROOF or end > len(view):
        raise WireError("malformed_header", f"header length {hlen} or proof of {hashes} hashes exceeds the message "
                                            f"or the limits ({MAX_HEADER_BYTES} bytes, {MAX_PROOF} hashes)")
    return bytes(view[_PREFIX.size:_PREFIX.size + hlen]), index, view[end - hashes * HASH_BYTES:end], view[end:]


def parse_header(head: bytes) -> ChunkHeader:
    """A chunk header with every field type-checked, and consistent with itself."""
    try:
        h = decode(head, ChunkHeader, MAX_HEADER_BYTES)
    except MessageError as e:
        raise WireError("bad_version" if e.reason == "bad_version" else "malformed_header", e.detail) from None
    if h.count != max(1, math.ceil(h.size / h.chunk)):
        raise WireError("malformed_header", f"{h.size} bytes in chunks of {h.chunk} are not {h.count} chunks")
    return h


def parse_chunk(message: bytes | memoryview) -> Chunk:
    """One message, its header type-checked and the proof's length right for its index; data unchecked."""
    head, index, proof, data = split_chunk(message)
    h = parse_header(head)
    return _chunk(h, head, index, proof, data)


def _chunk(h: ChunkHeader, head: bytes, index: int, proof: memoryview, data: memoryview) -> Chunk:
    if index >= h.count:
        raise WireError("malformed_header", f"chunk {index} of {h.count}")
    if len(proof) != proof_length(index, h.count) * HASH_BYTES:
        raise WireError("malformed_header", f"chunk {index} of {h.count} needs a proof of "
                                            f"{proof_length(index, h.count)} hashes, it has {len(proof) // HASH_BYTES}")
    return Chunk(h, index, proof, data, head)


def check_chunk(chunk: Chunk) -> None:
    """The chunk's data has the size its index says and hashes up to the header's digest, or WireError."""
    h, i = chunk.header, chunk.index
    want = h.chunk if i + 1 < h.count else h.size - h.chunk * (h.count - 1)
    if len(chunk.data) != want:
        raise WireError("size_mismatch", f"chunk {i} carries {len(chunk.data)} bytes, the header says {want}")
    if merkle_root_of(chunk.data, i, h.count, chunk.proof).hex() != h.digest:
        raise WireError("digest_mismatch", f"chunk {i} does not hash to the digest in its header")


def payload_of(messages: list[bytes]) -> bytes:
    """The payload a complete, checked set of messages carries (the device's own model download)."""
    chunks = sorted((parse_chunk(m) for m in messages), key=lambda c: c.index)
    for c in chunks:
        check_chunk(c)
    return b"".join(c.data for c in chunks)


def _assembled(header: ChunkHeader, payload: np.ndarray, lazy: bool) -> Assembled:
    if header.dtype not in DTYPES:
        raise WireError("bad_dtype", f"a {header.kind} message of dtype {header.dtype} carries no tensors")
    try:
        return Assembled(header, decode_tensors(header.dtype, payload, lazy), header.size)
    except PayloadError as e:
        raise WireError(e.reason, e.detail) from None


@dataclass
class _Pending:
    header: ChunkHeader  # every chunk of the set carries the same header bytes
    started: float
    buffer: np.ndarray  # the payload, uninitialised until its chunks arrive
    have: set[int] = field(default_factory=set)
    received: int = 0


class Reassembler:
    """Collects chunks into verified tensor messages under caps on size, count, pending sets and time.

    Each chunk is checked against the header's Merkle root before a byte of it is kept, and copied once,
    into its place in the payload; a single-chunk payload in a writable buffer (nefl.protocol.paho_fast.FastClient hands
    bytearrays on) is decoded where it lies, and its tensors then share that buffer. A header's parse (and, with a device key, its signature check) is done
    once per set: later chunks present the same header bytes. The caps on pending sets and buffered bytes
    hold per sender (the header's client, which the server has already matched to the topic), so one
    client can only exhaust its own share. lazy_views: the assembled tensors' views are made on first use
    (an aggregator's updates: checked and summed as flat buffers; nefl.nested.tensors.Tiled)."""

    def __init__(self, max_bytes: int = 64 << 20, timeout_s: float = 120.0, max_pending: int = 2,
                 max_chunks: int = 4096, remember: int = 4096, max_buffered: int | None = None,
                 headers: int = 1024, lazy_views: bool = False) -> None:
        self.lazy_views = lazy_views
        self.max_bytes, self.timeout_s, self.max_pending, self.max_chunks = max_bytes, timeout_s, max_pending, max_chunks
        self.max_buffered = max_buffered or 2 * max_bytes  # one sender's incomplete sets together
        self._pending: dict[tuple, _Pending] = {}
        self._held: dict[str, list[int]] = {}  # sender -> [its pending sets, their bytes received]: O(1) caps per chunk
        self._done: OrderedDict[tuple, None] = OrderedDict()
        self._remember = remember
        self._headers: OrderedDict[bytes, tuple[ChunkHeader, object]] = OrderedDict()  # bytes -> (header, key verified)
        self._max_headers = headers
        self.duplicates = 0

    def parse(self, message: bytes | memoryview, key: Any = None) -> Chunk:
        """Size cap, framing and header; with `key` (an Ed25519 public key), the header's signature, checked
        once per distinct header and key. Raises WireError or MessageError (unsigned, bad_signature)."""
        if len(message) > self.max_bytes + MAX_HEADER_BYTES + _PREFIX.size + MAX_PROOF * HASH_BYTES:
            raise WireError("oversized", f"message of {len(message)} bytes exceeds {self.max_bytes}")
        head, index, proof, data = split_chunk(message)
        known = self._headers.get(head)
        if known is None:
            known = self._headers[head] = (parse_header(signing.verify(head, key) if key is not None else head), key)
            while len(self._headers) > self._max_headers:
                self._headers.popitem(last=False)
        elif key is not None and known[1] is not key:  # parsed before, not yet checked against this key
            signing.verify(head, key)
            known = self._headers[head] = (known[0], key)
        if known[0].size > self.max_bytes or known[0].count > self.max_chunks:
            raise WireError("oversized", f"{known[0].size} bytes in {known[0].count} chunks exceeds the caps "
                                         f"({self.max_bytes} bytes, {self.max_chunks} chunks)")
        return _chunk(known[0], head, index, proof, data)

    @staticmethod
    def key(header: ChunkHeader) -> tuple:
        """Redeliveries share it; a different payload under the same identity is a different set."""
        return header.kind, header.round, header.client, header.submodel, header.digest

    def is_duplicate(self, chunk: Chunk) -> bool:
        """A QoS 1 redelivery of a chunk already held, or of a set already completed."""
        key = self.key(chunk.header)
        pending = self._pending.get(key)
        if key in self._done or (pending is not None and chunk.index in pending.have):
            self.duplicates += 1
            return True
        return False

    def feed(self, message: bytes | memoryview | Chunk, now: float | None = None) -> Assembled | None:
        """The assembled message when this chunk completes one; None while incomplete or a redelivery."""
        now = time.monotonic() if now is None else now
        chunk = message if isinstance(message, Chunk) else self.parse(message)
        if self.is_duplicate(chunk):
            return None
        header, key = chunk.header, self.key(chunk.header)
        check_chunk(chunk)
        pending = self._pending.get(key)
        sender = header.client
        if header.count == 1 and not chunk.data.readonly:  # a whole payload in a buffer the receiver owns: no copy
            self._remember_done(key)
            return _assembled(header, np.frombuffer(chunk.data, dtype=np.uint8), self.lazy_views)
        if pending is None:
            if self._held.get(sender, (0, 0))[0] >= self.max_pending:
                raise WireError("too_many_pending", f"{self.max_pending} chunk sets from {sender} already in flight")
            pending = self._pending[key] = _Pending(header, now, np.empty(header.size, dtype=np.uint8))
            self._held.setdefault(sender, [0, 0])[0] += 1
        elif header != pending.header:
            raise WireError("inconsistent_chunks", f"chunk {chunk.index} header differs from earlier chunks")
        held = self._held[sender]
        if held[1] + len(chunk.data) > self.max_buffered:
            raise WireError("oversized", f"more than {self.max_buffered} bytes buffered across {sender}'s incomplete chunk sets")
        at = chunk.index * header.chunk
        pending.buffer[at:at + len(chunk.data)] = np.frombuffer(chunk.data, dtype=np.uint8)
        pending.have.add(chunk.index)
        pending.received += len(chunk.data)
        held[1] += len(chunk.data)
        if len(pending.have) < header.count:
            return None
        self._drop(key)
        self._remember_done(key)  # every chunk matched the root: this is the set its header names
        return _assembled(header, pending.buffer, self.lazy_views)

    def _drop(self, key: tuple) -> None:
        """Forget a pending set, and its share of its sender's caps."""
        pending = self._pending.pop(key)
        held = self._held[key[2]]
        held[0] -= 1
        held[1] -= pending.received
        if not held[0]:
            del self._held[key[2]]

    def expire(self, now: float | None = None) -> list[tuple]:
        """Drop chunk sets older than the timeout; returns their keys (kind, round, client, submodel, digest)."""
        now = time.monotonic() if now is None else now
        old = [k for k, p in self._pending.items() if now - p.started > self.timeout_s]
        for k in old:
            self._drop(k)
        return old

    def discard_rounds_before(self, round_: int) -> None:
        """Partial sets of closed rounds can never complete usefully; free their memory."""
        for k in [k for k in self._pending if k[1] < round_]:
            self._drop(k)

    def _remember_done(self, key: tuple) -> None:
        self._done[key] = None
        while len(self._done) > self._remember:
            self._done.popitem(last=False)
