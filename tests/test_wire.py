"""Wire format: roundtrip, chunking, QoS 1 dedupe, verification and caps."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from nefl.topics import Topics, check_name
from nefl.wire import MAGIC, Reassembler, WireError, encode, parse_chunk

CHUNK = 16 * 1024


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"conv.weight": torch.randn(16, 8, 3, 3, generator=g), "bn.bias": torch.randn(16, generator=g),
            "step": torch.tensor(0.5), "fc.weight": torch.randn(10, 300, generator=g)}


def msgs(t=None, **kw) -> list[bytes]:
    args = dict(kind="update", federation="f", round=3, submodel=1, client="c1", samples=7, chunk_bytes=CHUNK)
    return encode(tensors() if t is None else t, **{**args, **kw})


def test_roundtrip_chunked_and_bounded():
    out = msgs()
    assert len(out) > 1 and all(len(m) <= CHUNK for m in out)
    r = Reassembler()
    results = [r.feed(m) for m in out]
    assert all(x is None for x in results[:-1])
    done = results[-1]
    assert done.header.client == "c1" and done.header.round == 3 and done.header.samples == 7
    for n, t in tensors().items():
        assert torch.equal(done.tensors[n], t)


def test_out_of_order_and_redelivered_chunks_are_idempotent():
    out = msgs()
    r = Reassembler()
    order = list(reversed(out))
    assert r.feed(order[0]) is None
    assert r.feed(order[0]) is None  # redelivery while pending
    done = [r.feed(m) for m in order[1:]]
    assert done[-1] is not None
    assert all(r.feed(m) is None for m in out)  # redelivery after completion: no second message
    assert r.duplicates == 1 + len(out)


def test_fp16_halves_the_payload_and_decodes_to_float32():
    full, half = msgs(), msgs(dtype="fp16")
    assert sum(map(len, half)) < 0.6 * sum(map(len, full))
    r = Reassembler()
    done = [r.feed(m) for m in half][-1]
    assert done.header.dtype == "fp16"
    for n, t in tensors().items():
        assert done.tensors[n].dtype == torch.float32
        assert torch.allclose(done.tensors[n], t, atol=1e-2, rtol=1e-3)


def tamper(message: bytes, **changes) -> bytes:
    hlen = struct.unpack_from(">4sI", message)[1]
    header = json.loads(message[8:8 + hlen])
    header.update(changes)
    head = json.dumps(header).encode()
    return struct.pack(">4sI", MAGIC, len(head)) + head + message[8 + hlen:]


def test_sha256_mismatch_rejected():
    out = msgs(chunk_bytes=1 << 20)
    assert len(out) == 1
    corrupted = bytearray(out[0])
    corrupted[-5] ^= 0xFF
    with pytest.raises(WireError) as e:
        Reassembler().feed(bytes(corrupted))
    assert e.value.reason == "sha256_mismatch"


@pytest.mark.parametrize("message, reason", [
    (b"", "malformed_header"),
    (b"\x00" * 64, "malformed_header"),
    (MAGIC + struct.pack(">I", 3) + b"{x}", "malformed_header"),
    (MAGIC + struct.pack(">I", 10**6) + b"{}", "malformed_header"),
])
def test_garbage_rejected(message, reason):
    with pytest.raises(WireError) as e:
        Reassembler().feed(message)
    assert e.value.reason == reason


def test_random_bytes_rejected():
    g = torch.Generator().manual_seed(1)
    for n in (3, 100, 5000):
        with pytest.raises(WireError):
            Reassembler().feed(bytes(torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).tolist()))


def test_header_fields_are_type_checked():
    m = msgs(chunk_bytes=1 << 20)[0]
    for change in ({"round": "3"}, {"client": 5}, {"index": 2}, {"dtype": "int8"}, {"v": 99}, {"samples": True}):
        with pytest.raises(WireError):
            parse_chunk(tamper(m, **change))


def test_size_caps():
    out = msgs()
    with pytest.raises(WireError) as e:
        Reassembler(max_bytes=CHUNK // 2).feed(out[0])
    assert e.value.reason == "oversized"
    with pytest.raises(WireError) as e:  # a header announcing a huge set is refused before buffering
        Reassembler(max_bytes=1 << 20).feed(tamper(out[0], size=1 << 30))
    assert e.value.reason == "oversized"
    with pytest.raises(WireError) as e:  # chunks carrying more than announced
        r = Reassembler()
        for m in out:
            r.feed(tamper(m, size=10))
    assert e.value.reason == "oversized"


def test_inconsistent_chunks_and_pending_cap():
    out = msgs()
    r = Reassembler()
    r.feed(out[0])
    with pytest.raises(WireError) as e:
        r.feed(tamper(out[1], samples=999))
    assert e.value.reason == "inconsistent_chunks"
    r = Reassembler(max_pending=2)
    for round_ in (1, 2):
        r.feed(msgs(round=round_)[0])
    with pytest.raises(WireError) as e:
        r.feed(msgs(round=3)[0])
    assert e.value.reason == "too_many_pending"


def test_timeout_expires_partial_sets():
    out = msgs()
    r = Reassembler(timeout_s=5)
    r.feed(out[0], now=100.0)
    assert r.expire(now=104.0) == []
    assert [k[:4] for k in r.expire(now=106.0)] == [("update", 3, "c1", 1)]
    assert r.feed(out[1], now=107.0) is None  # a fresh set starts; the expired part is gone


def test_non_finite_and_wrong_dtype_rejected():
    bad = tensors()
    bad["bn.bias"][3] = float("nan")
    r = Reassembler()
    with pytest.raises(WireError) as e:
        for m in msgs(bad):
            r.feed(m)
    assert e.value.reason == "non_finite"
    # a payload of fp16 tensors under a header that claims fp32
    half = msgs(dtype="fp16", chunk_bytes=1 << 20)[0]
    lying = tamper(half, dtype="fp32")
    with pytest.raises(WireError) as e:
        Reassembler().feed(lying)
    assert e.value.reason == "bad_dtype"


def test_topics_confine_ids():
    t = Topics("fed-1")
    assert t.update("c1") == "nefl/fed-1/update/c1"
    assert t.client_of("nefl/fed-1/update/c1", "update") == "c1"
    assert t.client_of("nefl/fed-1/update/c1/x", "update") is None
    assert t.client_of("nefl/other/update/c1", "update") is None
    for bad in ("a/b", "+", "#", "", "x" * 65):
        with pytest.raises(ValueError):
            check_name("client id", bad)


def test_a_corrupted_copy_does_not_shadow_the_genuine_message():
    out = msgs(chunk_bytes=1 << 20)
    corrupted = bytearray(out[0])
    corrupted[-5] ^= 0xFF
    r = Reassembler()
    with pytest.raises(WireError):
        r.feed(bytes(corrupted))
    assert r.feed(out[0]) is not None


def test_total_buffered_bytes_are_capped():
    r = Reassembler(max_buffered=CHUNK)  # one chunk fits, two do not
    r.feed(msgs(round=1)[0])
    with pytest.raises(WireError) as e:
        r.feed(msgs(round=2)[0])
    assert e.value.reason == "oversized"
