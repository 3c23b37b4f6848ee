"""Rounds per minute of the paper-size setting (100 clients, 10 a round) on Flower's simulation engine
against `aggregator simulate`, in one run on one machine -> docs/flower.md, benchmarks/results/flower.json.

Flower: `flwr run examples/flower-nefl` (a local SuperLink, the simulation engine with 1, 2 and 4 Ray
worker processes of one torch thread each). The simulator: the `aggregator simulate` command in one
process, with 1 and 2 torch threads. Same profile, seed, shards, paper tiers and assignment everywhere,
so every run trains the same updates and ends with the same accuracies (the equivalence the tests
check, at full size). A round's time is its `wall_s` in metrics.jsonl: from opening the round to
committing it, training included; the last round, which also evaluates, is left out of the mean.

Run it in .venv-flower (`make env-flower`): `.venv-flower/bin/python benchmarks/bench_flower.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import ROOT, measured_by, provenance, write_section  # benchmarks/ is the script directory, on sys.path

sys.path.insert(0, str(ROOT))
from tests.harness.flower_helpers import flwr_run  # noqa: E402

DOC = ROOT / "docs" / "flower.md"
RESULTS = ROOT / "benchmarks" / "results" / "flower.json"
BEGIN, END = "<!-- bench_flower:begin -->", "<!-- bench_flower:end -->"
SETTING = {"profile": "resnet8-fmnist-w", "clients": 100, "per_round": 10, "local_epochs": 1, "assignment": "paper",
           "final_eval_samples": 2000}
# the `aggregator simulate` command itself; the rest of the aggregator CLI (the broker) needs amqtt, not in .venv-flower
SIMULATE = ("import typer; from aggregator.simulate_cli import simulate_command; app = typer.Typer(add_completion=False); "
            "app.command()(simulate_command); app()")


def simulate(out: Path, rounds: int, threads: int) -> dict:
    args = [f"--{k.replace('_', '-')}={v}" for k, v in SETTING.items()]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", SIMULATE, *args, f"--rounds={rounds}", "--eval-every=0", f"--threads={threads}",
                    f"--out={out}"], env=env, check=True, capture_output=True, text=True)
    return summary(out, time.monotonic() - t0)


def flower(out: Path, rounds: int, workers: int) -> dict:
    overrides = (f"rounds={rounds} per-round={SETTING['per_round']} local-epochs={SETTING['local_epochs']} "
                 f"assignment='{SETTING['assignment']}' max-samples-per-client='' eval-every=0 "
                 f"eval-samples={SETTING['final_eval_samples']} fraction-evaluate=0.0 out='{out}'")
    federation = f"num-supernodes={SETTING['clients']} client-resources-num-cpus=1 init-args-num-cpus={workers}"
    run, seconds = flwr_run(out.parent / f"{out.name}-home", overrides, federation, timeout=3600)
    if run.returncode != 0 or not (out / "metrics.jsonl").exists():
        raise SystemExit(f"flwr run failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    return summary(out, seconds)


def summary(out: Path, total_s: float) -> dict:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["round"] > 0]
    rounds = [r["wall_s"] for r in rows[:-1]]  # the last one also evaluates
    mean = statistics.fmean(rounds)
    return {"round_s": rounds, "mean_round_s": mean, "rounds_per_min": 60 / mean, "total_s": total_s,
            "outside_rounds_s": total_s - sum(r["wall_s"] for r in rows), "accuracy": rows[-1]["accuracy"],
            "assigned": [r["assigned"] for r in rows]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6, help="rounds per run (the last one, which evaluates, is not timed)")
    ap.add_argument("--note", help="said beside the machine, e.g. 'shared 2-core machine, other jobs running'")
    args = ap.parse_args()
    started = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="bench-flower-"))
    runs = {}
    for name, go in [("simulate, 1 thread", lambda o: simulate(o, args.rounds, 1)),
                     ("flwr run, 1 worker", lambda o: flower(o, args.rounds, 1)),
                     ("simulate, 2 threads", lambda o: simulate(o, args.rounds, 2)),
                     ("flwr run, 2 workers", lambda o: flower(o, args.rounds, 2)),
                     ("flwr run, 4 workers", lambda o: flower(o, args.rounds, 4))]:
        runs[name] = go(tmp / name.replace(", ", "-").replace(" ", "_"))
        print(f"{name}: {runs[name]['rounds_per_min']:.2f} rounds/min, final accuracy {runs[name]['accuracy']}", flush=True)
    results = {"setting": {**SETTING, "rounds": args.rounds}, "runs": runs, "provenance": provenance(started, args.note)}
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    lines = render(results)
    write_section(DOC, BEGIN, END, lines)
    print("\n".join(lines))


def render(r: dict) -> list[str]:
    """The lines between the markers of docs/flower.md."""
    p, s, runs = r["provenance"], r["setting"], r["runs"]
    base = runs["simulate, 1 thread"]
    same = {n: v["assigned"] == base["assigned"] for n, v in runs.items()}
    diff = {n: max(abs(a - b) for a, b in zip(v["accuracy"], base["accuracy"])) for n, v in runs.items()}
    rows = [f"| {n} | {v['mean_round_s']:.1f} | **{v['rounds_per_min']:.2f}** | {v['rounds_per_min'] / base['rounds_per_min']:.2f}x "
            f"| {v['outside_rounds_s']:.0f} | {v['total_s']:.0f} | {' / '.join(f'{a:.3f}' for a in v['accuracy'])} "
            f"| {'yes' if same[n] else 'NO'}, {diff[n]:.4f} |" for n, v in runs.items()]
    return [
        measured_by(".venv-flower/bin/python benchmarks/bench_flower.py", p),
        f"Setting: {s['profile']} (5 submodels), {s['clients']} clients with their full IID shards (600 images), "
        f"{s['per_round']} a round, E = {s['local_epochs']}, batch 32, the paper's tiers and assignment, {s['rounds']} "
        "rounds per run; rounds timed from opening to commit (training included), the last round (it also evaluates "
        f"{s['final_eval_samples']} test images) left out of the mean.",
        "",
        "| run | s / round | rounds / min | vs simulate, 1 thread | s outside rounds (start-up) | s in all "
        "| final accuracy, submodels 1-5 | same assignments as simulate; largest accuracy difference |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "\"Outside rounds\" is everything else in the run's wall time: for `flwr run`, starting the SuperLink, the "
        "simulation process and its Ray workers, and the nodes' join queries; for the simulator, importing torch and "
        "loading the data.",
    ]


if __name__ == "__main__":
    main()
