"""The light coordinator of a FedJigsaw federation over MQTT (`aggregator jigsaw-serve`): no model, only timing.

It admits `devices` devices that said hello and are online (each hello is signed by the key it names; a client
id keeps the first key it came with), numbers them by client id, announces the plan (participants and keys,
topology, the settings of the client step and of the shards), then opens each round with the devices that are
online and closes it when every one of them has reported, or at `round_timeout_s`, whichever comes first: a
device that goes offline mid-round is not waited for, and its neighbours mask it when it does not answer a fetch.
During the policy phase it runs CoRe-Tune's critic on the devices' reports (nefl.jigsaw.coretune) and answers
each with its advice; in the model-training phase the devices need it only for the round timing.

Every message it takes is checked (signature against the device's key, strict loader) and never raises past
`handle`. Each round's row (traffic, borrowed and returned copies, chain changes, rejections, accuracies) goes
to `metrics.jsonl` and to the Prometheus gauges of `JigsawMetrics`.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable

from nefl.jigsaw.coordination import JigsawHello, JigsawPlan, JigsawRound, Participant, Phase, RoundDone
from nefl.jigsaw.coretune import MAX_REPORT_BYTES, CoReTune, PolicyReport
from nefl.jigsaw.methods import get_method
from nefl.jigsaw.sim import JigsawConfig
from nefl.jigsaw.symbio import neighbours
from nefl.jigsaw.zoo import load_base
from nefl.nested.data import get_dataset_info
from nefl.protocol import signing
from nefl.protocol.messages import MAX_CONTROL_BYTES, ClientStatus, MessageError, decode
from nefl.protocol.mqtt import QOS, Transport
from nefl.protocol.signing import Signer, parse_public_key
from nefl.protocol.topics import Topics
from nefl.support.settings import TrainConfig

log = logging.getLogger(__name__)
MAX_CANDIDATES = 4096  # client ids whose hello (and key) the coordinator keeps: a flood of made-up ids stops here


class Coordinator:
    def __init__(self, cfg: JigsawConfig, federation: str, devices: int, signer: Signer, transport: Transport,
                 clock: Callable[[], float] = time.monotonic, on_row: Callable[[dict], None] | None = None) -> None:
        self.method = get_method(cfg.method)
        if self.method.family != "modules" or (not self.method.assemble and self.method.fixed != "base"):
            raise ValueError(f"--method {cfg.method} is an ablation of the simulator: over MQTT, use fedjigsaw, "
                             "no-coretune, no-symbio or local-only")
        self.cfg, self.devices, self.signer, self.transport, self.clock = cfg, devices, signer, transport, clock
        self.max_blocks = max(load_base(a).blocks for a in cfg.archs)  # an unknown architecture fails here, first
        self.classes = get_dataset_info(cfg.dataset).num_classes
        self.topics = Topics(federation)
        self.on_row = on_row or (lambda row: None)
        self.run_id = secrets.token_hex(6)
        self.cond = threading.Condition()
        self.hellos: dict[str, JigsawHello] = {}
        self.keys: dict[str, str] = {}  # client id -> the key it first said hello with
        self.offline: set[str] = set()
        self.stamps: dict[str, int] = {}  # client id -> the connection stamp of its newest status
        self.done: dict[tuple[int, int], RoundDone] = {}
        self.reports: dict[tuple[int, int], PolicyReport] = {}
        self.rejected: Counter[str] = Counter()
        self.plan: JigsawPlan | None = None
        self.by_id: dict[str, Participant] = {}
        self.rows: list[dict] = []
        self.final: dict[int, float] = {}

    def subscriptions(self) -> list[str]:
        t = self.topics
        return [t.jigsaw(k, "+") for k in ("hello", "done", "report")] + [f"{t.root}/status/+"]

    # -- inbound: the trust boundary ------------------------------------------------------------------

    def handle(self, topic: str, payload: bytes) -> None:
        """Act on a device's message or count why it was refused; never raises."""
        if not payload:
            return
        try:
            status_of = self.topics.client_of(topic, "status")
            if status_of is not None:
                self._on_status(status_of, bytes(payload))
                return
            parsed = self.topics.jigsaw_of(topic)
            if parsed is None or parsed[1] is None:
                return
            kind, client = parsed
            if kind == "hello":
                self._on_hello(client, bytes(payload))
            elif kind == "done":
                msg = decode(self._from(client, bytes(payload)), RoundDone)
                self._keep(client, msg, self.done)
            elif kind == "report":
                msg = decode(self._from(client, bytes(payload), MAX_REPORT_BYTES), PolicyReport, MAX_REPORT_BYTES)
                self._keep(client, msg, self.reports)
        except MessageError as e:
            with self.cond:
                self.rejected[e.reason] += 1
            log.warning(f"dropped {topic}: {e.detail} ({e.reason})")
        except Exception as e:  # a hostile payload must not end the coordinator, whatever it trips
            with self.cond:
                self.rejected["malformed"] += 1
            log.warning(f"dropped {topic}: {type(e).__name__}")

    def _on_hello(self, client: str, payload: bytes) -> None:
        body, key = signing.verify_self_signed(payload, lambda b: decode(b, JigsawHello).key)
        hello = decode(body, JigsawHello)
        if hello.client_id != client or hello.federation != self.topics.federation:
            raise MessageError("not_for_me", f"hello of {hello.client_id} in {hello.federation} on {client}'s topic")
        with self.cond:
            if client not in self.keys and len(self.keys) >= MAX_CANDIDATES:
                raise MessageError("too_many_devices", f"{len(self.keys)} devices said hello already")
            if self.keys.setdefault(client, key) != key:
                raise MessageError("key_changed", f"{client} said hello with another key than its first")
            if self.plan is None:  # a retained hello of a device whose status says offline is not counted
                self.hellos[client] = hello
                self.offline.discard(client)
                self.cond.notify_all()

    def _from(self, client: str, payload: bytes, max_bytes: int = MAX_CONTROL_BYTES) -> bytes:
        p = self.by_id.get(client)
        if p is None:
            raise MessageError("unknown_client", f"{client} is not in this run's plan")
        if len(payload) > max_bytes + signing.SIGNATURE_OVERHEAD:
            raise MessageError("oversized", f"{len(payload)}-byte message")
        return signing.verify(payload, parse_public_key(p.key))

    def _keep(self, client: str, msg: RoundDone | PolicyReport, into: dict) -> None:
        if msg.client != self.by_id[client].index or (isinstance(msg, RoundDone) and msg.run != self.run_id):
            raise MessageError("not_for_me", f"a message of client {msg.client} on {client}'s topic, or of another run")
        with self.cond:
            into.setdefault((msg.round, msg.client), msg)
            self.cond.notify_all()

    def _on_status(self, client: str, payload: bytes) -> None:
        with self.cond:
            key = self.keys.get(client)
        if key is None:
            return
        status = decode(signing.verify(payload, parse_public_key(key)), ClientStatus)
        with self.cond:
            if status.seq < self.stamps.get(client, 0):
                raise MessageError("stale_status", f"{client}'s status of an earlier connection")
            self.stamps[client] = status.seq
            (self.offline.add if status.state == "offline" else self.offline.discard)(client)
            self.cond.notify_all()

    # -- the run --------------------------------------------------------------------------------------

    def admit(self, timeout_s: float) -> JigsawPlan:
        """Wait for `devices` hellos, then announce the plan (participants numbered by client id)."""
        deadline = self.clock() + timeout_s
        with self.cond:
            while len(online := [h for c, h in self.hellos.items() if c not in self.offline]) < self.devices:
                if self.clock() > deadline:
                    raise TimeoutError(f"{len(online)} of {self.devices} devices said hello in {timeout_s:.0f} s: "
                                       "are they running `edge-client jigsaw` against this broker and federation?")
                self.cond.wait(0.5)
            hellos = sorted(online, key=lambda h: h.client_id)[:self.devices]
        cfg = self.cfg
        participants = [Participant(index=i, client_id=h.client_id, key=h.key) for i, h in enumerate(hellos)]
        links = neighbours(len(hellos), cfg.topology, cfg.neighbours_k, cfg.seed) if self.method.share \
            else [[] for _ in hellos]
        plan = JigsawPlan(federation=self.topics.federation, run=self.run_id, key=self.signer.public_text,
                          method=cfg.method, dataset=cfg.dataset, archs=list(cfg.archs), participants=participants,
                          links=links, shards=dataclasses.replace(cfg, clients=len(hellos)).shards(),
                          settings=dataclasses.replace(cfg.settings(self.max_blocks), federation=self.topics.federation),
                          train=TrainConfig(lr=cfg.lr, batch_size=cfg.batch_size, local_epochs=cfg.local_epochs,
                                            milestones=tuple(cfg.milestones)),
                          rounds=cfg.rounds, policy_rounds=cfg.policy_rounds if self.method.assemble else 0,
                          fetch_timeout_s=cfg.fetch_timeout_s, norm_bound=cfg.norm_bound,
                          screen=cfg.screen_returns)
        with self.cond:
            self.plan, self.by_id = plan, {p.client_id: p for p in participants}
        self._publish(self.topics.jigsaw("plan"), plan.to_json(), retain=True)
        log.info(f"plan: {', '.join(f'{p.index}={p.client_id}' for p in participants)}; topology {cfg.topology}: {links}")
        return plan

    def run(self, admit_timeout_s: float) -> dict[int, float]:
        """Admit, run every round, close; returns each device's final local test accuracy."""
        plan = self.admit(admit_timeout_s)
        critic = self.cfg.coretune(plan.federation, self.classes) if self.method.coretune and plan.policy_rounds else None
        returns = [0] * len(plan.participants)
        for r in range(plan.policy_rounds + plan.rounds):
            phase: Phase = "policy" if r < plan.policy_rounds else "train"
            done = self._round(r, phase, returns)
            returns = [0] * len(plan.participants)
            for d in done.values():
                for source in d.returned:
                    if source < len(returns):
                        returns[source] += 1
            row = self._row(r, phase, done)
            if critic is not None and phase == "policy":
                row.update(self._advise(r, critic, done))
            self.rows.append(row)
            self.on_row(row)
        end = plan.policy_rounds + plan.rounds
        final = self._round(end, "end", returns)
        self.final = {c: d.accuracy for (_, c), d in final.items()}
        row = self._row(end, "end", final)  # its accuracies: the final chains' on the devices' local test sets
        self.rows.append(row)
        self.on_row(row)
        self._publish(self.topics.jigsaw("round"), self._round_msg(end + 1, "over", [], []).to_json(), retain=True)
        return self.final

    def _active(self) -> list[int]:
        assert self.plan is not None
        with self.cond:
            return [p.index for p in self.plan.participants if p.client_id not in self.offline]

    def _round_msg(self, r: int, phase: Phase, active: list[int], returns: list[int]) -> JigsawRound:
        return JigsawRound(federation=self.topics.federation, run=self.run_id, round=r, phase=phase, active=active,
                           returns=returns)

    def _round(self, r: int, phase: Phase, returns: list[int]) -> dict[tuple[int, int], RoundDone]:
        """Open round r for the online devices; wait for each one's report until it goes offline or the timeout."""
        assert self.plan is not None
        active = self._active()
        self._publish(self.topics.jigsaw("round"), self._round_msg(r, phase, active, returns).to_json(), retain=True)
        deadline = self.clock() + self.cfg.round_timeout_s
        names = {p.index: p.client_id for p in self.plan.participants}
        with self.cond:
            while True:
                waiting = [c for c in active if (r, c) not in self.done and names[c] not in self.offline]
                if not waiting or self.clock() > deadline:
                    break
                self.cond.wait(0.5)
            got = {k: d for k, d in self.done.items() if k[0] == r}
        if waiting:
            log.warning(f"round {r}: closed without {', '.join(names[c] for c in waiting)} (offline or past the "
                        f"{self.cfg.round_timeout_s:.0f} s round timeout)")
        return got

    def _advise(self, r: int, critic: CoReTune, done: dict[tuple[int, int], RoundDone]) -> dict:
        """CoRe-Tune's server step on the reports of the devices that trained this round, in client order."""
        trained = sorted(c for (_, c), d in done.items() if d.trained)
        deadline = self.clock() + self.cfg.fetch_timeout_s
        with self.cond:
            while any((r, c) not in self.reports for c in trained) and self.clock() < deadline:
                self.cond.wait(0.2)
            reports = [self.reports[(r, c)] for c in trained if (r, c) in self.reports]
        if not reports:
            return {}
        advice, stats = critic.step(reports)
        names = {p.index: p.client_id for p in self.plan.participants} if self.plan else {}
        for a in advice:
            self._publish(self.topics.jigsaw("advice", names[a.client]), a.to_json())
        return stats

    def _row(self, r: int, phase: Phase, done: dict[tuple[int, int], RoundDone]) -> dict:
        """The round's metrics: what the devices reported, summed, and the accuracies per client."""
        reports = [done[k] for k in sorted(done)]
        traffic: Counter[str] = Counter()
        rejected: Counter[str] = Counter()
        for d in reports:
            traffic.update(d.traffic)
            rejected.update(d.rejected)
        trained = [d for d in reports if d.trained]
        with self.cond:
            rejected.update({f"coordinator_{k}": v for k, v in self.rejected.items()})
        return {"round": r, "phase": phase, "devices": len(reports), "trained": len(trained),
                "val_accuracy": {d.client: d.accuracy for d in trained},
                "train_loss": statistics.fmean(d.loss for d in trained) if trained else None,
                "chain_changes": sum(d.changed for d in trained), "chains": {d.client: d.chain for d in trained},
                "modules_borrowed": sum(len(d.returned) for d in reports),
                "masked": sorted({m for d in reports for m in d.masked}),
                "bytes": dict(traffic), "bytes_per_device": sum(traffic.values()) / max(1, len(reports)),
                "whole_model_bytes_per_device": statistics.fmean(2 * d.model_bytes for d in reports) if reports else 0,
                "rejected": dict(rejected)}

    def _publish(self, topic: str, body: bytes, retain: bool = False) -> None:
        self.transport.publish(topic, self.signer.sign(body), qos=QOS, retain=retain)

