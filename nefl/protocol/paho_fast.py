"""The fast path of nefl.protocol.mqtt's client: paho-mqtt's receive and send paths redone for a stream of large
updates, by overriding private members of `paho.mqtt.client.Client`.

What it overrides, and why (docs/scale.md, "Why the code is as it is", says what each saved):

- `_packet_read` (with `_sock_close`, `loop_read`): the socket read ahead in blocks while a fixed header is
  wanted, a body received with `recv_into` into one buffer that is not zero-filled and grows as bytes come, its
  PUBLISH payload placed at an aligned address; `loop_read` goes on through packets already read ahead, which
  select would not wake for.
- `_handle_publish`: a QoS 0/1 PUBLISH (MQTT 3.1.1) handed on as the buffer it was received into, writable, to
  `on_payload(topic, payload)` without paho's message object, topic matching and callback locks.
- `_handle_pubackcomp`, `_send_puback`: a PUBACK taken and sent without paho's decoder objects, log call and
  packing.
- `_packet_queue` (and `batched()`): a packet queued as a memoryview (paho's writer copies the rest of a bytes
  packet after each partial send), and without a wake-up of the network thread for a packet that thread queues
  itself, or for each publish of a burst.

They also read paho's private state (`_in_packet`'s keys, `_out_packet`, `_out_messages`, `_sockpairW`,
`_thread`, `_msgtime_mutex`, `_manual_ack`, `_easy_log`, ...), which paho may change in any release. So the fast
path is used only with the paho-mqtt versions it was written and tested against (FAST_VERSIONS); with any other,
`client_class()` gives PlainClient, paho's own behaviour, and says so once in the log.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.metadata
import logging
import ssl
import threading
import time
from collections.abc import Callable, Iterator

import paho.mqtt.client as mqtt
from paho.mqtt.exception import MalformedPacket

log = logging.getLogger(__name__)

FAST_VERSIONS = ((2, 2), (2, 3))  # [from, to) of paho-mqtt's (major, minor): the releases the overrides were checked on
PUBACK_HEAD = bytes((mqtt.PUBACK, 2))  # a PUBACK's fixed header: its message id follows
PAYLOAD_ALIGN = 8  # a PUBLISH's payload starts at an address that is a multiple of this (FastClient's receive path)


def fast_path_fits(version: str) -> bool:
    """Whether paho-mqtt `version` (as installed: "2.2.0", "2.3.0rc1") is one the fast path was written against."""
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    return FAST_VERSIONS[0] <= (major, minor) < FAST_VERSIONS[1]


@functools.cache
def client_class() -> type[PlainClient]:
    """FastClient with a paho-mqtt the fast path fits, else PlainClient (said once)."""
    version = importlib.metadata.version("paho-mqtt")
    if fast_path_fits(version):
        return FastClient
    log.warning(f"paho-mqtt {version} is not one the MQTT fast path was written for "
                f"({'.'.join(map(str, FAST_VERSIONS[0]))} up to {'.'.join(map(str, FAST_VERSIONS[1]))}): "
                "using paho's own receive and send paths")
    return PlainClient


class PlainClient(mqtt.Client):
    """paho's client unchanged, with the two names the kit calls on either client: `on_payload`, which only
    FastClient calls (here every message goes to on_message, which a Connection sets too), and `batched()`, a
    block of publishes (here each one wakes the network thread, as paho does)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # (topic, payload) of each QoS 0/1 PUBLISH, in place of on_message (which gets paho's message objects)
        self.on_payload: Callable[[str, bytearray], None] | None = None

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        yield


_new_bytearray = ctypes.pythonapi.PyByteArray_FromStringAndSize
_new_bytearray.restype, _new_bytearray.argtypes = ctypes.py_object, (ctypes.c_char_p, ctypes.c_ssize_t)
_resize_bytearray = ctypes.pythonapi.PyByteArray_Resize
_resize_bytearray.restype, _resize_bytearray.argtypes = ctypes.c_int, (ctypes.py_object, ctypes.c_ssize_t)


def _unfilled(n: int) -> bytearray:
    """A bytearray of n bytes not zero-filled (CPython's C API with a NULL source): every byte is received before
    it is read, and zeroing would be one more pass over a body's buffer beside the kernel's copy into it."""
    return _new_bytearray(None, n)


def _grow(buffer: bytearray, n: int) -> None:
    """Lengthen `buffer` to n bytes in place, its new tail not zero-filled (no view of it may be held). A failure
    raises here: ctypes turns the C API's error (MemoryError, BufferError) into the exception."""
    _resize_bytearray(buffer, n)


class FastClient(PlainClient):
    """paho's client with a receive path that copies a PUBLISH's payload once, from the kernel into the buffer
    the application gets, and asks the kernel as little as it can.

    paho's reader takes a packet's fixed header one `recv(1)` at a time and its body with `recv(remaining)`:
    CPython allocates the whole remaining size first, paho copies what came into the packet, and its decoder
    copies the payload again. Here the socket is read ahead in blocks of `READ_AHEAD` whenever a fixed header is
    wanted, so a header, and a small packet whole, come out of memory; a body's rest is received with `recv_into`
    straight into its own buffer (not zero-filled first: every byte of it is written by the socket before it is
    handed on; grown as bytes arrive, so a claimed length costs no memory before its bytes come). A QoS 0/1
    PUBLISH (MQTT 3.1.1) hands on that same buffer, its topic and message id cut off the front (O(1) for a
    bytearray), writable, so an update's single chunk is decoded in place; with `on_payload` set (a Connection
    sets it) as (topic, payload), without paho's message object and callback machinery. A packet the network
    thread queues itself (a PUBACK) does not wake that thread through paho's socket pair: the loop's next select
    asks to write anyway. QoS 2 and MQTT 5 packets take paho's decoder, sockets without recv_into (websockets)
    paho's reader.

    The payload starts at an address that is a multiple of PAYLOAD_ALIGN wherever its topic's length came in the
    same read as the fixed header (the body is placed that far into its buffer): an update whose tensor data sits
    at an aligned offset in its payload (nefl/protocol/wire.py) is then read by numpy's BLAS, not by torch's slower
    path for float32 at an odd address."""

    FIRST_BUFFER = 1 << 20  # a body's first allocation; larger ones double towards the packet's length
    READ_AHEAD = 1 << 16  # bytes asked of the socket at once while a fixed header is read

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._ahead = bytearray(self.READ_AHEAD)
        self._ahead_at = self._ahead_end = 0  # bytes read ahead and not yet taken: _ahead[_ahead_at:_ahead_end]
        self._drain_only = False  # loop_read is taking what was read ahead: no new read-ahead
        self._batching: threading.Thread | None = None  # the thread inside batched(): its packets wake no one yet

    def _sock_close(self) -> None:
        super()._sock_close()
        self._ahead_at = self._ahead_end = 0  # what the old connection sent is not the new one's

    def loop_read(self, max_packets: int = 1) -> mqtt.MQTTErrorCode:
        """paho's, then on through the packets already read ahead (select would not wake for them), without
        reading the socket ahead again: a stream that never pauses must not keep the loop from writing its
        PUBACKs and pings."""
        rc = super().loop_read(max_packets)
        self._drain_only = True
        try:
            while rc == mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS and self._sock is not None and self._ahead_at < self._ahead_end:
                rc = super().loop_read(max_packets)  # each packet read takes at least a byte of what was read ahead
        finally:
            self._drain_only = False
        return rc

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        """Publishes in this block queue their packets without waking the network thread for each one (paho
        writes a byte to its socket pair per publish, and the network thread wakes, selects and writes that one
        packet); one wake at the end sends them all. For bursts from one thread (a round's tasks, their clears);
        nothing in the block may wait for its own publishes, which are not sent before the block ends."""
        if self._batching is not None or self._thread is None:  # nested, or no network thread to wake
            yield
            return
        self._batching = threading.current_thread()
        try:
            yield
        finally:
            self._batching = None
            if self._out_packet and self._sockpairW is not None:
                with contextlib.suppress(BlockingIOError, OSError):
                    self._sockpairW.send(b"0")

    def _packet_queue(self, command: int, packet: bytes | bytearray, mid: int, qos: int,
                      info: mqtt.MQTTMessageInfo | None = None) -> mqtt.MQTTErrorCode:
        # paho's writer sends `packet[pos:]` after each partial send: a copy of the rest of a bytes packet, so
        # O(size^2 / send size) per message; a view's slice is free
        packet = memoryview(packet)
        current = threading.current_thread()
        if self._thread is None or (current is not self._thread and current is not self._batching):
            return super()._packet_queue(command, packet, mid, qos, info)
        self._out_packet.append({"command": command, "mid": mid, "qos": qos, "pos": 0, "to_process": len(packet),
                                 "packet": packet, "info": info})
        return mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS

    def _packet_read(self) -> mqtt.MQTTErrorCode:
        if not hasattr(self._sock, "recv_into"):
            return super()._packet_read()
        pkt = self._in_packet
        try:
            while not pkt["have_remaining"]:
                if self._ahead_at == self._ahead_end:
                    if self._drain_only:
                        return mqtt.MQTTErrorCode.MQTT_ERR_AGAIN  # the socket still looks readable to select
                    if not self._read_ahead():
                        return mqtt.MQTTErrorCode.MQTT_ERR_CONN_LOST
                self._fixed_header_byte(pkt, self._ahead[self._ahead_at])
                self._ahead_at += 1
                if len(pkt["remaining_count"]) > 4:  # the MQTT limit: a longer length is a broken or hostile peer
                    return mqtt.MQTTErrorCode.MQTT_ERR_PROTOCOL
            self._take_ahead(pkt)
            for _ in range(100):  # paho's bound: back to the network loop now and then on a huge packet
                if pkt["to_process"] <= 0:
                    break
                if not self._read_body(pkt):
                    return mqtt.MQTTErrorCode.MQTT_ERR_CONN_LOST
            else:
                if pkt["to_process"] > 0:
                    return mqtt.MQTTErrorCode.MQTT_ERR_AGAIN
        except BlockingIOError:
            return mqtt.MQTTErrorCode.MQTT_ERR_AGAIN
        except OSError as err:
            self._easy_log(mqtt.MQTT_LOG_ERR, "failed to receive on socket: %s", err)
            return mqtt.MQTTErrorCode.MQTT_ERR_CONN_LOST
        pkt["pos"] = 0
        try:
            rc = self._packet_handle()
        except MalformedPacket as exc:
            self._easy_log(mqtt.MQTT_LOG_DEBUG, "Received malformed packet: %s", exc)
            rc = mqtt.MQTTErrorCode.MQTT_ERR_PROTOCOL
        self._in_packet = {"command": 0, "have_remaining": 0, "remaining_count": [], "remaining_mult": 1,
                           "remaining_length": 0, "packet": bytearray(), "to_process": 0, "pos": 0}
        with self._msgtime_mutex:
            self._last_bytes_received = mqtt.time_func()
        return rc

    def _read_ahead(self) -> bool:
        """Fill the read-ahead block from the socket. False: the connection closed."""
        n = self._recv_into(memoryview(self._ahead))
        self._ahead_at, self._ahead_end = 0, n
        return n > 0

    def _recv_into(self, view: memoryview) -> int:
        """recv_into with paho's reading of TLS's want-read and want-write (BlockingIOError: again later)."""
        try:
            return self._sock.recv_into(view)
        except ssl.SSLWantReadError as err:
            raise BlockingIOError from err
        except ssl.SSLWantWriteError as err:
            self._call_socket_register_write()
            raise BlockingIOError from err
        finally:
            view.release()

    def _fixed_header_byte(self, pkt: dict, byte: int) -> None:
        """One byte of the command or of the remaining length (five at most)."""
        if pkt["command"] == 0:
            pkt["command"] = byte
            return
        pkt["remaining_count"].append(byte)
        pkt["remaining_length"] += (byte & 127) * pkt["remaining_mult"]
        pkt["remaining_mult"] *= 128
        if not byte & 128:
            pkt["have_remaining"] = 1
            pkt["to_process"] = pkt["remaining_length"]  # its buffer comes with its first bytes (_open_body)

    def _take_ahead(self, pkt: dict) -> None:
        """The start of a body that came with its header (a small packet whole): read ahead, so copied once more
        (at most READ_AHEAD bytes)."""
        n = min(self._ahead_end - self._ahead_at, pkt["to_process"])
        if n <= 0:
            return
        got = pkt["remaining_length"] - pkt["to_process"]
        if not got:
            self._open_body(pkt, n)
        at = pkt["pad"] + got
        if at + n > len(pkt["packet"]):
            _grow(pkt["packet"], at + n)
        pkt["packet"][at:at + n] = memoryview(self._ahead)[self._ahead_at:self._ahead_at + n]
        self._ahead_at += n
        pkt["to_process"] -= n

    def _open_body(self, pkt: dict, n: int) -> None:
        """The body's buffer, made when its first bytes come (`n` of them read ahead): at most FIRST_BUFFER to
        start with, and for a QoS 0/1 PUBLISH (MQTT 3.1.1) whose topic length is among those bytes, the body put
        that far in (pkt["pad"]) that its payload, after the topic and message id, starts aligned (the buffer is
        malloc's, at least 16-byte aligned itself)."""
        command, pad = pkt["command"], 0
        qos = (command & 0x06) >> 1
        if command & 0xF0 == mqtt.PUBLISH and qos != 2 and self._protocol != mqtt.MQTTv5 and n >= 2:
            start = 2 + int.from_bytes(self._ahead[self._ahead_at:self._ahead_at + 2], "big") + (2 if qos else 0)
            pad = -start % PAYLOAD_ALIGN
        pkt["pad"] = pad
        pkt["packet"] = _unfilled(pad + min(pkt["remaining_length"], self.FIRST_BUFFER))

    def _read_body(self, pkt: dict) -> bool:
        """Receive what the socket has of the body into its buffer. False: the connection closed."""
        if "pad" not in pkt:  # none of the body came read ahead: its buffer now
            self._open_body(pkt, 0)
        packet, length, pad = pkt["packet"], pkt["remaining_length"], pkt["pad"]
        got = pad + length - pkt["to_process"]
        if got == len(packet):
            _grow(packet, pad + min(length, 2 * (len(packet) - pad)))
        n = self._recv_into(memoryview(packet)[got:])
        if n == 0:
            return False
        pkt["to_process"] -= n
        with self._msgtime_mutex:
            self._last_bytes_received = mqtt.time_func()
        return True

    def _handle_publish(self) -> mqtt.MQTTErrorCode:
        command, packet, pad = self._in_packet["command"], self._in_packet["packet"], self._in_packet.get("pad", 0)
        qos = (command & 0x06) >> 1
        if qos == 2 or self._protocol == mqtt.MQTTv5:
            return super()._handle_publish()
        topic_end = pad + 2 + int.from_bytes(packet[pad:pad + 2], "big")
        at = topic_end + (2 if qos else 0)
        if len(packet) < pad + 2 or topic_end == pad + 2 or at > len(packet):
            raise MalformedPacket("PUBLISH shorter than its topic and message id")
        mid = int.from_bytes(packet[topic_end:at], "big") if qos else 0
        topic = bytes(packet[pad + 2:topic_end])
        del packet[:at]  # the payload is the packet's buffer itself, not a copy
        if self.on_payload is not None:
            self._deliver(topic, packet)
        else:
            message = mqtt.MQTTMessage(mid=mid, topic=topic)
            message.dup, message.qos, message.retain = bool(command & 0x08), qos, bool(command & 0x01)
            message.payload = packet
            message.timestamp = time.monotonic()
            self._handle_on_message(message)
        if qos == 0 or self._manual_ack:
            return mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS
        return self._send_puback(mid)

    def _handle_pubackcomp(self, cmd: str) -> mqtt.MQTTErrorCode:
        """A PUBACK (MQTT 3.1.1, no on_publish callback) without paho's decoder objects (a reason code and a
        property set per packet), its debug log call and callback locks: the server gets one per task, task
        clear and status it publishes, about two for each update it takes in. The message is marked published
        and the inflight window moves on, as paho's `_do_on_publish` does."""
        packet = self._in_packet["packet"]
        if cmd != "PUBACK" or self._protocol == mqtt.MQTTv5 or self.on_publish is not None:
            return super()._handle_pubackcomp(cmd)
        if len(packet) != 2:
            raise MalformedPacket("PUBACK of a size other than 2")
        with self._out_message_mutex:
            msg = self._out_messages.pop(int.from_bytes(packet, "big"), None)
            if msg is None:
                return mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS
            msg.info._set_as_published()
            if msg.qos > 0:
                self._inflight_messages -= 1
                if self._max_inflight_messages > 0:
                    return self._update_inflight()
        return mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS

    def _send_puback(self, mid: int) -> mqtt.MQTTErrorCode:
        """paho's, without its debug log call and packing on the way."""
        return self._packet_queue(mqtt.PUBACK, PUBACK_HEAD + mid.to_bytes(2, "big"), mid, 1)

    def _deliver(self, topic: bytes, payload: bytearray) -> None:
        """`on_payload(topic, payload)`, without paho's message object, topic matching and locks around its
        callbacks (a large share of the network thread's Python per message); a topic that is not UTF-8 is dropped (the
        broker should never forward one), and a callback's exception is logged, as paho logs its callbacks'."""
        try:
            name = topic.decode("utf-8")
        except UnicodeDecodeError:
            self._easy_log(mqtt.MQTT_LOG_ERR, "dropped a PUBLISH whose topic is not UTF-8")
            return
        try:
            self.on_payload(name, payload)
        except Exception as err:  # noqa: BLE001  the network thread must go on, whatever a callback does
            self._easy_log(mqtt.MQTT_LOG_ERR, "caught exception in on_payload: %s", err)
