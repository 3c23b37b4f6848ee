"""System costs of the kit, each measured against what it replaces in the same run; writes docs/benchmarks.md.

    PYTHONPATH=. python benchmarks/bench_systems.py [--quick] [--only aggregation,client,wire,inference]

Sections (every comparison is a ratio of two numbers taken in this run, on this machine):
  aggregation  streaming NeFedAvg vs the paper's Algorithm 2 written as slice loops vs a plain torch
               sum of as many full-size updates (the memory-bandwidth bound); aggregator peak RSS
               growth as clients grow, one fresh child process per client count
  client       one training step per submodel vs the full model (edge_client.costmodel.calibrate)
  wire         bytes per update per submodel (nefl.protocol.wire, fp32/fp16) vs full-model FedAvg, and MQTT
               QoS 1 throughput of a model-sized chunked payload through mosquitto and the embedded amqtt broker
  inference    benchmarks/bench_inference.py (torch eager vs onnxruntime fp32/int8), run as is

--quick is a smoke run (smaller counts and payloads) and writes runs/bench-systems-quick.md instead.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from rich.console import Console
from rich.progress import Progress

from provenance import commit_label, cpu_name, load_average  # benchmarks/ is the script directory, on sys.path
from edge_client.costmodel import RssMeter, calibrate
from nefl.aggregation.nefedavg import NeFedAvg
from nefl.protocol.mqtt import make_client, parse_broker
from nefl.nested.profile import load_profile
from nefl.nested.state import GlobalState, Layout
from nefl.nested.tensors import ring
from nefl.protocol.topics import Topics
from nefl.aggregation.robust import NormBound, UpdateGuard, check_state, reference_norm
from nefl.aggregation.update_check import check_update
from nefl.protocol.signing import Signer, parse_public_key, verify
from nefl.protocol.wire import DEFAULT_CHUNK_BYTES, Reassembler, encode, split_chunk

ROOT = Path(__file__).resolve().parent.parent
AGG_PROFILE = "resnet18-cifar10-wd"
BASELINE_COMMIT = "cfb5226"  # NeFedAvg before its rework for throughput (issue 15), timed beside the current one
CLIENT_PROFILE = "resnet20-fmnist-wd"
MOSQUITTO = "/usr/sbin/mosquitto"
console = Console()

Delta = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Settings:
    agg_clients: tuple[int, ...]
    mem_clients: tuple[int, ...]
    repeats: int
    mqtt_profile: str  # whose full fp32 model is the MQTT payload
    mqtt_repeats: int
    inference_runs: int


FULL = Settings((10, 100), (10, 50, 100), 5, AGG_PROFILE, 3, 200)
QUICK = Settings((5, 10), (5, 10), 1, CLIENT_PROFILE, 1, 20)


# -- aggregation -----------------------------------------------------------------------------------

def random_delta(shapes: dict[str, torch.Size], gen: torch.Generator) -> Delta:
    return {n: torch.randn(s, generator=gen) * 1e-2 for n, s in shapes.items()}


def delta_pool(layout: Layout, size: int, seed: int = 0) -> list[list[Delta]]:
    gen = torch.Generator().manual_seed(seed)
    return [[random_delta(layout.upload_shapes(k), gen) for _ in range(size)] for k in range(layout.num_submodels)]


def distinct_deltas(shapes: dict[str, torch.Size], count: int, first: int = 0) -> list[Delta]:
    """`count` updates in distinct memory, as arriving off the wire (constant-filled: values do not change
    the timing, and filling is far faster than randn for the gigabytes a 100-client round needs)."""
    return [{n: torch.full(s, 1e-3 * (first + i + 1)) for n, s in shapes.items()} for i in range(count)]


def mixed_updates(layout: Layout, pool: list[list[Delta]], n: int) -> Iterator[tuple[int, Delta]]:
    """n updates, submodels round-robin (every submodel equally represented), cycling through the pool."""
    for i in range(n):
        k = i % layout.num_submodels
        yield k, pool[k][(i // layout.num_submodels) % len(pool[k])]


def reference_average(layout: Layout, state: GlobalState, updates: list[tuple[int, Delta]]) -> GlobalState:
    """The paper's Algorithm 2 (ParameterAverage) as written: group by submodel, then per tensor and per
    submodel k holding it, average the part phi_k \\ phi_k' over the clients of submodels >= k holding it."""
    groups: list[list[Delta]] = [[d for kk, d in updates if kk == k] for k in range(layout.num_submodels)]
    consistent = {}
    for n, old in state.consistent.items():
        having = [k for k in range(layout.num_submodels) if n in layout.upload_shapes(k)]  # M'
        new = old.clone()
        inner = None
        for i, k in enumerate(having):
            shape = layout.upload_shapes(k)[n]
            clients = [d[n] for ell in having[i:] for d in groups[ell]]
            if clients:  # nobody covered this part: it keeps its value
                assert inner is None or all(a <= b for a, b in zip(inner, shape)), f"not nested: {inner} vs {shape}"
                for box in ring(shape, inner):
                    new[box] += sum(c[box] for c in clients) / len(clients)
            inner = shape
        consistent[n] = new
    inconsistent = []
    for k, old_k in enumerate(state.inconsistent):
        if groups[k]:
            inconsistent.append({n: t + sum(d[n] for d in groups[k]) / len(groups[k]) for n, t in old_k.items()})
        else:
            inconsistent.append({n: t.clone() for n, t in old_k.items()})
    return GlobalState(consistent, inconsistent)


def streaming_average(layout: Layout, state: GlobalState, updates: list[tuple[int, Delta]]) -> GlobalState:
    """NeFedAvg.add as a library user calls it: every update validated (names, shapes, finite values)
    and left untouched (copied into the sums)."""
    agg = NeFedAvg(layout, "uniform")
    for k, d in updates:
        agg.add(k, d)
    return agg.finalize(state)


def server_average(layout: Layout, state: GlobalState, updates: Iterable[tuple[int, Delta]]) -> GlobalState:
    """NeFedAvg as the aggregator runs it (aggregator/federation.py): the wire decoder already proved the
    values finite, so only names and shapes are checked, and the just-decoded tensors are handed over."""
    agg = NeFedAvg(layout, "uniform")
    for k, d in updates:
        check_update(layout, k, d, values=False)
        agg.add_validated(k, d, owned=True)
    return agg.finalize(state)


def baseline_nefedavg() -> type | None:
    """NeFedAvg as it was at BASELINE_COMMIT, loaded from git, so old and new are timed in the same run."""
    try:
        src = subprocess.run(["git", "-C", str(ROOT), "show", f"{BASELINE_COMMIT}:nefl/aggregation/aggregate.py"],
                             capture_output=True, text=True, check=True).stdout
        module = types.ModuleType("nefl_aggregate_baseline")
        exec(compile(src, f"{BASELINE_COMMIT}:nefl/aggregation/aggregate.py", "exec"), module.__dict__)
        return module.NeFedAvg
    except (OSError, subprocess.CalledProcessError, ImportError) as e:
        console.print(f"[yellow]baseline NeFedAvg at {BASELINE_COMMIT} unavailable ({e}); its column stays empty")
        return None


def baseline_average(cls: type, layout: Layout, state: GlobalState, updates: list[tuple[int, Delta]]) -> GlobalState:
    agg = cls(layout, "uniform")
    for k, d in updates:
        agg.add(k, d)
    return agg.finalize(state)


def plain_sum(full: list[Delta], n: int) -> Delta:
    """FedAvg of n full-size updates: one add per tensor per update, one divide."""
    acc = {name: torch.zeros_like(t) for name, t in full[0].items()}
    for i in range(n):
        for name, t in full[i % len(full)].items():
            acc[name].add_(t)
    return {name: t.div_(n) for name, t in acc.items()}


def max_difference(a: GlobalState, b: GlobalState) -> float:
    diffs = [(a.consistent[n] - b.consistent[n]).abs().max().item() for n in a.consistent]
    diffs += [(x[n] - y[n]).abs().max().item() for x, y in zip(a.inconsistent, b.inconsistent) for n in x]
    return max(diffs)


def check_reference() -> float:
    """The paper's worked example (|M1| = |M5| = 2, |M3| = 3, |M2| = |M4| = 0) on the small profile."""
    layout = Layout.build(load_profile(CLIENT_PROFILE))
    state = GlobalState.init(layout, 0)
    gen = torch.Generator().manual_seed(1)
    updates = [(k, random_delta(layout.upload_shapes(k), gen)) for k in (0, 0, 2, 2, 2, 4, 4)]
    diff = max_difference(reference_average(layout, state, updates), streaming_average(layout, state, updates))
    if diff > 1e-5:
        raise SystemExit(f"reference and NeFedAvg disagree by {diff:g} (> 1e-5): fix before timing anything")
    return diff


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Best CPU time of this thread over the repeats: other load on the machine does not count."""
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return min(times)


def fresh_mixed(layout: Layout, n: int) -> list[tuple[int, Delta]]:
    """n submodel updates, round-robin, each in its own just-allocated memory, as decoded off the wire."""
    per_submodel = -(-n // layout.num_submodels)
    pool = [distinct_deltas(layout.upload_shapes(k), per_submodel, k * per_submodel) for k in range(layout.num_submodels)]
    return list(mixed_updates(layout, pool, n))


def time_aggregators(layout: Layout, state: GlobalState, n: int, repeats: int, tick: Callable[[], None]) -> dict:
    """Best-of-repeats seconds of each aggregator on n updates, interleaved (one call of every variant per
    repeat, so a change in machine load hits all of them alike), as CPU time of this thread (user + system,
    page faults included), so other processes on the machine do not count. Every call gets freshly allocated updates
    (built before the clock starts): the server variant takes ownership of its updates, and cold caches
    are what a real round sees."""
    mixed = lambda: fresh_mixed(layout, n)  # noqa: E731
    variants: dict[str, tuple[Callable[[], object], Callable[[object], object]]] = {
        "server": (mixed, lambda u: server_average(layout, state, u)),
        "add": (mixed, lambda u: streaming_average(layout, state, u)),
        "reference": (mixed, lambda u: reference_average(layout, state, u)),
        "sum": (lambda: distinct_deltas(layout.global_shapes, n), lambda u: plain_sum(u, n)),
    }
    old = baseline_nefedavg()
    if old is not None:
        variants["before"] = (mixed, lambda u: baseline_average(old, layout, state, u))
    best = {name: math.inf for name in variants}
    for _ in range(repeats):
        for name, (make, run) in variants.items():
            inputs = make()
            t0 = time.thread_time()
            run(inputs)
            best[name] = min(best[name], time.thread_time() - t0)
            del inputs
            tick()
    return best


def bench_aggregation(s: Settings, progress: Progress) -> dict:
    diff = check_reference()
    layout = Layout.build(load_profile(AGG_PROFILE))
    state = GlobalState.init(layout, 0)
    rows = []
    task = progress.add_task("aggregation timing", total=len(s.agg_clients) * s.repeats * 5)
    for n in s.agg_clients:
        times = time_aggregators(layout, state, n, s.repeats, lambda: progress.advance(task))
        elements = sum(math.prod(x) for k in range(n) for x in layout.upload_shapes(k % layout.num_submodels).values())
        rows.append({"clients": n, **times, "elements": elements,
                     "full_elements": n * sum(math.prod(x) for x in layout.global_shapes.values())})
    mem = []
    task = progress.add_task("aggregator peak memory (child per N)", total=len(s.mem_clients))
    for n in s.mem_clients:
        mem.append(aggregation_memory_child(n))
        progress.advance(task)
    params = sum(math.prod(x) for x in layout.global_shapes.values())
    groups = sum(math.prod(x) for k in range(layout.num_submodels) for x in layout.upload_shapes(k).values())
    return {"diff": diff, "rows": rows, "mem": mem, "params": params, "group_elements": groups}


def aggregation_memory_child(n: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, __file__, "_aggmem", str(n)], capture_output=True, text=True, env=env,
                         check=False)
    if out.returncode != 0:
        raise SystemExit(f"aggregator memory child for {n} clients failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def aggregation_memory_main(n: int) -> None:
    """Child: peak RSS growth of streaming n updates that arrive as fresh tensors (as decoded off the wire)."""
    torch.set_num_threads(1)
    layout = Layout.build(load_profile(AGG_PROFILE))
    state = GlobalState.init(layout, 0)
    pool = delta_pool(layout, 1)
    meter = RssMeter()
    meter.start()
    server_average(layout, state, ((k, {name: t.clone() for name, t in d.items()}) for k, d in mixed_updates(layout, pool, n)))
    growth = meter.stop()
    print(json.dumps({"clients": n, "growth": growth, "hwm": _status_bytes("VmHWM")}))


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


# -- client ----------------------------------------------------------------------------------------

def bench_client(progress: Progress) -> dict:
    layout = Layout.build(load_profile(CLIENT_PROFILE))
    task = progress.add_task("client train step (child process)", total=layout.num_submodels)
    with tempfile.TemporaryDirectory(prefix="nefl-bench-cal-") as cache:
        table = calibrate(layout, 32, threads=1, cache_dir=Path(cache), force=True,
                          on_result=lambda k: progress.advance(task))
        errors = [c.error for c in table.costs if c.error]
        if errors:
            raise SystemExit(f"client calibration failed: {errors[0]}")
        overhead = json.loads(table.cache_file.read_text())["submodels"]["0"]["overhead"]
    return {"costs": table.costs, "overhead": overhead}


# -- wire ------------------------------------------------------------------------------------------

def wire_bytes(tensors: Delta, dtype: str, submodel: int) -> tuple[int, int]:
    msgs = encode(tensors, kind="update", federation="bench", round=0, submodel=submodel, client="c1", dtype=dtype).messages
    return sum(len(m) for m in msgs), len(msgs)


def bench_wire_bytes(progress: Progress) -> dict:
    out = {}
    profiles = (CLIENT_PROFILE, AGG_PROFILE)
    task = progress.add_task("wire bytes", total=len(profiles))
    for name in profiles:
        layout = Layout.build(load_profile(name))
        full_bytes, full_chunks = wire_bytes({n: torch.zeros(x) for n, x in layout.global_shapes.items()}, "fp32", 0)
        rows = []
        for k in range(layout.num_submodels):
            delta = {n: torch.zeros(x) for n, x in layout.upload_shapes(k).items()}
            b32, c32 = wire_bytes(delta, "fp32", k)
            b16, c16 = wire_bytes(delta, "fp16", k)
            rows.append({"k": k, "gamma": layout.profile.submodels[k].gamma, "fp32": b32, "fp16": b16,
                         "chunks32": c32, "chunks16": c16})
        out[name] = {"full": full_bytes, "full_chunks": full_chunks, "rows": rows}
        progress.advance(task)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"broker exited with code {proc.returncode} before listening on {port}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise SystemExit(f"broker did not listen on 127.0.0.1:{port} within {timeout_s:.0f} s")


@contextmanager
def mosquitto(workdir: Path) -> Iterator[int]:
    port = free_port()
    conf = workdir / "mosquitto.conf"
    lines = [f"listener {port} 127.0.0.1", "allow_anonymous true", "persistence false",
             "message_size_limit 0", "max_inflight_messages 20", "max_queued_messages 10000"]
    if os.geteuid() == 0:
        lines.append("user root")
    conf.write_text("\n".join(lines) + "\n")
    with _listening([MOSQUITTO, "-c", str(conf)], port):
        yield port


@contextmanager
def embedded_broker() -> Iterator[int]:
    """The amqtt broker of aggregator/broker.py in its own process, like mosquitto (no GIL shared with the clients)."""
    port = free_port()
    code = ("import sys, time; from aggregator.broker import EmbeddedBroker; "
            f"b = EmbeddedBroker('127.0.0.1', {port}); b.start(); time.sleep(10**6)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    with _listening([sys.executable, "-c", code], port, env):
        yield port


@contextmanager
def _listening(cmd: list[str], port: int, env: dict[str, str] | None = None) -> Iterator[None]:
    """A broker process, from the moment it listens on `port` until the block ends."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        wait_for_port(port, proc)
        yield
    finally:
        proc.terminate()
        proc.wait(10)


def connected(client, port: int) -> None:
    ready = threading.Event()
    client.on_connect = lambda c, u, f, rc, p=None: ready.set()
    client.connect("127.0.0.1", port)
    client.loop_start()
    if not ready.wait(15):
        raise SystemExit(f"MQTT client could not connect to 127.0.0.1:{port}")


def transfer_seconds(port: int, messages: list[bytes], run: int, timeout_s: float = 300.0) -> float:
    """QoS 1 publisher -> broker -> QoS 1 subscriber; from the first publish to the last chunk delivered."""
    topics = Topics("bench")
    settings = parse_broker(f"mqtt://127.0.0.1:{port}")
    got: dict[str, bytes] = {}
    done, subscribed = threading.Event(), threading.Event()

    def on_message(c, u, msg) -> None:
        got[msg.topic] = msg.payload
        if len(got) == len(messages):
            done.set()

    sub = make_client(settings, f"bench-sub-{run}", topics.status(f"sub{run}"), b"offline")
    sub.on_message = on_message
    sub.on_subscribe = lambda c, u, mid, rc, p=None: subscribed.set()
    connected(sub, port)
    sub.subscribe(topics.model_all(run), qos=1)
    subscribed.wait(10)
    pub = make_client(settings, f"bench-pub-{run}", topics.status(f"pub{run}"), b"offline")
    connected(pub, port)
    t0 = time.perf_counter()
    for i, m in enumerate(messages):
        pub.publish(topics.model_chunk(run, i), m, qos=1)
    finished = done.wait(timeout_s)
    seconds = time.perf_counter() - t0
    for c in (pub, sub):
        c.disconnect()
        c.loop_stop()
    if not finished:
        raise SystemExit(f"only {len(got)} of {len(messages)} chunks arrived within {timeout_s:.0f} s")
    if any(got[topics.model_chunk(run, i)] != m for i, m in enumerate(messages)):
        raise SystemExit("a chunk arrived corrupted")
    return seconds


def bench_mqtt(s: Settings, progress: Progress) -> dict:
    layout = Layout.build(load_profile(s.mqtt_profile))
    full = {n: torch.randn(x) for n, x in layout.global_shapes.items()}
    messages = encode(full, kind="model", federation="bench", round=0, submodel=0, client="server").messages
    nbytes = sum(len(m) for m in messages)
    results = {}
    task = progress.add_task("MQTT transfers", total=2 * s.mqtt_repeats)
    with tempfile.TemporaryDirectory(prefix="nefl-bench-mq-") as tmp:
        for name, broker in (("mosquitto", lambda: mosquitto(Path(tmp))), ("embedded amqtt", embedded_broker)):
            with broker() as port:
                times = []
                for r in range(s.mqtt_repeats):
                    times.append(transfer_seconds(port, messages, r))
                    progress.advance(task)
            results[name] = min(times)
    return {"profile": s.mqtt_profile, "bytes": nbytes, "chunks": len(messages), "seconds": results,
            "repeats": s.mqtt_repeats}


# -- inference -------------------------------------------------------------------------------------

def bench_inference(s: Settings, progress: Progress) -> dict:
    """Runs benchmarks/bench_inference.py unchanged and lifts its rich table into markdown."""
    task = progress.add_task("inference (bench_inference.py)", total=1)
    env = dict(os.environ, COLUMNS="200", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_inference.py"), "--threads", "1", "--runs", str(s.inference_runs)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    progress.advance(task)
    if out.returncode != 0:
        raise SystemExit(f"bench_inference.py failed: {out.stderr.strip()[-500:]}")
    return {"command": " ".join(["python", "benchmarks/bench_inference.py", *cmd[2:]]), "text": out.stdout}


def rich_table_to_markdown(text: str) -> str:
    rows = [[c.strip() for c in line.strip().strip("│┃").split("│" if "│" in line else "┃")]
            for line in text.splitlines() if line.strip().startswith(("│", "┃"))]
    if not rows:
        return "```\n" + text.strip() + "\n```"
    head, body = rows[0], rows[1:]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    title = next((line.strip() for line in text.splitlines() if line.strip() and not line.strip()[0] in "│┃┏┡└┗━"), "")
    return (f"{title}\n\n" if title else "") + "\n".join(lines)


# -- report ----------------------------------------------------------------------------------------

def mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def machine() -> list[str]:
    import onnxruntime

    return [
        f"- CPU: {cpu_name()}, {os.cpu_count()} logical cores; memory {psutil.virtual_memory().total / 2**30:.1f} GiB",
        f"- {platform.system()} {platform.release()}, Python {platform.python_version()}, torch {torch.__version__}, "
        f"onnxruntime {onnxruntime.__version__}, mosquitto {mosquitto_version()}",
        f"- date {datetime.datetime.now().astimezone().isoformat(timespec='minutes')}, commit {commit_label()}",
        f"- load average at the end of the run: {load_average()}",
    ]


def mosquitto_version() -> str:
    out = subprocess.run([MOSQUITTO, "-h"], capture_output=True, text=True).stdout
    m = re.search(r"version ([\d.]+)", out)
    return m.group(1) if m else "unknown"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def _ratio(a: float | None, b: float) -> str:
    return "-" if a is None else f"{a / b:.2f}x"


def report_aggregation(r: dict) -> list[str]:
    lines = [
        "## Aggregation (server)",
        "",
        f"Profile `{AGG_PROFILE}` ({r['params'] / 1e6:.2f} M parameters, 5 submodels), uniform weighting as the paper.",
        "Updates are deltas of each submodel's upload shapes, submodels round-robin (equal counts), every update "
        "in its own memory as if just decoded off the wire (the plain sum gets as many distinct full-size updates). "
        "Times are the best of the repeats, one thread, in CPU time of the aggregating thread (user + system, "
        "so other load on the machine does not count; memory-bandwidth contention still does), the variants "
        "interleaved within each repeat, every call on freshly allocated updates (allocation not timed).",
        "",
        "- **NeFedAvg, server path**: what `aggregator serve` runs per update (aggregator/federation.py): "
        "`check_update` (names, shapes, dtype; the wire decoder has already proven every value finite, and the "
        "norm bound refuses NaN/inf too) and `add_validated(owned=True)` (the just-decoded tensors are handed "
        "over: a submodel's first update becomes its group sum without a copy), then `finalize`.",
        "- **NeFedAvg.add**: the library call on untrusted tensors: names, shapes, dtype and a finite-value scan "
        "of every update, copied into the sums (the caller's tensors are never written), then `finalize`.",
        f"- **before**: `NeFedAvg.add` + `finalize` as they were at commit {BASELINE_COMMIT} (loaded from git in "
        "this run): per-tensor finite checks and adds, a copy plus a multiply by the weight for each "
        "submodel's first update, and a finalize that built global-size sums, a coverage tensor and a select.",
        "- **reference**: the paper's Algorithm 2 written straightforwardly in the benchmark: all updates held, "
        "then per tensor, per submodel k holding it, the part phi_k \\ phi_k' averaged over the clients of "
        f"submodels >= k (no validation). Checked equal to NeFedAvg on the paper's worked example "
        f"(|M1| = |M5| = 2, |M3| = 3) on `{CLIENT_PROFILE}`: max difference {r['diff']:.1e} (<= 1e-5).",
        "- **plain sum**: FedAvg of the same number of full-size updates (`add_` per tensor into zeros, then "
        "divide), no checks: the memory-bandwidth bound; it moves more data than NeFedAvg, since submodel "
        "updates are smaller (here {:.2f}x the bytes of full ones).".format(r["rows"][0]["elements"] / r["rows"][0]["full_elements"]),
        "",
        "| clients | NeFedAvg server path ms | NeFedAvg.add ms | before ms | reference ms | plain sum ms "
        "| server path / plain sum | NeFedAvg.add / plain sum | before / plain sum | reference / server path "
        "| server path GB/s of update data | plain sum GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in r["rows"]:
        before = x.get("before")
        cells = [x["clients"], _ms(x["server"]), _ms(x["add"]), _ms(before), _ms(x["reference"]), _ms(x["sum"]),
                 _ratio(x["server"], x["sum"]), _ratio(x["add"], x["sum"]), _ratio(before, x["sum"]),
                 _ratio(x["reference"], x["server"]), f"{x['elements'] * 4 / x['server'] / 1e9:.2f}",
                 f"{x['full_elements'] * 4 / x['sum'] / 1e9:.2f}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    base = r["mem"][0]["growth"]
    lines += [
        "",
        "Aggregator peak memory as clients grow: one fresh child process per client count; each update arrives as "
        "a freshly allocated tensor dict (as decoded off the wire), is added and dropped; peak RSS growth "
        "(VmHWM reset via /proc/self/clear_refs, `edge_client.costmodel.RssMeter`) over NeFedAvg construction, "
        "all adds and finalize.",
        "",
        "| clients | peak RSS growth MiB | vs first row | process peak RSS MiB |",
        "|---|---|---|---|",
    ]
    for m in r["mem"]:
        lines.append(f"| {m['clients']} | {mib(m['growth'])} | {m['growth'] / base:.2f}x | {mib(m['hwm'])} |")
    held = r["rows"][-1]["elements"] * 4
    lines.append("")
    lines.append(f"(The full model is {mib(r['params'] * 4)} MiB fp32. The growth is NeFedAvg's per-submodel group "
                 f"sums (all 5 submodels together: {mib(r['group_elements'] * 4)} MiB, which finalize turns into the "
                 "new state in place), the untouched tensors copied into the new state and one update in flight: independent of the number of "
                 "clients. The reference, like any "
                 "implementation that groups updates by submodel first, must hold every update: for "
                 f"{r['rows'][-1]['clients']} clients of this mix that is {mib(held)} MiB (computed from the "
                 "shapes; the timing run above holds them all, as the reference needs).)")
    return lines


def report_client(r: dict) -> list[str]:
    costs = r["costs"]
    full = costs[-1]
    lines = [
        "## Client (one training step)",
        "",
        f"Profile `{CLIENT_PROFILE}`, batch 32, 1 thread, SGD, measured by `edge_client.costmodel.calibrate` "
        "(one child process; peak = RSS growth of building the module + one step, plus the process's one-time "
        "framework cost; step = fastest of 3 steps). Submodel 5 is the full model.",
        "",
        f"The one-time framework cost measured in that process is {mib(r['overhead'])} MiB; "
        "the 'model part' columns subtract it (what grows with the submodel).",
        "",
        "| submodel | gamma | params | MMACs/sample | step ms | step vs full | peak MiB | peak vs full "
        "| model part MiB | model part vs full | analytic estimate MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in costs:
        part, full_part = c.measured_peak - r["overhead"], full.measured_peak - r["overhead"]
        lines.append(f"| {c.index + 1} | {c.gamma:g} | {c.params:,} | {c.macs / 1e6:.1f} | {c.step_seconds * 1e3:.1f} "
                     f"| {c.step_seconds / full.step_seconds:.2f}x | {mib(c.measured_peak)} "
                     f"| {c.measured_peak / full.measured_peak:.2f}x | {mib(part)} | {part / full_part:.2f}x "
                     f"| {mib(c.estimated_peak)} |")
    return lines


def report_wire(r: dict, mq: dict) -> list[str]:
    lines = [
        "## Wire",
        "",
        f"Bytes of one update as sent by `nefl.protocol.wire.encode` (safetensors payload + JSON header per chunk, "
        f"{DEFAULT_CHUNK_BYTES // 1024} KiB chunks), against full-model FedAvg (every tensor of the full "
        "model, fp32, same encoding).",
    ]
    for name, x in r.items():
        lines += [
            "",
            f"`{name}`: full-model FedAvg update {mib(x['full'])} MiB in {x['full_chunks']} chunk(s).",
            "",
            "| submodel | gamma | fp32 bytes | fp32 vs full | fp16 bytes | fp16 vs full | chunks fp32 / fp16 |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in x["rows"]:
            lines.append(f"| {row['k'] + 1} | {row['gamma']:g} | {row['fp32']:,} | {row['fp32'] / x['full']:.3f} "
                         f"| {row['fp16']:,} | {row['fp16'] / x['full']:.3f} | {row['chunks32']} / {row['chunks16']} |")
    mosq, amq = mq["seconds"]["mosquitto"], mq["seconds"]["embedded amqtt"]
    lines += [
        "",
        f"MQTT transfer of a model-sized payload: the full `{mq['profile']}` model, fp32, encoded by "
        f"`nefl.protocol.wire.encode` into {mq['chunks']} chunks ({mib(mq['bytes'])} MiB), one chunk per topic as the "
        "aggregator publishes them, QoS 1, paho publisher -> broker -> paho subscriber (`nefl.protocol.mqtt.make_client`, "
        "20 in flight) on 127.0.0.1, each broker in its own process; time from the first publish to the last "
        f"chunk received (contents checked), best of {mq['repeats']}.",
        "",
        "| broker | seconds | MiB/s | vs mosquitto |",
        "|---|---|---|---|",
        f"| mosquitto {mosquitto_version()} | {mosq:.2f} | {mq['bytes'] / 2**20 / mosq:.1f} | 1.00x |",
        f"| embedded amqtt (aggregator/broker.py) | {amq:.2f} | {mq['bytes'] / 2**20 / amq:.1f} | "
        f"{mosq / amq:.2f}x the throughput |",
    ]
    return lines


def reassemble(msgs: list[bytes]) -> Delta:
    """All chunks of one update through a fresh Reassembler (the last one completes and verifies it)."""
    r = Reassembler()
    done = [r.feed(m) for m in msgs][-1]
    assert done is not None, "the chunks did not complete one update"
    return done.tensors


def bench_trust(s: Settings, progress: Progress) -> dict:
    """What the trust boundary costs per update: the full-model update of AGG_PROFILE (resnet18 size),
    through each check the server runs before an update touches the aggregate."""
    layout = Layout.build(load_profile(AGG_PROFILE))
    k = layout.num_submodels - 1
    state = GlobalState.init(layout, 0)
    delta = random_delta(layout.upload_shapes(k), torch.Generator().manual_seed(0))
    device = Signer(Ed25519PrivateKey.from_private_bytes(bytes(32)))
    msgs = encode(delta, kind="update", federation="bench", round=1, submodel=k, client="c1", sign=device.sign).messages
    device_key = parse_public_key(device.public_text)
    guard = UpdateGuard(NormBound(), layout.num_submodels)
    ref = reference_norm(state, layout, k)
    repeats = max(3, s.repeats)
    task = progress.add_task("trust boundary checks", total=7)

    def timed(fn: Callable[[], object]) -> float:
        progress.advance(task)
        return best_seconds(fn, repeats) * 1e3

    rows = {
        "framing and strict header parse, every chunk (parsed once per update, then compared byte for byte)":
            timed(lambda: [r.parse(m) for r in [Reassembler()] for m in msgs]),
        "device signature (Ed25519 verify of the header every chunk repeats: one per update)":
            timed(lambda: verify(split_chunk(msgs[0])[0], device_key)),
        "reassembly (includes the header parse): each chunk's BLAKE3 Merkle proof, one copy into place, "
        "safetensors decode, dtype + finite": timed(lambda: reassemble(msgs)),
        "names/shapes against the submodel (check_update; row 3 proved the values finite)":
            timed(lambda: check_update(layout, k, delta, values=False)),
        "update norm bound (UpdateGuard.check)": timed(lambda: guard.check(k, delta, ref)),
        "reference weight norm (once per submodel per round)": timed(lambda: reference_norm(state, layout, k)),
        "commit check of the new state (once per round)": timed(lambda: check_state(state, 1e6)),
    }
    add = best_seconds(lambda: NeFedAvg(layout).add_validated(k, delta), repeats) * 1e3
    return {"profile": AGG_PROFILE, "elements": sum(t.numel() for t in delta.values()), "chunks": len(msgs),
            "bytes": sum(map(len, msgs)), "rows": rows, "add_ms": add}


def report_trust(r: dict) -> list[str]:
    per_update = sum(ms for name, ms in r["rows"].items() if "once per" not in name and "header parse, every" not in name)
    lines = [
        "## Trust boundary checks",
        "",
        f"What the aggregator spends on checking one update before it is summed: the full-model update of "
        f"`{r['profile']}` ({r['elements']:,} float32 elements, {mib(r['bytes'])} MiB in {r['chunks']} chunks), "
        "one thread, best of the repeats in CPU time of the thread.",
        "",
        "| check | ms |",
        "|---|---|",
        *[f"| {name} | {ms:.1f} |" for name, ms in r["rows"].items()],
        "",
        f"Receiving and checking one update takes {per_update:.1f} ms (rows 2-5; row 3 includes row 1); summing "
        f"it into NeFedAvg takes {r['add_ms']:.1f} ms. Of the checks, the strict JSON parsing of the chunk "
        "headers is row 1, the device signatures row 2 and the norm bound row 5 (float32 norms of 4096-element rows "
        "combined in float64: float64's range and accuracy at float32 speed); the chunk hashes and the safetensors "
        "decode are needed to read an "
        "update at all.",
    ]
    return lines


def report_inference(r: dict) -> list[str]:
    return ["## Inference", "", f"Output of `{r['command']}` (fresh resnet20-fmnist-w export, batch 1):", "",
            rich_table_to_markdown(r["text"]), "",
            "The model is untrained, so the int8 accuracy delta column says nothing here (pass --checkpoint to "
            "bench_inference.py for a trained one); batch-1 latencies of a few ms are sensitive to the "
            "concurrent load on this machine."]


def kept_sections(out: Path, body: list[str]) -> list[tuple[str, str]]:
    """The `## ` sections of the existing report that this run did not write (a --only run, or a section
    another benchmark appends, such as the fleet load test), kept verbatim so a rerun loses nothing."""
    if not out.exists():
        return []
    written = {line[3:].strip() for line in body if line.startswith("## ")}
    parts = re.split(r"(?m)^(?=## )", out.read_text())[1:]
    return [(p.splitlines()[0][3:].strip(), p.rstrip()) for p in parts if p.splitlines()[0][3:].strip() not in written]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: small counts, small MQTT payload")
    ap.add_argument("--only", default="aggregation,client,wire,trust,inference",
                    help="comma-separated sections to run (default: all)")
    ap.add_argument("--out", type=Path, help="markdown report (default docs/benchmarks.md; --quick: runs/)")
    ap.add_argument("--note", default="", help="a line added under the machine description (e.g. concurrent load)")
    args = ap.parse_args()
    sections = set(args.only.split(","))
    unknown = sections - {"aggregation", "client", "wire", "trust", "inference"}
    if unknown:
        ap.error(f"unknown section(s) {sorted(unknown)}: choose from aggregation, client, wire, trust, inference")
    if "wire" in sections and not shutil.which(MOSQUITTO):
        raise SystemExit(f"{MOSQUITTO} not found: run `make system-deps` (installs mosquitto) or drop 'wire'")
    s = QUICK if args.quick else FULL
    out = args.out or (ROOT / "runs" / "bench-systems-quick.md" if args.quick else ROOT / "docs" / "benchmarks.md")
    torch.set_num_threads(1)
    started = time.monotonic()
    body: list[str] = []
    with Progress(console=console) as progress:
        if "aggregation" in sections:
            body += report_aggregation(bench_aggregation(s, progress)) + [""]
        if "client" in sections:
            body += report_client(bench_client(progress)) + [""]
        if "wire" in sections:
            body += report_wire(bench_wire_bytes(progress), bench_mqtt(s, progress)) + [""]
        if "trust" in sections:
            body += report_trust(bench_trust(s, progress)) + [""]
        if "inference" in sections:
            body += report_inference(bench_inference(s, progress)) + [""]
    command = "PYTHONPATH=. python benchmarks/bench_systems.py" + " ".join(
        [""] + (["--quick"] if args.quick else []) + ([f"--only {args.only}"] if args.only != ap.get_default("only") else []))
    head = ["# System benchmarks", "", "Every number below comes from one run of", "", f"    {command}", "",
            "(`make bench-systems`) on this machine:", "", *machine()]
    if args.note:
        head.append(f"- {args.note}")
    head += [f"- wall time of the run: {time.monotonic() - started:.0f} s" + (" (--quick smoke run)" if args.quick else ""),
             ""]
    kept = kept_sections(out, body)
    if kept:
        head.append(f"Sections kept from the previous {out.name} (not produced by this run, each with its own provenance): "
                    + ", ".join(title for title, _ in kept) + ".")
        head.append("")
        body += [line for _, text in kept for line in (text, "")]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(head + body).rstrip() + "\n")
    console.print("\n".join(body))
    console.print(f"[green]wrote {out}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "_aggmem":
        aggregation_memory_main(int(sys.argv[2]))
    else:
        main()
