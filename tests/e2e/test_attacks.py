"""The attacks of the hardening issue, replayed against real processes on mosquitto.

One participant ("raw") turns hostile: small messages that used to end the aggregator (retained,
so they also hit every restart), a poisoned but finite update, a flood of chunk sets, and, where
the broker lets it (no ACL), forged server messages aimed at the honest devices. The federation
must keep going: the aggregator and the devices keep running, every round completes for the honest
clients, the global state stays finite and bounded, and each rejection is counted in the round's
metrics. Run anonymous and under the password file + ACL of docs/security.md.
"""

from __future__ import annotations

import json
import struct
import queue
import subprocess

import paho.mqtt.client as mqtt
import pytest
import torch

from nefl.nested.checkpoint import load_checkpoint
from nefl.nested.profile import load_profile
from nefl.nested.state import Layout
from nefl.protocol.topics import Topics
from nefl.protocol.wire import encode, split_chunk
from tests.harness.broker_acl import ACL, PASSWORD
from tests.harness.procs import (PROFILE, Procs, client_args, finish, free_port, metrics, needs_mosquitto,
                                   serve_args, wait_for)

pytestmark = pytest.mark.slow  # every test here runs a real broker, aggregator and devices

T = Topics("t")
KILLERS = [  # each one ended the aggregator (or, retained, every restart of it) before the strict loader
    b'{"v":2,"samples":1,"max_submodel":Infinity}',
    b'{"v":2,"type":"announce","client":"raw","samples":1,"max_submodel":' + b"9" * 5000 + b"}",
    b"[" * 2000 + b"]" * 2000,
]
NESTED_HEADER = b"NEFL\x02\x00\x0f\xa0\x00\x00\x00\x00" + b"[" * 2000 + b"]" * 2000


class Attacker:
    """A participant under its own (authenticated) id that sends whatever it likes."""

    def __init__(self, port: int, acl: bool) -> None:
        self.tasks: queue.Queue[bytes] = queue.Queue()
        self.overheard: list[bytes] = []  # c1's update chunks, where the broker lets anyone read them
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="raw", protocol=mqtt.MQTTv311)
        if acl:
            self.c.username_pw_set("raw", PASSWORD)
        self.c.on_message = self._on_message
        self.c.connect("127.0.0.1", port)
        self.c.loop_start()
        self.c.subscribe(T.task("raw"), qos=1)
        self.c.subscribe(T.update("c1"), qos=1)
        self.send(T.status("raw"), b'{"v":2,"type":"client_status","state":"online"}', retain=True)
        self.send(T.announce("raw"), b'{"v":2,"type":"announce","client":"raw","samples":10,"max_submodel":1}', retain=True)

    def _on_message(self, client, userdata, m) -> None:
        if m.payload and m.topic == T.task("raw"):
            self.tasks.put(bytes(m.payload))
        elif m.payload:
            self.overheard.append(bytes(m.payload))

    def send(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.c.publish(topic, payload, qos=1, retain=retain).wait_for_publish(10)

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def update(layout: Layout, task: dict, value: float, **kw) -> list[bytes]:
    shapes = layout.upload_shapes(task["submodel"])
    args = dict(kind="update", federation="t", round=task["round"], submodel=task["submodel"], client="raw",
                samples=10, chunk_bytes=1 << 22)
    return encode({n: torch.full(s, value) for n, s in shapes.items()}, **{**args, **kw}).messages


def broker_setup(procs: Procs, port: int, acl: bool) -> tuple[list[str], dict[str, list[str]]]:
    """Start mosquitto; the aggregator's broker args and each client's credential args."""
    users = ("aggregator", "c1", "c2", "raw")
    if not acl:
        procs.mosquitto(port)
        return ["--broker", f"mqtt://127.0.0.1:{port}"], {u: [] for u in users}
    passwd, acl_file = procs.tmp / "passwd", procs.tmp / "acl"
    for i, u in enumerate(users):
        subprocess.run(["mosquitto_passwd", "-b", *([] if i else ["-c"]), str(passwd), u, PASSWORD], check=True,
                       capture_output=True)
    acl_file.write_text(ACL)
    procs.mosquitto(port, f"allow_anonymous false\npassword_file {passwd}\nacl_file {acl_file}")
    creds = {u: ["--username", u, "--password", PASSWORD] for u in users}
    return ["--broker", f"mqtt://127.0.0.1:{port}", *creds["aggregator"]], creds


@needs_mosquitto
@pytest.mark.timeout(600)
@pytest.mark.parametrize("acl", [pytest.param(False, marks=pytest.mark.extended), True], ids=["anonymous", "acl"])
def test_one_device_cannot_stop_or_spoil_the_federation(procs, tmp_path, acl):
    port = free_port()
    agg_broker, creds = broker_setup(procs, port, acl)
    args = serve_args(agg_broker, 2, 20, per_round=3)
    procs.aggregator("agg", args)
    url = f"mqtt://127.0.0.1:{port}"
    for i in (1, 2):
        procs.client(f"c{i}", url, [*client_args(i, 64, i), *creds[f"c{i}"]])
    raw = Attacker(port, acl)
    task = json.loads(raw.tasks.get(timeout=120))
    layout = Layout.build(load_profile(PROFILE))

    # 1. small messages that ended the aggregator, retained where they would hit every restart
    for payload in KILLERS:
        raw.send(T.announce("raw"), payload)
        raw.send(T.status("raw"), payload, retain=True)
    raw.send(T.update("raw"), NESTED_HEADER, retain=True)
    # 2. a finite update that would spoil the model, and one whose sum overflows float32
    raw.send(T.update("raw"), update(layout, task, 1e30)[0])
    raw.send(T.update("raw"), update(layout, task, 3e38)[0])
    # 3. a flood of first chunks: only this client's own share of pending chunk sets fills up
    for i in range(64):
        raw.send(T.update("raw"), update(layout, task, float(i), chunk_bytes=16 << 10)[0])
    wait_for(lambda: all(f"round {r}: update from c{i}" in procs.log("agg") for i in (1, 2)
                         for r in [task["round"]]), 60, "the honest updates despite the flood")
    # 5. without an ACL anyone is anyone: c1's own update, overheard and re-wrapped into the next round
    if not acl:
        wait_for(lambda: raw.overheard, 30, "c1's update to be overheard")
        head, index, proof, data = split_chunk(raw.overheard[0])
        moved = head.replace(f'"round":{task["round"]}'.encode(), f'"round":{task["round"] + 1}'.encode())
        raw.send(T.update("c1"), struct.pack(">4sBBHI", b"NEFL", 2, len(proof) // 32, len(moved), index) + moved
                 + bytes(proof) + bytes(data))
    # ... and at the devices, where the broker lets it through (without an ACL anyone is anyone): a forged end,
    # nested JSON, a forged task, and forged weights retained where the server never overwrites them
    raw.send(T.control, b'{"v":2,"type":"control","federation":"t","run":"x","event":"end"}', retain=True)
    raw.send(T.control, b"[" * 2000 + b"]" * 2000)
    raw.send(T.task("c1"), json.dumps({**task, "epochs": 10**6, "batch_size": 0}).encode(), retain=True)
    poison_model = encode({n: torch.full(s, 1e30) for n, s in layout.sub_shapes[0].items()}, kind="model",
                          federation="t", round=task["round"] + 1, submodel=0, client="server", chunk_bytes=16 << 10).messages
    raw.send(T.model_chunk(0, 7), poison_model[1], retain=True)
    raw.send(T.status("raw"), b'{"v":2,"type":"client_status","state":"offline"}')  # not picked again
    raw.close()

    finish(procs, "agg", 300)
    m = metrics(tmp_path)
    r = task["round"]
    for rnd in (1, 2):  # the honest clients were heard every round
        assert {"c1", "c2"} <= set(m[rnd]["reported"]), m[rnd]
    rejected = m[r]["rejected"]
    for reason in ("malformed_json", "invalid_announce", "too_deep", "update_norm", "too_many_pending",
                   *(() if acl else ("bad_signature",))):  # the re-wrapped update fails c1's pinned key
        assert rejected.get(reason, 0) >= 1, (reason, rejected)
    assert "internal_error" not in json.dumps(m)
    state = load_checkpoint(tmp_path / "run").state.flat()
    assert all(bool(torch.isfinite(t).all()) and float(t.abs().max()) < 1e4 for t in state.values())
    for i in (1, 2):
        finish(procs, f"c{i}", 30)  # each saw the real, signed end (and not the forged one)
        log = procs.log(f"c{i}")
        assert "internal_error" not in log
        if not acl:
            assert "dropped a message (unsigned" in log

    # the retained hostile messages are still on the broker: a resumed aggregator shrugs them off
    procs.aggregator("agg2", [*serve_args(agg_broker, 3, 20, per_round=3), "--resume"])
    wait_for(lambda: "resuming federation" in procs.log("agg2"), 60, "the resumed aggregator")
    for i in (1, 2):
        procs.client(f"c{i}", url, [*client_args(i, 64, i), *creds[f"c{i}"]])
    finish(procs, "agg2", 240)
    m = metrics(tmp_path)
    assert {"c1", "c2"} <= set(m[3]["reported"])
    assert m[3]["rejected"].get("too_deep", 0) >= 1  # the retained nested status and update header, counted
