"""nefl.protocol.paho_fast.FastClient's receive path (recv_into one buffer per packet, the payload handed on without a copy)
against paho's own reader and decoder on the same byte streams: well-formed PUBLISH packets cut into pieces
as a live stream delivers them (a few bytes at a time, or in bursts), and hostile tails after them."""

from __future__ import annotations

import threading

import numpy as np
import paho.mqtt.client as mqtt
from hypothesis import given, settings
from hypothesis import strategies as st

from nefl.protocol.paho_fast import PAYLOAD_ALIGN, FastClient


class Trickle:
    """A non-blocking socket's receive side: `stream` in pieces of the given sizes, one piece per readable
    moment (BlockingIOError in between, as after a select), then end of stream (b"", a closed connection)."""

    def __init__(self, stream: bytes, pieces: list[int]) -> None:
        self.stream, self.pieces, self.at, self.budget = stream, pieces or [1 << 30], 0, 0

    def readable(self) -> bool:
        if self.at >= len(self.stream):
            return True  # the close is readable too
        self.budget = self.pieces[0]
        self.pieces = self.pieces[1:] + self.pieces[:1]
        return True

    def _take(self, n: int) -> bytes:
        if self.at >= len(self.stream):
            return b""
        if self.budget <= 0:
            raise BlockingIOError
        out = self.stream[self.at:self.at + min(n, self.budget)]
        self.at += len(out)
        self.budget -= len(out)
        return out

    def recv(self, n: int) -> bytes:
        return self._take(n)

    def close(self) -> None:
        pass

    def recv_into(self, buffer: memoryview, nbytes: int = 0) -> int:
        data = self._take(nbytes or len(buffer))
        buffer[:len(data)] = data
        return len(data)


class NoRecvInto:
    """A socket without recv_into (as paho's websocket wrapper): the client must take paho's reader."""

    def __init__(self, inner: Trickle) -> None:
        self.inner = inner

    def recv(self, n: int) -> bytes:
        return self.inner.recv(n)

    def close(self) -> None:
        pass


def publish_packet(qos: int, topic: bytes, payload: bytes, mid: int) -> bytes:
    body = len(topic).to_bytes(2, "big") + topic + (mid.to_bytes(2, "big") if qos else b"") + payload
    length, n = bytearray(), len(body)
    while True:
        n, digit = n // 128, n % 128
        length.append(digit | (0x80 if n else 0))
        if not n:
            break
    return bytes([0x30 | (qos << 1)]) + bytes(length) + body


def run(client: mqtt.Client, sock: Trickle, wrap=lambda s: s, payloads: bool = False) -> tuple[list[tuple], list[int], str]:
    """Read the whole stream: the messages (topic, mid, qos, retain, payload), the PUBACKs sent, and how it ended.
    payloads: through FastClient.on_payload (topic and payload only), as nefl.protocol.mqtt.Connection takes them."""
    got, acked = [], []
    client.on_message = lambda c, u, m: got.append((m.topic, m.mid, m.qos, m.retain, bytes(m.payload), type(m.payload)))
    if payloads:
        client.on_payload = lambda topic, payload: got.append((topic, bytes(payload), type(payload)))
    client._send_puback = lambda mid: acked.append(mid) or mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS
    client._sock = wrap(sock)
    end = "reads"
    for _ in range(100_000):
        sock.readable()
        try:
            rc = client._packet_read()
        except Exception as e:  # paho's handlers raise on some garbage: the same on both paths
            end = f"raised {type(e).__name__}"
            break
        if rc not in (mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS, mqtt.MQTTErrorCode.MQTT_ERR_AGAIN):
            end = f"rc {int(rc)}"
            break
    return [g[:5] for g in got], acked, end


def stock() -> mqtt.Client:
    """paho's reader and decoder, unchanged."""
    return mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv311)


def ours(first_buffer: int = FastClient.FIRST_BUFFER) -> FastClient:
    c = FastClient(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv311)
    c.FIRST_BUFFER = first_buffer  # small: the buffer's doubling runs on small packets too
    return c


messages = st.lists(st.tuples(st.sampled_from([0, 1]), st.binary(min_size=1, max_size=40), st.binary(max_size=3000),
                              st.integers(1, 65535)), max_size=6)


@settings(max_examples=150, deadline=None)
@given(messages, st.lists(st.integers(1, 5000), max_size=8), st.binary(max_size=40), st.sampled_from([1, 7, 1 << 20]))
def test_the_receive_path_agrees_with_paho_on_any_stream(msgs, pieces, tail, first_buffer):
    """Same messages, same acknowledgements, same ending (closed, protocol error or paho's own exception)
    whatever the cut of the stream, the buffer's first size, and whatever garbage follows the packets."""
    stream = b"".join(publish_packet(*m) for m in msgs) + tail
    want = run(stock(), Trickle(stream, pieces))
    got = run(ours(first_buffer), Trickle(stream, pieces))
    assert got == want
    assert [m[4] for m in got[0][:len(msgs)]] == [p for _, _, p, _ in msgs][:len(got[0])]
    if all(is_utf8(t) for _, t, _, _ in msgs):  # else paho raises in its handler (the next test)
        topics, acked, end = run(ours(first_buffer), Trickle(stream, pieces), payloads=True)
        assert (acked, end) == want[1:]
        assert topics == [(topic, payload, bytearray) for topic, _, _, _, payload in want[0]]  # in place, the same


def is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_a_topic_that_is_not_utf8_is_dropped_and_the_stream_goes_on():
    """paho's handler raises (out of its network loop); on_payload's path drops that message, acknowledges it
    (QoS 1: the broker must not send it again) and takes the next."""
    stream = publish_packet(1, b"\x80bad", b"x", 3) + publish_packet(1, b"a/b", b"y", 4)
    assert run(stock(), Trickle(stream, [])) == ([], [], "raised UnicodeDecodeError")
    assert run(ours(), Trickle(stream, []), payloads=True) == ([("a/b", b"y", bytearray)], [3, 4], "rc 7")


def test_a_publish_payload_is_the_packet_buffer_itself():
    """No copy on the way out: the payload is a bytearray, writable (an update is decoded in place)."""
    c, seen = ours(), []
    c._send_puback = lambda mid: mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS
    c.on_message = lambda cl, u, m: seen.append(m.payload) or seen.append(m.payload is c._in_packet["packet"])
    c._sock = Trickle(publish_packet(1, b"nefl/f/update/c1", bytes(range(256)) * 8192, 7), [65536])
    for _ in range(64):
        c._sock.readable()
        c._packet_read()
    assert len(seen) == 2 and isinstance(seen[0], bytearray) and seen[0] == bytes(range(256)) * 8192
    assert seen[1], "the payload is a copy, not the buffer the packet was received into"


def test_a_claimed_length_costs_no_memory_before_its_bytes():
    """A peer that claims the MQTT maximum (256 MiB) and sends nothing more gets one first buffer, not 256 MiB."""
    c = ours(first_buffer=4096)
    c._sock = Trickle(bytes([0x30, 0xFF, 0xFF, 0xFF, 0x7F]) + bytes(1000), [5 + 35])
    c._sock.readable()
    assert c._packet_read() == mqtt.MQTTErrorCode.MQTT_ERR_AGAIN
    pad = c._in_packet.get("pad", 0)  # the room before the body that aligns its payload
    assert pad < 8 and len(c._in_packet["packet"]) == pad + 4096 and c._in_packet["to_process"] == 268_435_455 - 35


def test_a_socket_without_recv_into_takes_paho_reader():
    stream = publish_packet(1, b"a/b", b"payload" * 100, 9)
    assert run(ours(), Trickle(stream, [5]), NoRecvInto) == run(stock(), Trickle(stream, [5]))


def test_the_receive_path_over_tls(tmp_path):
    """recv_into on a non-blocking TLS socket: a record not yet whole is SSLWantReadError, which must read as
    "again" (not a lost connection); messages sent in pieces arrive whole and in order."""
    import datetime
    import socket
    import ssl
    import time

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key()).serial_number(1)
            .not_valid_before(datetime.datetime(2020, 1, 1)).not_valid_after(datetime.datetime(2100, 1, 1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .sign(key, hashes.SHA256()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    client_ctx = ssl.create_default_context(cafile=str(tmp_path / "cert.pem"))
    a, b = socket.socketpair()
    wrapped = {}
    handshake = threading.Thread(target=lambda: wrapped.update(server=server_ctx.wrap_socket(a, server_side=True)))
    handshake.start()
    client_sock = client_ctx.wrap_socket(b, server_hostname="localhost")
    handshake.join(10)
    server = wrapped["server"]
    msgs = [(1, b"nefl/f/update/c%d" % i, bytes([i]) * (70_000 * i + 5), i + 1) for i in range(4)]
    stream = b"".join(publish_packet(*m) for m in msgs)

    def send() -> None:
        for at in range(0, len(stream), 9000):
            server.sendall(stream[at:at + 9000])
            time.sleep(0.001)

    sender = threading.Thread(target=send)
    client_sock.setblocking(False)
    c, got = ours(first_buffer=50_000), []
    c._send_puback = lambda mid: mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS
    c.on_message = lambda cl, u, m: got.append((m.topic.encode(), m.mid, bytes(m.payload)))
    c._sock = client_sock
    sender.start()
    try:
        deadline = time.monotonic() + 20
        while len(got) < len(msgs) and time.monotonic() < deadline:
            rc = c._packet_read()
            assert rc in (mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS, mqtt.MQTTErrorCode.MQTT_ERR_AGAIN)
            if rc == mqtt.MQTTErrorCode.MQTT_ERR_AGAIN:
                time.sleep(0.0005)
    finally:
        sender.join(20)
        c._sock = None
        client_sock.close()
        server.close()
    assert got == [(topic, mid, payload) for _, topic, payload, mid in msgs]


def test_one_loop_read_takes_every_packet_read_ahead():
    """Packets that came in one read are read ahead together: the same loop_read must deliver them all, since
    the socket no longer looks readable to select (paho's own loop_read takes one packet per call here)."""
    msgs = [(1, b"nefl/f/status/c%d" % i, b"x" * (10 + i), i + 1) for i in range(5)]
    c, got = ours(), []
    c._send_puback = lambda mid: mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS
    c.on_message = lambda cl, u, m: got.append(m.mid)
    c._sock = Trickle(b"".join(publish_packet(*m) for m in msgs), [1 << 20])
    c._sock.readable()
    assert c.loop_read() == mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS
    assert got == [1, 2, 3, 4, 5] and c._ahead_at == c._ahead_end


def test_a_new_connection_does_not_read_the_old_one_ahead():
    """Bytes read ahead on a connection that closed are not the start of the next connection's stream."""
    c = ours()
    c._sock = Trickle(publish_packet(0, b"a/b", b"1", 0) + bytes([0x30, 0x05]), [1 << 20])
    c._sock.readable()
    c._packet_read()
    assert c._ahead_at < c._ahead_end  # the next packet's first bytes wait
    c._sock_close()
    assert c._ahead_at == c._ahead_end == 0


class CountingPair:
    def __init__(self) -> None:
        self.sent = 0

    def send(self, data: bytes) -> int:
        self.sent += 1
        return len(data)

    def close(self) -> None:
        pass


def test_a_packet_the_network_thread_queues_does_not_wake_it():
    """A PUBACK queued while reading is written on the loop's next turn (select asks to write when packets
    wait); only another thread's packet needs the socket pair's wake-up."""
    c = ours()
    c._sockpairW = pair = CountingPair()
    c._thread = threading.current_thread()
    assert c._packet_queue(0x40, b"\x40\x02\x00\x07", 7, 0) == mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS
    assert pair.sent == 0 and c.want_write() and c._out_packet[-1]["packet"] == b"\x40\x02\x00\x07"
    c._thread = threading.Thread(target=lambda: None)
    c._packet_queue(0x40, b"\x40\x02\x00\x08", 8, 0)
    assert pair.sent == 1 and len(c._out_packet) == 2



class Flood:
    """A socket that always has more: PINGRESPs (two bytes, all header) without end, from a broker that never
    pauses, in reads that always end inside a fixed header."""

    def __init__(self) -> None:
        self.reads = 0

    def recv_into(self, buffer: memoryview, nbytes: int = 0) -> int:
        self.reads += 1
        assert self.reads < 100, "loop_read keeps reading a stream that never pauses"
        n = min(nbytes or len(buffer), 9_999 if self.reads == 1 else 10_000)
        start = 0 if self.reads == 1 else 1  # every read after the first ends one byte into a packet, as the first
        buffer[:n] = (b"\xd0\x00" * (n // 2 + 2))[start:start + n]
        return n

    def close(self) -> None:
        pass


def test_one_loop_read_returns_on_a_stream_that_never_pauses():
    """What was read ahead is delivered, but the socket is not read ahead again in the same call: the loop must
    get back to writing PUBACKs and pings however fast packets come."""
    c, handled = ours(), []
    handle = c._packet_handle
    c._packet_handle = lambda: handled.append(1) or handle()
    c._sock = sock = Flood()
    assert c.loop_read() == mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS
    assert sock.reads == 1 and len(handled) == 9_999 // 2


def test_a_puback_is_the_packet_paho_would_queue():
    queued = {}
    for name, c in (("paho", stock()), ("ours", ours())):
        c._packet_queue = lambda command, packet, mid, qos, info=None, name=name: queued.setdefault(name, (command, bytes(packet), mid, qos))
        c._send_puback(0x1234)
    assert queued["ours"] == queued["paho"]


def test_a_connection_takes_every_publish_a_hostile_broker_sends():
    """QoS 0 and 1 through on_payload, QoS 2 (never subscribed to here) through paho's decoder: all reach the
    inbox, and a topic that is not UTF-8 is dropped on either path without stopping the network loop."""
    import logging

    from nefl.protocol.mqtt import BrokerSettings, Connection

    conn = Connection(BrokerSettings("127.0.0.1", 1), "t", None, b"", logging.getLogger("t"))
    def qos2(topic: bytes, payload: bytes, mid: int) -> bytes:  # delivered once its PUBREL comes
        return bytes([0x34]) + publish_packet(1, topic, payload, mid)[1:] + bytes([0x62, 2]) + mid.to_bytes(2, "big")

    stream = b"".join([publish_packet(0, b"a/0", b"zero", 0), publish_packet(1, b"a/1", b"one", 5), qos2(b"a/2", b"two", 6),
                       publish_packet(1, b"\xff/x", b"bad", 7), qos2(b"\xfe", b"bad", 8), publish_packet(1, b"a/3", b"three", 9)])
    c = conn.client
    c._send_puback = c._send_pubrec = c._send_pubcomp = lambda mid: mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS
    c._sock = Trickle(stream, [])
    for _ in range(20):
        c._sock.readable()
        if c._packet_read() not in (mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS, mqtt.MQTTErrorCode.MQTT_ERR_AGAIN):
            break
    got = []
    while not conn.inbox.empty():
        topic, payload = conn.inbox.get_nowait()
        got.append((topic, bytes(payload)))
    assert got == [("a/0", b"zero"), ("a/1", b"one"), ("a/2", b"two"), ("a/3", b"three")]


class Sink:
    """A socket's send side that takes at most `piece` bytes a call, and notes what kind of buffer it was given."""

    def __init__(self, piece: int) -> None:
        self.piece, self.sent, self.kinds = piece, bytearray(), set()

    def send(self, buffer) -> int:
        self.kinds.add(type(buffer))
        self.sent += bytes(buffer[:self.piece])
        return min(self.piece, len(buffer))

    def close(self) -> None:
        pass


def test_a_large_packet_goes_out_in_pieces_without_copying_its_rest():
    """paho's writer sends `packet[pos:]` after each partial send, a copy of the rest of a bytes packet (quadratic in
    a 42.7 MiB update); queued as a view, each send is handed a slice of the packet itself, and the bytes that go
    out are the packet's."""
    packet = bytes(range(256)) * 4000
    c = ours()
    c._sock = sink = Sink(piece=7_777)
    c._thread = threading.Thread(target=lambda: None)  # queued from another thread: written when the loop writes
    c._sockpairW = CountingPair()
    c._packet_queue(mqtt.PUBLISH, packet, 1, 1)
    for _ in range(1000):
        if not c._out_packet:
            break
        c._packet_write()
    assert bytes(sink.sent) == packet and sink.kinds == {memoryview}


def puback(mid: int) -> bytes:
    return bytes((mqtt.PUBACK, 2)) + mid.to_bytes(2, "big")


def test_pubacks_complete_publishes_and_move_the_window_as_paho_does():
    """The PUBACK fast path against paho's handler on the same traffic: five QoS 1 publishes through a window of
    two, acknowledged out of order with an unknown id among them; the same packets go out, every message ends
    published, and nothing stays in flight. A PUBACK of the wrong size is a protocol error, not a crash."""
    ends = {}
    for name, c in (("paho", stock()), ("ours", ours())):
        c._sock = sink = Sink(piece=1 << 20)
        c.max_inflight_messages_set(2)
        infos = [c.publish(f"t/{i}", b"x" * i, qos=1) for i in range(5)]
        before = bytes(sink.sent)
        c._sock = stream = Trickle(b"".join(puback(m) for m in (2, 1, 9, 3, 4, 5)), [])
        stream.send = sink.send
        for _ in range(20):
            stream.readable()
            if c._packet_read() not in (mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS, mqtt.MQTTErrorCode.MQTT_ERR_AGAIN):
                break
        ends[name] = (before, bytes(sink.sent), [i.is_published() for i in infos], c._inflight_messages, len(c._out_messages))
    assert ends["ours"] == ends["paho"]
    assert ends["ours"][2] == [True] * 5 and ends["ours"][3:] == (0, 0)
    c = ours()
    c._sock = Trickle(bytes((mqtt.PUBACK, 3)) + b"\x00\x01\x00", [])
    c._sock.readable()
    assert c._packet_read() == mqtt.MQTTErrorCode.MQTT_ERR_PROTOCOL


def test_a_batch_of_publishes_wakes_the_network_thread_once():
    """Publishes inside `batched()` from another thread queue their packets without a wake-up each (paho writes
    a byte to its socket pair per publish); one wake at the end sends them all."""
    c = ours()
    c._sock = Sink(piece=1 << 20)
    c._sockpairW = pair = CountingPair()
    c._thread = threading.Thread(target=lambda: None)  # the network thread is another
    with c.batched():
        for i in range(5):
            c.publish(f"t/{i}", b"x", qos=1)
        assert pair.sent == 0 and len(c._out_packet) == 5
    assert pair.sent == 1
    c.publish("t/5", b"x", qos=1)
    assert pair.sent == 2


@given(topic=st.integers(1, 40), qos=st.sampled_from([0, 1]), size=st.integers(0, 3 << 16), burst=st.sampled_from([16, 64, 1 << 16, 1 << 20]))
@settings(max_examples=60, deadline=None)
def test_a_payload_starts_aligned_whatever_its_topic(topic, qos, size, burst):
    """A PUBLISH whose topic length came with its fixed header (a read of 16 bytes or more) hands on a payload at an
    address that is a multiple of PAYLOAD_ALIGN, the bytes the same as paho's: an update's tensors, aligned in
    their payload (nefl/protocol/wire.py), are then aligned in memory too."""
    stream = publish_packet(qos, b"t" * topic, bytes(range(256)) * (size // 256) + b"x" * (size % 256), 5)
    c, seen = ours(), []
    c._send_puback = lambda mid: mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS
    c.on_payload = lambda t, p: seen.append((t, bytes(p), np.frombuffer(p, dtype=np.uint8).ctypes.data if p else 0))
    c._sock = Trickle(stream, [burst])
    while not seen and c._sock.at < len(stream):
        c._sock.readable()
        c._packet_read()
    assert seen and seen[0][0] == "t" * topic and len(seen[0][1]) == size
    assert size == 0 or seen[0][2] % PAYLOAD_ALIGN == 0


def test_the_fast_path_only_with_the_paho_versions_it_was_written_for(monkeypatch, caplog):
    """Another paho-mqtt release may change the private members FastClient overrides: with one, a Connection gets
    paho's own client (one log line says so) and still takes every message, through paho's decoder."""
    import logging

    from nefl.protocol import paho_fast
    from nefl.protocol.mqtt import BrokerSettings, Connection

    assert paho_fast.fast_path_fits("2.2.0") and paho_fast.fast_path_fits("2.2.1")
    assert not any(paho_fast.fast_path_fits(v) for v in ("2.1.0", "2.3.0", "3.0.0", "1.6.1", "dev"))
    versions = {"paho-mqtt": "2.2.0"}
    monkeypatch.setattr(paho_fast.importlib.metadata, "version", lambda name: versions[name])
    paho_fast.client_class.cache_clear()
    try:
        assert paho_fast.client_class() is paho_fast.FastClient
        versions["paho-mqtt"] = "2.3.0"
        paho_fast.client_class.cache_clear()
        with caplog.at_level(logging.WARNING, logger=paho_fast.__name__):
            conn = Connection(BrokerSettings("127.0.0.1", 1), "t", None, b"", logging.getLogger("t"))
            Connection(BrokerSettings("127.0.0.1", 1), "u", None, b"", logging.getLogger("t"))
        assert type(conn.client) is paho_fast.PlainClient
        assert [r.getMessage() for r in caplog.records if r.name == paho_fast.__name__] == [
            "paho-mqtt 2.3.0 is not one the MQTT fast path was written for (2.2 up to 2.3): "
            "using paho's own receive and send paths"]
        c = conn.client
        c._send_puback = lambda mid: mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS
        c._sock = Trickle(publish_packet(0, b"a/0", b"zero", 0) + publish_packet(1, b"a/1", b"one" * 1000, 5), [7])
        for _ in range(1000):
            c._sock.readable()
            if c._packet_read() not in (mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS, mqtt.MQTTErrorCode.MQTT_ERR_AGAIN):
                break
        with c.batched():
            pass
        got = []
        while not conn.inbox.empty():
            got.append(conn.inbox.get_nowait())
        assert got == [("a/0", b"zero"), ("a/1", b"one" * 1000)]
    finally:
        paho_fast.client_class.cache_clear()
