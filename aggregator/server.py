"""`aggregator serve`: runs federated rounds over MQTT.

Threads: paho's network thread only enqueues (topic, payload); the main thread owns all state
(membership, round, aggregate) and does the publishing, aggregation, evaluation and checkpoints.
One consumer means no locks around the federation state and no message is handled twice at once.
"""

from __future__ import annotations

import json
import queue
import secrets
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from aggregator.broker import EmbeddedBroker
from aggregator.evaluation import Evaluator
from aggregator.federation import Federation, Rejected, state_digest
from nefl.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from nefl.mqtt import QOS, BrokerSettings, make_client, parse_broker
from nefl.profile import Profile, ProfileError, load_profile
from nefl.state import GlobalState, Layout
from nefl.topics import Topics
from nefl.train import TrainConfig
from nefl.wire import DEFAULT_CHUNK_BYTES, Reassembler, WireError, encode, parse_chunk

MAX_CONTROL_BYTES = 16 * 1024  # announce / status messages are small JSON
METRICS_FILE, STATUS_FILE = "metrics.jsonl", "status.json"


@dataclass
class ServeConfig:
    profile: str = "resnet20-fmnist-w"
    federation: str = "default"
    rounds: int = 10
    clients_per_round: int = 10
    min_clients: int = 1
    round_timeout: float = 120.0
    join_wait: float = 10.0
    checkpoint_dir: str = "runs/default"
    resume: bool = False
    eval_dataset: str | None = None
    eval_samples: int | None = None
    data_root: str | None = None
    local_epochs: int = 1
    lr: float = 0.1
    batch_size: int = 32
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    max_update_bytes: int = 64 << 20
    seed: int = 0


def log(msg: str) -> None:
    print(f"[aggregator {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Server:
    def __init__(self, cfg: ServeConfig, settings: BrokerSettings, profile: Profile, layout: Layout,
                 state: GlobalState, next_round: int) -> None:
        self.cfg, self.settings, self.profile, self.layout = cfg, settings, profile, layout
        self.topics = Topics(cfg.federation)
        self.fed = Federation(layout, state, cfg.federation, cfg.clients_per_round, cfg.min_clients,
                              cfg.round_timeout, seed=cfg.seed + next_round)
        self.next_round = next_round
        self.train_cfg = TrainConfig(lr=cfg.lr, batch_size=cfg.batch_size, local_epochs=cfg.local_epochs)
        self.reasm = Reassembler(max_bytes=cfg.max_update_bytes, timeout_s=cfg.round_timeout)
        self.inbox: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.evaluator = Evaluator(layout, cfg.eval_dataset, cfg.eval_samples, cfg.data_root) if cfg.eval_dataset else None
        self.out = Path(cfg.checkpoint_dir)
        self.bytes_out = 0
        self.round_rejects: Counter[str] = Counter()
        self.late = 0
        self.accuracy: list[float] | None = None
        self._published: dict[int, list[bytes]] = {}  # this round's model messages, for republishing
        self._reconnected = False
        self.run_id = secrets.token_hex(4)  # tells clients a restarted server's round 3 from the dead one's
        self.client = make_client(settings, f"nefl-aggregator-{cfg.federation}", self.topics.server_status,
                                  json.dumps({"v": 1, "state": "offline"}).encode())
        self.client.on_connect = self._on_connect
        self.client.on_message = lambda c, u, m: self.inbox.put((m.topic, bytes(m.payload)))

    # -- MQTT plumbing (network thread) ---------------------------------------------------------
    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log(f"broker refused the connection: {reason_code}; check --username/--password")
            return
        client.subscribe([(t, QOS) for t in self.topics.server_subscriptions()])
        self._reconnected = True

    def connect(self) -> None:
        self.client.connect_async(self.settings.host, self.settings.port, keepalive=15)
        self.client.loop_start()

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.client.publish(topic, payload, qos=QOS, retain=retain)
        self.bytes_out += len(payload)

    # -- status ---------------------------------------------------------------------------------
    def status(self, state: str) -> dict[str, Any]:
        r = self.fed.round
        return {
            "v": 1, "state": state, "federation": self.cfg.federation, "round": r.index if r else self.next_round - 1,
            "rounds": self.cfg.rounds, "profile": self.profile.to_dict(), "method": self.layout.method.name,
            "profile_hash": self.layout.profile.hash, "clients_online": self.fed.available(),
            "participants": sorted(r.assignments) if r else [], "reported": sorted(r.received) if r else [],
            "accuracy": self.accuracy, "rejected_total": dict(self.fed.rejected), "time": time.time(),
            "training": {"batch_size": self.cfg.batch_size, "local_epochs": self.cfg.local_epochs,
                         "round_timeout": self.cfg.round_timeout},
        }

    def publish_status(self, state: str) -> None:
        body = self.status(state)
        self.client.publish(self.topics.server_status, json.dumps(body).encode(), qos=QOS, retain=True)
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / f".{STATUS_FILE}.tmp"
        tmp.write_text(json.dumps(body, indent=1))
        tmp.replace(self.out / STATUS_FILE)

    # -- inbound (main thread) ------------------------------------------------------------------
    def pump(self, until: float) -> None:
        """Handle inbound messages until `until` (monotonic) or until the round can close."""
        while time.monotonic() < until:
            if self._reconnected:
                self._reconnected = False
                self._republish()
            try:
                topic, payload = self.inbox.get(timeout=0.1)
            except queue.Empty:
                for key in self.reasm.expire():
                    self._reject("timeout", key[2], f"chunk set of round {key[1]} incomplete after {self.cfg.round_timeout}s")
                continue
            self.handle(topic, payload)
            if self.fed.round is not None and self.fed.complete():
                return

    def handle(self, topic: str, payload: bytes) -> None:
        t = self.topics
        if (client := t.client_of(topic, "update")) is not None:
            self._handle_update(client, payload)
        elif (client := t.client_of(topic, "announce")) is not None:
            if payload:
                self._handle_announce(client, payload)
        elif (client := t.client_of(topic, "status")) is not None:
            body = self._json(client, payload) if payload else {"state": "offline"}
            if body is not None:
                self.fed.set_online(client, body.get("state") == "online")

    def _json(self, client: str, payload: bytes) -> dict | None:
        if len(payload) > MAX_CONTROL_BYTES:
            self._reject("oversized", client, f"{len(payload)}-byte control message")
            return None
        try:
            body = json.loads(payload)
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None
        if not isinstance(body, dict):
            self._reject("malformed_json", client, "control message is not a JSON object")
            return None
        return body

    def _handle_announce(self, client: str, payload: bytes) -> None:
        body = self._json(client, payload)
        if body is None:
            return
        try:
            info = self.fed.announce(client, body)
        except Rejected as e:
            self._reject(e.reason, client, str(e))
            return
        why = f" ({info.selection})" if info.selection else ""
        log(f"client {client} announced: submodel <= {info.max_submodel + 1}, {info.samples} samples{why}")
        r = self.fed.round
        if r is not None and client in r.declined and client not in r.assignments:
            log(f"round {r.index}: {client} declined its task; the round no longer waits for it")

    def _handle_update(self, client: str, payload: bytes) -> None:
        try:
            if len(payload) > self.cfg.chunk_bytes * 4:  # peers use our chunk size; allow slack, refuse floods
                raise WireError("oversized", f"{len(payload)}-byte message, chunks are <= {self.cfg.chunk_bytes}")
            header, _ = parse_chunk(payload)
            if self.reasm.is_duplicate(header):
                return
            try:
                self.fed.check_header(client, header)
            except Rejected as e:
                if header["index"] == 0:  # one count per update, not per chunk
                    self.late += e.reason == "stale_round" and header["round"] < self.next_round
                    self._reject(e.reason, client, str(e))
                return
            done = self.reasm.feed(payload)
            if done is not None:
                self.fed.accept(client, done.header, done.tensors, done.nbytes)
                log(f"round {header['round']}: update from {client} (submodel {header['submodel'] + 1}, "
                    f"{done.nbytes} bytes, {done.header['dtype']})")
        except (WireError, Rejected) as e:
            self._reject(e.reason, client, str(e))

    def _reject(self, reason: str, client: str, msg: str) -> None:
        self.fed.reject(reason)
        self.round_rejects[reason] += 1
        log(f"rejected {reason} from {client}: {msg}")

    # -- rounds ---------------------------------------------------------------------------------
    def wait_for_clients(self) -> None:
        """Until clients_per_round are online, or min_clients after join_wait seconds."""
        self.publish_status("waiting")
        since = time.monotonic()
        while True:
            n = len(self.fed.available())
            if n >= self.cfg.clients_per_round or (n >= self.cfg.min_clients and time.monotonic() - since >= self.cfg.join_wait):
                return
            self.pump(time.monotonic() + 0.5)

    def _republish(self) -> None:
        """After a (re)connect: the broker may have lost retained tasks and weights in a restart."""
        self.publish_status("training" if self.fed.round else "waiting")
        r = self.fed.round
        if r is None:
            return
        for k, msgs in self._published.items():
            for i, m in enumerate(msgs):
                self.client.publish(self.topics.model_chunk(k, i), m, qos=QOS, retain=True)
        for c, k in r.assignments.items():
            if c not in r.received:
                self.client.publish(self.topics.task(c), self._task(r.index, k), qos=QOS, retain=True)

    def _task(self, index: int, k: int) -> bytes:
        return json.dumps({
            "v": 1, "federation": self.cfg.federation, "round": index, "submodel": k,
            "lr": self.train_cfg.lr_at(index - 1, self.cfg.rounds), "epochs": self.cfg.local_epochs,
            "batch_size": self.cfg.batch_size, "profile_hash": self.layout.profile.hash,
            "deadline_s": self.cfg.round_timeout, "chunks": len(self._published[k]), "run": self.run_id,
        }).encode()

    def run_round(self, index: int) -> dict[str, Any]:
        t0 = time.monotonic()
        self.round_rejects.clear()
        self.late = 0
        out0, in0 = self.bytes_out, self.fed.bytes_in
        start_digest = state_digest(self.fed.state)
        r = self.fed.open_round(index)
        self.reasm.discard_rounds_before(index)
        self._published = {}
        for k in sorted(set(r.assignments.values())):
            msgs = encode(self.fed.state.extract(self.layout, k), kind="model", federation=self.cfg.federation,
                          round=index, submodel=k, client="server", chunk_bytes=self.cfg.chunk_bytes)
            self._published[k] = msgs
            for i, m in enumerate(msgs):
                self.publish(self.topics.model_chunk(k, i), m, retain=True)
        for c, k in r.assignments.items():
            self.publish(self.topics.task(c), self._task(index, k), retain=True)
        log(f"round {index}/{self.cfg.rounds} open: " + ", ".join(f"{c}->submodel {k + 1}" for c, k in sorted(r.assignments.items())))
        self.publish_status("training")
        while not self.fed.complete():
            self.pump(r.deadline)
        if len(r.received) < len(r.assignments):
            log(f"round {index} closed at its deadline: {len(r.received)}/{len(r.assignments)} updates")
        for c in r.assignments:  # a retained task outliving its round would send a restarted client astray
            self.client.publish(self.topics.task(c), b"", qos=QOS, retain=True)
        facts = self.fed.close_round()
        self.next_round = index + 1
        facts.update({
            "start_sha256": start_digest, "bytes_out": self.bytes_out - out0, "bytes_in": self.fed.bytes_in - in0,
            "rejected": dict(self.round_rejects), "late_updates": self.late,
            "duplicates_dropped": self.reasm.duplicates, "train_wall_s": round(time.monotonic() - t0, 3),
        })
        if self.evaluator is not None:
            self.publish_status("evaluating")
            self.accuracy = self.evaluator.accuracy(self.fed.state)
            facts["accuracy"] = self.accuracy
        save_checkpoint(self.out, self.fed.state, self.layout,
                        {"round": index, "rounds": self.cfg.rounds, "federation": self.cfg.federation,
                         "accuracy": self.accuracy, "state_sha256": state_digest(self.fed.state)})
        facts["wall_s"] = round(time.monotonic() - t0, 3)
        self.write_metrics(facts)
        log(f"round {index} done in {facts['wall_s']}s: reported {facts['reported']}, rejected {facts['rejected']}"
            + (f", accuracy {self.accuracy}" if self.accuracy else ""))
        return facts

    def write_metrics(self, facts: dict[str, Any]) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.out / METRICS_FILE, "a") as f:
            f.write(json.dumps(facts) + "\n")

    def run(self) -> None:
        self.connect()
        if self.evaluator is not None and self.next_round == 1:
            self.accuracy = self.evaluator.accuracy(self.fed.state)
            self.write_metrics({"round": 0, "accuracy": self.accuracy, "start_sha256": state_digest(self.fed.state)})
            log(f"round 0 accuracy {self.accuracy}")
        self.client.publish(self.topics.control, b"", qos=QOS, retain=True)  # forget an earlier run's "end"
        for index in range(self.next_round, self.cfg.rounds + 1):
            self.wait_for_clients()
            self.run_round(index)
        self.finish()

    def finish(self) -> None:
        self.publish_status("finished")
        self.client.publish(self.topics.control, json.dumps({"v": 1, "event": "end"}).encode(), qos=QOS, retain=True)
        for k, msgs in self._published.items():
            for i in range(len(msgs)):
                self.client.publish(self.topics.model_chunk(k, i), b"", qos=QOS, retain=True)
        info = self.client.publish(self.topics.server_status, json.dumps(self.status("finished")).encode(), qos=QOS, retain=True)
        try:
            info.wait_for_publish(5)
        except (RuntimeError, ValueError):
            pass  # broker gone at the very end: the checkpoint and metrics are already on disk
        self.client.disconnect()
        self.client.loop_stop()
        log(f"federation {self.cfg.federation!r} finished after round {self.cfg.rounds}")


def load_start(cfg: ServeConfig) -> tuple[Profile, Layout, GlobalState, int]:
    """Fresh state, or the checkpoint under --resume; refuses to overwrite or ignore a checkpoint."""
    profile = load_profile(cfg.profile)
    layout = Layout.build(profile)
    ckpt_dir = Path(cfg.checkpoint_dir)
    if cfg.resume:
        ckpt = load_checkpoint(ckpt_dir, profile)
        if not isinstance(ckpt.meta.get("round"), int):
            raise CheckpointError(f"{ckpt_dir}: checkpoint metadata has no round number; not a federation checkpoint")
        if ckpt.meta.get("state_sha256") not in (None, state_digest(ckpt.state)):
            raise CheckpointError(f"{ckpt_dir}: state does not match the digest in meta.json (corrupt or mixed files)")
        return profile, ckpt.layout, ckpt.state, ckpt.meta["round"] + 1
    if (ckpt_dir / "meta.json").exists():
        raise CheckpointError(f"{ckpt_dir} already holds a checkpoint: pass --resume, or another --checkpoint-dir")
    return profile, layout, GlobalState.init(layout, cfg.seed), 1


def serve_command(
    profile: str = typer.Option("resnet20-fmnist-w", help="Profile name or TOML path (the submodel ladder)."),
    broker: str = typer.Option(None, help="mqtt://HOST:PORT or mqtts://HOST:PORT; omit to start an embedded broker."),
    username: str = typer.Option(None, envvar="NEFL_MQTT_USERNAME", help="Broker user (env NEFL_MQTT_USERNAME)."),
    password: str = typer.Option(None, envvar="NEFL_MQTT_PASSWORD", help="Broker password (env NEFL_MQTT_PASSWORD)."),
    ca_cert: str = typer.Option(None, help="CA certificate (PEM) to verify an mqtts:// broker."),
    certfile: str = typer.Option(None, help="Client certificate (PEM) for mutual TLS."),
    keyfile: str = typer.Option(None, help="Key of --certfile."),
    federation: str = typer.Option("default", help="Federation name: the MQTT topic prefix nefl/NAME/."),
    rounds: int = typer.Option(10, min=1, help="Rounds to run (in total, counting resumed ones)."),
    clients_per_round: int = typer.Option(10, min=1, help="Participants per round, among connected clients."),
    min_clients: int = typer.Option(1, min=1, help="Quorum: updates needed for a round to change the model."),
    round_timeout: float = typer.Option(120.0, min=1, help="Seconds before a round closes without stragglers."),
    join_wait: float = typer.Option(10.0, min=0, help="Seconds to wait for --clients-per-round clients before starting with the quorum."),
    checkpoint_dir: str = typer.Option(None, help="Checkpoint + metrics.jsonl directory [default: runs/FEDERATION]."),
    resume: bool = typer.Option(False, help="Continue from the checkpoint in --checkpoint-dir."),
    eval_dataset: str = typer.Option(None, help="Evaluate every submodel on this dataset's test split after each round."),
    eval_samples: int = typer.Option(None, min=1, help="Evaluate on the first N test images only (faster)."),
    data_root: str = typer.Option(None, help="Dataset directory (default $NEFL_DATA_ROOT or ~/.cache/nefl/data)."),
    local_epochs: int = typer.Option(1, min=1, help="Local epochs per task."),
    lr: float = typer.Option(0.1, help="Base learning rate (x0.1 at 1/2 and 3/4 of the rounds)."),
    batch_size: int = typer.Option(32, min=1, help="Local batch size clients train with."),
    chunk_kib: int = typer.Option(DEFAULT_CHUNK_BYTES // 1024, min=8, help="Largest MQTT message the server publishes, KiB."),
    embedded_port: int = typer.Option(1883, help="Port of the embedded broker (127.0.0.1)."),
    seed: int = typer.Option(0, help="Seed of the initial weights and of participant sampling."),
) -> None:
    """Run a federation: rounds over MQTT, NeFedAvg, checkpoints after every round."""
    cfg = ServeConfig(profile, federation, rounds, clients_per_round, min_clients, round_timeout, join_wait,
                      checkpoint_dir or f"runs/{federation}", resume, eval_dataset, eval_samples, data_root,
                      local_epochs, lr, batch_size, chunk_bytes=chunk_kib * 1024, seed=seed)
    try:
        Topics(federation)
        prof, layout, state, next_round = load_start(cfg)
        embedded = None
        if broker is None:
            embedded = EmbeddedBroker("127.0.0.1", embedded_port)
            embedded.start()
            broker = embedded.url
            log(f"started embedded MQTT broker on {broker} (amqtt, MQTT 3.1.1); clients join with --broker {broker}")
        settings = parse_broker(broker, username, password, ca_cert, certfile, keyfile)
    except (CheckpointError, ProfileError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
    if next_round > rounds:
        log(f"checkpoint is already at round {next_round - 1} of {rounds}: nothing to do (raise --rounds)")
        return
    if next_round > 1:
        log(f"resuming federation {federation!r} at round {next_round} from {cfg.checkpoint_dir}")
    server = Server(cfg, settings, prof, layout, state, next_round)
    try:
        server.run()
    except KeyboardInterrupt:
        log("interrupted; the last completed round is checkpointed (restart with --resume)")
        raise typer.Exit(130) from None
    finally:
        if embedded is not None:
            embedded.stop()
