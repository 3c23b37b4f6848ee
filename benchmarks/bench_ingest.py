"""Where an aggregator worker's CPU goes per MiB of update it ingests: the whole path in one process,
profiled, plus the MQTT client's receive path and the hash and chunk-size choices behind the wire format.

Part 1 feeds signed update messages, as `aggregator loadtest` devices send them, through a real
`aggregator.worker.Worker` (`route`: the trust boundary, intake with every check on, the centre check,
NeFedAvg, receipts and logging; no broker) under cProfile, and groups the time by what it is for.
Part 2 runs paho's receive loop (what `nefl.protocol.mqtt.Connection` uses) and the alternatives on the
package index against a real mosquitto and measures the client's CPU per MiB received.
Part 3 measures hashes and chunk sizes. Writes the "Ingest profile" section of docs/benchmarks.md.

    PYTHONPATH=. python benchmarks/bench_ingest.py            # `make bench-ingest`
    PYTHONPATH=. python benchmarks/bench_ingest.py --quick    # a smoke run, to runs/
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import logging
import os
import pstats
import re
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402

from aggregator.broker import MosquittoBroker  # noqa: E402
from aggregator.federation import Federation  # noqa: E402
from aggregator.loadtest import device_delta  # noqa: E402
from aggregator.partials import plan_bound, plan_screen  # noqa: E402
from aggregator.worker import Worker, WorkerConfig  # noqa: E402
from benchmarks.provenance import ROOT, commit_label, cpu_name, load_average, replace_section  # noqa: E402
from nefl.aggregation.robust import reference_norm  # noqa: E402
from nefl.aggregation.centre_check import Screened  # noqa: E402
from nefl.nested.profile import load_profile  # noqa: E402
from nefl.nested.state import GlobalState, Layout  # noqa: E402
from nefl.protocol.messages import DEFAULT_CHUNK_BYTES, WorkerRound  # noqa: E402
from nefl.protocol.mqtt import BrokerSettings, Connection, parse_broker  # noqa: E402
from nefl.protocol.signing import Signer  # noqa: E402
from nefl.protocol.topics import Topics  # noqa: E402
from nefl.protocol.wire import encode  # noqa: E402
from nefl.support.heap import keep_freed_memory  # noqa: E402
from nefl.support.threads import one_per_process  # noqa: E402

SECTION = "## Ingest profile"
BEFORE = "58229f7"  # the last commit of wire version 1
FEDERATION = "b"

# what each function's own time is for; the first pattern that matches (file:function) wins
CATEGORIES: list[tuple[str, str]] = [
    ("signature (Ed25519)", r"ed25519|crypto_sign_open|signing\.py:(verify|split_signed)|b64decode|binascii"),
    ("hash", r"_hashlib|blake3|wire\.py:.*(digest|leaf|root|proof)"),
    ("header parse", r"messages\.py|msgspec|wire\.py:(parse_chunk|split_chunk|_parse)"),
    ("safetensors decode + finite", r"safetensors|tensors\.py:(all_finite|first_non_finite)|wire\.py:(decode_payload|_tensors)|"
                                    r"frombuffer|isfinite"),
    ("norm bound", r"robust\.py|tensors\.py:(l2_norm|norm)$"),
    ("centre check (sketch, direction vote)", r"(centre_check|coverage)\.py"),
    ("shapes + NeFedAvg sum", r"aggregate\.py|_foreach"),
    ("reassembly + copies", r"wire\.py|bytes.join|method 'join'|bytearray|memoryview"),
    ("receipts (encode + publish)", r"worker\.py:(\w+\.)?(receipt|send_receipts|publish_up)|signing\.py:sign|"
                                    r"crypto_sign\.py:crypto_sign$|crypto_sign>|paho|threading|queue"),
    ("logging", r"logging|logs\.py"),
    ("routing + checks (Python)", r"worker\.py|intake\.py|federation\.py|topics\.py"),
]


def category(key: tuple[str, int, str]) -> str | None:
    text = f"{Path(key[0]).name}:{key[2]}"
    return next((name for name, pattern in CATEGORIES if re.search(pattern, text)), None)


def attribute(stats: pstats.Stats) -> dict[str, float]:
    """Seconds per category: a function's own time goes to its category; a torch or builtin call that
    names none (a norm, a sum, a sort) goes to its callers' categories, split by the time each caller spent in it."""
    parts: dict[str, float] = {}

    def add(name: str | None, seconds: float) -> None:
        name = name or "other (interpreter)"
        parts[name] = parts.get(name, 0.0) + seconds

    for key, (_, _, tt, _, callers) in stats.stats.items():
        own = category(key)
        if own is not None or not callers:
            add(own, tt)
            continue
        edge_total = sum(edge[2] for edge in callers.values()) or 1.0
        for caller, edge in callers.items():
            add(category(caller), tt * edge[2] / edge_total)
    return parts


def plan_for(layout: Layout, profile_name: str, assignments: dict[str, int], keys: dict[str, str], chunk_bytes: int) -> bytes:
    """The signed round plan a coordinator would publish for these devices (fresh weights)."""
    state = GlobalState.init(layout, 0)
    fed = Federation(layout, state, FEDERATION, len(assignments), 1, 600.0)
    plan = WorkerRound(federation=FEDERATION, run="bench", round=1, profile=load_profile(profile_name).to_dict(),
                       profile_hash=layout.profile.hash, assignments=assignments, keys=keys,
                       references=[reference_norm(state, layout, k) for k in range(layout.num_submodels)],
                       norms=[[] for _ in range(layout.num_submodels)], bound=plan_bound(fed.robustness.bound),
                       screen=plan_screen(fed.robustness.aggregation), deadline_s=600.0, max_update_bytes=64 << 20,
                       chunk_bytes=chunk_bytes)
    return plan.to_json()


def signed_updates(layout: Layout, devices: int, chunk_bytes: int, submodel: int | None) -> tuple[list, dict, dict]:
    """(topic, message) of one round of `devices` signed updates, their assignments and device keys."""
    names = [f"sim{i:05d}" for i in range(devices)]
    signers = {c: Signer(Ed25519PrivateKey.generate()) for c in names}
    assignments = {c: (submodel if submodel is not None else i % layout.num_submodels) for i, c in enumerate(names)}
    topics = Topics(FEDERATION)
    messages = []
    for c in names:
        k = assignments[c]
        msgs = encode(device_delta(layout, k, c, 1, pool=8), kind="update", federation=FEDERATION, round=1, submodel=k,
                      client=c, samples=100, chunk_bytes=chunk_bytes, sign=signers[c].sign).messages
        messages += [(topics.update(c), m) for m in msgs]
    return messages, assignments, {c: s.public_text for c, s in signers.items()}


def ingest(profile_name: str, layout: Layout, messages: list, assignments: dict, keys: dict, chunk_bytes: int,
           prof: cProfile.Profile | None) -> float:
    """Thread CPU seconds of a fresh Worker taking every message (every check on), and the centre check's end."""
    w = Worker(WorkerConfig(FEDERATION, "w1", shared=False), parse_broker("mqtt://127.0.0.1:1"),
               Signer(Ed25519PrivateKey.generate()))
    w.on_plan(plan_for(layout, profile_name, assignments, keys, chunk_bytes))
    messages = [(topic, bytearray(m)) for topic, m in messages]  # as nefl.protocol.paho_fast.FastClient hands them on: writable, decoded in place
    t0 = time.thread_time()
    if prof is not None:
        prof.enable()
    for topic, m in messages:
        w.route(w.up, topic, m)
    w.fed.agg.partial()  # the centre check judges what it still holds
    if prof is not None:
        prof.disable()
    cpu = time.thread_time() - t0
    if len(w.fed.round.received) != len(assignments):
        raise RuntimeError(f"only {len(w.fed.round.received)} of {len(assignments)} updates accepted: the benchmark's "
                           "updates must pass every check")
    return cpu


def worker_profile(profile_name: str, devices: int, chunk_bytes: int, submodel: int | None = None, repeats: int = 3) -> dict:
    """CPU per MiB of a Worker taking `devices` signed updates (one round), every check on: the best of
    `repeats` clean runs, then one under cProfile whose shares are scaled to the clean figure."""
    layout = Layout.build(load_profile(profile_name))
    messages, assignments, keys = signed_updates(layout, devices, chunk_bytes, submodel)
    mib = sum(len(m) for _, m in messages) / 2**20
    cpu = min(ingest(profile_name, layout, messages, assignments, keys, chunk_bytes, None) for _ in range(repeats))
    prof = cProfile.Profile(time.thread_time)  # CPU, not wall: on a loaded machine the wall clock counts others' turns
    ingest(profile_name, layout, messages, assignments, keys, chunk_bytes, prof)
    parts = attribute(pstats.Stats(prof))
    scale = cpu / sum(parts.values())  # the profiler's overhead spread evenly: the parts add up to the clean CPU
    return {"profile": profile_name, "devices": devices, "chunk_bytes": chunk_bytes, "messages": len(messages), "mib": mib,
            "cpu_s": cpu, "ms_per_mib": cpu * 1000 / mib,
            "parts_ms_per_mib": {k: v * scale * 1000 / mib for k, v in sorted(parts.items(), key=lambda kv: -kv[1])}}


PUBLISHER = """
import sys, time, paho.mqtt.client as mqtt
port, n, size, rate = (int(x) for x in sys.argv[1:5])
c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="bench-pub")
c.max_inflight_messages_set(20)
c.connect("127.0.0.1", port)
c.loop_start()
body = bytes(range(256)) * (size // 256)
last, t0 = None, time.monotonic()
for i in range(n):
    last = c.publish("bench/x", body, qos=1)
    if rate:  # paced: the receiver keeps up and its socket holds a few KiB at a time, as under a live fleet
        time.sleep(max(0.0, t0 + (i + 1) * size / (rate << 20) - time.monotonic()))
last.wait_for_publish(120)
c.disconnect()
c.loop_stop()
"""


def receive_paho(port: int, n: int, ready: Callable[[], None]) -> int:
    """nefl.protocol.mqtt.Connection as the server and workers use it: paho's network thread, the inbox, the main thread."""
    conn = Connection(BrokerSettings("127.0.0.1", port), "bench-sub", None, b"", logging.getLogger("bench"))
    conn.start()
    while not conn.just_connected():
        time.sleep(0.01)
    conn.client.subscribe("bench/x", qos=1)
    time.sleep(0.3)
    ready()
    got = nbytes = 0
    while got < n:
        _, payload = conn.inbox.get(timeout=60)
        got, nbytes = got + 1, nbytes + len(payload)
    conn.stop()
    return nbytes


def receive_gmqtt(port: int, n: int, ready: Callable[[], None]) -> int:
    import asyncio

    import gmqtt

    async def main() -> int:
        done, seen = asyncio.Event(), [0, 0]

        def on_message(client, topic, payload, qos, properties):
            seen[0] += 1
            seen[1] += len(payload)
            if seen[0] >= n:
                done.set()
            return 0

        c = gmqtt.Client("bench-sub")
        c.on_message = on_message
        await c.connect("127.0.0.1", port, version=gmqtt.constants.MQTTv311)
        c.subscribe("bench/x", qos=1)
        await asyncio.sleep(0.3)
        ready()
        await asyncio.wait_for(done.wait(), 120)
        await c.disconnect()
        return seen[1]

    return asyncio.run(main())


def receive_aiomqtt(port: int, n: int, ready: Callable[[], None]) -> int:
    import asyncio

    import aiomqtt

    async def main() -> int:
        got = nbytes = 0
        async with aiomqtt.Client("127.0.0.1", port, identifier="bench-sub") as c:
            await c.subscribe("bench/x", qos=1)
            await asyncio.sleep(0.3)
            ready()
            async for m in c.messages:
                got, nbytes = got + 1, nbytes + len(m.payload)
                if got >= n:
                    break
        return nbytes

    return asyncio.run(main())


RECEIVERS = {"paho-mqtt 2.x (nefl.protocol.mqtt.Connection)": receive_paho, "gmqtt": receive_gmqtt, "aiomqtt": receive_aiomqtt}


PACED_MIB_S = 50  # about the update stream of the fleet load test on this machine (docs/benchmarks.md, fleet load test)


def receive_path(total_mib: int, sizes: list[int]) -> list[dict]:
    """CPU per MiB of each MQTT client receiving `total_mib` MiB from mosquitto in messages of each size
    (QoS 1, one publisher in another process), and of mosquitto forwarding it, from the same runs: as fast as
    the publisher can (bursts: the receiver's socket fills), then paced at PACED_MIB_S (paho's two readers only)."""
    out = []
    broker = MosquittoBroker("127.0.0.1", 0)
    broker.start()
    try:
        mosq = psutil.Process(broker.proc.pid)
        runs = [(size, 0, name) for size in sizes for name in RECEIVERS]
        runs += [(size, PACED_MIB_S, name) for size in sizes for name in RECEIVERS if name.startswith("paho")]
        for size, rate, name in runs:
            receive = RECEIVERS[name]
            n = max(4, ((total_mib // 4 if rate else total_mib) << 20) // size)
            marks: dict[str, float] = {}

            def ready() -> None:
                marks["cpu"], marks["broker"] = process_cpu(), sum(mosq.cpu_times()[:2])
                marks["pub"] = subprocess.Popen([sys.executable, "-c", PUBLISHER, str(broker.port), str(n), str(size),
                                                 str(rate)])

            try:
                nbytes = receive(broker.port, n, ready)
            except ImportError:
                continue
            cpu, broker_cpu = process_cpu() - marks["cpu"], sum(mosq.cpu_times()[:2]) - marks["broker"]
            marks["pub"].wait(60)
            mib = nbytes / 2**20
            out.append({"client": name, "message_kib": size // 1024, "paced_mib_s": rate, "mib": mib,
                        "client_ms_per_mib": cpu * 1000 / mib,
                        "mosquitto_ms_per_mib": broker_cpu * 1000 / mib})
            print(json.dumps(out[-1]), flush=True)
    finally:
        broker.stop()
    return out


def process_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def clean_cpu(fn, repeats: int = 3) -> float:
    """Best thread CPU seconds of fn() over repeats (no profiler)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return best


def hashes(mib: int = 8) -> dict[str, float]:
    """ms of one thread per MiB for each candidate hash."""
    data = os.urandom(mib << 20)
    out = {"sha256 (hashlib, OpenSSL)": clean_cpu(lambda: hashlib.sha256(data).digest(), 5) * 1000 / mib,
           "blake2b (hashlib)": clean_cpu(lambda: hashlib.blake2b(data).digest(), 5) * 1000 / mib}
    try:
        import blake3

        out["blake3 (blake3-py)"] = clean_cpu(lambda: blake3.blake3(data).digest(), 5) * 1000 / mib
    except ImportError:
        pass
    return out


def stock_paho(port: int, n: int, ready: Callable[[], None]) -> int:
    """The same Connection with paho's own reader and PUBLISH decoder (the allocations and copies nefl.protocol.paho_fast.FastClient saves)."""
    import paho.mqtt.client as mqtt

    from nefl.protocol.paho_fast import FastClient
    fast = FastClient._handle_publish, FastClient._packet_read
    FastClient._handle_publish, FastClient._packet_read = mqtt.Client._handle_publish, mqtt.Client._packet_read
    try:
        return receive_paho(port, n, ready)
    finally:
        FastClient._handle_publish, FastClient._packet_read = fast


RECEIVERS["paho-mqtt 2.x, its own reader and PUBLISH decoder"] = stock_paho


def old_wire():
    """nefl/protocol/wire.py as it was before this change (wire version 1), loaded from git."""
    import types

    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{BEFORE}:nefl/protocol/wire.py"], capture_output=True, text=True,
                         check=True).stdout
    module = sys.modules["wire_v1"] = types.ModuleType("wire_v1")
    exec(compile(src, "wire_v1.py", "exec"), module.__dict__)
    return module


def device_upload(profile_name: str = "resnet18-cifar10-wd", k: int = 4) -> list[dict]:
    """A device's CPU to encode, hash, sign and frame one update (256 KiB chunks), before and after."""
    from nefl.protocol import wire
    layout = Layout.build(load_profile(profile_name))
    delta = device_delta(layout, k, "d", 1)
    signer = Signer(Ed25519PrivateKey.generate())
    out = []
    for name, module in (("wire v1: sha256, a signature per chunk", old_wire()), ("wire v2: BLAKE3 tree, one signature", wire)):
        calls = []

        def sign(head: bytes) -> bytes:
            calls.append(1)
            return signer.sign(head)

        msgs = module.encode(delta, kind="update", federation="f", round=1, submodel=k, client="d", chunk_bytes=256 << 10,
                             sign=sign)
        msgs = msgs if isinstance(msgs, list) else msgs.messages  # wire v1's encode returns the messages alone
        mib = sum(map(len, msgs)) / 2**20
        cpu = clean_cpu(lambda: module.encode(delta, kind="update", federation="f", round=1, submodel=k, client="d",
                                              chunk_bytes=256 << 10, sign=signer.sign))
        out.append({"wire": name, "mib": mib, "messages": len(msgs), "signatures": len(calls), "ms_per_mib": cpu * 1000 / mib})
        print(json.dumps(out[-1]), flush=True)
    return out


SPY_EXTRA = [("MQTT client thread (paho: receive, and sending partials and receipts)", r"paho/|nefl/protocol/mqtt\.py|socket\.py|selectors|ssl\.py"),
             ("waiting for messages (inbox, sleep)", r"queue\.py|threading\.py:.*wait|time\.sleep|step \(aggregator/worker"),
             ("checkpoint, model publish, evaluation (per round)", r"checkpoint\.py|save_checkpoint|state\.py|encode_tensors|"
                                                                  r"extract|fsio")]


def spy_summary(path: Path) -> dict[str, float]:
    """Shares of a py-spy raw profile (`py-spy record --format raw`), by the deepest frame that names a
    category: the same categories as the in-process profile, plus the receive thread and waiting."""
    shares: dict[str, float] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = [f for f in stack.split(";") if f]
        name = "start-up (imports)" if any("_find_and_load" in f for f in frames) else \
            next((c for f in reversed(frames) for c, pattern in [*SPY_EXTRA, *CATEGORIES] if re.search(pattern, spy_key(f))),
                 "other (interpreter)")
        shares[name] = shares.get(name, 0) + int(n)
        total += int(n)
    return {k: v / max(1, total) for k, v in sorted(shares.items(), key=lambda kv: -kv[1])}


def spy_key(frame: str) -> str:
    """'func (path/file.py:line)' as 'file.py:func' (and the path), for the category patterns."""
    m = re.match(r"(.*) \((.*):\d+\)$", frame)
    return f"{Path(m.group(2)).name}:{m.group(1)} {m.group(2)}" if m else frame


def window_note(worker: list[dict]) -> str:
    """What a round's size does to the per-MiB cost: the centre check compares each arrival with up to
    `Screened.compare` earlier sketches, while each round's fixed costs fall on fewer bytes in a small one."""
    rows = sorted((r for r in worker if r["profile"] == "resnet20-fmnist-w" and r["chunk_bytes"] == DEFAULT_CHUNK_BYTES),
                  key=lambda r: r["devices"])
    small, big = rows[0], rows[-1]
    centre = "centre check (sketch, direction vote)"
    return (f"A round's size: {big['devices']} resnet20 updates (the fleet load test's round) cost {big['ms_per_mib']:.2f} ms "
            f"per MiB, of which the centre check {big['parts_ms_per_mib'].get(centre, 0):.2f} (each update is compared with up "
            f"to {Screened.compare} earlier ones of its round, scored in batches), against {small['ms_per_mib']:.2f} and "
            f"{small['parts_ms_per_mib'].get(centre, 0):.2f} for {small['devices']}, where each round's own costs (a fresh "
            "worker's plan, the sketch's sample and positions, the partial) fall on a tenth of the bytes.")


def report(data: dict, command: str) -> list[str]:
    """The "Ingest profile" section."""
    prov = data["provenance"]
    lines = [SECTION, "", "Every number in this section comes from one run of", "", f"    {command}", "",
             "(`make bench-ingest`) on this machine:", "", f"- CPU: {prov['cpu']}, {os.cpu_count()} logical cores, shared "
             "with other work (CPU time is measured, not wall time; contention for the cores' caches still inflates it "
             "under load, so compare figures of one run, or runs at a similar load)",
             f"- {prov['date']}, commit {prov['commit']}", f"- load average at the end of the run: {prov['load']}", "",
             "**The worker's whole path, in one process.** A real `aggregator.worker.Worker` takes one round of signed "
             "updates as `aggregator loadtest` devices send them (`route`: the trust boundary, aggregator/intake.py with "
             "every check on, the centre check, NeFedAvg, receipts and logging; the broker replaced by a list), best of 3 "
             "in thread CPU time, then once under cProfile (timed by thread CPU time): each function's own time goes to "
             "what it is for (a torch or builtin call to its callers' share), scaled to the clean total. ms of CPU per "
             "MiB of messages:", ""]
    cats = sorted({c for r in data["worker"] for c in r["parts_ms_per_mib"]},
                  key=lambda c: -max(r["parts_ms_per_mib"].get(c, 0) for r in data["worker"]))
    cols = [f"{r['profile']}, {r['devices']} updates of {r['mib'] / r['devices']:.2f} MiB, {r['chunk_bytes'] >> 10} KiB chunks"
            for r in data["worker"]]
    lines += ["| ms per MiB | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for c in cats:
        lines.append(f"| {c} | " + " | ".join(f"{r['parts_ms_per_mib'].get(c, 0):.2f}" for r in data["worker"]) + " |")
    lines.append("| **total** | " + " | ".join(f"**{r['ms_per_mib']:.2f}**" for r in data["worker"]) + " |")
    lines += ["", window_note(data["worker"])]
    before = data.get("before")
    if before:
        prov_b = before.get("provenance") or {"commit": f"{BEFORE} (wire v1)", "date": before.get("note", "")}
        lines += ["", f"Before (commit {prov_b['commit']}, the same script, {prov_b['date']}"
                  + (f", load average {prov_b['load']}" if prov_b.get("load") else "") + "): "
                  + "; ".join(f"{r['profile']} {r['chunk_bytes'] >> 10} KiB chunks {r['ms_per_mib']:.1f} ms/MiB"
                              for r in before["worker"]) + "."]
    lines += ["", "**The MQTT client's receive path.** Each client receives the same stream from mosquitto (QoS 1, one "
              "publisher in another process), sent as fast as the publisher can (the receiver's socket fills: bursts) or "
              f"paced at {PACED_MIB_S} MiB/s (the receiver keeps up, and each read returns what a few segments brought, "
              "as under a live fleet); CPU of the receiving process (all threads) and of mosquitto over the same transfer:",
              "", "| client | message KiB | sent | client ms/MiB | mosquitto ms/MiB |", "|---|---:|---|---:|---:|"]
    for r in data["receive"]:
        sent = f"paced, {r['paced_mib_s']} MiB/s" if r.get("paced_mib_s") else "bursts"
        lines.append(f"| {r['client']} | {r['message_kib']} | {sent} | {r['client_ms_per_mib']:.2f} | "
                     f"{r['mosquitto_ms_per_mib']:.2f} |")
    lines += ["", "**Hashes**, one thread, ms per MiB: " + ", ".join(f"{k} {v:.2f}" for k, v in data["hashes"].items()) + ".",
              ""]
    for label, shares in data.get("spy", {}).items():
        lines += [f"**{label}**, sampled with py-spy (`py-spy record --nonblocking --threads --format raw`, 50 Hz) through a "
                  "federation of benchmarks/bench_scale.py (its `federation()`, real mosquitto and `loadtest` devices): share of "
                  "its samples by what the deepest recognised frame does (py-spy counts a thread waiting for a core as busy, so "
                  "on this loaded machine the start-up's share is above its share of CPU time): "
                  + ", ".join(f"{k} {v:.0%}" for k, v in shares.items() if v >= 0.01) + ".", ""]
    lines += ["**A device's upload** (" + data["upload"][0].get("profile", "resnet18-cifar10-wd submodel 5") + ", 256 KiB "
              "chunks: encode, hash, sign, frame), ms of CPU per MiB here: "
              + "; ".join(f"{r['wire']} {r['ms_per_mib']:.2f} ({r['signatures']} signature(s) for {r['messages']} messages)"
                          for r in data["upload"]) + ".", ""]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: fewer updates; report to runs/")
    ap.add_argument("--json", type=Path, help="also write the raw results here")
    ap.add_argument("--before", type=Path, help="raw results (--json) of this script at an earlier commit, shown beside")
    ap.add_argument("--worker-only", action="store_true", help="measure the worker path only, print JSON, write nothing")
    ap.add_argument("--py-spy", action="append", default=[], metavar="LABEL=RAW",
                    help="summarise a py-spy raw profile of a process in the report (repeatable)")
    args = ap.parse_args()
    one_per_process()  # as `aggregator worker` runs: torch and the BLAS on one thread, freed memory kept for the next message
    keep_freed_memory()
    quick = args.quick
    r20, r18, window = (8, 1, 40) if quick else (40, 3, 400)
    runs = [("resnet20-fmnist-w", r20, None, 256 << 10), ("resnet20-fmnist-w", r20, None, DEFAULT_CHUNK_BYTES),
            ("resnet18-cifar10-wd", r18, 4, DEFAULT_CHUNK_BYTES), ("resnet18-cifar10-wd", r18, 4, 4 << 20),
            ("resnet20-fmnist-w", window, None, DEFAULT_CHUNK_BYTES)]  # the fleet load test's round: a full comparison window
    data: dict = {"worker": []}
    for profile, devices, k, chunk in runs:
        data["worker"].append(worker_profile(profile, devices, chunk, k))
        print(json.dumps(data["worker"][-1]), flush=True)
    if not args.worker_only:
        data["receive"] = receive_path(32 if quick else 192, [256 << 10, DEFAULT_CHUNK_BYTES, 4 << 20])
        data["hashes"] = hashes()
        data["upload"] = device_upload()
    data["spy"] = {label: spy_summary(Path(raw)) for label, raw in (a.split("=", 1) for a in args.py_spy)}
    data["provenance"] = {"cpu": cpu_name(), "commit": commit_label(), "load": load_average(),
                          "date": time.strftime("%Y-%m-%dT%H:%M%z")}
    if args.json:
        args.json.write_text(json.dumps(data, indent=1))
    if args.worker_only:
        return
    if args.before:
        before = json.loads(args.before.read_text())
        data["before"] = before if isinstance(before, dict) else {"worker": before}
    out = ROOT / ("runs/bench-ingest-quick.md" if quick else "docs/benchmarks.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "PYTHONPATH=. python benchmarks/bench_ingest.py" + (" --quick" if quick else "") + \
        (f" --before {args.before}" if args.before else "") + "".join(f" --py-spy '{spy}'" for spy in args.py_spy)
    replace_section(out, SECTION, report(data, command))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
