"""Tensors <-> safetensors bytes with one copy each way: the wire's payloads and the checkpoint's state file.

Torch is imported when a function is called, so the framing that imports this module (nefl/protocol/wire.py)
stays loadable on the small install. Never unpickles: the table is parsed by a strict schema, and holes,
overlaps, other dtypes and non-finite values are refused with a PayloadError carrying a short reason code.
"""

from __future__ import annotations

import functools
import math
import struct
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
import numpy as np

if TYPE_CHECKING:
    import torch

    from nefl.nested.tensors import Tiling

DTYPES = ("fp32", "fp16")  # tensor payloads; the wire's "raw" is a file's bytes


class PayloadError(ValueError):
    """Bytes that are not a safetensors payload this kit accepts; `reason` is a short code for counters."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.detail = message


_ST_DTYPES = {"fp32": ("F32", 4), "fp16": ("F16", 2)}


@functools.cache
def _st_names() -> dict[torch.dtype, str]:
    """safetensors' name of each torch dtype a tensor file may hold (torch imported on first use)."""
    import torch

    return {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
            torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


class _StEntry(msgspec.Struct, forbid_unknown_fields=True):
    dtype: str
    shape: list[Annotated[int, msgspec.Meta(ge=0)]]
    data_offsets: tuple[Annotated[int, msgspec.Meta(ge=0)], Annotated[int, msgspec.Meta(ge=0)]]


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {name!r}")
    return {"fp32": torch.float32, "fp16": torch.float16}[name]


def encode_tensors(tensors: dict[str, torch.Tensor], dtype: str | None = "fp32") -> bytearray:
    """A safetensors file of `tensors` in `dtype` ("fp32", "fp16"; None: each tensor's own, as a checkpoint
    keeps them), written with one copy of the tensor data: what `safetensors.torch.load` reads, built without
    its two intermediate copies. Data 8-byte aligned, wider dtypes first, then by name (so each tensor is
    aligned to its width; of one dtype, the bytes safetensors writes). Tensors that need no cast are copied by
    one numpy concatenation into the buffer, cheaper than one torch copy at a time or safetensors' own
    `save_file`. numpy, not torch.cat: a process forked
    after torch's thread pool ran (the checkpoint tests' crashing writer) hangs in its next parallel operation."""
    import torch

    from nefl.nested.tensors import byte_view

    want, st_names = None if dtype is None else _torch_dtype(dtype), _st_names()
    kind = {n: want or t.dtype for n, t in tensors.items()}
    if unnamed := sorted(n for n, k in kind.items() if k not in st_names):
        raise ValueError(f"tensor(s) {unnamed} of a dtype safetensors has no name for")
    names = sorted(tensors, key=lambda n: (-kind[n].itemsize, n))  # wider first: each tensor aligned to its own width
    header: dict[str, Any] = {}
    offset = 0
    for n in names:
        size = tensors[n].numel() * kind[n].itemsize
        header[n] = {"dtype": st_names[kind[n]], "shape": list(tensors[n].shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = msgspec.json.encode(header)
    head += b" " * (-(8 + len(head)) % 8)
    out = bytearray(8 + len(head) + offset)
    out[:8] = struct.pack("<Q", len(head))
    out[8:8 + len(head)] = head
    if not offset:
        return out
    if all(tensors[n].dtype == kind[n] and tensors[n].device.type == "cpu" for n in names):  # no cast: numpy lays them end to end
        np.concatenate([byte_view(tensors[n]) for n in names],
                       out=np.frombuffer(out, dtype=np.uint8, offset=8 + len(head)))
        return out
    body = torch.frombuffer(out, dtype=torch.uint8, offset=8 + len(head))
    at = 0
    for n in names:
        size = tensors[n].numel() * kind[n].itemsize
        body[at:at + size].view(kind[n]).copy_(tensors[n].detach().reshape(-1))
        at += size
    return out


def decode_tensors(dtype: str, payload: np.ndarray, lazy: bool = False) -> dict[str, torch.Tensor]:
    """Verified safetensors bytes (a writable uint8 array) -> float32 views of one flat buffer, without a
    copy for fp32. Refuses holes, overlaps, other dtypes and non-finite values; never unpickles.
    lazy: the views are made on first use (nefl.nested.tensors.Tiled)."""
    import torch

    from nefl.nested.tensors import Tiled, array_norm

    if len(payload) < 8:
        raise PayloadError("malformed_payload", "not a safetensors payload (too short)")
    raw = payload.data  # the header's bytes through a memoryview: numpy's slicing is a call each, costly cold
    hlen = int.from_bytes(raw[:8], "little")
    if hlen > min(len(payload) - 8, 16 << 20):
        raise PayloadError("malformed_payload", "not a safetensors payload (header length)")
    tiling, item = safetensors_tiling(bytes(raw[8:8 + hlen]), dtype), _ST_DTYPES[dtype][1]
    start, at = 8 + hlen, tiling.numel * item
    if start + at != len(payload):
        raise PayloadError("malformed_payload", f"{len(payload) - start - at} bytes after the last tensor")
    body = payload[start:] if start % item == 0 else payload[start:].copy()
    if dtype == "fp32":  # the payload's own bytes, one numpy view and one tensor of them
        array = body.view(np.float32)
        flat = torch.from_numpy(array)
    else:
        array, flat = None, torch.from_numpy(body).view(_torch_dtype(dtype)).to(torch.float32)
    tiled = Tiled(flat, tiling, lazy, array)
    # one pass that the norm bound then reuses, not a sum of its own; numpy's, on the bytes as they lie, where it can
    norm = array_norm(array) if array is not None else None
    if norm is not None:
        tiled.normed = (0, norm)  # a tensor just made from the bytes: no write has bumped its version
    elif not math.isfinite(tiled.norm()):
        raise PayloadError("non_finite", "non-finite values")
    return tiled


CACHED_HEADER_BYTES = 64 << 10  # safetensors headers parsed once and kept (256 of them at most: 16 MiB)


def safetensors_tiling(head: bytes, dtype: str) -> Tiling:
    """The tensors a safetensors header lays out, in buffer order, or WireError for holes, overlaps or
    other dtypes. Cached by the header's bytes: every update of a submodel repeats its header, so the
    JSON parse and the checks of its table run once per submodel, not once per update; the same
    Tiling object then marks every such update's layout as already checked (nefl/aggregation/aggregate.py)."""
    return (_cached_tiling if len(head) <= CACHED_HEADER_BYTES else _read_tiling)(head, dtype)


def _read_tiling(head: bytes, dtype: str) -> Tiling:
    import torch

    from nefl.nested.tensors import Tiling

    try:
        try:  # one typed decode; a header with "__metadata__" (strings) takes the entry-by-entry way
            table = msgspec.json.decode(head, type=dict[str, _StEntry])
        except msgspec.ValidationError:
            raw = msgspec.json.decode(head, type=dict[str, msgspec.Raw])
            raw.pop("__metadata__", None)
            table = {n: msgspec.json.decode(v, type=_StEntry) for n, v in raw.items()}
        entries = sorted(table.items(), key=lambda e: e[1].data_offsets)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise PayloadError("malformed_payload", f"not a safetensors payload ({str(e)[:100]})") from None
    st_dtype, item = _ST_DTYPES[dtype]
    at = 0
    for n, e in entries:
        if e.dtype != st_dtype:
            raise PayloadError("bad_dtype", f"{n}: {e.dtype}, header says {dtype}")
        begin, end = e.data_offsets
        if begin != at or end - begin != math.prod(e.shape) * item:
            raise PayloadError("malformed_payload", f"{n}: data offsets {e.data_offsets} leave a hole, overlap or "
                                                 f"disagree with shape {e.shape}")
        at = end
    return Tiling(tuple(n for n, _ in entries), tuple(torch.Size(e.shape) for _, e in entries))


_cached_tiling = functools.lru_cache(maxsize=256)(_read_tiling)
