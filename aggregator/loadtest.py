"""`aggregator loadtest`: a fleet of simulated devices against a real broker and real aggregators.

Each simulated device is its own MQTT connection and behaves like `edge-client join` on the wire
(its own Ed25519 key, which signs its statuses and last will, its announce, its update headers and the
notice that an update is out; a task; the update in chunks) but sends a random delta of its assigned
submodel instead of training, so hundreds to thousands of devices fit in a few processes and the
aggregation side (broker, coordinator, workers, relays) is what gets measured. The deltas are a
pure function of (seed, client, round, submodel), so a test can recompute exactly what the
aggregators should have summed (`device_delta`). The command line is in aggregator/scale_cli.py.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from dataclasses import dataclass

import paho.mqtt.client as mqtt
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from aggregator.enrolment import Grant
from nefl.nested.state import Layout
from nefl.nested.tensors import corner
from nefl.protocol.messages import Announce, ClientStatus, Control, MessageError, Sent, Task
from nefl.protocol.mqtt import QOS, BrokerSettings, make_client, next_stamp
from nefl.protocol.signing import Signer, split_signed
from nefl.protocol.topics import Topics
from nefl.protocol.wire import DEFAULT_CHUNK_BYTES, encode

log = logging.getLogger("aggregator.loadtest")


def device_delta(layout: Layout, k: int, client: str, round_: int, scale: float = 1e-3, seed: int = 0,
                 pool: int = 0) -> dict[str, torch.Tensor]:
    """The delta `client` sends for submodel k in `round_`, seeded by what it names: the round's common
    direction (one Gaussian of the global shapes, each submodel its corner, as honest devices that train
    one model share a descent direction) plus as much Gaussian noise of its own, times `scale`. So the
    fleet passes the server's centre check as honest devices do. pool > 0 draws the noise from `pool`
    variants per submodel instead (cheap to cache in a load run)."""
    name = f"{seed}|{k}|{int(hashlib.sha256(f'{client}|{round_}'.encode()).hexdigest(), 16) % pool}" if pool \
        else f"{seed}|{k}|{client}|{round_}"
    own = torch.Generator().manual_seed(_seed_of(name))
    return {n: (_common(layout, n, seed, round_)[corner(s)] + torch.randn(s, generator=own)).mul_(scale)
            for n, s in layout.upload_shapes(k).items()}


def _common(layout: Layout, name: str, seed: int, round_: int) -> torch.Tensor:
    """The round's shared direction of one global tensor (seeded per tensor, so every submodel cuts the same one)."""
    return torch.randn(layout.global_shapes[name], generator=torch.Generator().manual_seed(_seed_of(f"{seed}|{round_}|{name}")))


def _seed_of(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def device_key(seed: int, client: str) -> Signer:
    """A simulated device's Ed25519 key, derived from the fleet's seed and its id: anyone can derive it, so it is
    enrolled (`loadtest --enroll`) only in a load test's federation."""
    return Signer(Ed25519PrivateKey.from_private_bytes(hashlib.sha256(f"loadtest key|{seed}|{client}".encode()).digest()))


def device_grants(cfg: FleetConfig) -> list[Grant]:
    """The journal entries that enrol every device of the fleet with its key (a closed federation's load test)."""
    now = time.time()
    return [Grant(client=name, created=now, key=device_key(cfg.seed, name).public_text)
            for name in device_names(cfg)]


def device_names(cfg: FleetConfig) -> list[str]:
    return [f"{cfg.prefix}{i:05d}" for i in range(cfg.first, cfg.devices, cfg.stride)]


@dataclass(frozen=True)
class FleetConfig:
    federation: str = "default"
    prefix: str = "sim"
    first: int = 0  # this process's devices: first, first + stride, ... below devices
    stride: int = 1
    devices: int = 100
    max_submodel: int | None = None  # None: device i can train submodel (i mod K) + 1; otherwise this bound for all
    rate: float = 0.0  # updates per second this process sends at most; 0 = as fast as it can
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    scale: float = 1e-3
    seed: int = 0
    pool: int = 0
    samples: int = 100
    duration_s: float = 600.0  # give up after this long even without the coordinator's "end"


class DeviceFleet:
    """This process's share of the simulated devices; one sender thread paces their uploads."""

    def __init__(self, cfg: FleetConfig, settings: BrokerSettings, layout: Layout) -> None:
        self.cfg, self.settings, self.layout = cfg, settings, layout
        self.topics = Topics(cfg.federation)
        self.names = device_names(cfg)
        self.clients: dict[str, mqtt.Client] = {}
        self.keys = {name: device_key(cfg.seed, name) for name in self.names}
        self.stamps = {name: next_stamp(0) for name in self.names}  # each connection's, as Connection stamps them
        self.work: queue.Queue[tuple[str, str, int, int]] = queue.Queue()
        self.ended = threading.Event()
        self.done: set[tuple[str, int]] = set()  # (client, round) already queued
        self.sent = self.bytes = 0
        self._lock = threading.Lock()
        self._cache: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    def bound(self, i: int) -> int:
        return self.cfg.max_submodel or i % self.layout.num_submodels + 1

    def start(self) -> None:
        for i, name in zip(range(self.cfg.first, self.cfg.devices, self.cfg.stride), self.names):
            c = make_client(self.settings, name, self.topics.status(name), self.status(name, "offline"), (1, 30))
            c.on_connect = self._on_connect(name, self.bound(i))
            c.on_message = self._on_message
            c.connect_async(self.settings.host, self.settings.port, keepalive=60)
            c.loop_start()
            self.clients[name] = c

    def status(self, name: str, state: str) -> bytes:
        """The device's signed status for its current connection stamp (the offline one is its last will)."""
        return self.keys[name].sign(ClientStatus(state=state, seq=self.stamps[name]).to_json())

    def _on_connect(self, name: str, bound: int):
        def on_connect(c, userdata, flags, reason_code, properties) -> None:
            if reason_code.is_failure:
                return
            key = self.keys[name]
            c.subscribe([(self.topics.task(name), QOS), (self.topics.control, QOS)])
            c.publish(self.topics.status(name), self.status(name, "online"), qos=QOS, retain=True)
            c.publish(self.topics.announce(name), key.sign(Announce(client=name, samples=self.cfg.samples, max_submodel=bound,
                                                                    key=key.public_text).to_json()), qos=QOS, retain=True)
            self.stamps[name] = next_stamp(self.stamps[name])  # the next connection's, with its own last will
            c.will_set(self.topics.status(name), self.status(name, "offline"), qos=QOS, retain=True)
        return on_connect

    def _on_message(self, c, userdata, m) -> None:
        """Network thread: only parse and enqueue (never raises on hostile bytes)."""
        payload = bytes(m.payload)
        if not payload:
            return
        body = (split_signed(payload) or (payload, b""))[0]
        try:
            if m.topic == self.topics.control:
                Control.from_json(body)
                self.ended.set()
                return
            task = Task.from_json(body)
        except MessageError:
            return
        client = m.topic.rsplit("/", 1)[1]
        with self._lock:
            if (client, task.round) in self.done:
                return
            self.done.add((client, task.round))
        self.work.put((client, task.run, task.round, task.submodel))

    def delta(self, client: str, round_: int, k: int) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        if not cfg.pool:
            return device_delta(self.layout, k, client, round_, cfg.scale, cfg.seed)
        variant = int(hashlib.sha256(f"{client}|{round_}".encode()).hexdigest(), 16) % cfg.pool
        if (k, variant) not in self._cache:
            self._cache[(k, variant)] = device_delta(self.layout, k, client, round_, cfg.scale, cfg.seed, cfg.pool)
        return self._cache[(k, variant)]

    def send_loop(self) -> None:
        """Upload queued tasks, at most `rate` per second, until the federation ends or time runs out."""
        cfg = self.cfg
        end = time.monotonic() + cfg.duration_s
        next_at = time.monotonic()
        while not self.ended.is_set() and time.monotonic() < end:
            try:
                client, run, r, k = self.work.get(timeout=0.2)
            except queue.Empty:
                continue
            if cfg.rate > 0:
                time.sleep(max(0.0, next_at - time.monotonic()))
                next_at = max(next_at, time.monotonic() - 1.0) + 1.0 / cfg.rate
            key, c = self.keys[client], self.clients[client]
            msgs, header = encode(self.delta(client, r, k), kind="update", federation=cfg.federation, round=r, submodel=k,
                          client=client, samples=cfg.samples, chunk_bytes=cfg.chunk_bytes, sign=key.sign)
            for m in msgs:
                c.publish(self.topics.update(client), m, qos=QOS)
            c.publish(self.topics.sent(client), key.sign(Sent(client=client, run=run, round=r, submodel=k,
                                                              digest=header.digest).to_json()), qos=QOS)
            self.sent += 1
            self.bytes += sum(map(len, msgs))

    def stop(self) -> None:
        for c in self.clients.values():
            c.disconnect()
            c.loop_stop()
