"""A rollout's file chunks on the device: each is taken only when its Merkle proof leads to its file's root in the
signed release (edge_client/follow.py `check_release_chunk`), and staged with its proof so that a resumed download
checks every staged chunk again (edge_client/store.py `Staging`)."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import msgspec
import pytest

from edge_client.follow import Refused, check_release_chunk
from edge_client.store import Staging, Store
from nefl.protocol.manifest import (
    InputSpec,
    Manifest,
    OutputSpec,
    ParitySpec,
    SubmodelEntry,
)
from nefl.protocol.merkle import HASH_BYTES, payload_root
from nefl.protocol.messages import Release, ReleaseFile
from nefl.protocol.wire import (
    _PREFIX,
    MAGIC,
    WIRE_VERSION,
    WireError,
    chunk_room,
    frame,
    parse_chunk,
    split_chunk,
)

CHUNK_BYTES = 6000  # a room of 1124 bytes: the model travels in 5 chunks
ROOM = chunk_room(CHUNK_BYTES)
FILES = {"model.onnx": random.Random(0).randbytes(5000), "parity.npz": random.Random(1).randbytes(700)}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _release(files: dict[str, bytes] = FILES, version: int = 1) -> Release:
    manifest = Manifest(
        profile="p", profile_hash="h", method="m", dataset="d", source_round=1, created="now",
        input=InputSpec(name="x", shape=[1, 4, 4], mean=[0.0], std=[1.0]),
        output=OutputSpec(name="y", num_classes=2, class_names=None),
        parity=ParitySpec(tolerance=0.1, inputs="x", batch_sizes=[1], file="parity.npz", sha256=_sha(files["parity.npz"])),
        submodels=[SubmodelEntry(index=0, file="model.onnx", sha256=_sha(files["model.onnx"]), gamma=1.0, gamma_w=1.0,
                                 params=1, flops=1, weight_bytes=1, activation_bytes_per_sample=1, accuracy=None,
                                 parity_max_diff=0.0)])
    return Release(federation="t", version=version, created="now", chunk_bytes=ROOM, manifest=manifest,
                   files=[ReleaseFile(name=n, sha256=_sha(b), size=len(b), digest=payload_root(b, ROOM).hex())
                          for n, b in files.items()])


def _messages(name: str, files: dict[str, bytes] = FILES, version: int = 1) -> list[bytes]:
    position = list(files).index(name)
    return frame(files[name], kind="file", federation="t", round=version, submodel=position, client="aggregator",
                 dtype="raw", chunk_bytes=CHUNK_BYTES).messages


def _with(message: bytes, *, index: int | None = None, proof: bytes | None = None, data: bytes | None = None) -> bytes:
    """`message` with its index, proof or data replaced (the header kept byte for byte)."""
    head, old_index, old_proof, old_data = split_chunk(message)
    proof = bytes(old_proof) if proof is None else proof
    prefix = _PREFIX.pack(MAGIC, WIRE_VERSION, len(proof) // HASH_BYTES, len(head), old_index if index is None else index)
    return prefix + head + proof + (bytes(old_data) if data is None else data)


def _check(message: bytes, release: Release | None = None) -> tuple[str, int]:
    return check_release_chunk(release or _release(), set(FILES), parse_chunk(message))


def test_every_chunk_in_any_order_proves_its_place() -> None:
    messages = [(n, m) for n in FILES for m in _messages(n)]
    random.Random(2).shuffle(messages)
    assert sorted(_check(m) for _, m in messages) == sorted((n, i) for n in FILES for i in range(len(_messages(n))))


@pytest.mark.parametrize("tamper", ["data", "proof"])
def test_a_tampered_chunk_is_refused_with_a_reason(tamper: str) -> None:
    message = _messages("model.onnx")[2]
    _, _, proof, data = split_chunk(message)
    flipped = {"data": {"data": bytes(data[:-1]) + bytes([data[-1] ^ 1])},
               "proof": {"proof": bytes([proof[0] ^ 1]) + bytes(proof[1:])}}[tamper]
    with pytest.raises(Refused) as e:
        _check(_with(message, **flipped))
    assert e.value.reason == "digest_mismatch"
    assert "chunk 2 of model.onnx (v1): chunk 2 does not hash to the digest in its header" in str(e.value)


def test_a_reordered_chunk_is_refused() -> None:
    """Chunk 3's data and proof presented as chunk 1, or chunk 1 carrying chunk 3's data: neither proves its place."""
    messages = _messages("model.onnx")
    _, _, proof3, data3 = split_chunk(messages[3])
    for forged in (_with(messages[3], index=1), _with(messages[1], data=bytes(data3)),
                   _with(messages[1], data=bytes(data3), proof=bytes(proof3))):
        with pytest.raises((Refused, WireError)) as e:
            _check(forged)
        assert e.value.reason in {"digest_mismatch", "malformed_header"}


def test_a_chunk_missing_its_proof_is_refused_by_the_framing() -> None:
    message = _messages("model.onnx")[1]
    with pytest.raises(WireError) as e:
        parse_chunk(_with(message, proof=bytes(split_chunk(message)[2])[:-HASH_BYTES]))
    assert e.value.reason == "malformed_header" and "needs a proof of" in str(e.value)


def test_a_chunk_of_another_payload_is_refused_even_when_its_proof_holds() -> None:
    """A self-consistent chunk of other bytes (its own root in its header) does not describe the signed file."""
    other = dict(FILES, **{"model.onnx": bytes(5000)})
    with pytest.raises(Refused) as e:
        _check(_messages("model.onnx", other)[0])
    assert e.value.reason == "inconsistent_chunks"


def test_a_chunk_of_a_file_not_wanted_is_refused() -> None:
    release = _release()
    with pytest.raises(Refused) as e:
        check_release_chunk(release, {"model.onnx"}, parse_chunk(_messages("parity.npz")[0]))
    assert e.value.reason == "unwanted"


def _stage(root: Path, names: dict[str, list[int]]) -> Staging:
    release = _release()
    staging = Staging(Store(root), release, list(FILES), keep_free_bytes=0)
    for name, indices in names.items():
        for i in indices:
            chunk = parse_chunk(_messages(name)[i])
            staging.write(*check_release_chunk(release, set(FILES), chunk), chunk.data, chunk.proof)
    return staging


def test_a_resumed_download_reverifies_every_staged_chunk(tmp_path: Path) -> None:
    """Missing chunks stay missing; a staged chunk or proof changed on disk is fetched again; the rest resumes."""
    staging = _stage(tmp_path, {"model.onnx": [0, 1, 3, 4], "parity.npz": [0]})
    assert staging.missing("model.onnx") == [2] and not staging.done
    part, proofs = staging.dir / "model.onnx.part", staging.dir / "model.onnx.proofs"
    raw = bytearray(part.read_bytes())
    raw[ROOM * 3] ^= 1  # a byte of chunk 3
    part.write_bytes(raw)
    raw = bytearray(proofs.read_bytes())
    raw[4 * 3 * HASH_BYTES] ^= 1  # a hash of chunk 4's proof (slots of 3 hashes: the depth of 5 chunks)
    proofs.write_bytes(raw)
    again = Staging(Store(tmp_path), _release(), list(FILES), keep_free_bytes=0)
    assert again.missing("model.onnx") == [2, 3, 4] and again.file_done("parity.npz")
    assert again.resumed_bytes == 2 * ROOM + len(FILES["parity.npz"])


def test_a_finished_download_holds_the_signed_bytes(tmp_path: Path) -> None:
    staging = _stage(tmp_path, {"model.onnx": [4, 2, 0, 3, 1], "parity.npz": [0]})
    assert staging.done
    target = staging.finish(_release().manifest, b"{}")
    assert {n: (target / n).read_bytes() for n in FILES} == FILES
    assert not list(target.glob("*.proofs")) and not list(target.glob("*.part"))


def test_a_release_travels_as_version_3_and_a_version_2_follower_refuses_it() -> None:
    raw = _release().to_json()
    assert msgspec.json.decode(raw)["v"] == 3
    assert Release.from_json(raw) == _release()
    old = msgspec.json.encode(msgspec.json.decode(raw) | {"v": 2})
    with pytest.raises(ValueError, match="bad_version: release message of wire version 2, this build speaks 3"):
        Release.from_json(old)
