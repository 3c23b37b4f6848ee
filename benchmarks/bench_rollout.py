"""A model rollout end to end, measured: three `edge-client serve --follow` devices answer HTTP requests back to
back while `aggregator publish` rolls a trained ladder out to them, swaps it for a newer one, and sends a slow
version to one canary, which the rule rolls back before the other two get it. Reports failed requests, the
swap pause, bytes per device against the full export and every refusal's message; rewrites the generated
section of docs/deploy.md.

    python benchmarks/bench_rollout.py --v1 EXPORT --v2 EXPORT [--note TEXT]

--v1 and --v2 are exports of two checkpoints of one federation (docs/deploy.md, "Measured", says which);
the bad version is --v2 with a latency regression that passes every hash and parity check
(tests/harness/rollout_helpers.py `slow_export`). Everything runs on 127.0.0.1: mosquitto at a free port,
devices as separate processes, the operator's commands as real `aggregator` processes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import ROOT, measured_by, provenance, write_section  # benchmarks/ is the script directory, on sys.path

sys.path.insert(0, str(ROOT))
import paho.mqtt.client as mqtt  # noqa: E402

from aggregator.enrolment import Grant, append  # noqa: E402
from aggregator.keys import KeyDir  # noqa: E402
from nefl.protocol.manifest import read_manifest  # noqa: E402
from nefl.protocol.signing import Signer  # noqa: E402
from nefl.protocol.topics import Topics  # noqa: E402
from nefl.protocol.wire import split_chunk  # noqa: E402
from tests.harness.rollout_helpers import LoadLoop, get_json, release_messages, rollout, slow_export  # noqa: E402

DOC = ROOT / "docs" / "deploy.md"
RESULTS = ROOT / "benchmarks" / "results" / "rollout.json"
BEGIN, END = "<!-- bench_rollout:begin -->", "<!-- bench_rollout:end -->"
FED = "demo"
MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(cond, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if value := cond():
            return value
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}")


class Lab:
    """The processes of one run and where their logs go."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.procs = tmp, {}
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    "NEFL_CACHE_DIR": str(tmp / "cache"), "NEFL_KEY_DIR": str(tmp / "keys")}
        self.broker = free_port()
        conf = tmp / "mosquitto.conf"
        conf.write_text(f"listener {self.broker} 127.0.0.1\npersistence false\nallow_anonymous true\n"
                        + ("user root\n" if os.geteuid() == 0 else ""))
        self.start("mosquitto", [MOSQUITTO, "-c", str(conf)])
        wait(lambda: socket.socket().connect_ex(("127.0.0.1", self.broker)) == 0, 10, "mosquitto")
        self.run_dir = tmp / "run"
        self.key = KeyDir(FED, tmp / "keys").server_signer()  # what the operator commands below sign with

    def start(self, name: str, argv: list[str]) -> None:
        self.procs[name] = subprocess.Popen(argv, stdout=open(self.tmp / f"{name}.log", "w"), stderr=subprocess.STDOUT,
                                            env=self.env, cwd=self.tmp)

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()

    def device(self, name: str, *extra: str) -> int:
        """A following device, enrolled first with its device key (its reports count only under that key)."""
        port = free_port()
        device_key = Signer.load_or_create(self.tmp, f"{name}.key")
        append(KeyDir(FED, self.tmp / "keys").journal, Grant(client=name, role="follower", created=time.time(),
                                                                 key=device_key.public_text))
        self.start(name, [sys.executable, "-c", "from edge_client.cli import app; app()", "serve", "--follow",
                          f"mqtt://127.0.0.1:{self.broker}", "--federation", FED, "--server-key", self.key.public_text,
                          "--client-id", name, "--device-key", str(self.tmp / f"{name}.key"), "--models",
                          str(self.tmp / name), "--port", str(port), "--threads", "1", *extra])
        return port

    def aggregator(self, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
        started = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", "from aggregator.cli import app; app()", *args,
                              "--broker", f"mqtt://127.0.0.1:{self.broker}", "--federation", FED,
                              "--checkpoint-dir", str(self.run_dir)], env=self.env, cwd=self.tmp, capture_output=True,
                             text=True, timeout=900)
        return out, time.perf_counter() - started

    def publish_raw(self, messages: list[tuple[str, bytes]]) -> None:
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv311)
        client.connect("127.0.0.1", self.broker)
        client.loop_start()
        for topic, payload in messages:
            client.publish(topic, payload, qos=1, retain=True).wait_for_publish(10)
            time.sleep(0.3)  # one at a time: a retained message replaces the one before on its topic
        client.disconnect()
        client.loop_stop()

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)


def version_of(port: int) -> int | None:
    return get_json(f"http://127.0.0.1:{port}/health")[1].get("version")


def ms(seconds: list[float], q: float) -> float:
    ordered = sorted(seconds)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def swap_numbers(loop: LoadLoop, published: float) -> dict:
    """What one device's requests saw of the v1 -> v2 swap: failures, latencies before and around it, and the
    gap between the last answer of v1 and the first request answered by v2."""
    answers = sorted(loop.answers, key=lambda a: a.sent)
    versions = [a.version for a in answers]
    first = versions.index(2)
    before = [a.seconds for a in answers if a.sent + a.seconds < published]
    around = [a.seconds for a in answers if published <= a.sent <= answers[first].sent + 1.0]
    last_v1 = answers[first - 1]
    return {"requests": len(answers), "failed": sum(a.status != 200 for a in answers),
            "one_swap": set(versions[:first]) == {1} and 1 not in versions[first:],
            "p50_before_ms": ms(before, 0.5), "p95_before_ms": ms(before, 0.95),
            "p95_during_ms": ms(around, 0.95), "max_during_ms": max(around) * 1000,
            "gap_ms": (answers[first].sent - (last_v1.sent + last_v1.seconds)) * 1000,
            "v2_latency_ms": answers[first].seconds * 1000}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--v1", type=Path, required=True)
    ap.add_argument("--v2", type=Path, required=True)
    ap.add_argument("--note", help="said beside the machine, e.g. 'shared 2-core machine, other jobs running'")
    args = ap.parse_args()
    started = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    lab = Lab(tmp)
    try:
        results = scenario(lab, args.v1.resolve(), args.v2.resolve())
    finally:
        lab.close()
    results["provenance"] = provenance(started, args.note)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    lines = render(results, args)
    write_section(DOC, BEGIN, END, lines)
    print("\n".join(lines))


def scenario(lab: Lab, v1: Path, v2: Path) -> dict:
    manifest = read_manifest(v1)
    ladder = sorted(manifest.submodels, key=lambda e: e.gamma)
    need = [e.weight_bytes + e.activation_bytes_per_sample for e in ladder]
    budget = (64 << 20) + (need[2] + need[3]) // 2  # d3 fits submodels 1-3 of 5
    ports = {"d1": lab.device("d1"), "d2": lab.device("d2"), "d3": lab.device("d3", "--memory-budget", str(budget))}
    for name, port in ports.items():
        wait(lambda: get_json(f"http://127.0.0.1:{port}/health")[0] == 503, 180, f"{name} to listen")
    bad = slow_export(v2, lab.tmp / "bad")

    first, first_s = lab.aggregator("publish", "--export", str(v1))
    assert first.returncode == 0, first.stderr
    wait(lambda: all(version_of(p) == 1 for p in ports.values()), 180, "v1 on every device")

    loops = {name: LoadLoop(port) for name, port in ports.items()}
    for loop in loops.values():
        loop.start()
    try:
        time.sleep(5)
        published = time.perf_counter()
        second, second_s = lab.aggregator("publish", "--export", str(v2))
        assert second.returncode == 0, second.stderr
        wait(lambda: all(version_of(p) == 2 for p in ports.values()), 180, "v2 on every device")
        after_v2, _ = lab.aggregator("rollout", "status", "--json")  # what each device fetched of v2
        swap = {name: swap_numbers(loop, published) for name, loop in loops.items()}
        canary, canary_s = lab.aggregator("publish", "--export", str(bad), "--canary", "0.34", "--min-requests", "30")
    finally:
        for loop in loops.values():
            loop.stop()
    status, _ = lab.aggregator("rollout", "status", "--json")
    table, _ = lab.aggregator("rollout", "status")
    view = json.loads(status.stdout)
    devices = {d["client"]: d for d in view["devices"]}
    on_v2 = {d["client"]: d for d in json.loads(after_v2.stdout)["devices"]}
    canaries = [n for n, d in devices.items() if "rolled back v3" in d["event"]]
    others_untouched = all(not list((lab.tmp / n).glob("*/v3")) and "v3" not in lab.log(n)
                           for n in ports if n not in canaries)
    failed_total = sum(a.status != 200 for loop in loops.values() for a in loop.answers)
    return {
        "export": {"v1": str(v1), "v2": str(v2), "source_round": {"v1": manifest.source_round,
                                                                   "v2": read_manifest(v2).source_round},
                   "files_bytes": sum(f.stat().st_size for f in v1.iterdir() if f.name != "manifest.json")},
        "publish_s": {"v1": first_s, "v2": second_s, "canary": canary_s},
        "swap": swap, "requests_total": sum(len(loop.answers) for loop in loops.values()), "failed_total": failed_total,
        "devices": {n: {k: d.get(k) for k in ("version", "submodels", "fetched_bytes", "release_bytes", "swap_ms", "event",
                                                   "current", "before")} for n, d in on_v2.items()},
        "devices_at_end": {n: {k: d.get(k) for k in ("version", "event", "current", "before")} for n, d in devices.items()},
        "canary": {"exit_code": canary.returncode, "devices": canaries, "others_untouched": others_untouched,
                   "verdict": next((line for line in canary.stderr.splitlines() if "rolled back before" in line), ""),
                   "reason": view["rollout"]["reason"]},
        "status_table": table.stdout,
        "refusals": refusals(lab, ports["d1"], v1, v2),
    }


def refusals(lab: Lab, port: int, v1: Path, v2: Path) -> dict[str, str]:
    """Each bad input against d1 (serving v2, stable), and the line it logged; d1 must keep serving v2."""
    t, forger = Topics(FED), Signer.load_or_create(lab.tmp / "forger")
    state = json.loads((KeyDir(FED, lab.tmp / "keys").rollout_dir / "rollout.json").read_text())
    seq = state["seq"]
    release, chunks = release_messages(lab.key, v2, 7, FED)
    topic, chunk = chunks[0]
    _, _, _, data = split_chunk(chunk)
    frame = chunk[:len(chunk) - len(data)]
    unsigned = rollout(lab.key, seq + 1, 7, FED)
    cases = {
        "unsigned manifest": [(t.deploy_rollout, unsigned[:unsigned.rindex(b',"sig"')] + b"}")],
        "wrongly signed manifest": [(t.deploy_rollout, rollout(forger, seq + 1, 7, FED))],
        "another federation": [(t.deploy_rollout, rollout(lab.key, seq + 1, 7, "other"))],
        "a replayed older rollout": [(t.deploy_rollout, rollout(lab.key, seq - 1, 1, FED))],
        "an older version, not a signed rollback": [(t.deploy_rollout, rollout(lab.key, seq + 1, 1, FED))],
        "truncated chunk": [(t.deploy_rollout, rollout(lab.key, seq + 2, 7, FED)), (t.deploy_release(7), release),
                            (topic, frame + data[:-10])],
        "oversized chunk": [(topic, frame + data + b"0123456789")],
        "hash mismatch": [(topic, frame + data[:-1] + bytes([data[-1] ^ 1]))],
    }
    found = {}
    for case, messages in cases.items():
        mark = len(lab.log("d1"))
        lab.publish_raw(messages)
        line = wait(lambda: next((ln for ln in lab.log("d1")[mark:].splitlines() if "WARNING" in ln), None), 30, case)
        found[case] = line.split("edge_client.follow: ", 1)[1]
        assert version_of(port) == 2, case
    found["too little disk"] = disk_refusal(lab, v1)
    return found


def disk_refusal(lab: Lab, v1: Path) -> str:
    """A fourth device that must keep more disk free than there is: refused before a byte is written."""
    lab.device("d4", "--keep-free", "100TB")
    line = wait(lambda: next((ln for ln in lab.log("d4").splitlines() if "cannot stage" in ln), None), 180, "d4's refusal")
    return re.sub(r" in /[^\s,]+", " in DIR", line.split("edge_client.follow: ", 1)[1])


def render(r: dict, args: argparse.Namespace) -> list[str]:
    p, swap, devs = r["provenance"], r["swap"], r["devices"]
    full = devs["d1"]["release_bytes"]
    rows = [f"| {n} | {s['requests']} | {s['failed']} | {'yes' if s['one_swap'] else 'NO'} | {s['p50_before_ms']:.1f} / "
            f"{s['p95_before_ms']:.1f} | {s['p95_during_ms']:.1f} / {s['max_during_ms']:.1f} | {s['gap_ms']:.2f} | "
            f"{devs[n]['swap_ms']} | {', '.join(str(k + 1) for k in devs[n]['submodels'])} | "
            f"{devs[n]['fetched_bytes']:,} of {full:,} ({devs[n]['fetched_bytes'] / full:.0%}) |"
            for n, s in swap.items()]
    refusals = [f"| {case} | `` {line} `` |" for case, line in r["refusals"].items()]
    return [
        measured_by("python benchmarks/bench_rollout.py --v1 ... --v2 ...", p),
        f"v1 and v2 are exports of the demo federation after rounds {r['export']['source_round']['v1']} and "
        f"{r['export']['source_round']['v2']} (resnet20-fmnist-w, five submodels); the bad version is v2 with an "
        "injected latency regression. Three devices answered POST /predict back to back for the whole run "
        f"({r['requests_total']:,} requests, {r['failed_total']} failed); d3 emulates a device with less memory "
        "(`--memory-budget`).",
        "",
        "| device | requests | failed | one swap, between requests | before: p50 / p95 ms | around the swap: p95 / max ms "
        "| gap at the swap ms | swap lock held ms | submodels fetched | bytes fetched of the full export |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "\"Around the swap\" is every request sent from the moment `aggregator publish` started until a second after "
        "the device's first v2 answer: it includes the download, the parity check and the calibration of v2, which "
        "share the device's cores with the requests. \"Gap at the swap\" is the time between the last v1 answer and "
        "the next request, which v2 answered: the swap itself stops nothing. `aggregator publish` took "
        f"{r['publish_s']['v1']:.1f} s for v1 and {r['publish_s']['v2']:.1f} s for v2, most of it importing torch "
        "and waiting 2 s for the devices' retained reports.",
        "",
        f"Canary: `aggregator publish --export BAD --canary 0.34 --min-requests 30` gave the bad version to "
        f"{', '.join(r['canary']['devices'])} only and exited {r['canary']['exit_code']} after "
        f"{r['publish_s']['canary']:.1f} s: {r['canary']['reason']}. The other devices "
        + ("never fetched a byte of it." if r["canary"]["others_untouched"] else "FETCHED IT (a failure)."),
        "",
        "`aggregator rollout status` afterwards:",
        "",
        "```",
        r["status_table"].rstrip(),
        "```",
        "",
        "Each refusal, as the device logged it (the old version kept serving every time):",
        "",
        "| bad input | the device's log line |",
        "|---|---|",
        *refusals,
    ]


if __name__ == "__main__":
    main()
