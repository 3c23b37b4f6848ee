"""`aggregator loadtest`: a fleet of simulated devices against a real broker and real aggregators.

Each simulated device is its own MQTT connection and behaves like `edge-client join` on the wire
(status with last will, announce, task, update in chunks) but sends a random delta of its assigned
submodel instead of training, so hundreds to thousands of devices fit in a few processes and the
aggregation side (broker, coordinator, workers, relays) is what gets measured. The deltas are a
pure function of (seed, client, round, submodel), so a test can recompute exactly what the
aggregators should have summed (`device_delta`).
"""

from __future__ import annotations

import hashlib
import logging
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import paho.mqtt.client as mqtt
import torch
import typer

from nefl.cli_options import LogFormatOption, LogLevelOption
from nefl.logs import setup_logging
from nefl.messages import Announce, ClientStatus, Control, MessageError, Task
from nefl.mqtt import QOS, BrokerSettings, make_client, parse_broker
from nefl.profile import ProfileError, load_profile
from nefl.signing import split_signed
from nefl.state import Layout
from nefl.tensors import corner
from nefl.topics import Topics
from nefl.wire import DEFAULT_CHUNK_BYTES, encode

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


@dataclass(frozen=True)
class FleetConfig:
    federation: str = "default"
    prefix: str = "sim"
    first: int = 0  # this process's devices: first, first + stride, ... below devices
    stride: int = 1
    devices: int = 100
    max_submodel: int = 0  # 0: device i can train submodel (i mod K) + 1; otherwise this bound for all
    rate: float = 0.0  # updates per second this process sends at most; 0 = as fast as it can
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    scale: float = 1e-3
    seed: int = 0
    pool: int = 0
    samples: int = 100
    duration_s: float = 600.0  # give up after this long even without the coordinator's "end"


class Fleet:
    """This process's share of the simulated devices; one sender thread paces their uploads."""

    def __init__(self, cfg: FleetConfig, settings: BrokerSettings, layout: Layout) -> None:
        self.cfg, self.settings, self.layout = cfg, settings, layout
        self.topics = Topics(cfg.federation)
        self.names = [f"{cfg.prefix}{i:05d}" for i in range(cfg.first, cfg.devices, cfg.stride)]
        self.clients: dict[str, mqtt.Client] = {}
        self.work: queue.Queue[tuple[str, int, int]] = queue.Queue()
        self.ended = threading.Event()
        self.done: set[tuple[str, int]] = set()  # (client, round) already queued
        self.sent = self.bytes = 0
        self._lock = threading.Lock()
        self._cache: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    def bound(self, i: int) -> int:
        return self.cfg.max_submodel or i % self.layout.num_submodels + 1

    def start(self) -> None:
        for i, name in zip(range(self.cfg.first, self.cfg.devices, self.cfg.stride), self.names):
            c = make_client(self.settings, name, self.topics.status(name),
                            ClientStatus(state="offline").to_json(), (1, 30))
            c.on_connect = self._on_connect(name, self.bound(i))
            c.on_message = self._on_message
            c.connect_async(self.settings.host, self.settings.port, keepalive=60)
            c.loop_start()
            self.clients[name] = c

    def _on_connect(self, name: str, bound: int):
        def on_connect(c, userdata, flags, reason_code, properties) -> None:
            if reason_code.is_failure:
                return
            c.subscribe([(self.topics.task(name), QOS), (self.topics.control, QOS)])
            c.publish(self.topics.status(name), ClientStatus(state="online").to_json(), qos=QOS, retain=True)
            c.publish(self.topics.announce(name), Announce(client=name, samples=self.cfg.samples,
                                                           max_submodel=bound).to_json(), qos=QOS, retain=True)
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
        self.work.put((client, task.round, task.submodel))

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
                client, r, k = self.work.get(timeout=0.2)
            except queue.Empty:
                continue
            if cfg.rate > 0:
                time.sleep(max(0.0, next_at - time.monotonic()))
                next_at = max(next_at, time.monotonic() - 1.0) + 1.0 / cfg.rate
            msgs = encode(self.delta(client, r, k), kind="update", federation=cfg.federation, round=r, submodel=k,
                          client=client, samples=cfg.samples, chunk_bytes=cfg.chunk_bytes)
            for m in msgs:
                self.clients[client].publish(self.topics.update(client), m, qos=QOS)
            self.sent += 1
            self.bytes += sum(map(len, msgs))

    def stop(self) -> None:
        for c in self.clients.values():
            c.disconnect()
            c.loop_stop()


def loadtest_command(
    broker: str = typer.Option(..., help="mqtt://HOST:PORT the aggregator (and its workers) use."),
    federation: str = typer.Option("default", help="Federation name: the MQTT topic prefix nefl/NAME/."),
    profile: str = typer.Option("resnet20-fmnist-w", help="The coordinator's profile (deltas must fit its submodels)."),
    devices: int = typer.Option(100, min=1, help="Simulated devices, one MQTT connection each."),
    procs: int = typer.Option(1, min=1, help="Processes to spread the devices over."),
    rate: float = typer.Option(0.0, min=0, help="Updates per second, all processes together; 0 = as fast as possible."),
    max_submodel: int = typer.Option(0, min=0, help="Largest submodel every device announces (1-based); 0: device i "
                                     "announces (i mod K) + 1, a mixed fleet."),
    chunk_kib: int = typer.Option(DEFAULT_CHUNK_BYTES // 1024, min=8, help="Largest MQTT message a device sends, KiB."),
    scale: float = typer.Option(1e-3, min=0, help="Standard deviation of the random deltas."),
    pool: int = typer.Option(0, min=0, help="Draw deltas from this many cached variants per submodel (0: a fresh "
                             "delta per device and round, costlier to generate)."),
    prefix: str = typer.Option("sim", help="Device ids are PREFIX00000, PREFIX00001, ..."),
    seed: int = typer.Option(0, help="Seed of the deltas (with client id and round)."),
    duration: float = typer.Option(600.0, min=1, help="Stop after this many seconds even if the federation goes on."),
    shard: str = typer.Option(None, hidden=True, help="I/P: run only devices i with i mod P == I (set for child processes)."),
    log_level: LogLevelOption = "info",
    log_format: LogFormatOption = "plain",
) -> None:
    """Play a fleet of simulated devices sending valid random deltas (docs/scale.md, `make bench-scale`)."""
    setup_logging(log_level, log_format)
    try:
        settings = parse_broker(broker)
        layout = Layout.build(load_profile(profile))
        first, stride = (int(x) for x in shard.split("/")) if shard else (0, 1)
    except (ValueError, ProfileError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
    if procs > 1 and shard is None:
        argv = ["--broker", broker, "--federation", federation, "--profile", profile, "--devices", str(devices),
                "--rate", str(rate / procs), "--max-submodel", str(max_submodel), "--chunk-kib", str(chunk_kib),
                "--scale", str(scale), "--pool", str(pool), "--prefix", prefix, "--seed", str(seed),
                "--duration", str(duration), "--log-level", log_level, "--log-format", log_format]
        children = [subprocess.Popen([sys.executable, "-c", "from aggregator.cli import app; app()", "loadtest", *argv,
                                      "--shard", f"{i}/{procs}"]) for i in range(procs)]
        raise typer.Exit(max(p.wait() for p in children))
    cfg = FleetConfig(federation=federation, prefix=prefix, first=first, stride=stride, devices=devices,
                      max_submodel=max_submodel, rate=rate, chunk_bytes=chunk_kib * 1024, scale=scale, seed=seed,
                      pool=pool, duration_s=duration)
    fleet = Fleet(cfg, settings, layout)
    fleet.start()
    log.info(f"{len(fleet.names)} simulated devices connecting to {settings.url}")
    t0 = time.monotonic()
    try:
        fleet.send_loop()
    except KeyboardInterrupt:
        pass
    fleet.stop()
    log.info(f"sent {fleet.sent} updates, {fleet.bytes} bytes in {time.monotonic() - t0:.1f}s"
             + ("" if fleet.ended.is_set() else " (no end from the coordinator)"))
