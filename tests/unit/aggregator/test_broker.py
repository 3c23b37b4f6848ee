"""The embedded broker of `aggregator serve` (aggregator/broker.py): mosquitto as a child process where
installed, amqtt otherwise; each carries messages, stops with the server, and mosquitto dies with it."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import paho.mqtt.client as mqtt
from paho.mqtt.exception import MalformedPacket
import pytest

from aggregator import broker as b
from tests.harness.procs import ROOT, needs_mosquitto, wait_for


def round_trip(url_port: int, payload: bytes) -> bytes:
    """Publish `payload` through the broker on 127.0.0.1:port and return what a subscriber got."""
    got, ready = [], threading.Event()
    sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="sub")
    sub.on_connect = lambda c, u, f, rc, p: c.subscribe("t/x", qos=1)
    sub.on_subscribe = lambda *a: ready.set()
    sub.on_message = lambda c, u, m: got.append(m.payload)
    sub.connect("127.0.0.1", url_port)
    sub.loop_start()
    pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="pub")
    pub.connect("127.0.0.1", url_port)
    pub.loop_start()
    try:
        assert ready.wait(10)
        pub.publish("t/x", payload, qos=1).wait_for_publish(10)
        wait_for(lambda: got, 10, "the message through the broker")
        return got[0]
    finally:
        for c in (pub, sub):
            c.disconnect()
            c.loop_stop()


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@needs_mosquitto
def test_mosquitto_child_carries_messages_on_a_free_port_and_stops_with_the_server():
    m = b.MosquittoBroker("127.0.0.1", 0)
    m.start()
    try:
        assert m.url == f"mqtt://127.0.0.1:{m.port}" and round_trip(m.port, b"x" * (3 << 20)) == b"x" * (3 << 20)
        conf = (m._dir / "mosquitto.conf").read_text()
        assert f"listener {m.port} 127.0.0.1" in conf and "persistence false" in conf
    finally:
        m.stop()
    assert m.proc.poll() is not None and not listening(m.port) and not m._dir.exists()


@needs_mosquitto
def test_a_taken_port_is_one_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        m = b.MosquittoBroker("127.0.0.1", s.getsockname()[1])
        with pytest.raises(RuntimeError, match="could not listen.*--embedded-port"):
            m.start(timeout_s=10)
    assert m.proc is None or m.proc.poll() is not None


@needs_mosquitto
def test_mosquitto_dies_with_a_killed_server():
    """SIGKILL leaves no stop() to run: the kernel ends the child (PR_SET_PDEATHSIG)."""
    code = ("from aggregator.broker import MosquittoBroker; import time; m = MosquittoBroker('127.0.0.1', 0); m.start(); "
            "print(m.proc.pid, m.port, flush=True); time.sleep(60)")
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    pid, port = (int(x) for x in server.stdout.readline().split())
    assert listening(port)
    server.send_signal(signal.SIGKILL)
    server.wait(10)

    def gone() -> bool:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for init to reap it is gone too
                return f.read().split()[2] == "Z"
        except (ProcessLookupError, FileNotFoundError):
            return True
    wait_for(gone, 10, "mosquitto to exit with its parent")
    assert not listening(port)


def test_amqtt_carries_messages_and_stops():
    a = b.AmqttBroker("127.0.0.1", 0)
    a.start()
    try:
        assert round_trip(a.port, b"hello") == b"hello"
    finally:
        a.stop()
    time.sleep(0.5)
    assert not listening(a.port)


def test_the_choice_of_broker(monkeypatch, caplog):
    monkeypatch.setattr(b, "find_mosquitto", lambda: "/usr/sbin/mosquitto")
    assert b.embedded_broker("auto", "127.0.0.1", 1883).name == "mosquitto"
    assert b.embedded_broker("amqtt", "127.0.0.1", 1883).name == "amqtt"
    monkeypatch.setattr(b, "find_mosquitto", lambda: None)
    with caplog.at_level(logging.WARNING, logger="aggregator.server"):
        assert b.embedded_broker("auto", "127.0.0.1", 1883).name == "amqtt"
    assert [r.getMessage() for r in caplog.records] == [b.AMQTT_NOTE]
    with pytest.raises(ValueError, match="no mosquitto binary"):
        b.embedded_broker("mosquitto", "127.0.0.1", 1883)


@pytest.mark.parametrize("qos, topic, payload", [(0, b"a/b", b""), (1, b"nefl/f/update/c1", bytes(range(256)) * 300),
                                                 (1, b"t", b"x")])
def test_the_fast_publish_decoder_agrees_with_paho(qos, topic, payload):
    """nefl.protocol.paho_fast.FastClient decodes a PUBLISH as paho does (topic, id, flags, payload), with a bytearray payload."""
    from paho.mqtt import _packet
    from nefl.protocol.paho_fast import FastClient

    packet = bytearray(len(topic).to_bytes(2, "big") + topic + ((4242).to_bytes(2, "big") if qos else b"") + payload)
    command = 0x30 | (qos << 1) | 0x01
    want = _packet.decode_publish(command, bytes(packet), mqtt.MQTTv311)
    c = FastClient(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv311)
    got, acked = [], []
    c.on_message = lambda client, userdata, m: got.append(m)
    c._send_puback = lambda mid: acked.append(mid) or mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS
    c._in_packet = {**c._in_packet, "command": command, "packet": packet}
    c._handle_publish()
    m = got[0]
    assert (m.topic.encode(), m.mid, m.qos, m.retain, bytes(m.payload)) == (want.topic, want.mid, want.qos, want.retain,
                                                                             want.payload)
    assert isinstance(m.payload, bytearray) and acked == ([4242] if qos else [])
    c._in_packet = {**c._in_packet, "packet": bytearray(b"\x00\x09abc")}
    with pytest.raises(MalformedPacket):
        c._handle_publish()
