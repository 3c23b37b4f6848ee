"""Fleet load test of the scale-out path: real mosquitto, `aggregator serve --workers N`, `aggregator relay`
and `aggregator loadtest` devices as processes; writes a section of docs/benchmarks.md and docs/img/scale.png.

Measured per configuration (every device in every round, devices sending as fast as they can), all
in one run so the numbers share the machine's load: updates/s and MiB/s ingested (reported updates and their bytes over the time from round
open to the last update), round-close latency (asking the workers for their partials until merged),
CPU seconds per component (where the time goes, per update and per MiB: a worker's against
mosquitto's), peak RSS of coordinator and workers; resnet18 updates through one worker; plain `serve`
with default options; `serve` on its embedded broker against the same on an external mosquitto.
Then the bytes a site relay sends upstream per round against the bytes its devices' updates would have been.

    PYTHONPATH=. python benchmarks/bench_scale.py            # `make bench-scale`
    PYTHONPATH=. python benchmarks/bench_scale.py --quick    # a smoke run, to runs/
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.provenance import ROOT, commit_label, cpu_name, load_average, replace_section  # noqa: E402
from nefl.protocol.wire import DEFAULT_CHUNK_BYTES  # noqa: E402

MOSQUITTO = "/usr/sbin/mosquitto"
SECTION = "## Fleet load test (scale-out)"
CLI = [sys.executable, "-c", "from aggregator.cli import app; app()"]


@dataclass(frozen=True)
class Setting:
    profile: str
    devices: int
    fleet_procs: int
    workers: tuple[int, ...]
    big_devices: int  # the peak-RSS run
    relay_devices: int
    rounds: int
    large_profile: str  # large updates through one worker
    large_devices: int


FULL = Setting("resnet20-fmnist-w", 400, 2, (0, 1, 2), 1000, 100, 4, "resnet18-cifar10-wd", 16)
QUICK = Setting("resnet8-fmnist-w", 20, 1, (0, 1), 60, 10, 2, "resnet20-fmnist-w", 8)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    """Processes of one measured federation, sampled for CPU and RSS until the coordinator exits."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        # the commands as an operator runs them: no thread settings of the benchmark's own (nefl/support/threads.py)
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        p = subprocess.Popen(argv, stdout=open(self.tmp / f"{name}.log", "w"), stderr=subprocess.STDOUT, env=self.env,
                             cwd=self.tmp)
        self.procs[name] = p
        return p

    def mosquitto(self, port: int) -> None:
        conf = self.tmp / f"mosquitto-{port}.conf"
        user = "user root\n" if os.geteuid() == 0 else ""
        conf.write_text(f"listener {port} 127.0.0.1\npersistence false\n{user}allow_anonymous true\nmax_queued_messages 100000\n")
        self.start(f"mosquitto-{port}", [MOSQUITTO, "-c", str(conf)])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.1)
        raise RuntimeError("mosquitto did not start")

    def components(self) -> dict[str, list[psutil.Process]]:
        """Live processes by role: the coordinator's children are its workers, loadtest's its shards."""
        out: dict[str, list[psutil.Process]] = {}
        for name, p in self.procs.items():
            try:
                proc = psutil.Process(p.pid)
                role = "mosquitto" if name.startswith("mosquitto") else name
                out.setdefault(role, []).append(proc)
                for child in proc.children():  # the coordinator's: its workers and its embedded mosquitto
                    child_role = "mosquitto" if child.name() == "mosquitto" else "workers" if name == "coordinator" else role
                    out.setdefault(child_role, []).append(child)
            except psutil.NoSuchProcess:
                pass
        return out

    def watch(self, until: subprocess.Popen, timeout_s: float, metrics_path: Path, last_round: int) -> dict:
        """Sample every 0.2 s until `until` exits: peak RSS per role (largest single process), and CPU seconds per
        role and per thread kind (the MQTT client's network thread, the rest) between the metrics lines of round 1
        and of `last_round`: the measured rounds only, so start-up, round 1's warm-up and shutdown do not blur
        a per-MiB figure (a process's start-up alone is seconds, a resnet20 round of 400 updates a few)."""
        peak: dict[str, float] = {}
        marks: dict[str, dict[tuple[str, str], float]] = {}
        end = time.monotonic() + timeout_s
        while until.poll() is None:
            if time.monotonic() > end:
                raise RuntimeError(f"run did not finish in {timeout_s}s; logs in {self.tmp}")
            closed = rounds_closed(metrics_path)
            now: dict[tuple[str, str], float] = {}
            for role, procs in self.components().items():
                for p in procs:
                    try:
                        peak[role] = max(peak.get(role, 0.0), p.memory_info().rss / 2**20)
                        for kind, s in thread_cpu(p).items():
                            now[(role, kind)] = now.get((role, kind), 0.0) + s
                    except psutil.NoSuchProcess:
                        pass
            if closed >= 1 and "start" not in marks:
                marks["start"] = now
            if closed >= last_round and "end" not in marks:
                marks["end"] = now
            time.sleep(0.2)
        if "end" not in marks:
            raise RuntimeError(f"the run ended before round {last_round} closed; logs in {self.tmp}")
        cpu: dict[str, float] = {}
        threads: dict[str, dict[str, float]] = {}
        for (role, kind), s in marks["end"].items():
            spent = s - marks["start"].get((role, kind), 0.0)
            cpu[role] = cpu.get(role, 0.0) + spent
            threads.setdefault(role, {})[kind] = spent
        return {"peak_rss_mib": peak, "cpu_s": cpu, "thread_cpu_s": threads}

    def finish(self, until: subprocess.Popen, timeout_s: float) -> None:
        """Wait for `until` to exit, sampling nothing (benchmarks that judge outcomes, not CPU)."""
        try:
            until.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"run did not finish in {timeout_s}s; logs in {self.tmp}") from None

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def rounds_closed(path: Path) -> int:
    """The highest round with a metrics line so far (0 before the first closes)."""
    try:
        return max((json.loads(line)["round"] for line in path.read_text().splitlines() if line.strip()), default=0)
    except (OSError, ValueError):  # not written yet, or a line half written
        return 0


def thread_cpu(p: psutil.Process) -> dict[str, float]:
    """CPU seconds of a process: "main" its main thread's, "threads" its other threads' (in a Python process of the
    kit, the MQTT clients' network threads), those that ended included."""
    t = p.cpu_times()
    main = next((th.user_time + th.system_time for th in p.threads() if th.id == p.pid), 0.0)
    return {"main": main, "threads": t.user + t.system - main}


def idle_process() -> dict[str, float]:
    """RSS and CPU seconds of a process that has only imported the worker (torch and all): the floor
    under every peak below, and the start-up cost each process pays once, not per update."""
    code = ("import aggregator.worker, psutil; p = psutil.Process(); t = p.cpu_times(); "
            "print(p.memory_info().rss / 2**20, t.user + t.system)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    rss, cpu = out.stdout.split()
    return {"rss_mib": float(rss), "cpu_s": float(cpu)}


def metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def federation(s: Setting, workers: int, devices: int, fleet_procs: int, tmp: Path, profile: str | None = None,
               chunk_kib: int | None = 4096, embedded: bool = False, rounds: int | None = None) -> dict:
    """One federation: every device in each of the rounds; ingest rate over rounds 2.. (round 1 warms up).
    chunk_kib None: serve's and loadtest's default chunks; embedded: serve starts its own broker (mosquitto)."""
    run = Run(tmp)
    profile, rounds = profile or s.profile, rounds or s.rounds
    chunks = ["--chunk-kib", str(chunk_kib)] if chunk_kib else []
    try:
        port = free_port()
        broker = f"mqtt://127.0.0.1:{port}"
        if not embedded:
            run.mosquitto(port)
        where = ["--embedded-port", str(port), "--embedded-broker", "mosquitto"] if embedded else ["--broker", broker]
        keys = enroll_fleet(run, tmp, devices)
        coord = run.start("coordinator", [*CLI, "serve", "--profile", profile, *where, "--federation", "b", *keys,
                                          "--rounds", str(rounds), "--clients-per-round", str(devices), "--min-clients", "1",
                                          "--round-timeout", "600", "--join-wait", "60", *chunks,
                                          "--checkpoint-dir", str(tmp / "run"), "--workers", str(workers),
                                          "--worker-timeout", "120", "--log-level", "warning"])
        if embedded:
            wait_listening(port, coord)
        run.start("loadtest", [*CLI, "loadtest", "--broker", broker, "--federation", "b", "--profile", profile,
                               "--devices", str(devices), "--procs", str(fleet_procs), "--pool", "8", *chunks,
                               "--duration", "1200", "--log-level", "warning"])
        watched = run.watch(coord, 1500, tmp / "run" / "metrics.jsonl", rounds)
        if coord.returncode != 0:
            raise RuntimeError(f"coordinator failed; see {tmp}/coordinator.log")
    finally:
        run.stop()
    rounds = [m for m in metrics(tmp / "run" / "metrics.jsonl") if m["round"] >= 2]
    wall = sum(m["train_wall_s"] for m in rounds)
    n = sum(len(m["reported"]) for m in rounds)
    nbytes = sum(m["bytes_in"] for m in rounds)
    return {"workers": workers, "devices": devices, "fleet_procs": fleet_procs, "updates": n, "expected": devices * len(rounds),
            "profile": profile, "chunk_kib": chunk_kib, "embedded": embedded, "mib_measured": nbytes / 2**20,
            "rounds": max((m["round"] for m in rounds), default=1),
            "updates_per_s": n / wall, "mib_per_s": nbytes / wall / 2**20, "mean_update_kib": nbytes / max(1, n) / 1024,
            "close_s": [m.get("workers", {}).get("collect_s") for m in rounds],
            "aggregate_s": [m.get("aggregate_s") for m in rounds], "round_wall_s": [m["train_wall_s"] for m in rounds],
            "lost": sum(m.get("workers", {}).get("lost_updates", 0) for m in rounds), **watched}


def enroll_fleet(run: Run, tmp: Path, devices: int, prefix: str = "sim") -> list[str]:
    """The key-dir option of a closed federation whose journal enrols the fleet's device keys: every device signs
    its messages as `edge-client join` does, and the coordinator takes only enrolled keys (open enrolment would pin
    new keys at most 60 a minute)."""
    keys = ["--key-dir", str(tmp / "keys")]
    subprocess.run([*CLI, "loadtest", "--broker", "mqtt://127.0.0.1:1", "--federation", "b", "--devices", str(devices),
                    "--prefix", prefix, "--enroll", *keys], env=run.env, check=True, capture_output=True)
    return keys


def wait_listening(port: int, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and proc.poll() is None:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"the embedded broker on port {port} did not come up")


def relay_bytes(s: Setting, tmp: Path) -> dict:
    """A site of s.relay_devices devices behind a relay: bytes it sends upstream per round, against the
    bytes of the updates its devices send (what would cross the WAN without it)."""
    run = Run(tmp)
    try:
        central, site = free_port(), free_port()
        run.mosquitto(central)
        run.mosquitto(site)
        up, down = f"mqtt://127.0.0.1:{central}", f"mqtt://127.0.0.1:{site}"
        keys = ["--federation", "b", *enroll_fleet(run, tmp, s.relay_devices)]
        # the coordinator takes only authorised relays' receipts and partials: the operator's `enroll --worker`
        relay_key = subprocess.run([*CLI, "relay", "--site-broker", down, "--upstream", up, "--relay-id", "site",
                                    "--print-key", *keys], env=run.env, check=True,
                                   capture_output=True, text=True).stdout.strip().split()[-1]
        subprocess.run([*CLI, "enroll", "site", "--worker", "--public-key", relay_key, *keys], env=run.env, check=True,
                       capture_output=True)
        coord = run.start("coordinator", [*CLI, "serve", "--profile", s.profile, "--broker", up, "--key-dir", str(tmp / "keys"),
                                          "--federation", "b",
                                          "--rounds", str(s.rounds), "--clients-per-round", str(s.relay_devices),
                                          "--min-clients", "1", "--round-timeout", "600", "--join-wait", "60",
                                          "--chunk-kib", "4096", "--checkpoint-dir", str(tmp / "run"), "--log-level", "warning"])
        run.start("relay", [*CLI, "relay", "--site-broker", down, "--upstream", up, *keys, "--relay-id", "site"])
        run.start("loadtest", [*CLI, "loadtest", "--broker", down, "--federation", "b", "--profile", s.profile,
                               "--devices", str(s.relay_devices), "--pool", "8", "--chunk-kib", "4096", "--duration", "1200",
                               "--log-level", "warning"])
        run.watch(coord, 1500, tmp / "run" / "metrics.jsonl", s.rounds)
    finally:
        run.stop()
    per_round = [int(x) for x in re.findall(r"partial of \d+ update\(s\) sent \((\d+) bytes up since", (tmp / "relay.log").read_text())]
    rounds = metrics(tmp / "run" / "metrics.jsonl")
    update_bytes = [m["bytes_in"] for m in rounds]
    return {"devices": s.relay_devices, "relay_up_bytes": per_round, "update_bytes": update_bytes}


def plot(results: list[dict], path: Path) -> None:
    """Left: ingest rate against workers (MiB/s written at each point). Right: where the CPU goes per update."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["workers"] for r in results]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9, 3.6))
    ax.plot(xs, [r["updates_per_s"] for r in results], "o-")
    for r in results:
        ax.annotate(f"{r['mib_per_s']:.0f} MiB/s", (r["workers"], r["updates_per_s"]), textcoords="offset points",
                    xytext=(0, -14), ha="center", fontsize=8)
    ax.set_xlabel("aggregator workers (0 = the coordinator alone)")
    ax.set_ylabel("updates/s ingested")
    ax.set_xticks(xs)
    ax.set_ylim(bottom=0)
    ax.set_title(f"{results[0]['devices']} simulated devices, 2 shared cores", fontsize=10)
    bottom = [0.0] * len(results)
    for role in ("mosquitto", "coordinator", "workers", "loadtest"):
        ms = [cpu_per_update(r, role) for r in results]
        bx.bar([str(x) for x in xs], ms, bottom=bottom, label=role)
        bottom = [b + m for b, m in zip(bottom, ms)]
    bx.set_xlabel("aggregator workers")
    bx.set_ylabel("CPU ms per update")
    bx.set_title("CPU per update by component", fontsize=10)
    bx.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def cpu_per_update(r: dict, role: str, kind: str | None = None) -> float:
    """CPU milliseconds a component (or one kind of its threads) spent per update in the measured rounds."""
    spent = r["cpu_s"].get(role, 0.0) if kind is None else r["thread_cpu_s"].get(role, {}).get(kind, 0.0)
    return spent * 1000 / max(1, r["updates"])


def cpu_per_mib(r: dict, role: str, kind: str | None = None) -> float:
    """CPU milliseconds a component spent per MiB of update ingested in the measured rounds."""
    return cpu_per_update(r, role, kind) * max(1, r["updates"]) / max(1e-9, r["mib_measured"])


def pairs_note(ingest: dict) -> str:
    """Each alternating pair's ratio, where the run measured pairs (earlier runs: one of each)."""
    pairs = ingest.get("broker_pairs")
    if not pairs:
        return ""
    return f" ({len(pairs)} alternating pairs pooled; each pair {', '.join(f'{e / x:.2f}x' for x, e in pairs)})"


def per_mib(ingest: dict) -> list[str]:
    """The ingest paragraphs: worker and plain serve against mosquitto per MiB, embedded against external."""
    one, large, plain = ingest["one_worker"], ingest["large"], ingest["plain"]
    embedded, external = ingest["embedded"], ingest["external"]

    def versus(r: dict, role: str) -> str:
        mine, broker = cpu_per_mib(r, role), cpu_per_mib(r, "mosquitto")
        return f"{mine:.2f} ms of CPU per MiB against mosquitto's {broker:.2f} ms in the same run ({mine / broker:.1f}x)"

    return [
        "**Per MiB, against the broker.** One worker, every check on (device signatures, per-chunk Merkle proofs, shapes, "
        f"finite values, the norm bound, the centre check, NeFedAvg, receipts): {one['profile']} updates of "
        f"{one['mean_update_kib']:.0f} KiB from {one['devices']} devices, {versus(one, 'workers')}; {large['profile']} updates "
        f"of {large['mean_update_kib'] / 1024:.1f} MiB (one message each) from {large['devices']} devices, "
        f"{versus(large, 'workers')}, {large['updates_per_s']:.1f} updates/s. Plain `serve` with default options (no "
        f"workers, default chunks of {plain['chunk_note']}) and {plain['devices']} {plain['profile']} devices, rounds 2-"
        f"{plain['rounds']}: the coordinator spends {versus(plain, 'coordinator')}, checkpoints and per-round publishing "
        "included. "
        "Where that time goes, function by function: the \"Ingest profile\" section.",
        "",
        f"**Embedded broker.** `serve` without `--broker` starts mosquitto as its child (aggregator/broker.py); with "
        f"{embedded['devices']} devices and no workers, rounds 2-{embedded['rounds']}, it ingested {embedded['mib_per_s']:.1f} MiB/s "
        f"({embedded['updates_per_s']:.1f} updates/s) against {external['mib_per_s']:.1f} MiB/s "
        f"({external['updates_per_s']:.1f} updates/s) on an external mosquitto in the same run: "
        f"{embedded['mib_per_s'] / external['mib_per_s']:.2f}x{pairs_note(ingest)}. Where no mosquitto is installed it falls back to amqtt "
        "(about a tenth of mosquitto's throughput: the \"Wire\" section).",
        "",
    ]


def zero_vs_one(by: dict[int, dict], cost: dict[str, float], alone: float) -> str:
    """Whether moving the checks out of the coordinator paid on this host, and why, from the measured rates."""
    if 0 not in by or 1 not in by:
        return ""
    r0, r1 = by[0]["updates_per_s"], by[1]["updates_per_s"]
    if r1 > r0:
        return ("From 0 to 1 worker the rate rises because checking and summing leave the coordinator's single main "
                f"thread for a process of their own (the coordinator's CPU per update falls from {alone:.1f} to "
                f"{cost['coordinator']:.1f} ms), so two cores work at once.")
    return (f"The coordinator alone is fastest here ({r0:.0f} against {r1:.0f} updates/s with one worker): a worker "
            f"process costs {cost['workers']:.1f} ms per update plus the coordinator's remaining {cost['coordinator']:.1f} ms "
            f"(receipts), more CPU in all than the {alone:.1f} ms of checking in the coordinator, and on cores the fleet "
            "and mosquitto already fill nothing runs beside it; workers pay off where they get cores of their own.")


def analysis(results: list[dict]) -> list[str]:
    """Where the curve flattens and what the per-update costs predict for larger hosts, from this run's numbers."""
    by = {r["workers"]: r for r in results}
    best = max(results, key=lambda r: r["updates_per_s"])
    one = by.get(1, best)
    mib = one["mean_update_kib"] / 1024
    cost = {role: cpu_per_update(one, role) for role in ("mosquitto", "coordinator", "workers", "loadtest")}
    worker_ms = ", ".join(f"{cpu_per_update(r, 'workers'):.1f}" for r in results if r["workers"])
    alone = cpu_per_update(by[0], "coordinator") if 0 in by else float("nan")
    return [
        f"The curve peaks at {best['workers']} worker(s), {best['updates_per_s']:.0f} updates/s "
        f"({best['mib_per_s']:.0f} MiB/s), and " + ("has not flattened by then. " if best is results[-1] else "falls beyond. ")
        + f"On {os.cpu_count()} cores the simulated fleet itself needs "
        f"{cost['loadtest']:.1f} ms of CPU per update and a worker {cost['workers']:.1f} ms, so one worker already fills "
        "what the fleet, the coordinator and mosquitto leave of the two cores; more workers add processes, not cores, "
        f"and time-sharing raises each update's worker CPU ({worker_ms} ms at {', '.join(str(r['workers']) for r in results if r['workers'])} "
        "workers: context switches, every worker's per-round plan and partial, idle polling). " + zero_vs_one(by, cost, alone),
        f"On a larger host the aggregation side scales with workers until the cores run out: a worker spends about "
        f"{cost['workers'] / mib:.1f} ms of CPU per MiB of update (chunk proofs, safetensors decode, finite and norm checks, "
        f"the sum), about {1000 / (cost['workers'] / mib):.0f} MiB/s per core; mosquitto {cost['mosquitto'] / mib:.2f} ms "
        f"per MiB, about {1000 / (cost['mosquitto'] / mib) / 1024:.1f} GiB/s on its one thread, beyond which the broker "
        f"must be several (an EMQX cluster, or a broker per site behind relays); the coordinator {cost['coordinator']:.1f} "
        "ms per update (receipts, plus per-round publishing and the checkpoint spread over the round's updates).",
    ]


def report(s: Setting, results: list[dict], big: dict, relay: dict, idle: dict[str, float], prov: dict[str, str],
           command: str, wall_s: float, img: str, ingest: dict | None = None) -> list[str]:
    roles = ["mosquitto", "coordinator", "workers", "loadtest"]
    lines = [SECTION, "", "Every number in this section comes from one run of", "", f"    {command}", "",
             "(`make bench-scale`) on this machine:", "",
             f"- CPU: {cpu_name()}, {os.cpu_count()} logical cores" + (f"; {prov['note']}" if prov.get("note") else ""),
             f"- {prov['date']}, commit {prov['commit']}",
             f"- load average at the end of the run: {prov['load']}; wall time {wall_s:.0f} s", "",
             f"Profile {s.profile}; every device takes part in every round and sends as fast as it can (deltas from a "
             f"pool of 8 per submodel, one MQTT message per update); rates over rounds 2-{s.rounds} (round 1 warms up). "
             "CPU per update and per MiB: each component's CPU time from the close of round 1 to the close of the last "
             "round (sampled every 0.2 s; per-round publishing, plans, partials and checkpoints included, start-up and "
             "shutdown not), over the updates and bytes of rounds 2 on; `loadtest` is the simulated fleet.", "",
             "| workers | devices | updates | updates/s | MiB/s | mean update KiB | round close s | "
             + " | ".join(f"CPU ms/update {r}" for r in roles) + " | CPU ms/MiB mosquitto | CPU ms/MiB coordinator | "
             "CPU ms/MiB workers |",
             "|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * (len(roles) + 3)]
    for r in results:
        close = [c for c in r["close_s"] if c is not None]
        lines.append(f"| {r['workers']} | {r['devices']} | {r['updates']}/{r['expected']} | {r['updates_per_s']:.1f} | "
                     f"{r['mib_per_s']:.1f} | {r['mean_update_kib']:.0f} | "
                     + (f"{sum(close) / len(close):.2f} | " if close else "- | ")
                     + " | ".join(f"{cpu_per_update(r, role):.1f}" for role in roles) + " | "
                     + " | ".join(f"{cpu_per_mib(r, role):.2f}" for role in ("mosquitto", "coordinator", "workers"))
                     + " |")
    if ingest:
        lines += [""] + per_mib(ingest)
    lines += ["", f"![updates/s against workers, and CPU per update by component]({img})", ""]
    lines += [" ".join(analysis(results)), ""]
    rss = big["peak_rss_mib"]
    lines += [f"At {big['devices']} devices ({big['workers']} workers): {big['updates']}/{big['expected']} updates in "
              f"{sum(big['round_wall_s']):.1f} s of rounds 2-{s.rounds}, {big['updates_per_s']:.1f} updates/s (bigger rounds spread "
              f"the per-round costs over more updates); peak RSS coordinator "
              f"{rss.get('coordinator', 0):.0f} MiB, largest worker {rss.get('workers', 0):.0f} MiB, mosquitto "
              f"{rss.get('mosquitto', 0):.0f} MiB, largest load-generator process {rss.get('loadtest', 0):.0f} MiB; "
              f"round close {max(c or 0 for c in big['close_s']):.2f} s at most. A process that has only imported "
              f"the kit (torch included) already holds {idle['rss_mib']:.0f} MiB: the aggregation state on top of "
              "that is O(model), whatever the number of devices.", ""]
    ups, upd = relay["relay_up_bytes"], relay["update_bytes"]
    lines += [f"A site relay with {relay['devices']} devices: per round it sent {', '.join(f'{b / 2**20:.2f}' for b in ups)} "
              f"MiB upstream (one partial, receipts, the devices' announces and statuses); the same updates sent directly "
              f"would be {', '.join(f'{b / 2**20:.1f}' for b in upd)} MiB per round.", ""]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny model, few devices; report to runs/")
    ap.add_argument("--from-json", type=Path, help="re-render the report from an earlier run's raw results")
    ap.add_argument("--note", default="", help="a line added to the machine description (e.g. concurrent load)")
    ap.add_argument("--stage", action="append", choices=sorted(STAGES), default=[],
                    help="run only this ingest stage (repeatable) and print its CPU per MiB against mosquitto's; writes nothing")
    args = ap.parse_args()
    s = QUICK if args.quick else FULL
    if args.stage:
        return run_stages(s, args.stage)
    out = ROOT / ("runs/bench-scale-quick.md" if args.quick else "docs/benchmarks.md")
    img = ROOT / ("runs/scale.png" if args.quick else "docs/img/scale.png")
    raw = ROOT / ("runs" if args.quick else "benchmarks/results") / "scale.json"
    t0 = time.monotonic()
    if args.from_json:
        data = json.loads(args.from_json.read_text())
    else:
        if not Path(MOSQUITTO).exists():
            raise SystemExit(f"{MOSQUITTO} not found: run `make system-deps`")
        data = measure(s)
        data["wall_s"] = time.monotonic() - t0
        data["idle"] = idle_process()
        data["provenance"] = {"date": time.strftime("%Y-%m-%dT%H:%M%z"), "commit": commit_label(), "load": load_average(),
                              "note": args.note}
        raw.parent.mkdir(parents=True, exist_ok=True)
        raw.write_text(json.dumps(data, indent=1))
    plot(data["scaling"], img)
    command = "PYTHONPATH=. python benchmarks/bench_scale.py" + (" --quick" if args.quick else "")
    out.parent.mkdir(parents=True, exist_ok=True)
    replace_section(out, SECTION, report(s, data["scaling"], data["big"], data["relay"], data["idle"], data["provenance"], command, data["wall_s"],
                              os.path.relpath(img, out.parent), data.get("ingest")))
    print(f"wrote {out} and {img}")


STAGES = {"one_worker": lambda s: dict(workers=1, devices=s.devices, fleet_procs=s.fleet_procs),
          # 3 x the rounds: half the devices make short rounds, and a window of a few seconds sampled every 0.2 s
          # leaves mosquitto's figure noisy between runs
          "plain": lambda s: dict(workers=0, devices=s.devices // 2, fleet_procs=s.fleet_procs, chunk_kib=None,
                                  rounds=3 * s.rounds),
          "large": lambda s: dict(workers=1, devices=s.large_devices, fleet_procs=1, profile=s.large_profile,
                                  chunk_kib=65536, rounds=3)}


def run_stages(s: Setting, names: list[str]) -> None:
    """A before/after check of the ingest path without the whole run: the named stages of measure(), as there."""
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        for n, name in enumerate(names):
            d = Path(tmp) / f"{n}-{name}"
            d.mkdir()
            r = federation(s, tmp=d, **STAGES[name](s))
            role = "workers" if r["workers"] else "coordinator"
            mine, broker = cpu_per_mib(r, role), cpu_per_mib(r, "mosquitto")
            print(json.dumps({"stage": name, "role": role, "ms_per_mib": round(mine, 2), "mosquitto_ms_per_mib": round(broker, 2),
                              "ratio": round(mine / broker, 2), "threads_ms_per_mib": round(cpu_per_mib(r, role, "threads"), 2),
                              "updates_per_s": round(r["updates_per_s"], 1), "load": load_average()}), flush=True)


BROKER_PAIRS = 2  # embedded against external mosquitto, each over 3 x the rounds


def pooled(runs: list[dict]) -> dict:
    """Runs of one configuration as one: rates over all their measured rounds (no CPU figures: not summed)."""
    wall = sum(sum(r["round_wall_s"]) for r in runs)
    updates, mib = sum(r["updates"] for r in runs), sum(r["mib_measured"] for r in runs)
    first = {k: v for k, v in runs[0].items() if k not in ("cpu_s", "thread_cpu_s", "peak_rss_mib")}
    return {**first, "updates": updates, "mib_measured": mib, "updates_per_s": updates / wall, "mib_per_s": mib / wall,
            "runs": len(runs)}


def measure(s: Setting) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        results = []
        for w in s.workers:
            d = Path(tmp) / f"w{w}"
            d.mkdir()
            results.append(federation(s, w, s.devices, s.fleet_procs, d))
            print(json.dumps(results[-1]), flush=True)
        ingest = {"one_worker": next(r for r in results if r["workers"] == 1)}
        pairs = []
        for n in range(BROKER_PAIRS):  # alternately: a few seconds of rounds leave the ratio noisy between runs
            pair = []
            for embedded in (False, True):
                d = Path(tmp) / f"broker-{n}-{'embedded' if embedded else 'external'}"
                d.mkdir()
                pair.append(federation(s, 0, s.devices, s.fleet_procs, d, embedded=embedded, rounds=3 * s.rounds))
                print(json.dumps(pair[-1]), flush=True)
            pairs.append(pair)
        ingest["external"], ingest["embedded"] = (pooled([p[i] for p in pairs]) for i in (0, 1))
        ingest["broker_pairs"] = [[p[0]["mib_per_s"], p[1]["mib_per_s"]] for p in pairs]
        for name, kw in (("plain", STAGES["plain"](s)), ("large", STAGES["large"](s))):
            d = Path(tmp) / name
            d.mkdir()
            ingest[name] = federation(s, tmp=d, **kw)
            print(json.dumps(ingest[name]), flush=True)
        ingest["plain"]["chunk_note"] = f"{DEFAULT_CHUNK_BYTES // 1024} KiB"
        d = Path(tmp) / "big"
        d.mkdir()
        big = federation(s, 2, s.big_devices, 4, d)
        print(json.dumps(big), flush=True)
        d = Path(tmp) / "relay"
        d.mkdir()
        relay = relay_bytes(s, d)
        print(json.dumps(relay), flush=True)
    return {"scaling": results, "big": big, "relay": relay, "ingest": ingest}


if __name__ == "__main__":
    main()
