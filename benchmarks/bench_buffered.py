"""Buffered asynchronous NeFedAvg against synchronous rounds on one emulated fleet of mixed speeds (issue 47); writes
docs/results.md's generated section.

    PYTHONPATH=. python benchmarks/bench_buffered.py [--seeds 3] [--jobs 1] [--time-budget-s 800] [--buffer-sizes 3 5]

Each run is `aggregator simulate --mode buffered|sync` in-process (aggregator/fleet_sim.py), one torch thread,
resumable: a finished run is saved as <out>/<setting>_<name>_s<seed>.json and skipped when present (name: sync,
buffered, or buffered-k<K> for a buffer size other than the declared one). Both modes train
the same devices (speeds 1x-10x, budgets, shards, vanishings: the fleet's draws depend on the seed only), IID and
Dirichlet(0.5), over the seeds declared below. Reported per setting and mode, over the seeds: the simulated time at
which every submodel first reaches TARGET (worst-submodel accuracy), the time buffered mode needs to reach the
synchronous run's final worst-submodel accuracy (the issue's criterion, per seed), the accuracy at the time budget,
the staleness of the committed updates, and the server's commit CPU time and buffer memory per version.
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from rich.console import Console

from aggregator.fleet import FleetConfig
from aggregator.fleet_sim import FleetSimulator
from aggregator.simulate import SimConfig
from nefl.aggregation.config import AggregationConfig
from nefl.aggregation.pipeline import Robustness
from nefl.aggregation.staleness import StalenessConfig
from nefl.support.fsio import atomic_write_text
from provenance import measured_by, provenance, write_section  # benchmarks/ is the script directory, on sys.path
from sweep import run_sweep

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "results.md"
START, END = "<!-- bench-buffered:start -->", "<!-- bench-buffered:end -->"
SETTINGS: dict[str, float | None] = {"iid": None, "dir0.5": 0.5}
TARGET = 0.5  # worst-submodel accuracy every submodel must reach; declared before the runs
# the last evaluations averaged for a steadier accuracy at the budget (one evaluation's worst submodel is noisy)
TAIL = 4
console = Console()


@dataclass(frozen=True)
class Budget:
    """Small enough for 2 shared CPU cores: 20 devices of 64 images each, 1000 test images per evaluation."""

    profile: str = "resnet8-fmnist-w"
    clients: int = 20
    concurrency: int = 5  # devices training at once; sync: participants per round
    samples_per_client: int = 64
    buffer_size: int = 3  # K, declared before the runs
    time_budget_s: float = 800.0
    eval_every_s: float = 50.0
    eval_samples: int = 1000


def run_name(mode: str, buffer_size: int) -> str:
    """sync, buffered (the declared K) or buffered-k<K>."""
    return mode if mode == "sync" or buffer_size == Budget.buffer_size else f"{mode}-k{buffer_size}"


@dataclass(frozen=True)
class Job:
    setting: str
    mode: str
    seed: int
    budget: Budget
    out: str

    @property
    def name(self) -> str:
        return run_name(self.mode, self.budget.buffer_size)

    @property
    def label(self) -> str:
        return f"{self.setting}/{self.name}/s{self.seed}"

    @property
    def path(self) -> str:
        return str(Path(self.out) / f"{self.setting}_{self.name}_s{self.seed}.json")

    @property
    def rounds(self) -> int:  # the progress bar's steps: evaluations
        return int(self.budget.time_budget_s // self.budget.eval_every_s) + 1


def run_job(job: Job, progress_queue) -> dict:
    torch.set_num_threads(1)
    b = job.budget
    cfg = SimConfig(b.profile, dataset="fashion-mnist", clients=b.clients, per_round=b.concurrency,
                    non_iid=SETTINGS[job.setting], seed=job.seed, max_samples_per_client=b.samples_per_client,
                    eval_samples=b.eval_samples, robustness=Robustness(aggregation=AggregationConfig(centre_check=False)))
    fleet = FleetConfig(mode=job.mode, concurrency=b.concurrency, time_budget_s=b.time_budget_s, eval_every_s=b.eval_every_s)
    started = time.time()
    sim = FleetSimulator(cfg, fleet, StalenessConfig(buffer_size=b.buffer_size))
    done = [0]

    def progress(line: dict) -> None:
        if line["kind"] == "eval":
            done[0] += 1
            progress_queue.put((job.label, done[0]))

    res = sim.run(progress)
    out = {**asdict(job), "fleet": asdict(fleet), "curve": res.curve, "tasks": res.tasks, "lost": res.lost,
           "refused": dict(res.refused), "seconds": res.seconds, "versions": len(res.commits),
           "updates": sum(len(c["staleness"]) for c in res.commits),
           "staleness": dict(Counter(s for c in res.commits for s in c["staleness"])),
           "trained": [sum(c["submodels"][k] for c in res.commits) for k in range(sim.layout.num_submodels)],
           "commit_cpu_s": statistics.median(c["cpu_s"] for c in res.commits) if res.commits else None,
           "buffer_bytes": max((c["buffer_bytes"] for c in res.commits), default=0),
           "state_bytes": res.commits[-1]["state_bytes"] if res.commits else None,
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "provenance": provenance(started, None)}
    Path(job.path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(job.path), json.dumps(out, indent=1))
    return out


def load(job: Job) -> dict | None:
    path = Path(job.path)
    return json.loads(path.read_text()) if path.exists() else None


def describe(r: dict) -> str:
    last = r["curve"][-1]
    return f"worst {last['worst']:.3f} avg {last['avg']:.3f} at {last['t']:g} s, {r['versions']} versions, {r['seconds']:.0f} s"


def first_time(curve: list[dict], level: float) -> float | None:
    """The first evaluation time at which every submodel is at `level` or above; None: never within the budget."""
    return next((p["t"] for p in curve if p["worst"] >= level), None)


def tail_mean(curve: list[dict], key: str) -> float:
    """`key` averaged over the last TAIL evaluations."""
    return statistics.fmean(p[key] for p in curve[-TAIL:])


def _mean_sd(xs: list[float], fmt: str = "{:.0f}") -> str:
    if not xs:
        return "-"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{fmt.format(statistics.fmean(xs))} ± {fmt.format(sd)}"


def _times(ts: list[float | None]) -> str:
    reached = [t for t in ts if t is not None]
    return _mean_sd(reached) + ("" if len(reached) == len(ts) else f" ({len(ts) - len(reached)} of {len(ts)} never)")


def report(results: list[dict], budget: Budget, seeds: list[int]) -> list[str]:
    by = {(r["setting"], run_name(r["mode"], r["budget"]["buffer_size"]), r["seed"]): r for r in results}
    names = sorted({name for _, name, _ in by}, key=lambda n: (n != "sync", n != "buffered", n))
    p = results[-1]["provenance"]
    lines = ["## Generated: buffered asynchronous vs synchronous NeFedAvg on an emulated fleet (`benchmarks/bench_buffered.py`)",
             "", measured_by("PYTHONPATH=. python benchmarks/bench_buffered.py", p), "",
             f"{budget.profile}, {budget.clients} emulated devices of {budget.samples_per_client} Fashion-MNIST images "
             f"(step times 1x-{FleetConfig.slowest:g}x, {FleetConfig.vanish:.0%} of tasks lost to a vanishing device), "
             f"{budget.concurrency} training at once, buffer K = {budget.buffer_size} (buffered-kN: K = N), staleness 1/sqrt(1 + tau), "
             f"{budget.time_budget_s:g} simulated s, evaluated every {budget.eval_every_s:g} s on {budget.eval_samples} "
             f"test images; seeds {seeds}, target: every submodel at {TARGET:.0%}. Mean ± sd over the seeds.", "",
             "| setting | run | s to every submodel >= target | s to sync's final worst | worst at budget | avg at budget "
             f"| worst, last {TAIL} evaluations | avg, last {TAIL} | versions | updates committed | real s per run |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for setting in SETTINGS:
        for mode in names:
            runs = [by[(setting, mode, s)] for s in seeds if (setting, mode, s) in by]
            if not runs:
                continue
            to_sync = [first_time(r["curve"], by[(setting, "sync", r["seed"])]["curve"][-1]["worst"])
                       for r in runs if (setting, "sync", r["seed"]) in by]
            lines.append(
                f"| {setting} | {mode} | {_times([first_time(r['curve'], TARGET) for r in runs])} | {_times(to_sync)} | "
                f"{_mean_sd([100 * r['curve'][-1]['worst'] for r in runs], '{:.1f}')} | "
                f"{_mean_sd([100 * r['curve'][-1]['avg'] for r in runs], '{:.1f}')} | "
                f"{_mean_sd([100 * tail_mean(r['curve'], 'worst') for r in runs], '{:.1f}')} | "
                f"{_mean_sd([100 * tail_mean(r['curve'], 'avg') for r in runs], '{:.1f}')} | {_mean_sd([r['versions'] for r in runs])} | "
                f"{_mean_sd([r['updates'] for r in runs])} | {_mean_sd([r['seconds'] for r in runs])} |")
    lines += ["", "Staleness of the committed updates (buffered, all seeds), updates refused, and the server's cost per "
              "committed version (median commit CPU time: finalize and state check; the buffer's largest tensor memory):",
              "", "| setting | run | staleness: updates | refused | commit CPU ms | buffer MiB | model MiB | trained per submodel |",
              "|---|---|---|---|---:|---:|---:|---|"]
    for setting, name in itertools.product(SETTINGS, names[1:]):
        runs = [by[(setting, name, s)] for s in seeds if (setting, name, s) in by]
        if not runs:
            continue
        seen: Counter[int] = Counter()
        refused: Counter[str] = Counter()
        for r in runs:
            seen.update({int(k): v for k, v in r["staleness"].items()})
            refused.update(r["refused"])
        trained = [sum(r["trained"][k] for r in runs) for k in range(len(runs[0]["trained"]))]
        lines.append(f"| {setting} | {name} | {', '.join(f'{k}: {v}' for k, v in sorted(seen.items()))} | {dict(refused) or 'none'} | "
                     f"{1000 * statistics.fmean(r['commit_cpu_s'] for r in runs):.1f} | "
                     f"{max(r['buffer_bytes'] for r in runs) / 2**20:.2f} | {runs[0]['state_bytes'] / 2**20:.2f} | {trained} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--time-budget-s", type=float, default=Budget.time_budget_s)
    ap.add_argument("--buffer-sizes", type=int, nargs="+", default=[Budget.buffer_size], help="buffered runs' K")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "buffered"))
    ap.add_argument("--no-doc", action="store_true", help="print the tables, leave docs/results.md alone")
    args = ap.parse_args()
    budget = Budget(time_budget_s=args.time_budget_s)
    seeds = list(range(args.seeds))
    runs = [("sync", budget), *(("buffered", replace(budget, buffer_size=k)) for k in args.buffer_sizes)]
    jobs = [Job(setting, mode, seed, b, args.out) for seed in seeds for setting in SETTINGS for mode, b in runs]
    results = run_sweep(jobs, args.jobs, run_job, load, describe, console)
    lines = report(results, budget, seeds)
    console.print("\n".join(lines))
    if not args.no_doc:
        write_section(DOC, START, END, lines)


if __name__ == "__main__":
    main()
