"""The control-plane attacks of issue 21 as a real process on the broker, for the end-to-end tests
(tests/e2e/test_control_attacks.py) and the benchmark (benchmarks/bench_control_plane.py).

    python -m tests.harness.control_attacker ATTACK --broker mqtt://HOST:PORT [--federation t] [--username U --password P] ...

  silent          join the workers' shared subscription and swallow every update handed to it
  forge-workers   forged receipts for every task seen, and at each round close a forged partial (sums x1000,
                  norms 1e-9) and summary, as a worker id of its own and as the real workers' ids
  flood N         N made-up ids, each announcing (signed by a key of its own) and saying "online", retained
  claim ID        announce (retained) as ID with the attacker's key, before the real ID first joins
  forge-status [S]  a retained server status of the federation, signed by the attacker's own key (every S seconds)
  capture FILE    wait for the run's "finished" status and "end", keep them in FILE
  replay FILE     publish what `capture` kept, retained, into a later run

Each writes what it did to --report (JSON: counts), so a test can compare with what the aggregator counted.
"""

from __future__ import annotations

import argparse
import base64
import json
import subprocess
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import psutil
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from nefl.aggregation.nefedavg import NeFedAvg
from nefl.protocol.messages import (Announce, ClientStatus, PartialSummary, Receipt, ReceiptBatch, RoundClose, ServerStatus, Task,
                           TrainingSettings, WorkerRound, WorkerStatus)
from nefl.nested.profile import load_profile
from nefl.protocol.signing import Signer, split_signed
from nefl.nested.state import Layout
from nefl.protocol.topics import WORKER_GROUP, Topics
from nefl.protocol.wire import encode, parse_chunk


class Attacker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.t = args, Topics(args.federation)
        self.key = Signer(Ed25519PrivateKey.generate())
        self.report: dict[str, int] = {}
        self.lock = threading.Lock()
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=args.client_id, protocol=mqtt.MQTTv311)
        if args.username:
            self.c.username_pw_set(args.username, args.password)
        self.c.on_message = self.on_message
        self.ready = threading.Event()
        self.c.on_connect = lambda *a: self.ready.set()
        host, port = args.broker.rsplit("/", 1)[1].split(":")
        self.c.connect(host, int(port))
        self.c.loop_start()
        self.ready.wait(10)
        self.seen: set[tuple[str, int]] = set()

    def count(self, what: str, n: int = 1) -> None:
        with self.lock:
            self.report[what] = self.report.get(what, 0) + n
            if self.args.report:
                Path(self.args.report).write_text(json.dumps(self.report))

    def send(self, topic: str, payload: bytes, retain: bool = False) -> None:
        info = self.c.publish(topic, payload, qos=1, retain=retain)
        if threading.current_thread() is not self.c._thread:  # never wait inside paho's own callbacks
            info.wait_for_publish(10)

    def on_message(self, client, userdata, m) -> None:
        try:
            self.handle(m.topic, bytes(m.payload))
        except Exception as e:  # an attacker that dies on odd input tests nothing
            print(f"attacker: {type(e).__name__}: {e}", flush=True)

    def handle(self, topic: str, payload: bytes) -> None:
        a = self.args.attack
        if a == "silent" and payload:
            h = parse_chunk(payload).header
            if (h.client, h.round) not in self.seen:
                self.seen.add((h.client, h.round))
                self.count("updates_swallowed")
            self.count("chunks_swallowed")
        elif a == "forge-workers":
            self.forge_workers(topic, payload)
        elif a == "capture" and payload:
            self.capture(topic, payload)

    # -- attacks ----------------------------------------------------------------------------------------
    def forge_workers(self, topic: str, payload: bytes) -> None:
        t = self.t
        if payload and t.client_of(topic, "task") is not None:
            task = Task.from_json(split_signed(payload)[0])
            for worker in ("evil", *self.args.workers):
                for outcome in ("accepted", "update_norm"):
                    rc = Receipt(run=task.run, round=task.round, client=t.client_of(topic, "task"), outcome=outcome,
                                 samples=10, norm=1e-9, attributed=True)
                    self.send(t.worker(worker, "receipt"), self.key.sign(ReceiptBatch(receipts=[rc]).to_json()))
                    self.count("receipts_forged")
        elif topic == t.workers_round and payload:
            self.plan = WorkerRound.from_json(split_signed(payload)[0], 16 << 20)
        elif topic == t.workers_close and payload and getattr(self, "plan", None) is not None:
            close = RoundClose.from_json(split_signed(payload)[0])
            layout = Layout.build(load_profile(self.args.profile))
            agg = NeFedAvg(layout)
            for c, k in self.plan.assignments.items():
                agg.add(k, {n: torch.randn(s) * 1000 for n, s in layout.upload_shapes(k).items()})
            for worker in ("evil", *self.args.workers):
                msgs, header = encode(agg.partial_tensors(), kind="partial", federation=self.args.federation, round=close.round,
                              submodel=0, client=worker, chunk_bytes=1 << 18, sign=self.key.sign)
                for m in msgs:
                    self.send(t.worker(worker, "partial"), m)
                summary = PartialSummary(run=close.run, round=close.round, weights=[float(w) for w in agg.weights],
                                         updates=list(agg.updates), clients=sorted(self.plan.assignments),
                                         digest=header.digest)
                self.send(t.worker(worker, "summary"), self.key.sign(summary.to_json()))
                self.count("partials_forged")

    def flood(self, n: int) -> None:
        for i in range(n):
            me, key = f"fake{i:05d}", Signer(Ed25519PrivateKey.generate())
            self.c.publish(self.t.status(me), ClientStatus(state="online").to_json(), qos=1, retain=True)
            a = Announce(client=me, samples=100, max_submodel=5, key=key.public_text)
            last = self.c.publish(self.t.announce(me), key.sign(a.to_json()), qos=1, retain=True)
            self.count("ids_flooded")
            if i % 200 == 199:
                last.wait_for_publish(30)  # in step with the broker: the flood is about the aggregator

    def claim(self, victim: str) -> None:
        self.send(self.t.status(victim), self.key.sign(ClientStatus(state="online", seq=1).to_json()), retain=True)
        a = Announce(client=victim, samples=100, max_submodel=5, key=self.key.public_text)
        self.send(self.t.announce(victim), self.key.sign(a.to_json()), retain=True)
        self.count("ids_claimed")

    def forge_status(self) -> None:
        profile = load_profile(self.args.profile)
        layout = Layout.build(profile)
        status = ServerStatus(state="training", federation=self.args.federation, run="evilrun", round=1, rounds=99,
                              profile=profile.to_dict(), method=profile.method, profile_hash=layout.profile.hash,
                              key=self.key.public_text, time=time.time(), training=TrainingSettings(),
                              incarnation=10**6, seq=1)
        self.send(self.t.server_status, self.key.sign(status.to_json()), retain=True)
        self.count("statuses_forged")

    def capture(self, topic: str, payload: bytes) -> None:
        body = split_signed(payload)
        if body is None:
            return
        if topic == self.t.server_status and ServerStatus.from_json(body[0], 1 << 20).state == "finished":
            self.kept["status"] = base64.b64encode(payload).decode()
        elif topic == self.t.control:
            self.kept["control"] = base64.b64encode(payload).decode()
        if len(self.kept) == 2 and not self.report.get("captured"):
            Path(self.args.file).write_text(json.dumps(self.kept))
            self.count("captured")

    def replay(self) -> None:
        kept = json.loads(Path(self.args.file).read_text())
        self.send(self.t.server_status, base64.b64decode(kept["status"]), retain=True)
        self.send(self.t.control, base64.b64decode(kept["control"]), retain=True)
        self.count("replayed")

    def run(self) -> None:
        a, t = self.args.attack, self.t
        if a == "silent":
            self.c.subscribe(t.update_shared(self.args.group), qos=1)
        elif a == "forge-workers":
            self.send(t.worker("evil", "status"), self.key.sign(WorkerStatus(state="online", seq=1).to_json()), retain=True)
            self.c.subscribe([(t.task("+"), 1), (t.workers_round, 1), (t.workers_close, 1)])
        elif a == "flood":
            self.flood(self.args.n)
        elif a == "claim":
            self.claim(self.args.victim)
        elif a == "forge-status":
            self.forge_status()
            while self.args.arg:
                time.sleep(float(self.args.arg))
                self.forge_status()
        elif a == "capture":
            self.kept: dict[str, str] = {}
            self.c.subscribe([(t.server_status, 1), (t.control, 1)])
        elif a == "replay":
            self.replay()
        self.count("started", 0)
        if a in ("silent", "forge-workers", "capture"):
            while True:
                time.sleep(1)
        self.c.disconnect()
        self.c.loop_stop()


def workers_group(serve: subprocess.Popen) -> str | None:
    """The shared-subscription group `serve --workers` drew, from a worker's command line (an insider's knowledge)."""
    for child in psutil.Process(serve.pid).children():
        cmd = child.cmdline()
        if "--group" in cmd:
            return cmd[cmd.index("--group") + 1]
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("attack", choices=["silent", "forge-workers", "flood", "claim", "forge-status", "capture", "replay"])
    ap.add_argument("arg", nargs="?", default="")
    ap.add_argument("--broker", required=True)
    ap.add_argument("--federation", default="t")
    ap.add_argument("--profile", default="resnet8-fmnist-w")
    ap.add_argument("--group", default=WORKER_GROUP)
    ap.add_argument("--workers", nargs="*", default=["t-w1", "t-w2"])
    ap.add_argument("--client-id", default="evil")
    ap.add_argument("--username")
    ap.add_argument("--password")
    ap.add_argument("--report")
    args = ap.parse_args()
    args.n = int(args.arg) if args.attack == "flood" else 0
    args.victim = args.file = args.arg
    Attacker(args).run()


if __name__ == "__main__":
    main()
