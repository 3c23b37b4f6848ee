"""A busy device still trains what fits: two bare `edge-client join`s beside external busy loops.

The scenario of issue 22: an aggregator with 15 s rounds (embedded broker, evaluation on 500 images)
and two identical devices, each a bare `join` on half of Fashion-MNIST with a fresh calibration cache,
while `--busy-loops` processes (`while 1: pass`, not the devices' children: someone else's load)
keep the CPU busy. Per round and device it reads from metrics.jsonl what the device chose (the
selection its update carries), which submodel it trained, the seconds per step it measured and the
ones it predicted before training, and checks

- every round has both reports;
- the chosen bound is the largest submodel whose *measured* step time fits MIN_BATCHES steps in the
  training time a round leaves (each submodel judged by its measurement nearest in rounds);
- predicted and measured seconds per step agree within 30 % after the first round.

It rewrites the generated section of docs/device-selection.md and exits 1 when a check fails.

    python benchmarks/bench_busy_device.py [--rounds 6] [--round-timeout 15] [--busy-loops 2] [--note TEXT]
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
from pathlib import Path

from provenance import ROOT, commit_label, cpu_name, load_average  # benchmarks/ is the script directory, on sys.path

sys.path.insert(0, str(ROOT))
from edge_client.agent import UPLOAD_SHARE  # noqa: E402
from edge_client.device import MIN_BATCHES  # noqa: E402

DOC = ROOT / "docs" / "device-selection.md"
BEGIN, END = "<!-- bench_busy_device:begin -->", "<!-- bench_busy_device:end -->"
TOLERANCE = 0.30
PROFILE = "resnet20-fmnist-w"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_federation(work: Path, rounds: int, timeout: float, loops: int) -> list[dict]:
    """Start the busy loops, the aggregator and two bare joins; wait for the end; the metrics lines."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "NEFL_CACHE_DIR": str(work / "cache"),  # a fresh device: it calibrates, on the busy machine
           "NEFL_KEY_DIR": str(work / "keys")}  # the aggregator's keys, apart from the user's
    port = free_port()
    url = f"mqtt://127.0.0.1:{port}"
    procs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(loops)]
    time.sleep(2)  # the load is there before anything starts, as on a device running its own application

    def start(name: str, argv: list[str]) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", *argv], stdout=open(work / f"{name}.log", "w"),
                             stderr=subprocess.STDOUT, env=env, cwd=work)
        procs.append(p)
        return p

    try:
        agg = start("agg", ["from aggregator.cli import app; app()", "serve", "--profile", PROFILE, "--embedded-port",
                            str(port), "--federation", "busy", "--rounds", str(rounds), "--clients-per-round", "2",
                            "--min-clients", "2", "--round-timeout", f"{timeout:g}", "--join-wait", "5",
                            "--eval-dataset", "fashion-mnist", "--eval-samples", "500",
                            "--checkpoint-dir", str(work / "run")])
        for i in (1, 2):
            start(f"c{i}", ["from edge_client.cli import app; app()", "join", "--broker", url, "--client-id", f"c{i}",
                            "--federation", "busy", "--partition", f"{i}/2", "--threads", "1"])
        if agg.wait(600 + rounds * timeout * 4) != 0:
            raise RuntimeError(f"the aggregator failed:\n{(work / 'agg.log').read_text()[-3000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    lines = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [m for m in lines if m["round"] >= 1]


def analyse(rounds: list[dict], timeout: float) -> tuple[list[list[str]], list[str]]:
    """Table rows and the failed checks."""
    budget = timeout * (1 - UPLOAD_SHARE)  # what the device may train in, at most
    steps: dict[int, dict[int, float]] = {}  # submodel -> round -> measured seconds per step (either device)
    for m in rounds:
        for stats in m["clients"].values():
            steps.setdefault(stats["submodel"], {})[m["round"]] = stats["step_s"]

    def measured(k: int, r: int) -> float | None:
        near = sorted(steps.get(k, {}).items(), key=lambda item: (abs(item[0] - r), item[0]))
        return near[0][1] if near else None

    rows, failed = [], []
    for m in rounds:
        r = m["round"]
        if sorted(m["reported"]) != ["c1", "c2"]:
            failed.append(f"round {r}: reported {m['reported']}, declined {m.get('declined')}")
        for c, stats in sorted(m["clients"].items()):
            bound = int(re.match(r"submodel (\d+)/", stats.get("selection", "")).group(1)) \
                if re.match(r"submodel (\d+)/", stats.get("selection", "")) else 0
            fits = [k for k in range(1, 6) if measured(k, r) is not None and MIN_BATCHES * measured(k, r) <= budget]
            largest = max(fits, default=0)
            error = stats["predicted_step_s"] / stats["step_s"] - 1 if "predicted_step_s" in stats else None
            if bound != largest:
                failed.append(f"round {r} {c}: chose submodel {bound}, the largest whose measured step fits is {largest}")
            if r >= 2 and (error is None or abs(error) > TOLERANCE):
                failed.append(f"round {r} {c}: predicted {stats.get('predicted_step_s')} s a step, measured {stats['step_s']} s")
            rows.append([str(r), c, str(bound), str(largest), str(stats["submodel"]), str(stats["steps"]),
                         f"{stats['step_s']:.3f}", f"{stats['predicted_step_s']:.3f}" if error is not None else "-",
                         f"{error:+.0%}" if error is not None else "-"])
    return rows, failed


def write_doc(rows: list[list[str]], failed: list[str], args: argparse.Namespace, load_before: str, wall: float) -> None:
    head = ["round", "device", "chose (bound)", "largest that fits (measured)", "trained", "steps", "measured s/step",
            "predicted s/step", "error"]
    table = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]
    verdict = "every check passed" if not failed else "FAILED: " + "; ".join(failed)
    text = "\n".join([
        BEGIN,
        f"Generated by `python benchmarks/bench_busy_device.py --rounds {args.rounds} --round-timeout {args.round_timeout:g} "
        f"--busy-loops {args.busy_loops}` at commit {commit_label()} on {cpu_name()}, {os.cpu_count()} cores; "
        f"load average before the run {load_before}. {args.note}".rstrip(),
        "",
        f"Two bare joins (`--threads 1`, half of Fashion-MNIST each, fresh calibration) and an aggregator with "
        f"{args.round_timeout:g} s rounds, beside {args.busy_loops} busy-loop processes; {wall:.0f} s in all. "
        f"\"Largest that fits\": the largest submodel whose measured seconds per step (nearest round in which either "
        f"device trained it) times {MIN_BATCHES} fits the {args.round_timeout * (1 - UPLOAD_SHARE):g} s a round leaves "
        f"for training. Predicted: the device's running calibration before the round; error = predicted / measured - 1 "
        f"(checked within {TOLERANCE:.0%} from round 2). Result: {verdict}.",
        "",
        *table,
        END,
    ])
    doc = DOC.read_text()
    if BEGIN in doc:
        doc = doc[:doc.index(BEGIN)] + text + doc[doc.index(END) + len(END):]
    else:
        doc = doc.rstrip("\n") + "\n\n" + text + "\n"
    DOC.write_text(doc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--round-timeout", type=float, default=15.0)
    ap.add_argument("--busy-loops", type=int, default=2)
    ap.add_argument("--note", default="", help="Said beside the numbers, e.g. that other jobs shared the machine.")
    ap.add_argument("--keep", type=Path, help="Keep the logs and the run directory here (default: a temporary one).")
    args = ap.parse_args()
    load_before = load_average()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="nefl-busy-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        rounds = run_federation(work, args.rounds, args.round_timeout, args.busy_loops)
    rows, failed = analyse(rounds, args.round_timeout)
    for row in rows:
        print("  ".join(row))
    print("\n".join(failed) or "every check passed")
    write_doc(rows, failed, args, load_before, time.monotonic() - t0)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
