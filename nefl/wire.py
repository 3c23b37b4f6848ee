"""The wire format: tensors as safetensors bytes behind a small JSON header, in bounded chunks.

One MQTT message = b"NEFL" + 4-byte big-endian header length + JSON header + a slice of the
payload. The payload is a safetensors file of the whole tensor dict (never a pickle), or, for kind
"file" (dtype "raw"), the bytes of one file of a model release (docs/deploy.md); the header
repeats in every chunk so each message is self-describing, and carries the payload's sha256 so a
reassembled set is verified before a single byte is parsed as tensors.

Framing needs no torch: a device on the small install (`edge-client serve --follow`) parses file
chunks with `parse_chunk`; only the tensor functions import torch, when called.

Everything received is untrusted: the Reassembler caps sizes, counts and time, drops QoS 1
redeliveries by (kind, round, client, submodel, payload sha256, chunk index), and raises WireError carrying a
short reason code that the server counts and logs.
"""

from __future__ import annotations

import hashlib
import math
import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Literal

import msgspec

from nefl.messages import Count, Hex64, Message, MessageError, Name, Reason, Round, Short, Submodel, decode

if TYPE_CHECKING:
    import torch

MAGIC = b"NEFL"
DEFAULT_CHUNK_BYTES = 256 * 1024
MAX_HEADER_BYTES = 4096
DTYPES = ("fp32", "fp16")  # tensor payloads; "raw" is a file's bytes (kind "file")
KINDS = ("model", "update", "partial", "file")
_PREFIX = struct.Struct(">4sI")


class ChunkHeader(Message, frozen=True):
    """The JSON header every chunk repeats; parsed by the same strict loader as control messages."""

    kind: Literal["model", "update", "partial", "file"]  # partial: a worker's sums (aggregator/partials.py)
    federation: Name  # file: one file of release `round` (the version), `submodel` its position in the release
    round: Round
    submodel: Submodel
    client: Name
    sha256: Hex64
    dtype: Literal["fp32", "fp16", "raw"]
    samples: Count
    metrics: Annotated[dict[Short, float | int | Reason | None], msgspec.Meta(max_length=32)]
    size: Count
    count: Annotated[int, msgspec.Meta(ge=1, le=1 << 24)]
    index: Annotated[int, msgspec.Meta(ge=0, le=1 << 24)]


class WireError(ValueError):
    """A rejected message; `reason` is a short code for counters, the message says why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.detail = message


@dataclass
class Assembled:
    """A complete, verified tensor message."""

    header: ChunkHeader  # of the set (index 0)
    tensors: dict[str, torch.Tensor]  # float32, whatever dtype travelled
    nbytes: int  # payload bytes received (what the wire carried, headers excluded)


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {name!r}")
    return {"fp32": torch.float32, "fp16": torch.float16}[name]


def encode_tensors(tensors: dict[str, torch.Tensor], dtype: str = "fp32") -> bytes:
    from safetensors.torch import save as st_save

    want = _torch_dtype(dtype)
    return st_save({n: t.detach().to(want).contiguous() for n, t in tensors.items()})


def chunk_room(chunk_bytes: int) -> int:
    """Payload bytes per message when no message may exceed `chunk_bytes` (the header's worst case counted)."""
    room = chunk_bytes - _PREFIX.size - MAX_HEADER_BYTES
    if room < 1024:
        raise ValueError(f"chunk size {chunk_bytes} too small: needs at least {_PREFIX.size + MAX_HEADER_BYTES + 1024} bytes")
    return room


def encode(
    tensors: dict[str, torch.Tensor], *, kind: str, federation: str, round: int, submodel: int, client: str,
    dtype: str = "fp32", samples: int = 0, metrics: dict[str, float] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES, sign: Callable[[bytes], bytes] | None = None,
) -> list[bytes]:
    """Messages (each at most chunk_bytes long) carrying `tensors`; `sign` (a device's key) signs
    every chunk's header, which names the payload's sha256, so the payload is covered too."""
    return frame(encode_tensors(tensors, dtype), kind=kind, federation=federation, round=round, submodel=submodel,
                 client=client, dtype=dtype, samples=samples, metrics=metrics, chunk_bytes=chunk_bytes, sign=sign)


def frame(
    payload: bytes, *, kind: str, federation: str, round: int, submodel: int, client: str, dtype: str,
    samples: int = 0, metrics: dict[str, float] | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    sign: Callable[[bytes], bytes] | None = None,
) -> list[bytes]:
    """`payload` (safetensors bytes, or a file's bytes with dtype "raw") cut into messages of at most
    chunk_bytes; chunk i carries payload[i * chunk_room(chunk_bytes):][:chunk_room(chunk_bytes)]."""
    room = chunk_room(chunk_bytes)
    count = max(1, math.ceil(len(payload) / room))
    header = dict(kind=kind, federation=federation, round=round, submodel=submodel, client=client,
                  sha256=hashlib.sha256(payload).hexdigest(), dtype=dtype, samples=samples,
                  metrics=metrics or {}, size=len(payload), count=count)
    out = []
    for i in range(count):
        head = ChunkHeader(**header, index=i).to_json()
        head = sign(head) if sign is not None else head
        if len(head) > MAX_HEADER_BYTES:
            raise ValueError(f"message header is {len(head)} bytes, the limit is {MAX_HEADER_BYTES}: fewer metrics")
        out.append(_PREFIX.pack(MAGIC, len(head)) + head + payload[i * room:(i + 1) * room])
    return out


def split_chunk(message: bytes) -> tuple[bytes, bytes]:
    """The raw JSON header (what a device signature covers) and the data slice of one message."""
    if len(message) < _PREFIX.size:
        raise WireError("malformed_header", f"message of {len(message)} bytes is too short")
    magic, hlen = _PREFIX.unpack_from(message)
    if magic != MAGIC:
        raise WireError("malformed_header", "not a NEFL message (bad magic)")
    if hlen > MAX_HEADER_BYTES or _PREFIX.size + hlen > len(message):
        raise WireError("malformed_header", f"header length {hlen} exceeds the message or {MAX_HEADER_BYTES} bytes")
    return message[_PREFIX.size:_PREFIX.size + hlen], message[_PREFIX.size + hlen:]


def parse_chunk(message: bytes) -> tuple[ChunkHeader, bytes]:
    """Header and data slice of one message, with every header field type-checked."""
    head, data = split_chunk(message)
    try:
        parsed = decode(head, ChunkHeader, MAX_HEADER_BYTES)
    except MessageError as e:
        raise WireError("bad_version" if e.reason == "bad_version" else "malformed_header", e.detail) from None
    if parsed.index >= parsed.count:
        raise WireError("malformed_header", f"chunk {parsed.index} of {parsed.count}")
    return parsed, data


def decode_payload(header: ChunkHeader, payload: bytes) -> dict[str, torch.Tensor]:
    """Verified payload -> float32 tensors; never unpickles, refuses other dtypes and non-finite values."""
    import torch
    from safetensors.torch import load as st_load

    from nefl.tensors import all_finite

    if hashlib.sha256(payload).hexdigest() != header.sha256:
        raise WireError("sha256_mismatch", "payload does not match the sha256 in its header")
    if header.dtype not in DTYPES:
        raise WireError("bad_dtype", f"a {header.kind} message of dtype {header.dtype} carries no tensors")
    try:
        tensors = st_load(payload)
    except Exception as e:  # the safetensors parser's error types vary by version; all mean "bad bytes"
        raise WireError("malformed_payload", f"not a safetensors payload ({type(e).__name__})") from None
    want = _torch_dtype(header.dtype)
    out = {}
    for n, t in tensors.items():
        if t.dtype != want:
            raise WireError("bad_dtype", f"{n}: {t.dtype}, header says {header.dtype}")
        if not all_finite(t):
            raise WireError("non_finite", f"{n}: non-finite values")
        out[n] = t.to(torch.float32)
    return out


@dataclass
class _Pending:
    header: ChunkHeader  # chunk 0's: every chunk of the set must carry the same header but for its index
    started: float
    parts: dict[int, bytes] = field(default_factory=dict)
    received: int = 0


class Reassembler:
    """Collects chunks into verified tensor messages under caps on size, count, pending sets and time.

    The caps on pending sets and buffered bytes hold per sender (the header's client, which the
    server has already matched to the topic), so one client can only exhaust its own share."""

    def __init__(self, max_bytes: int = 64 << 20, timeout_s: float = 120.0, max_pending: int = 2,
                 max_chunks: int = 4096, remember: int = 4096, max_buffered: int | None = None) -> None:
        self.max_bytes, self.timeout_s, self.max_pending, self.max_chunks = max_bytes, timeout_s, max_pending, max_chunks
        self.max_buffered = max_buffered or 2 * max_bytes  # one sender's incomplete sets together
        self._pending: dict[tuple, _Pending] = {}
        self._done: OrderedDict[tuple, None] = OrderedDict()
        self._remember = remember
        self.duplicates = 0

    @staticmethod
    def key(header: ChunkHeader) -> tuple:
        """Redeliveries share it; a different payload under the same identity is a different set."""
        return header.kind, header.round, header.client, header.submodel, header.sha256

    def is_duplicate(self, header: ChunkHeader) -> bool:
        """A QoS 1 redelivery of a chunk already held, or of a set already completed."""
        key = self.key(header)
        pending = self._pending.get(key)
        if key in self._done or (pending is not None and header.index in pending.parts):
            self.duplicates += 1
            return True
        return False

    def feed(self, message: bytes, now: float | None = None) -> Assembled | None:
        """The assembled message when this chunk completes one; None while incomplete or a redelivery."""
        now = time.monotonic() if now is None else now
        if len(message) > self.max_bytes:
            raise WireError("oversized", f"message of {len(message)} bytes exceeds {self.max_bytes}")
        header, data = parse_chunk(message)
        if header.size > self.max_bytes or header.count > self.max_chunks:
            raise WireError("oversized", f"{header.size} bytes in {header.count} chunks exceeds the caps "
                                         f"({self.max_bytes} bytes, {self.max_chunks} chunks)")
        key = self.key(header)
        if key in self._done:
            self.duplicates += 1
            return None
        pending = self._pending.get(key)
        sender = header.client
        first = msgspec.structs.replace(header, index=0)
        if pending is None:
            if self._count(sender) >= self.max_pending:
                raise WireError("too_many_pending", f"{self.max_pending} chunk sets from {sender} already in flight")
            pending = self._pending[key] = _Pending(first, now)
        elif first != pending.header:
            self._pending.pop(key)
            raise WireError("inconsistent_chunks", f"chunk {header.index} header differs from earlier chunks")
        if header.index in pending.parts:
            self.duplicates += 1
            return None
        if self._buffered(sender) + len(data) > self.max_buffered:
            raise WireError("oversized", f"more than {self.max_buffered} bytes buffered across {sender}'s incomplete chunk sets")
        pending.parts[header.index] = data
        pending.received += len(data)
        if pending.received > header.size:
            self._pending.pop(key)
            raise WireError("oversized", f"chunks carry more than the {header.size} bytes announced")
        if len(pending.parts) < header.count:
            return None
        self._pending.pop(key)
        payload = b"".join(pending.parts[i] for i in range(header.count))
        if len(payload) != header.size:
            raise WireError("size_mismatch", f"{len(payload)} bytes received, header says {header.size}")
        tensors = decode_payload(header, payload)
        self._remember_done(key)  # only verified sets: a corrupted copy must not shadow the real one
        return Assembled(pending.header, tensors, len(payload))

    def _count(self, sender: str) -> int:
        return sum(1 for k in self._pending if k[2] == sender)

    def _buffered(self, sender: str) -> int:
        return sum(p.received for k, p in self._pending.items() if k[2] == sender)

    def expire(self, now: float | None = None) -> list[tuple]:
        """Drop chunk sets older than the timeout; returns their keys (kind, round, client, submodel, sha256)."""
        now = time.monotonic() if now is None else now
        old = [k for k, p in self._pending.items() if now - p.started > self.timeout_s]
        for k in old:
            del self._pending[k]
        return old

    def discard_rounds_before(self, round_: int) -> None:
        """Partial sets of closed rounds can never complete usefully; free their memory."""
        for k in [k for k in self._pending if k[1] < round_]:
            del self._pending[k]

    def _remember_done(self, key: tuple) -> None:
        self._done[key] = None
        while len(self._done) > self._remember:
            self._done.popitem(last=False)
