"""Control messages and signatures: round trips, every rejection reason, and fuzzing of the strict loader."""

from __future__ import annotations

import json

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nefl.protocol.messages import (MAX_CONTROL_BYTES, MAX_DEPTH, TASK_VERSION, VERSION, Announce, AnnounceRefusal,
                                   ClientStatus, Control, FlowerTask, MessageError, ServerStatus, Task, UpdateRefusal, message_type,
                                   nesting_depth)
from nefl.protocol.signing import KeyPin, Signer, parse_public_key, split_signed, verify

TASK = Task(federation="f", run="r1", round=3, submodel=1, lr=0.1, epochs=1, batch_size=32, profile_hash="abc",
            deadline_s=60.0, chunks=2, model_digest="0" * 64, model_bytes=1000)
MESSAGES = [
    Announce(client="c1", samples=10, max_submodel=3, selection="memory binds"),
    ClientStatus(state="online"),
    TASK,
    Control(federation="f", run="r1", event="end"),
    ServerStatus(state="training", federation="f", run="r1", round=2, rounds=5, profile={"name": "x", "submodels": [{}]}),
    msgspec.structs.replace(TASK, mode="buffered", version=7),
    UpdateRefusal(client="c1", federation="f", run="r1", round=9, submodel=0, version=1, current=20, reason="stale"),
]

# hostile JSON: any nesting of any JSON value, including the constants Python's json would accept
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=40,
)
_FIXED_KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
fuzz = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert type(msg).from_json(msg.to_json(), 1 << 20) == msg


@pytest.mark.parametrize("payload, reason", [
    (b'{"v":2,"type":"announce","client":"c","samples":1,"max_submodel":Infinity}', "malformed_json"),
    (b'{"v":2,"type":"announce","client":"c","samples":1,"max_submodel":NaN}', "malformed_json"),
    (b'{"v":2,"type":"announce","client":"c","samples":1,"max_submodel":' + b"9" * 5000 + b"}", "invalid_announce"),
    (b"[" * 2000 + b"]" * 2000, "too_deep"),
    (b'{"v":2,"x":' + b"[" * 2000 + b"]" * 2000 + b"}", "too_deep"),
    (b'{"v":2,"type":"announce","client":"a/b","samples":1,"max_submodel":1}', "invalid_announce"),
    (b'{"v":2,"type":"announce","client":"c","samples":0,"max_submodel":1}', "invalid_announce"),
    (b'{"v":2,"type":"task","client":"c","samples":1,"max_submodel":1}', "invalid_announce"),
    (b'{"v":1,"type":"announce"}', "bad_version"),
    (b'{"v":true}', "malformed_json"),
    (b"\xff\xfe\x00", "malformed_json"),
    (b" " * (MAX_CONTROL_BYTES + 1), "oversized"),
])
def test_each_kind_of_bad_announce_has_its_reason(payload, reason):
    with pytest.raises(MessageError) as e:
        Announce.from_json(payload)
    assert e.value.reason == reason


def test_a_task_of_wire_version_2_is_read_as_a_sync_task_and_other_versions_are_refused():
    body = json.loads(TASK.to_json())
    assert body["v"] == TASK_VERSION == 3
    old = {k: v for k, v in body.items() if k not in ("mode", "version")} | {"v": VERSION}  # what a sync server sends
    task = Task.from_json(json.dumps(old).encode())
    assert (task.mode, task.model_round) == ("sync", 3)
    assert msgspec.structs.replace(TASK, mode="buffered", version=7).model_round == 7
    for v in (1, 4):
        with pytest.raises(MessageError) as e:
            Task.from_json(json.dumps({**body, "v": v}).encode())
        assert e.value.reason == "bad_version"
    with pytest.raises(MessageError) as e:
        Control.from_json(json.dumps({**json.loads(Control(federation="f", run="r", event="end").to_json()), "v": 3}).encode())
    assert e.value.reason == "bad_version"  # only a message that says so reads another version
    with pytest.raises(MessageError) as e:
        Task.from_json(json.dumps({**body, "mode": "async"}).encode())
    assert e.value.reason == "invalid_task"


def test_message_type_tells_the_refusals_apart():
    refusal = AnnounceRefusal(client="c", federation="f", run="r", reason="revoked")
    assert message_type(refusal.to_json()) == "announce_refusal"
    assert message_type(UpdateRefusal(client="c", federation="f", run="r", round=1, submodel=0, version=0, current=0,
                                      reason="stale").to_json()) == "update_refusal"
    for junk in (b"", b"[1]", b"{", b'{"type": 3}', b"\xff"):
        assert message_type(junk) == ""


def test_task_ranges_are_checked():
    body = json.loads(TASK.to_json())
    for field, bad in (("batch_size", 0), ("epochs", 10**6), ("lr", -1), ("deadline_s", 0), ("model_digest", "xyz"),
                       ("round", -1), ("submodel", 1000), ("run", "../x")):
        with pytest.raises(MessageError) as e:
            Task.from_json(json.dumps({**body, field: bad}).encode())
        assert e.value.reason == "invalid_task", field


def test_nesting_depth_ignores_brackets_inside_strings():
    assert nesting_depth(b'{"a":"[[[[{{{{\\"]]"}') == 1
    assert nesting_depth(b'[[["x"]]]') == 3
    assert nesting_depth(b"[" * (MAX_DEPTH + 1)) == MAX_DEPTH + 1


@fuzz
@given(value=json_values, cls=st.sampled_from([Announce, ClientStatus, Task, Control, ServerStatus]))
def test_any_json_value_is_a_message_or_a_message_error(value, cls):
    payload = json.dumps(value).encode()  # allow_nan: NaN and Infinity literals included
    try:
        msg = cls.from_json(payload, 1 << 20)
    except MessageError as e:
        assert e.reason and isinstance(e.detail, str)
    else:
        assert isinstance(msg, cls)


@fuzz
@given(data=st.binary(max_size=2000), cls=st.sampled_from([Announce, Task, ServerStatus]))
def test_random_bytes_never_escape_as_another_exception(data, cls):
    with pytest.raises(MessageError):
        cls.from_json(data)


@fuzz
@given(msg=st.sampled_from(MESSAGES), data=st.data())
def test_mutated_valid_messages_decode_or_are_rejected(msg, data):
    raw = bytearray(msg.to_json())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    try:
        type(msg).from_json(bytes(raw), 1 << 20)
    except MessageError:
        pass


def test_signature_round_trip_and_tampering(tmp_path):
    signer = Signer.load_or_create(tmp_path)
    assert Signer.load_or_create(tmp_path).public_text == signer.public_text  # kept, not regenerated
    assert oct((tmp_path / "server.key").stat().st_mode & 0o777) == "0o600"
    key = parse_public_key(signer.public_text)
    signed = signer.sign(TASK.to_json())
    assert json.loads(signed)["round"] == 3  # still plain JSON for mosquitto_sub readers
    assert Task.from_json(verify(signed, key)) == TASK
    forged = signed.replace(b'"round":3', b'"round":4')
    with pytest.raises(MessageError) as e:
        verify(forged, key)
    assert e.value.reason == "bad_signature"
    with pytest.raises(MessageError) as e:
        verify(TASK.to_json(), key)
    assert e.value.reason == "unsigned"
    other = parse_public_key(Signer.load_or_create(tmp_path / "other").public_text)
    with pytest.raises(MessageError) as e:
        verify(signed, other)
    assert e.value.reason == "bad_signature"


@fuzz
@given(data=st.binary(max_size=300), suffix=st.booleans())
def test_verify_of_random_bytes_is_a_message_error(data, suffix):
    signer = Signer(_FIXED_KEY)
    if suffix:  # random bodies with a well-formed but wrong signature field
        data = signer.sign(b'{"x":1}')[:-100] + data + signer.sign(b'{"y":2}')[-98:]
        assert split_signed(data) is not None
    with pytest.raises(MessageError):
        verify(data, parse_public_key(signer.public_text))


def test_key_pin_learns_once_and_remembers(tmp_path):
    signer = Signer.load_or_create(tmp_path / "srv")
    pin = KeyPin(None, tmp_path / "pins" / "f.pub")
    pin.learn(signer.public_text)
    assert KeyPin(None, tmp_path / "pins" / "f.pub").text == signer.public_text
    with pytest.raises(ValueError):
        pin.learn(signer.public_text)


def test_msgspec_refuses_nan_and_infinity_literals():
    """The property the loader relies on (Python's json module accepts them)."""
    for literal in (b"NaN", b"Infinity", b"-Infinity"):
        with pytest.raises(msgspec.DecodeError):
            msgspec.json.decode(b'{"x":' + literal + b"}")


def test_flower_task_carries_the_buffered_version():
    """A buffered Flower task names its model version; a round's task (and an older strategy's JSON) has none."""
    task = FlowerTask(kind="train", round=12, submodel=2, lr=0.1, epochs=1, batch_size=32, profile_hash="abc", version=4)
    assert FlowerTask.from_json(task.to_json()) == task
    old = json.loads(task.to_json())
    del old["version"]
    assert FlowerTask.from_json(json.dumps(old).encode()).version is None
    with pytest.raises(MessageError):
        FlowerTask.from_json(json.dumps({**old, "version": -1}).encode())
