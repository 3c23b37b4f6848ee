"""MQTT connection settings shared by the aggregator and the edge agent (paho-mqtt 2.x, MQTT 3.1.1).

Both apps connect the same way (URL, credentials, TLS, backoff, last will), so it lives here once.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from urllib.parse import urlparse

import paho.mqtt.client as mqtt

ENV_USERNAME, ENV_PASSWORD = "NEFL_MQTT_USERNAME", "NEFL_MQTT_PASSWORD"
QOS = 1


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


def make_client(settings: BrokerSettings, client_id: str, will_topic: str, will_payload: bytes,
                keepalive_backoff: tuple[int, int] = (1, 30)) -> mqtt.Client:
    """A paho client with retained last will, QoS 1 queueing while offline and reconnect backoff.

    clean_session=True: subscriptions are redone in on_connect, which also covers brokers that
    lost their sessions in a restart.
    """
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=True,
                         protocol=mqtt.MQTTv311)
    if settings.username:
        client.username_pw_set(settings.username, settings.password)
    if settings.tls:
        client.tls_set(ca_certs=settings.ca_cert, certfile=settings.certfile, keyfile=settings.keyfile,
                       cert_reqs=ssl.CERT_REQUIRED)
    client.will_set(will_topic, will_payload, qos=QOS, retain=True)
    client.reconnect_delay_set(*keepalive_backoff)
    client.max_queued_messages_set(0)  # unbounded: QoS 1 publishes wait out a broker restart
    client.max_inflight_messages_set(20)
    return client
