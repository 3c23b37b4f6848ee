"""`aggregator serve`: runs federated rounds over MQTT.

Threads: paho's network thread only enqueues (topic, payload); the main thread owns all state
(membership, round, aggregate) and does the publishing, aggregation, evaluation and checkpoints.
One consumer means no locks around the federation state and no message is handled twice at once.
"""

from __future__ import annotations

import json
import logging
import queue
import secrets
import signal
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer

from aggregator.assignment import Assignment
from aggregator.broker import EmbeddedBroker
from aggregator.evaluation import Evaluator
from aggregator.federation import Federation, Rejected, Robustness, state_digest
from nefl.checkpoint import (METRICS_FILE, UPDATES_TOTAL_KEY, CheckpointError, append_metrics, has_checkpoint,
                             load_checkpoint, replay_metrics, save_checkpoint)
from nefl.fsio import atomic_write_text
from nefl.messages import (MAX_LISTED, Announce, ClientStatus, Control, MessageError, ServerStatus, Task,
                           TrainingSettings)
from nefl.cli_options import (CaCertOption, CertfileOption, KeyfileOption, LogFormatOption, LogLevelOption, PasswordOption,
                              UsernameOption)
from nefl.logs import setup_logging
from nefl.mqtt import QOS, BrokerSettings, Connection, parse_broker
from nefl.profile import Profile, ProfileError, load_profile
from nefl.robust import DEFAULT_ADAPTIVE_K, DEFAULT_RELATIVE, DPAccountant, NormBound
from nefl.state import GlobalState, Layout
from nefl.topics import Topics
from nefl.signing import KeyFileError, Signer
from nefl.train import TrainConfig
from nefl.wire import DEFAULT_CHUNK_BYTES, Reassembler, WireError, encode, parse_chunk

STATUS_FILE = "status.json"


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
    local_epochs: int = TrainConfig.local_epochs
    lr: float = TrainConfig.lr
    batch_size: int = TrainConfig.batch_size
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    max_update_bytes: int = 64 << 20
    seed: int = 0
    robustness: Robustness = Robustness()
    dp_delta: float = 1e-5
    assignment: Assignment = "coverage"


@dataclass
class Start:
    """Where a federation starts: fresh, or the committed checkpoint under --resume."""

    profile: Profile
    layout: Layout
    state: GlobalState
    next_round: int
    meta: dict[str, Any] = field(default_factory=dict)


log = logging.getLogger(__name__)


class Stop(Exception):
    """SIGTERM: end like Ctrl-C, cleanly."""


def _stop(signum: int, frame: object) -> None:
    raise Stop(signal.Signals(signum).name)


class Server:
    def __init__(self, cfg: ServeConfig, settings: BrokerSettings, start: Start, signer: Signer) -> None:
        layout, next_round = start.layout, start.next_round
        self.cfg, self.settings, self.profile, self.layout = cfg, settings, start.profile, layout
        self.topics = Topics(cfg.federation)
        self.fed = Federation(layout, start.state, cfg.federation, cfg.clients_per_round, cfg.min_clients,
                              cfg.round_timeout, seed=cfg.seed + next_round, robustness=cfg.robustness,
                              assignment=cfg.assignment, trained_updates=start.meta.get(UPDATES_TOTAL_KEY))
        if "update_guard" in start.meta:  # the adaptive bound's history survives a restart
            self.fed.guard.load_state_dict(start.meta["update_guard"])
        self.next_round = next_round
        self.train_cfg = TrainConfig(lr=cfg.lr, batch_size=cfg.batch_size, local_epochs=cfg.local_epochs)
        self.reasm = Reassembler(max_bytes=cfg.max_update_bytes, timeout_s=cfg.round_timeout)
        self.evaluator = Evaluator.for_dataset(layout, cfg.eval_dataset, cfg.eval_samples, cfg.data_root,
                                               seed=cfg.seed) if cfg.eval_dataset else None
        self.out = Path(cfg.checkpoint_dir)
        self.bytes_out = 0
        self.round_rejects: Counter[str] = Counter()
        self.late = 0
        self.accuracy: list[float] | None = None
        self._published: dict[int, list[bytes]] = {}  # this round's model messages, for republishing
        self.run_id = secrets.token_hex(4)  # tells clients a restarted server's round 3 from the dead one's
        self.signer = signer
        self.conn = Connection(settings, f"nefl-aggregator-{cfg.federation}", self.topics.server_status,
                               ServerStatus(state="offline", federation=cfg.federation).to_json(), log)
        self.client = self.conn.client

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.client.publish(topic, payload, qos=QOS, retain=retain)
        self.bytes_out += len(payload)

    # -- status ---------------------------------------------------------------------------------
    def status(self, state: str) -> ServerStatus:
        r, online = self.fed.round, self.fed.available()
        return ServerStatus(
            state=state, federation=self.cfg.federation, run=self.run_id, round=r.index if r else self.next_round - 1,
            rounds=self.cfg.rounds, profile=self.profile.to_dict(), method=self.layout.method.name,
            profile_hash=self.layout.profile.hash, key=self.signer.public_text,
            clients_online=online[:MAX_LISTED], clients_online_count=len(online),
            participants=sorted(r.assignments)[:MAX_LISTED] if r else [],
            reported=sorted(r.received)[:MAX_LISTED] if r else [], accuracy=self.accuracy,
            rejected_total=dict(self.fed.rejected), time=time.time(),
            training=TrainingSettings(batch_size=self.cfg.batch_size, local_epochs=self.cfg.local_epochs,
                                      round_timeout=self.cfg.round_timeout),
        )

    def publish_status(self, state: str) -> None:
        body = self.status(state)
        self.client.publish(self.topics.server_status, self.signer.sign(body.to_json()), qos=QOS, retain=True)
        self.out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.out / STATUS_FILE, json.dumps(json.loads(body.to_json()), indent=1))

    # -- inbound (main thread) ------------------------------------------------------------------
    def pump(self, until: float) -> None:
        """Handle inbound messages until `until` (monotonic) or until the round can close."""
        while time.monotonic() < until:
            if self.conn.just_connected():
                self.client.subscribe([(t, QOS) for t in self.topics.server_subscriptions()])
                self._republish()
            try:
                topic, payload = self.conn.inbox.get(timeout=0.1)
            except queue.Empty:
                for key in self.reasm.expire():
                    self._reject("timeout", key[2], f"chunk set of round {key[1]} incomplete after {self.cfg.round_timeout}s")
                continue
            self.handle(topic, payload)
            if self.fed.round is not None and self.fed.complete():
                return

    def handle(self, topic: str, payload: bytes) -> None:
        """The trust boundary: whatever arrives, a rejection is counted and the loop goes on."""
        t = self.topics
        client = "?"
        try:
            if (client := t.client_of(topic, "update")) is not None:
                self._handle_update(client, payload)
            elif (client := t.client_of(topic, "announce")) is not None:
                if payload:  # an empty retained message clears the announce
                    self._handle_announce(client, Announce.from_json(payload))
            elif (client := t.client_of(topic, "status")) is not None:
                online = bool(payload) and ClientStatus.from_json(payload).state == "online"
                self.fed.set_online(client, online)
        except (MessageError, Rejected, WireError) as e:
            self._reject(e.reason, client or "?", str(e))
        except Exception:  # a bug must not let one message end the federation: count it, keep the trace
            self._reject("internal_error", client or "?", traceback.format_exc(limit=3).strip().replace("\n", " | "))

    def _handle_announce(self, client: str, msg: Announce) -> None:
        info = self.fed.announce(client, msg)
        why = f" ({info.selection})" if info.selection else ""
        log.info(f"client {client} announced: submodel <= {info.max_submodel + 1}, {info.samples} samples{why}")
        r = self.fed.round
        if r is not None and client in r.declined and client not in r.assignments:
            log.info(f"round {r.index}: {client} declined its task; the round no longer waits for it")

    def _handle_update(self, client: str, payload: bytes) -> None:
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
            log.info(f"round {header['round']}: update from {client} (submodel {header['submodel'] + 1}, "
                f"{done.nbytes} bytes, {done.header['dtype']})")

    def _reject(self, reason: str, client: str, msg: str) -> None:
        self.fed.reject(reason)
        self.round_rejects[reason] += 1
        log.info(f"rejected {reason} from {client}: {msg}")

    # -- rounds ---------------------------------------------------------------------------------
    def wait_for_clients(self) -> None:
        """Until clients_per_round can train, or min_clients can and join_wait has passed since the
        first of them arrived (so a first round does not open the moment one device shows up)."""
        self.publish_status("waiting")
        first_ready: float | None = None
        said = ""
        while True:
            n = len(self.fed.available())
            if n and first_ready is None:
                first_ready = time.monotonic()
            if n >= self.cfg.clients_per_round or (
                    n >= self.cfg.min_clients and time.monotonic() - first_ready >= self.cfg.join_wait):
                return
            said = self._say_why_waiting(n, said)
            self.pump(time.monotonic() + 0.5)

    def _say_why_waiting(self, ready: int, said: str) -> str:
        """Log, once per change, who is online but cannot train and why; returns what was said."""
        idle = {c: i.selection or "announced it can train nothing now" for c, i in self.fed.clients.items()
                if i.online and i.max_submodel < 0}
        why = "; ".join(f"{c}: {reason}" for c, reason in sorted(idle.items())[:20])
        text = (f"waiting for clients: {ready} ready of {self.cfg.min_clients} needed"
                + (f"; online but unable to train: {why}" if why else ""))
        if text != said:
            log.info(text)
        return text

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
        model, _ = parse_chunk(self._published[k][0])
        return self.signer.sign(Task(
            federation=self.cfg.federation, run=self.run_id, round=index, submodel=k,
            lr=self.train_cfg.lr_at(index - 1, self.cfg.rounds), epochs=self.cfg.local_epochs,
            batch_size=self.cfg.batch_size, profile_hash=self.layout.profile.hash, deadline_s=self.cfg.round_timeout,
            chunks=len(self._published[k]), model_sha256=model["sha256"], model_bytes=model["size"],
        ).to_json())

    def run_round(self, index: int) -> dict[str, Any]:
        t0 = time.monotonic()
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
        log.info(f"round {index}/{self.cfg.rounds} open: " + ", ".join(f"{c}->submodel {k + 1}" for c, k in sorted(r.assignments.items())))
        self.publish_status("training")
        while not self.fed.complete():
            self.pump(r.deadline)
        if len(r.received) < len(r.assignments):
            log.info(f"round {index} closed at its deadline: {len(r.received)}/{len(r.assignments)} updates")
        for c in r.assignments:  # a retained task outliving its round would send a restarted client astray
            self.client.publish(self.topics.task(c), b"", qos=QOS, retain=True)
        facts = self.fed.close_round()
        self.next_round = index + 1
        rejected, self.round_rejects = dict(self.round_rejects), Counter()  # rejections since the last round closed
        facts.update({
            "start_sha256": start_digest, "bytes_out": self.bytes_out - out0, "bytes_in": self.fed.bytes_in - in0,
            "rejected": rejected, "late_updates": self.late, "inbox_dropped": self.conn.inbox_dropped,
            "duplicates_dropped": self.reasm.duplicates, "train_wall_s": round(time.monotonic() - t0, 3),
        })
        if not facts["committed"] and facts["quorum"]:
            log.info(f"round {index} NOT committed, the previous weights stay: {facts['not_committed']}")
        rb = self.cfg.robustness
        if rb.dp_noise_multiplier > 0:
            q = min(1.0, self.cfg.clients_per_round / max(1, len(self.fed.clients)))
            facts["dp_epsilon"] = DPAccountant(rb.dp_noise_multiplier, q, self.cfg.dp_delta).epsilon(index)
        if self.evaluator is not None:
            self.publish_status("evaluating")
            self.accuracy = self.evaluator.accuracy(self.fed.state)
            facts["accuracy"] = self.accuracy
        facts["wall_s"] = round(time.monotonic() - t0, 3)  # up to the commit: the saved line and the appended one agree
        save_checkpoint(self.out, self.fed.state, self.layout,
                        {"round": index, "rounds": self.cfg.rounds, "federation": self.cfg.federation,
                         "accuracy": self.accuracy, "state_sha256": state_digest(self.fed.state),
                         "update_guard": self.fed.guard.state_dict(), UPDATES_TOTAL_KEY: self.fed.trained_updates},
                        metrics=facts)
        self.write_metrics(facts)
        log.info(f"round {index} done in {facts['wall_s']}s: reported {facts['reported']}, rejected {facts['rejected']}"
            + (f", accuracy {self.accuracy}" if self.accuracy else ""))
        return facts

    def write_metrics(self, facts: dict[str, Any]) -> None:
        append_metrics(self.out, facts)

    def run(self) -> None:
        self.conn.start()
        if self.evaluator is not None and self.next_round == 1:
            self.accuracy = self.evaluator.accuracy(self.fed.state)
            self.write_metrics({"round": 0, "accuracy": self.accuracy, "start_sha256": state_digest(self.fed.state)})
            log.info(f"round 0 accuracy {self.accuracy}")
        self.client.publish(self.topics.control, b"", qos=QOS, retain=True)  # forget an earlier run's "end"
        for index in range(self.next_round, self.cfg.rounds + 1):
            self.wait_for_clients()
            self.run_round(index)
        self.finish()

    def finish(self) -> None:
        self.publish_status("finished")
        end = Control(federation=self.cfg.federation, run=self.run_id, event="end")
        self.client.publish(self.topics.control, self.signer.sign(end.to_json()), qos=QOS, retain=True)
        for k, msgs in self._published.items():
            for i in range(len(msgs)):
                self.client.publish(self.topics.model_chunk(k, i), b"", qos=QOS, retain=True)
        info = self.client.publish(self.topics.server_status, self.signer.sign(self.status("finished").to_json()),
                                   qos=QOS, retain=True)
        try:
            info.wait_for_publish(5)
        except (RuntimeError, ValueError):
            pass  # broker gone at the very end: the checkpoint and metrics are already on disk
        self.client.disconnect()
        self.client.loop_stop()
        log.info(f"federation {self.cfg.federation!r} finished after round {self.cfg.rounds}")


def load_start(cfg: ServeConfig) -> Start:
    """Fresh state, or the checkpoint under --resume; refuses to overwrite or ignore a checkpoint."""
    profile = load_profile(cfg.profile)
    layout = Layout.build(profile)
    ckpt_dir = Path(cfg.checkpoint_dir)
    if cfg.resume:
        if replay_metrics(ckpt_dir):
            log.info(f"restored the last committed round's line to {ckpt_dir / METRICS_FILE} (crash before it was appended)")
        ckpt = load_checkpoint(ckpt_dir, profile)
        if not isinstance(ckpt.meta.get("round"), int):
            raise CheckpointError(f"{ckpt_dir}: checkpoint metadata has no round number; not a federation checkpoint")
        if ckpt.meta.get("state_sha256") not in (None, state_digest(ckpt.state)):
            raise CheckpointError(f"{ckpt_dir}: state does not match the digest in meta.json (corrupt or mixed files)")
        return Start(profile, ckpt.layout, ckpt.state, ckpt.meta["round"] + 1, ckpt.meta)
    if has_checkpoint(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir} already holds a checkpoint: pass --resume, or another --checkpoint-dir")
    return Start(profile, layout, GlobalState.init(layout, cfg.seed), 1)


def serve_command(
    profile: str = typer.Option("resnet20-fmnist-w", help="Profile name or TOML path (the submodel ladder)."),
    broker: str = typer.Option(None, help="mqtt://HOST:PORT or mqtts://HOST:PORT; omit to start an embedded broker."),
    username: UsernameOption = None,
    password: PasswordOption = None,
    ca_cert: CaCertOption = None,
    certfile: CertfileOption = None,
    keyfile: KeyfileOption = None,
    federation: str = typer.Option("default", help="Federation name: the MQTT topic prefix nefl/NAME/."),
    rounds: int = typer.Option(10, min=1, help="Rounds to run (in total, counting resumed ones)."),
    clients_per_round: int = typer.Option(10, min=1, help="Participants per round, among connected clients."),
    min_clients: int = typer.Option(1, min=1, help="Quorum: updates needed for a round to change the model."),
    round_timeout: float = typer.Option(120.0, min=1, help="Seconds before a round closes without stragglers."),
    join_wait: float = typer.Option(10.0, min=0, help="Seconds to wait for --clients-per-round clients before starting with the quorum."),
    checkpoint_dir: str = typer.Option(None, help="Checkpoint + metrics.jsonl directory (default: runs/FEDERATION)."),
    resume: bool = typer.Option(False, help="Continue from the checkpoint in --checkpoint-dir."),
    eval_dataset: str = typer.Option(None, help="Evaluate every submodel on this dataset's test split after each round."),
    eval_samples: int = typer.Option(None, min=1, help="Evaluate on the first N test images only (faster)."),
    data_root: str = typer.Option(None, help="Dataset directory (default $NEFL_DATA_ROOT or ~/.cache/nefl/data)."),
    local_epochs: int = typer.Option(TrainConfig.local_epochs, min=1, help="Local epochs per task."),
    lr: float = typer.Option(TrainConfig.lr, help="Base learning rate (x0.1 at 1/2 and 3/4 of the rounds)."),
    batch_size: int = typer.Option(TrainConfig.batch_size, min=1, help="Local batch size clients train with."),
    chunk_kib: int = typer.Option(DEFAULT_CHUNK_BYTES // 1024, min=8, help="Largest MQTT message the server publishes, KiB."),
    embedded_port: int = typer.Option(1883, help="Port of the embedded broker (127.0.0.1)."),
    seed: int = typer.Option(0, help="Seed of the initial weights and of participant sampling."),
    max_update_norm: float = typer.Option(None, min=0, help="Fixed bound on an update's L2 norm (docs/security.md)."),
    update_norm_relative: float = typer.Option(DEFAULT_RELATIVE, min=0, help="Bound an update's norm by this multiple "
                                               "of its submodel's weight norm; 0 turns it off."),
    update_norm_k: float = typer.Option(DEFAULT_ADAPTIVE_K, min=0, help="Bound an update's norm by K x the median of the "
                                        "submodel's recent accepted norms; 0 turns it off."),
    clip: bool = typer.Option(False, "--clip/--reject", help="Scale oversized updates down to the bound, or refuse them."),
    max_weight_abs: float = typer.Option(1e6, min=0, help="A round whose new weights exceed this magnitude (or are not "
                                         "finite) is not committed."),
    dp_noise_multiplier: float = typer.Option(0.0, min=0, help="DP-FedAvg: Gaussian noise std = this x --max-update-norm "
                                              "(needs --clip); the spent epsilon is logged per round."),
    dp_delta: float = typer.Option(1e-5, min=0, max=1, help="The delta of the reported (epsilon, delta)-DP."),
    assignment: Assignment = typer.Option("coverage", help="Which submodel a participant trains within the bound it "
                                          "announced: coverage (every submodel each round when the pool allows), "
                                          "largest (the bound), or paper (tier t picks among t-2..t+2)."),
    log_level: LogLevelOption = "info",
    log_format: LogFormatOption = "plain",
) -> None:
    """Run a federation: rounds over MQTT, NeFedAvg, checkpoints after every round."""
    setup_logging(log_level, log_format)
    signal.signal(signal.SIGTERM, _stop)
    try:
        bound = NormBound(max_norm=max_update_norm or None, relative=update_norm_relative or None,
                          adaptive_k=update_norm_k or None, mode="clip" if clip else "reject")
        robust = Robustness(bound, max_weight_abs, dp_noise_multiplier)
        if dp_noise_multiplier > 0:
            DPAccountant(dp_noise_multiplier, 1.0, dp_delta).epsilon(1)  # fails now, not after round 1, without dp-accounting
    except (ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
    cfg = ServeConfig(profile=profile, federation=federation, rounds=rounds, clients_per_round=clients_per_round,
                      min_clients=min_clients, round_timeout=round_timeout, join_wait=join_wait,
                      checkpoint_dir=checkpoint_dir or f"runs/{federation}", resume=resume, eval_dataset=eval_dataset,
                      eval_samples=eval_samples, data_root=data_root, local_epochs=local_epochs, lr=lr,
                      batch_size=batch_size, chunk_bytes=chunk_kib * 1024, seed=seed, robustness=robust,
                      dp_delta=dp_delta, assignment=assignment)
    try:
        Topics(federation)
        start = load_start(cfg)
        signer = Signer.load_or_create(cfg.checkpoint_dir)
        embedded = None
        if broker is None:
            embedded = EmbeddedBroker("127.0.0.1", embedded_port)
            embedded.start()
            broker = embedded.url
            log.info(f"started embedded MQTT broker on {broker} (amqtt, MQTT 3.1.1); clients join with --broker {broker}")
        settings = parse_broker(broker, username, password, ca_cert, certfile, keyfile)
    except (CheckpointError, ProfileError, KeyFileError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
    if start.next_round > rounds:
        log.info(f"checkpoint is already at round {start.next_round - 1} of {rounds}: nothing to do (raise --rounds)")
        return
    if start.next_round > 1:
        log.info(f"resuming federation {federation!r} at round {start.next_round} from {cfg.checkpoint_dir}")
    log.info(f"server key {signer.public_text} (devices: --server-key; `aggregator key` prints it)")
    server = Server(cfg, settings, start, signer)
    try:
        server.run()
    except (KeyboardInterrupt, Stop) as e:
        done = server.next_round - 1
        log.info(f"stopping ({e or 'interrupted'}); "
                 + (f"round {done} is the last checkpointed one: continue with --resume" if done >= 1
                    else "no round completed yet, so there is nothing to resume"))
        server.conn.stop()
    finally:
        if embedded is not None:
            embedded.stop()


def key_command(
    checkpoint_dir: str = typer.Option(..., help="The federation's run directory (serve's --checkpoint-dir)."),
) -> None:
    """Print the aggregator's public key (created if missing), for devices' --server-key."""
    try:
        print(Signer.load_or_create(checkpoint_dir).public_text)
    except (KeyFileError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
