"""`edge-client join`: the device side of a federation.

The paho network thread only enqueues messages; the main thread waits for a task, collects that
round's weights (retained on the broker, so a late or reconnected client still gets them), trains
the physically smaller submodel, and uploads its delta in chunks. The profile comes from the
server's retained status, so a device needs no copy of it.
"""

from __future__ import annotations

import json
import os
import platform
import queue
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import typer

from edge_client.costmodel import CostTable, calibrate, estimate_costs
from edge_client.probe import DeviceSnapshot, Prober
from edge_client.select import DeviceBudget, Selection, select_submodel
from nefl.data import BatchLoader, DatasetUnavailable, load_dataset, load_image_folder, parse_partition, partition_iid
from nefl.mqtt import QOS, BrokerSettings, make_client, parse_broker
from nefl.profile import ProfileError, parse_profile
from nefl.state import Layout
from nefl.topics import Topics, check_name
from nefl.train import TrainConfig, local_train
from nefl.wire import DEFAULT_CHUNK_BYTES, Reassembler, WireError, encode

PARTITION_SEED = 0  # every client must cut the same permutation, or partitions overlap


@dataclass
class JoinConfig:
    client_id: str
    federation: str = "default"
    dataset: str = "fashion-mnist"
    partition: str = "1/1"
    data_root: str | None = None
    data_dir: str | None = None  # the device's own images (ImageFolder layout) instead of a torchvision split
    max_samples: int | None = None
    max_submodel: int = 1
    fp16: bool = False
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    seed: int = 0
    threads: int | None = None
    memory_budget: str | None = None  # emulate a smaller device (see edge_client.select.DeviceBudget)
    cpu_budget: float | None = None
    calibrate: bool = True  # measure one training step per submodel (cached) instead of the analytic estimate


def log(cid: str, msg: str) -> None:
    print(f"[{cid} {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def device_summary(snap: DeviceSnapshot) -> dict[str, Any]:
    """What the server logs about a device, from the same probe that drives selection."""
    mb = lambda n: None if n is None else n >> 20  # noqa: E731
    return {"machine": platform.machine(), "system": platform.system(), "cpus": snap.cpu_count,
            "mem_total_mb": mb(snap.memory_total), "mem_available_mb": mb(snap.memory_available),
            "cpu_percent": snap.cpu_percent, "torch_threads": torch.get_num_threads()}


class Agent:
    def __init__(self, cfg: JoinConfig, settings: BrokerSettings) -> None:
        self.cfg, self.settings = cfg, settings
        self.topics = Topics(cfg.federation)
        self.train_set = (load_image_folder(cfg.data_dir, cfg.dataset) if cfg.data_dir
                          else load_dataset(cfg.dataset, cfg.data_root, train=True))
        index, parts = parse_partition(cfg.partition)
        self.indices = partition_iid(len(self.train_set), parts, PARTITION_SEED)[index][: cfg.max_samples]
        self.inbox: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.layout: Layout | None = None
        self.profile_hash: str | None = None
        self.last_task: tuple[str, int] = ("", 0)  # (server run id, round) of the last task taken
        self.last_upload: tuple[tuple[str, int], list[bytes]] = (("", 0), [])  # kept for a resend after a broker restart
        self.model_sub: int | None = None
        self.task: dict[str, Any] | None = None
        self.task_since = 0.0
        self.ended = False
        self.models_in = Reassembler(max_bytes=1 << 30, timeout_s=600)
        self.models: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}  # submodel -> (round, weights)
        self.budget = DeviceBudget.parse(cfg.memory_budget, cfg.cpu_budget)
        self.prober = Prober()
        self.training: dict[str, Any] = {}  # the server's batch size, local epochs and round timeout
        self.costs: CostTable | None = None
        self.selection: Selection | None = None
        self.client = make_client(settings, cfg.client_id, self.topics.status(cfg.client_id),
                                  json.dumps({"v": 1, "state": "offline"}).encode())
        self.client.on_connect = self._on_connect
        self.client.on_message = lambda c, u, m: self.inbox.put((m.topic, bytes(m.payload)))

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log(self.cfg.client_id, f"broker refused the connection: {reason_code}; check credentials")
            return
        me = self.cfg.client_id
        subs = [self.topics.task(me), self.topics.control, self.topics.server_status]
        if self.model_sub is not None:
            subs.append(self.topics.model_all(self.model_sub))
        client.subscribe([(t, QOS) for t in subs])
        client.publish(self.topics.status(me), json.dumps({"v": 1, "state": "online"}).encode(), qos=QOS, retain=True)
        log(me, f"connected to {self.settings.url}")
        if self.selection is not None:  # a reconnect; a first connect announces once the profile is planned
            self._announce()

    def _can_train(self) -> int:
        """Largest submodel (1-based) this device takes now; 0 when nothing fits."""
        return self.cfg.max_submodel if self.selection is None else (self.selection.submodel or 0)

    def _announce(self, snap: DeviceSnapshot | None = None) -> None:
        """Tell the server what this device can train now (0: nothing fits this round) and why."""
        sel, can = self.selection, self._can_train()
        snap = snap or self.budget.apply(self.prober.snapshot())
        self.client.publish(self.topics.announce(self.cfg.client_id), json.dumps({
            "v": 1, "client": self.cfg.client_id, "samples": len(self.indices), "max_submodel": can,
            "selection": "" if sel is None else sel.reason, "device": device_summary(snap), "dataset": self.cfg.dataset,
        }).encode(), qos=QOS, retain=True)
        log(self.cfg.client_id, f"announced {len(self.indices)} samples, submodel <= {can}"
                                + ("" if sel is None else f": {sel.reason}"))

    def _plan(self, deadline_s: float | None = None) -> bool:
        """Re-select from a fresh probe (the paper's dynamic setting); re-announce when it changed.
        Returns whether it announced."""
        if self.layout is None:
            return False
        batch = int(self.training.get("batch_size", TrainConfig.batch_size))
        if self.costs is None:
            self.costs = (calibrate(self.layout, batch) if self.cfg.calibrate
                          else estimate_costs(self.layout, batch, threads=torch.get_num_threads()))
        snap = self.budget.apply(self.prober.snapshot())
        sel = select_submodel(
            self.costs, snap, len(self.indices),
            int(self.training.get("local_epochs", 1)),
            deadline_s if deadline_s is not None else self.training.get("round_timeout"),
            self.cfg.max_submodel, speed=self.budget.cpu_budget,
        )
        changed = self.selection is None or sel.index != self.selection.index
        self.selection = sel
        if changed:
            self._announce(snap)
        return changed

    def run(self) -> int:
        """Handle messages and train whenever a task and its weights are both here, until the end."""
        self.client.connect_async(self.settings.host, self.settings.port, keepalive=15)
        self.client.loop_start()
        try:
            while not self.ended:
                try:
                    self.dispatch(*self.inbox.get(timeout=0.5))
                except queue.Empty:
                    pass
                self._maybe_train()
            log(self.cfg.client_id, "federation ended")
            return 0
        finally:
            self.client.publish(self.topics.status(self.cfg.client_id), json.dumps({"v": 1, "state": "offline"}).encode(),
                                qos=QOS, retain=True).wait_for_publish(5)
            self.client.disconnect()
            self.client.loop_stop()

    def dispatch(self, topic: str, payload: bytes) -> None:
        if not payload:
            return  # a retained message being cleared
        if topic == self.topics.control:
            self.ended = self._json(payload).get("event") == "end"
        elif topic == self.topics.server_status:
            self._adopt_profile(self._json(payload))
        elif topic == self.topics.task(self.cfg.client_id):
            self._take_task(self._json(payload))
        elif self.model_sub is not None and topic.startswith(self.topics.model_all(self.model_sub)[:-1]):
            try:
                done = self.models_in.feed(payload)
            except WireError as e:
                log(self.cfg.client_id, f"dropped a model chunk: {e}")
                return
            if done is None or done.header["kind"] != "model" or done.header["federation"] != self.cfg.federation:
                return
            if done.header["round"] >= self.models.get(done.header["submodel"], (0, {}))[0]:
                self.models[done.header["submodel"]] = (done.header["round"], done.tensors)

    @staticmethod
    def _json(payload: bytes) -> dict[str, Any]:
        try:
            body = json.loads(payload)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return {}
        return body if isinstance(body, dict) else {}

    def _adopt_profile(self, status: dict[str, Any]) -> None:
        if status.get("profile_hash") in (None, self.profile_hash):
            return
        try:
            layout = Layout.build(parse_profile(status["profile"]), status.get("method"))
        except (ProfileError, KeyError, TypeError, ValueError) as e:
            log(self.cfg.client_id, f"cannot use the server's profile ({e})")
            return
        self.layout, self.profile_hash = layout, layout.profile.hash
        self.training = status.get("training") if isinstance(status.get("training"), dict) else {}
        self.costs = self.selection = None
        log(self.cfg.client_id, f"profile {layout.profile.name} ({layout.num_submodels} submodels, {layout.method.name})")
        self._plan()

    def _take_task(self, task: dict[str, Any]) -> None:
        """Remember a new task and subscribe to its submodel's (retained) weights."""
        try:
            r, k = int(task["round"]), int(task["submodel"])
            float(task["lr"]), int(task["epochs"]), float(task.get("deadline_s", 600))
        except (KeyError, TypeError, ValueError):
            log(self.cfg.client_id, f"ignoring malformed task {task}")
            return
        key = (str(task.get("run")), r)
        if key == self.last_task and self.last_upload[0] == key:
            # the task is still open after a reconnect: the broker may have lost our upload in a restart;
            # resending is safe, the server drops chunks it already has
            for m in self.last_upload[1]:
                self.client.publish(self.topics.update(self.cfg.client_id), m, qos=QOS)
            log(self.cfg.client_id, f"round {r}: task redelivered, resent the update")
            return
        if key == self.last_task or (key[0] == self.last_task[0] and r < self.last_task[1]):
            return  # a retained task seen again after a reconnect
        announced = self._plan(float(task.get("deadline_s", 600)))
        if not 0 <= k < self._can_train():
            sel = self.selection
            why = f"--max-submodel {self.cfg.max_submodel}" if sel is None else sel.reason
            log(self.cfg.client_id, f"refusing round {r}: submodel {k + 1} does not fit now ({why})")
            self.last_task = key
            if not announced:  # the server stops waiting for this client once it hears
                self._announce()
            return
        self.task, self.task_since = task, time.monotonic()
        self.models_in.discard_rounds_before(r)
        if self.model_sub != k:
            if self.model_sub is not None:
                self.client.unsubscribe(self.topics.model_all(self.model_sub))
            self.model_sub = k
            self.client.subscribe(self.topics.model_all(k), qos=QOS)

    def _maybe_train(self) -> None:
        task = self.task
        if task is None:
            return
        r, k = int(task["round"]), int(task["submodel"])
        if time.monotonic() - self.task_since > float(task.get("deadline_s", 600)):
            log(self.cfg.client_id, f"round {r}: weights or profile did not arrive before the deadline; skipping")
            self.task, self.last_task = None, (str(task.get("run")), r)
            return
        have_round, start = self.models.get(k, (0, None))
        if have_round != r or self.layout is None or task.get("profile_hash") != self.profile_hash:
            return
        self.task, self.last_task = None, (str(task.get("run")), r)
        self._train_and_upload(r, k, float(task["lr"]), int(task["epochs"]), int(task.get("batch_size", 32)), start)

    def _train_and_upload(self, r: int, k: int, lr: float, epochs: int, batch: int, start: dict[str, torch.Tensor]) -> None:
        me = self.cfg.client_id
        torch.manual_seed(self.cfg.seed + r)
        model = self.layout.module(k)
        loader = BatchLoader(self.train_set, self.indices, batch, True, True, self.cfg.seed * 100003 + r)
        try:
            res = local_train(model, start, loader, epochs, lr, TrainConfig(lr=lr, batch_size=batch),
                              upload=self.layout.upload_shapes(k))
        except ValueError as e:  # weights that do not fit the submodel: a server/profile mismatch
            log(me, f"round {r}: cannot train submodel {k + 1}: {e}")
            return
        time.sleep(self.budget.padding(res.seconds))  # --cpu-budget: really run as the slower device
        why = {"selection": self.selection.reason} if self.selection else {}
        msgs = encode(res.delta, kind="update", federation=self.cfg.federation, round=r, submodel=k, client=me,
                      dtype="fp16" if self.cfg.fp16 else "fp32", samples=res.num_samples,
                      metrics={"loss": round(res.loss, 4), "train_acc": round(res.accuracy, 4), "train_s": round(res.seconds, 2),
                               **why},
                      chunk_bytes=self.cfg.chunk_bytes)
        for m in msgs:
            self.client.publish(self.topics.update(me), m, qos=QOS)
        self.last_upload = (self.last_task, msgs)
        log(me, f"round {r}: trained submodel {k + 1} on {res.num_samples} samples in {res.seconds:.1f}s "
                f"(loss {res.loss:.3f}), uploading {sum(map(len, msgs))} bytes in {len(msgs)} chunks")
        self._plan()  # the next round's choice, from the device's state now


def join_command(
    broker: str = typer.Option(..., help="mqtt://HOST:PORT or mqtts://HOST:PORT of the federation's broker."),
    client_id: str = typer.Option(None, help="Unique id (letters, digits, _ . -) [default: edge-HOSTNAME-PID]."),
    federation: str = typer.Option("default", help="Federation name (topic prefix nefl/NAME/)."),
    dataset: str = typer.Option("fashion-mnist", help="Training dataset."),
    partition: str = typer.Option("1/1", help="This client's IID shard I/N of the training split."),
    data_root: str = typer.Option(None, help="Dataset directory (default $NEFL_DATA_ROOT or ~/.cache/nefl/data)."),
    data_dir: str = typer.Option(None, help="Train on this folder of images instead (DIR/CLASS/IMAGE.png, "
                                 "converted to --dataset's shape); --partition still shards it."),
    max_samples: int = typer.Option(None, min=1, help="Use at most N samples of the shard (quick tests, demos)."),
    max_submodel: int = typer.Option(1000, min=1, help="Cap on the submodel (1-based) this device trains; "
                                     "below it, each round picks the largest that fits memory and deadline."),
    memory_budget: str = typer.Option(None, help="Emulate a device with this much free memory, e.g. 300MB."),
    cpu_budget: float = typer.Option(None, help="Emulate a device this fraction as fast, e.g. 0.5."),
    calibrate_costs: bool = typer.Option(True, "--calibrate/--no-calibrate",
                                         help="Measure one training step per submodel (cached) or use the analytic estimate."),
    fp16: bool = typer.Option(False, help="Upload deltas as fp16 (half the bytes)."),
    chunk_kib: int = typer.Option(DEFAULT_CHUNK_BYTES // 1024, min=8, help="Largest MQTT message this client sends, KiB."),
    username: str = typer.Option(None, envvar="NEFL_MQTT_USERNAME", help="Broker user (env NEFL_MQTT_USERNAME)."),
    password: str = typer.Option(None, envvar="NEFL_MQTT_PASSWORD", help="Broker password (env NEFL_MQTT_PASSWORD)."),
    ca_cert: str = typer.Option(None, help="CA certificate (PEM) to verify an mqtts:// broker."),
    certfile: str = typer.Option(None, help="Client certificate (PEM) for mutual TLS."),
    keyfile: str = typer.Option(None, help="Key of --certfile."),
    threads: int = typer.Option(None, min=1, help="torch CPU threads [default: torch's choice]."),
    seed: int = typer.Option(0, help="Seed of local shuffling and augmentation."),
) -> None:
    """Join a federation: announce, train assigned submodels, upload deltas until the federation ends."""
    cid = client_id or f"edge-{socket.gethostname()}-{os.getpid()}"
    try:
        check_name("client id", cid)
        settings = parse_broker(broker, username, password, ca_cert, certfile, keyfile)
        parse_partition(partition)
        agent = Agent(JoinConfig(cid, federation, dataset, partition, data_root, data_dir, max_samples, max_submodel, fp16,
                                 chunk_kib * 1024, seed, threads, memory_budget, cpu_budget, calibrate_costs), settings)
    except (ValueError, DatasetUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
    if threads:
        torch.set_num_threads(threads)
    try:
        raise typer.Exit(agent.run())
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
