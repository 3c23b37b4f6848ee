"""Hostile payloads for the fuzz tests of inbound handlers (tests/integration/test_trust_boundary.py): random
bytes, any JSON value, a validly signed JSON object with a hostile body, and a valid message with bytes flipped."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

from nefl.protocol.messages import VERSION

# any nesting of any JSON value, including the constants Python's json accepts (NaN, Infinity)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=30,
)
# the kinds `hostile_payload` draws; a test adds its own (mutated valid messages) beside them
HOSTILE = ("bytes", "json", "signed-json")


def hostile_payload(data: st.DataObject, kind: str, sign: Callable[[bytes], bytes], **fields: Any) -> bytes:
    """A payload of one of HOSTILE's kinds: up to 3000 random bytes, any JSON value, or a JSON object of this
    protocol version signed by `sign` (a key the handler trusts), `fields` first, then any keys and values."""
    if kind == "bytes":
        return data.draw(st.binary(max_size=3000))
    if kind == "json":
        return json.dumps(data.draw(json_values)).encode()
    if kind == "signed-json":
        value = data.draw(st.dictionaries(st.text(max_size=10), json_values, min_size=1, max_size=5))
        return sign(json.dumps({"v": VERSION, **fields, **value}).encode())
    raise ValueError(f"not a hostile kind: {kind!r}")


def mutate(data: st.DataObject, raw: bytes) -> bytes:
    """`raw` with 1 to 6 bytes overwritten at drawn positions."""
    out = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 6))):
        out[data.draw(st.integers(0, len(out) - 1))] = data.draw(st.integers(0, 255))
    return bytes(out)
