"""MQTT connection settings shared by the aggregator and the edge agent (paho-mqtt 2.x, MQTT 3.1.1).

Both apps connect the same way (URL, credentials, TLS, backoff, last will), so it lives here once: the broker's
URL (`parse_broker`), the client (`make_client`: nefl.protocol.paho_fast's client, its fast path where the
installed paho-mqtt fits it), a `Connection` that says its state out loud and queues what comes in, and the
`Transport` a device's logic needs.
"""

from __future__ import annotations

import logging
import os
import queue
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlparse

import paho.mqtt.client as mqtt

from nefl.protocol.paho_fast import PlainClient, client_class
from nefl.support.cli_options import ENV_PASSWORD, ENV_USERNAME

QOS = 1


class Transport(Protocol):
    """What a device's logic needs of MQTT (paho's client satisfies it; tests record the calls)."""

    def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False) -> object: ...

    def subscribe(self, topic: str, qos: int = 0) -> object: ...

    def unsubscribe(self, topic: str) -> object: ...


@dataclass(frozen=True)
class BrokerSettings:
    host: str
    port: int
    tls: bool = False
    username: str | None = None
    password: str | None = None
    ca_cert: str | None = None
    certfile: str | None = None
    keyfile: str | None = None

    @property
    def url(self) -> str:
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"


def parse_broker(url: str, username: str | None = None, password: str | None = None, ca_cert: str | None = None,
                 certfile: str | None = None, keyfile: str | None = None) -> BrokerSettings:
    """mqtt://HOST[:PORT] or mqtts://HOST[:PORT]; credentials fall back to NEFL_MQTT_USERNAME/PASSWORD."""
    parsed = urlparse(url if "://" in url else f"mqtt://{url}")
    if parsed.scheme not in ("mqtt", "mqtts") or not parsed.hostname:
        raise ValueError(f"invalid broker URL {url!r}: use mqtt://HOST:PORT or mqtts://HOST:PORT")
    tls = parsed.scheme == "mqtts"
    try:
        port = parsed.port or (8883 if tls else 1883)
    except ValueError:
        raise ValueError(f"invalid port in broker URL {url!r}") from None
    if (certfile is None) != (keyfile is None):
        raise ValueError("--certfile and --keyfile go together (client certificate and its key)")
    return BrokerSettings(parsed.hostname, port, tls or bool(ca_cert),
                          username or parsed.username or os.environ.get(ENV_USERNAME),
                          password or parsed.password or os.environ.get(ENV_PASSWORD), ca_cert, certfile, keyfile)


def make_client(settings: BrokerSettings, client_id: str, will_topic: str | None, will_payload: bytes,
                keepalive_backoff: tuple[int, int] = (1, 30)) -> PlainClient:
    """A paho client with retained last will (none for a one-shot command: will_topic None), QoS 1
    queueing while offline and reconnect backoff.

    clean_session=True: subscriptions are redone in on_connect, which also covers brokers that
    lost their sessions in a restart.
    """
    client = client_class()(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=True, protocol=mqtt.MQTTv311)
    if settings.username:
        client.username_pw_set(settings.username, settings.password)
    if settings.tls:
        client.tls_set(ca_certs=settings.ca_cert, certfile=settings.certfile, keyfile=settings.keyfile,
                       cert_reqs=ssl.CERT_REQUIRED)
    if will_topic is not None:
        client.will_set(will_topic, will_payload, qos=QOS, retain=True)
    client.reconnect_delay_set(*keepalive_backoff)
    client.max_queued_messages_set(0)  # unbounded: QoS 1 publishes wait out a broker restart
    client.max_inflight_messages_set(20)
    return client


def next_stamp(previous: int) -> int:
    """A connection's stamp: microseconds of wall time, strictly above the previous one, so it grows from one
    connection to the next, across restarts too (a replayed status of an earlier connection is older)."""
    return max(previous + 1, time.time_ns() // 1000)


class Connection:
    """A paho client whose connection state is said out loud, on the server and on the device:
    connecting to URL, unreachable (retrying in N s), connected, lost. Inbound messages go to a
    bounded queue the main thread drains, and a (re)connect is a flag it polls (`just_connected`):
    the network thread never touches the application's state.

    `will_payload` may be a function of the connection's stamp: each connection then carries its own
    last will (a status signed in advance, naming that connection), and `stamp` is the current one."""

    def __init__(self, settings: BrokerSettings, client_id: str, will_topic: str | None,
                 will_payload: bytes | Callable[[int], bytes], log: logging.Logger, backoff: tuple[int, int] = (1, 30),
                 inbox_messages: int = 10_000) -> None:
        self.settings, self.log, self.backoff = settings, log, backoff
        self._will_topic = will_topic
        self._will = will_payload if callable(will_payload) else None
        self._next = next_stamp(0)  # the stamp of the next connection (its will names it)
        self.stamp = 0  # the current connection's
        first = self._will(self._next) if self._will else will_payload
        self.client = make_client(settings, client_id, will_topic, first, backoff)
        self.inbox: queue.Queue[tuple[str, bytes | bytearray]] = queue.Queue(maxsize=inbox_messages)
        self.inbox_dropped = 0
        self.connected = False
        self._fresh = threading.Event()
        self._failures = 0
        self.client.on_connect = self._on_connect
        self.client.on_connect_fail = self._on_connect_fail
        self.client.on_disconnect = self._on_disconnect
        self.client.on_payload = self._enqueue  # the payload: the buffer it was received into
        self.client.on_message = self._on_message  # what takes paho's decoder: QoS 2, or all without the fast path

    def start(self) -> None:
        self.log.info(f"connecting to {self.settings.url}")
        self.client.connect_async(self.settings.host, self.settings.port, keepalive=15)
        self.client.loop_start()

    def stop(self, last: tuple[str, bytes] | None = None) -> None:
        """Disconnect cleanly, first publishing `last` (topic, payload; retained) when connected."""
        if last is not None and self.connected:
            try:
                self.client.publish(*last, qos=QOS, retain=True).wait_for_publish(5)
            except (RuntimeError, ValueError):
                pass  # the broker went away at the very end: the last will says the same
        self.connected = False  # a disconnect we asked for is not a lost connection
        self.client.disconnect()
        self.client.loop_stop()

    def _on_message(self, client: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        try:
            topic = message.topic
        except UnicodeDecodeError:  # a hostile broker's: paho would raise it out of its network loop
            return
        self._enqueue(topic, message.payload)

    def _enqueue(self, topic: str, payload: bytes | bytearray) -> None:
        try:
            self.inbox.put_nowait((topic, payload))
        except queue.Full:
            self.inbox_dropped += 1

    def _retry_in(self) -> int:
        """paho's reconnect backoff: doubling from the minimum up to the maximum."""
        low, high = self.backoff
        return min(high, low * 2 ** min(self._failures - 1, 16))

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            self._failures += 1
            self.log.error(f"broker {self.settings.url} refused the connection: {reason_code} "
                           f"(check --username/--password); retrying in {self._retry_in()} s")
            return
        self._failures, self.connected = 0, True
        self.stamp, self._next = self._next, next_stamp(self._next)
        if self._will is not None and self._will_topic is not None:  # the next connection's own will
            client.will_set(self._will_topic, self._will(self._next), qos=QOS, retain=True)
        self.log.info(f"connected to {self.settings.url}")
        self._fresh.set()

    def just_connected(self) -> bool:
        """True once after each (re)connect: time to subscribe again (clean sessions) and republish."""
        if self._fresh.is_set():
            self._fresh.clear()
            return True
        return False

    def _on_connect_fail(self, client, userdata) -> None:
        self._failures += 1
        self.log.warning(f"cannot reach the broker at {self.settings.url}; retrying in {self._retry_in()} s "
                         "(is it running, and is the URL right?)")

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        if self.connected:
            self.log.warning(f"lost the connection to {self.settings.url} ({reason_code}); reconnecting")
        self.connected = False


def drain(conn: Connection, handle: Callable[[str, bytes | bytearray], None], on_connected: Callable[[], None],
          stop: threading.Event) -> None:
    """A thread's loop that feeds the inbox to `handle` (and says when the connection is fresh) until `stop`:
    for a process whose main thread is busy training while its peers' messages must still be answered."""
    while not stop.is_set():
        if conn.just_connected():
            on_connected()
        try:
            handle(*conn.inbox.get(timeout=0.2))
        except queue.Empty:
            pass
