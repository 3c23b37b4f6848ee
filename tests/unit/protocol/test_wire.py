"""Wire format: roundtrip, chunking, QoS 1 dedupe, verification and caps."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from blake3 import blake3
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from nefl.protocol import signing
from nefl.protocol.messages import MessageError
from nefl.protocol.signing import Signer, parse_public_key
from nefl.protocol.topics import Topics, check_name
from nefl.nested.tensorfile import PayloadError, decode_tensors, encode_tensors
from nefl.protocol.merkle import (_NODE, HASH_BYTES, leaf, merkle_levels, merkle_proof, merkle_root, merkle_root_of,
                                  proof_length)
from nefl.protocol.wire import (DATA_ALIGN, MAGIC, MAX_HEADER_BYTES, WIRE_VERSION, Reassembler, WireError, encode,
                                parse_chunk, split_chunk)

CHUNK = 16 * 1024


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"conv.weight": torch.randn(16, 8, 3, 3, generator=g), "bn.bias": torch.randn(16, generator=g),
            "step": torch.tensor(0.5), "fc.weight": torch.randn(10, 300, generator=g)}


def msgs(t=None, **kw) -> list[bytes]:
    args = dict(kind="update", federation="f", round=3, submodel=1, client="c1", samples=7, chunk_bytes=CHUNK)
    return encode(tensors() if t is None else t, **{**args, **kw}).messages


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


def test_encode_returns_the_header_its_messages_carry():
    """What a sender names the payload by (a task's model digest, an upload notice) without parsing its own output."""
    device = Signer(Ed25519PrivateKey.generate())
    for sign in (None, device.sign):
        out, header = encode(tensors(), kind="update", federation="f", round=3, submodel=1, client="c1", samples=7,
                             metrics={"loss": 0.5}, chunk_bytes=CHUNK, sign=sign)
        assert len(out) == header.count > 1 and all(parse_chunk(m).header == header for m in out)


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
    """The message with its header's fields changed (its proof and data kept)."""
    head, index, proof, data = split_chunk(message)
    header = json.loads(head)
    header.update(changes)
    return reframe(json.dumps(header, separators=(",", ":")).encode(), index, bytes(proof), bytes(data))


def reframe(head: bytes, index: int, proof: bytes, data: bytes, version: int = WIRE_VERSION) -> bytes:
    return struct.pack(">4sBBHI", MAGIC, version, len(proof) // HASH_BYTES, len(head), index) + head + proof + data


def test_a_corrupted_chunk_is_refused_alone_and_the_intact_copy_completes():
    out = msgs(chunk_bytes=8192 - 1024 + 2048 + 4096)  # 5 KiB of payload per chunk
    assert len(out) > 2
    r = Reassembler()
    head, index, proof, data = split_chunk(out[1])
    for bad, reason in ((reframe(head, index, bytes(proof), bytes(data[:-1]) + bytes([data[-1] ^ 1])), "digest_mismatch"),
                        (reframe(head, index, bytes(proof), bytes(data) + b"x"), "size_mismatch"),
                        (reframe(head, 0, bytes(split_chunk(out[0])[2]), bytes(data)), "digest_mismatch")):
        with pytest.raises(WireError) as e:
            r.feed(bad)
        assert e.value.reason == reason
    assert [r.feed(m) for m in out][-1] is not None and r.duplicates == 0


@settings(max_examples=60, deadline=None)
@given(count=st.integers(1, 40), data=st.data())
def test_every_chunk_proves_its_place_and_nothing_else_does(count, data):
    """Against brute force: the root is the pairwise tree, each chunk's proof leads to it, and no chunk
    proves another index, a neighbour's data or a changed byte."""
    parts = [bytes([i % 256]) * (1 + i % 3) for i in range(count)]
    levels = merkle_levels([leaf(p) for p in parts])
    nodes = [leaf(p) for p in parts]
    while len(nodes) > 1:  # the tree by hand
        nodes = [blake3(nodes[i] + nodes[i + 1], derive_key_context=_NODE).digest() if i + 1 < len(nodes) else nodes[i]
                 for i in range(0, len(nodes), 2)]
    root = levels[-1][0]
    assert root == nodes[0] == merkle_root([leaf(p) for p in parts])
    i = data.draw(st.integers(0, count - 1))
    proof = memoryview(merkle_proof(levels, i))
    assert len(proof) == proof_length(i, count) * HASH_BYTES
    assert merkle_root_of(parts[i], i, count, proof) == root
    assert merkle_root_of(parts[i] + b"!", i, count, proof) != root
    if count > 1:
        j = data.draw(st.integers(0, count - 1).filter(lambda j: parts[j] != parts[i]))
        assert merkle_root_of(parts[j], i, count, proof) != root
        if proof_length(j, count) == proof_length(i, count) and j != i:
            assert merkle_root_of(parts[i], j, count, proof) != root


def test_tensors_round_trip_through_safetensors_both_ways():
    """encode_tensors writes what the safetensors library reads, and the decoder reads what it writes."""
    t = tensors()
    assert all(torch.equal(st_load(bytes(encode_tensors(t)))[n], v) for n, v in t.items())
    got = decode_tensors("fp32", np.frombuffer(st_save(t), dtype=np.uint8).copy())
    assert all(torch.equal(got[n], v) for n, v in t.items())
    assert sum(v.numel() for v in got.values()) == got.flat.numel() and all(v._base is got.flat for v in got.values())


_KEPT = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8, torch.uint8,
         torch.bool]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(_KEPT), st.lists(st.integers(0, 5), max_size=3), st.booleans()), max_size=6),
       st.sampled_from(["fp32", "fp16", None]))
def test_encode_tensors_is_what_safetensors_writes(specs, dtype):
    """Any mix of dtypes and shapes (empty ones, non-contiguous views, no tensors at all), kept as they are
    (dtype None: a checkpoint) or cast: safetensors' reader gets them back exactly, and where they share one
    dtype the file is byte for byte what safetensors' own writer makes (of mixed ones it orders the data its own way)."""
    gen = torch.Generator().manual_seed(len(specs))
    t = {}
    for i, (kind, shape, transpose) in enumerate(specs):
        x = (torch.randn(shape, generator=gen) * 50).to(kind)
        t[f"t{i}"] = x.t() if transpose and x.dim() == 2 else x
    if dtype is not None:
        if not all(v.is_floating_point() for v in t.values()):
            return
        want = {"fp32": torch.float32, "fp16": torch.float16}[dtype]
        expected = {n: v.to(want).contiguous() for n, v in t.items()}
    else:
        expected = {n: v.contiguous() for n, v in t.items()}
    out = bytes(encode_tensors(t, dtype))
    if len({v.dtype for v in expected.values()}) <= 1:
        assert out == st_save(expected)
    back = st_load(out)
    assert back.keys() == expected.keys()
    assert all(torch.equal(back[n], v) for n, v in expected.items())


@pytest.mark.parametrize("message, reason", [
    (b"", "malformed_header"),
    (b"\x00" * 64, "malformed_header"),
    (reframe(b"{x}", 0, b"", b""), "malformed_header"),
    (MAGIC + struct.pack(">BBHI", WIRE_VERSION, 0, 60000, 0) + b"{}", "malformed_header"),
    (MAGIC + struct.pack(">BBHI", WIRE_VERSION, 200, 2, 0) + b"{}", "malformed_header"),
    (MAGIC + struct.pack(">I", 3) + b"{x}" + bytes(8), "bad_version"),  # a version 1 chunk: signed per chunk, one sha256
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


@settings(max_examples=200, deadline=None)
@given(cut=st.integers(0, 400), flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), max_size=4))
def test_damaged_messages_raise_only_wire_errors(cut, flips):
    """Any truncation and byte flips of a genuine chunk: a WireError with a reason, or (a flip in the
    data that the proof catches, or one in a field nobody checks twice) a clean refusal or acceptance."""
    m = bytearray(msgs(chunk_bytes=1 << 20)[0])
    for at, x in flips:
        m[at % len(m)] ^= x
    try:
        Reassembler().feed(bytes(m[:len(m) - cut]))
    except WireError as e:
        assert e.reason


def test_header_fields_are_type_checked():
    m = msgs(chunk_bytes=1 << 20)[0]
    for change in ({"round": "3"}, {"client": 5}, {"count": 2}, {"dtype": "int8"}, {"v": 99}, {"samples": True},
                   {"chunk": 0}, {"digest": "ab"}):
        with pytest.raises(WireError):
            parse_chunk(tamper(m, **change))


def test_size_caps():
    out = msgs()
    with pytest.raises(WireError) as e:
        Reassembler(max_bytes=CHUNK // 2).feed(out[0])
    assert e.value.reason == "oversized"
    with pytest.raises(WireError) as e:  # a header announcing a huge set is refused before buffering
        Reassembler(max_bytes=1 << 20).feed(tamper(out[0], size=1 << 30, count=(1 << 30) // parse_chunk(out[0]).header.chunk + 1))
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


def test_the_signature_is_checked_once_per_update(monkeypatch):
    """Every chunk repeats the signed header: one Ed25519 verification per update, a byte compare per chunk;
    a chunk whose header differs (a forged one under the same digest) is checked, and refused, on its own."""
    device = Signer(Ed25519PrivateKey.generate())
    key = parse_public_key(device.public_text)
    out = msgs(sign=device.sign)
    calls = []
    real = signing.verify
    monkeypatch.setattr(signing, "verify", lambda payload, k: calls.append(1) or real(payload, k))
    r = Reassembler()
    assert [r.feed(r.parse(m, key)) for m in out][-1] is not None and len(calls) == 1
    forged = tamper(msgs(sign=device.sign, round=4)[1], samples=1)
    with pytest.raises(MessageError) as e:
        r.parse(forged, key)
    assert e.value.reason == "bad_signature" and len(calls) == 2
    with pytest.raises(MessageError):
        r.parse(msgs()[0], key)  # unsigned under a pinned key


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
    with pytest.raises(WireError) as e:
        r.feed(bytes(corrupted))
    assert e.value.reason == "digest_mismatch"
    assert r.feed(out[0]) is not None


def test_total_buffered_bytes_are_capped():
    r = Reassembler(max_buffered=CHUNK)  # one chunk fits, two do not
    r.feed(msgs(round=1)[0])
    with pytest.raises(WireError) as e:
        r.feed(msgs(round=2)[0])
    assert e.value.reason == "oversized"


def test_a_single_chunk_in_a_writable_buffer_is_decoded_in_place():
    original = msgs(chunk_bytes=1 << 20)[0]
    m = bytearray(original)
    done = Reassembler().feed(m)
    assert all(torch.equal(done.tensors[n], t) for n, t in tensors().items())
    done.tensors["bn.bias"].mul_(0)  # the tensors are the message's own bytes
    assert m != original and Reassembler().feed(original).tensors["bn.bias"].abs().sum() > 0


def test_a_safetensors_header_is_parsed_once_and_its_tiling_shared():
    """Updates that repeat a header share one Tiling (what lets the aggregator judge their layout once);
    their views are still each payload's own values, and a bad header is refused every time, not cached."""
    first, second = tensors(), {n: t + 1 for n, t in tensors().items()}
    a, b = (decode_tensors("fp32", np.frombuffer(encode_tensors(t), dtype=np.uint8)) for t in (first, second))
    assert a.tiling is b.tiling and list(a) == list(a.tiling.names) == sorted(first)
    assert all(torch.equal(a[n], first[n]) and torch.equal(b[n], second[n]) for n in first)
    bad = bytearray(encode_tensors(first))
    bad[8:8 + 20] = b'{"x": {"dtype": "F32"'  # a header that no longer parses
    for _ in range(2):
        with pytest.raises(PayloadError, match="malformed_payload"):
            decode_tensors("fp32", np.frombuffer(bad, dtype=np.uint8))


def test_lazy_views_appear_on_first_use_of_any_dict_method():
    """A lazily decoded update (an aggregator's) makes no views until asked, then is the eager one for
    every way of reading a dict, including the C paths that copy one (dict(), **, update)."""
    t = tensors()
    payload = encode_tensors(t)
    eager = decode_tensors("fp32", np.frombuffer(payload, dtype=np.uint8))
    reads = [len, list, dict, lambda d: {**d}, lambda d: list(d.items()), lambda d: list(d.values()), lambda d: "step" in d,
             lambda d: d["bn.bias"], lambda d: d.get("fc.weight"), repr, lambda d: list(reversed(d)),
             lambda d: {}.update(d) or d.copy()]
    for read in reads:
        lazy = decode_tensors("fp32", np.frombuffer(bytearray(payload), dtype=np.uint8), lazy=True)
        assert lazy._empty and lazy.flat.numel() == eager.flat.numel()
        got, want = read(lazy), read(eager)
        assert not lazy._empty
        if isinstance(want, dict):
            assert list(got) == list(want) and all(torch.equal(got[n], want[n]) for n in want)
        elif isinstance(want, list) and want and isinstance(want[0], tuple):
            assert [n for n, _ in got] == [n for n, _ in want] and all(torch.equal(a, b) for (_, a), (_, b) in zip(got, want))
        elif isinstance(want, list) and want and isinstance(want[0], torch.Tensor):
            assert all(torch.equal(a, b) for a, b in zip(got, want))
        elif isinstance(want, torch.Tensor):
            assert torch.equal(got, want)
        else:
            assert got == want
    reasm = Reassembler(lazy_views=True)
    done = [reasm.feed(m) for m in msgs()][-1]
    assert done.tensors._empty and all(torch.equal(done.tensors[n], v) for n, v in t.items())


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["feed", "expire", "discard"]), st.integers(0, 2), st.integers(1, 4),
                          st.integers(0, 2)), max_size=30))
def test_the_per_sender_caps_are_counted_as_the_pending_sets_say(ops):
    """The running per-sender counts (sets in flight, bytes held) that the caps read in O(1) equal a
    recount over the pending sets after any mix of chunks, completions, refusals, expiries and round discards."""
    sets = {(c, r): msgs(client=f"c{c}", round=r) for c in range(3) for r in range(1, 5)}
    reasm, now = Reassembler(max_pending=2, max_buffered=3 * CHUNK), 0.0
    for op, c, r, i in ops:
        now += 1.0
        if op == "feed":
            try:
                reasm.feed(sets[c, r][min(i, len(sets[c, r]) - 1)], now=now)
            except WireError:
                pass
        elif op == "expire":
            reasm.expire(now=now + 100 * (i == 2))
        else:
            reasm.discard_rounds_before(r)
        recount: dict[str, list[int]] = {}
        for key, p in reasm._pending.items():
            held = recount.setdefault(key[2], [0, 0])
            held[0], held[1] = held[0] + 1, held[1] + p.received
        assert reasm._held == recount


@given(client=st.text("abc-_0123456789", min_size=1, max_size=60), round_=st.integers(0, 10**9),
       metrics=st.dictionaries(st.sampled_from(["loss", "acc", "t"]), st.floats(-1e6, 1e6), max_size=3),
       signed=st.booleans(), n=st.sampled_from([1, 3000, 70000]))
@settings(max_examples=60, deadline=None)
def test_every_chunk_s_data_starts_aligned_in_its_message(client, round_, metrics, signed, n):
    """The header is padded (JSON blank space) so that each chunk's data, and so an update's float32 tensors, start
    at a multiple of DATA_ALIGN in the message, whatever the lengths of the names and numbers in it; the padded
    header still parses, and its signature, over the padded bytes, still verifies."""
    device = Signer(Ed25519PrivateKey.generate())
    out = encode({"w": torch.randn(n)}, kind="update", federation="f", round=round_, submodel=0, client=client,
                 metrics=metrics, sign=device.sign if signed else None, chunk_bytes=64 * 1024).messages
    for m in out:
        head, _, _, data = split_chunk(m)
        assert (len(m) - len(data)) % DATA_ALIGN == 0
    r = Reassembler()
    key = parse_public_key(device.public_text) if signed else None
    done = [d for m in out if (d := r.feed(r.parse(m, key))) is not None]
    assert len(done) == 1 and done[0].header.round == round_ and torch.equal(done[0].tensors["w"], done[0].tensors["w"])


def test_a_header_at_the_size_limit_goes_unpadded():
    """Padding never makes a header too long: one within DATA_ALIGN bytes of MAX_HEADER_BYTES is sent as it is."""
    for extra in range(DATA_ALIGN + 2):
        metrics = {"m": 0.0}
        base = len(split_chunk(encode({"w": torch.zeros(4)}, kind="update", federation="f", round=1, submodel=0,
                                      client="c", metrics=metrics).messages[0])[0])
        name = "x" * (MAX_HEADER_BYTES - base - extra + 1)
        try:
            out = encode({"w": torch.zeros(4)}, kind="update", federation="f", round=1, submodel=0, client="c",
                         metrics={name: 0.0}).messages
        except ValueError:
            continue  # too long before any padding: refused as before
        assert len(split_chunk(out[0])[0]) <= MAX_HEADER_BYTES
