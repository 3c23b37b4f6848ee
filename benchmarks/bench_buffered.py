"""Buffered asynchronous NeFedAvg against synchronous rounds on one emulated fleet of mixed speeds (issue 47); writes
docs/results.md's generated section.

    PYTHONPATH=. python benchmarks/bench_buffered.py [--seeds 3] [--jobs 1] [--time-budget-s 800] [--runs sync ...]

Each run is `aggregator simulate --mode buffered|sync` in-process (aggregator/fleet_sim.py), one torch thread,
resumable: a finished run is saved as <out>/<setting>_<run>_s<seed>.json and skipped when present. The runs (RUNS):
synchronous rounds of `concurrency` devices (sync) and of every online device (sync-all), and buffered with every
online device in flight. All train the same devices (speeds 1x-10x, budgets, shards, vanishings), IID and
Dirichlet(0.5), over the seeds declared below. Reported per setting and run, over the seeds: the simulated time at
which every submodel first reaches TARGET, the time to reach the synchronous baseline's final worst-submodel accuracy
(baseline: per seed, the better of the sync runs; the issue's criterion), the accuracy at the time budget, the
staleness of the committed updates, the tasks of the fastest and slowest device, and the server's commit CPU time and
buffer memory per version.
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console

from aggregator.fleet import CoverageConfig, FleetConfig, FleetMode
from aggregator.fleet_sim import FleetSimulator
from aggregator.simulate import SimConfig
from nefl.aggregation.config import PLAIN_NEFEDAVG
from nefl.aggregation.pipeline import Robustness
from nefl.aggregation.staleness import Normalise, StalenessConfig
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
    concurrency: int = 5  # sync: devices a round
    samples_per_client: int = 64
    time_budget_s: float = 800.0
    eval_every_s: float = 50.0
    eval_samples: int = 1000


@dataclass(frozen=True)
class Run:
    """One compared setting of the fleet and the server step."""

    mode: FleetMode
    every_device: bool = False  # sync: every device a round; buffered: every online device in flight
    buffer_size: int = 5  # buffered: K, declared before the runs
    normalise: Normalise = "coverage"  # buffered: the divisor, declared before the runs
    coverage: CoverageConfig = CoverageConfig()  # buffered: which submodel each task trains (the default: steering)


RUNS: dict[str, Run] = {
    "sync": Run("sync"),
    "sync-all": Run("sync", every_device=True),
    "buffered": Run("buffered", every_device=True, coverage=CoverageConfig(steer_window=None)),
    "buffered-steer": Run("buffered", every_device=True),
}
BASELINES = [name for name, run in RUNS.items() if run.mode == "sync"]


def fleet_configs(run: Run, b: Budget) -> tuple[FleetConfig, StalenessConfig]:
    """The fleet and buffer settings of `run` under `b`."""
    fleet = FleetConfig(mode=run.mode, concurrency=b.clients if run.every_device else b.concurrency,
                        in_flight=None if run.every_device else b.concurrency, time_budget_s=b.time_budget_s,
                        eval_every_s=b.eval_every_s, coverage=run.coverage)
    return fleet, StalenessConfig(buffer_size=run.buffer_size, normalise=run.normalise)


@dataclass(frozen=True)
class Job:
    setting: str
    name: str  # a key of RUNS
    seed: int
    budget: Budget
    out: str

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
                    eval_samples=b.eval_samples, robustness=Robustness(aggregation=PLAIN_NEFEDAVG))
    fleet, staleness = fleet_configs(RUNS[job.name], b)
    started = time.time()
    sim = FleetSimulator(cfg, fleet, staleness)
    done = [0]

    def progress(line: dict) -> None:
        if line["kind"] == "eval":
            done[0] += 1
            progress_queue.put((job.label, done[0]))

    res = sim.run(progress)
    out = {**asdict(job), "fleet": asdict(fleet), "staleness_config": asdict(staleness), "curve": res.curve,
           "tasks": res.tasks, "lost": res.lost, "device_tasks": [res.device_tasks[d] for d in range(b.clients)],
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


def baseline(by: dict, setting: str, seed: int, value) -> float | None:
    """`value(curve)` of the synchronous baseline at this seed: the best over the sync runs there; None: none ran."""
    vals = [value(by[(setting, name, seed)]["curve"]) for name in BASELINES if (setting, name, seed) in by]
    return max(vals, default=None)


def criterion(r: dict, by: dict, budget: Budget) -> bool | None:
    """The issue's bar for one buffered run: every submodel reaches the baseline's final worst accuracy within half
    the budget, and its last evaluations' worst is no lower than the baseline's; None: no baseline ran."""
    final = baseline(by, r["setting"], r["seed"], lambda c: c[-1]["worst"])
    tail = baseline(by, r["setting"], r["seed"], lambda c: tail_mean(c, "worst"))
    if final is None or tail is None:
        return None
    reached = first_time(r["curve"], final)
    return reached is not None and reached <= budget.time_budget_s / 2 and tail_mean(r["curve"], "worst") >= tail


def describe_run(name: str, budget: Budget) -> str:
    run = RUNS[name]
    if run.mode == "sync":
        return f"{name}: rounds of {budget.clients if run.every_device else budget.concurrency} devices"
    window = run.coverage.steer_window
    steer = f"lag rule ({run.coverage.lag} versions)" if window is None else f"steered by the last {window} tasks"
    return (f"{name}: {'every online device' if run.every_device else budget.concurrency} in flight, K = "
            f"{run.buffer_size}, divisor {run.normalise}, {steer}")


def report(results: list[dict], budget: Budget, seeds: list[int]) -> list[str]:
    by = {(r["setting"], r["name"], r["seed"]): r for r in results}
    names = [n for n in RUNS if any(key[1] == n for key in by)]
    p = results[-1]["provenance"]
    half = budget.time_budget_s / 2
    lines = ["## Generated: buffered asynchronous vs synchronous NeFedAvg on an emulated fleet (`benchmarks/bench_buffered.py`)",
             "", measured_by("PYTHONPATH=. python benchmarks/bench_buffered.py", p), "",
             f"{budget.profile}, {budget.clients} emulated devices of {budget.samples_per_client} Fashion-MNIST images "
             f"(step times 1x-{FleetConfig.slowest:g}x; a device vanishes with {FleetConfig.vanish:.0%} chance per simulated "
             f"minute and stays away {FleetConfig.away_s:g} s on average), "
             f"{budget.time_budget_s:g} simulated s, evaluated every {budget.eval_every_s:g} s on {budget.eval_samples} "
             f"test images, staleness 1/sqrt(1 + tau); seeds {seeds}, target: every submodel at {TARGET:.0%}. Runs: "
             + "; ".join(describe_run(n, budget) for n in names) + ". Baseline: per seed, the better sync run "
             f"(its final worst for the time, its last-{TAIL} worst for the end). Criterion: the baseline's final worst "
             f"reached by {half:g} s and a last-{TAIL} worst no lower than the baseline's. Mean ± sd over the seeds.", "",
             "| setting | run | s to every submodel >= target | s to baseline's final worst | worst at budget | avg at budget "
             f"| worst, last {TAIL} evaluations | avg, last {TAIL} | versions | updates committed | criterion met | real s per run |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for setting in SETTINGS:
        for name in names:
            runs = [by[(setting, name, s)] for s in seeds if (setting, name, s) in by]
            if not runs:
                continue
            to_base = [first_time(r["curve"], f) for r in runs
                       if (f := baseline(by, setting, r["seed"], lambda c: c[-1]["worst"])) is not None]
            met = [criterion(r, by, budget) for r in runs] if RUNS[name].mode == "buffered" else []
            lines.append(
                f"| {setting} | {name}{'' if len(runs) == len(seeds) else f' ({len(runs)} of {len(seeds)} seeds ran)'} | "
                f"{_times([first_time(r['curve'], TARGET) for r in runs])} | {_times(to_base)} | "
                f"{_mean_sd([100 * r['curve'][-1]['worst'] for r in runs], '{:.1f}')} | "
                f"{_mean_sd([100 * r['curve'][-1]['avg'] for r in runs], '{:.1f}')} | "
                f"{_mean_sd([100 * tail_mean(r['curve'], 'worst') for r in runs], '{:.1f}')} | "
                f"{_mean_sd([100 * tail_mean(r['curve'], 'avg') for r in runs], '{:.1f}')} | {_mean_sd([r['versions'] for r in runs])} | "
                f"{_mean_sd([r['updates'] for r in runs])} | "
                f"{f'{sum(m is True for m in met)} of {len(met)} seeds' if met else '-'} | {_mean_sd([r['seconds'] for r in runs])} |")
    lines += ["", "Staleness of the committed updates (all seeds), updates refused, tasks started by the fastest and the "
              "slowest device (mean per run), and the server's cost per committed version (median commit CPU time: "
              "finalize and state check; the buffer's largest tensor memory):",
              "", "| setting | run | staleness: updates | refused | tasks, fastest / slowest device | commit CPU ms "
              "| buffer MiB | model MiB | trained per submodel |",
              "|---|---|---|---|---:|---:|---:|---:|---|"]
    for setting, name in itertools.product(SETTINGS, names):
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
                     f"{statistics.fmean(r['device_tasks'][0] for r in runs):.0f} / "
                     f"{statistics.fmean(r['device_tasks'][-1] for r in runs):.0f} | "
                     f"{1000 * statistics.fmean(r['commit_cpu_s'] for r in runs):.1f} | "
                     f"{max(r['buffer_bytes'] for r in runs) / 2**20:.2f} | {runs[0]['state_bytes'] / 2**20:.2f} | {trained} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--seed-from", type=int, default=0, help="the first seed (a pilot seed outside the reported ones)")
    ap.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--time-budget-s", type=float, default=Budget.time_budget_s)
    ap.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS), help="which of RUNS to run")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "buffered"))
    ap.add_argument("--no-doc", action="store_true", help="print the tables, leave docs/results.md alone")
    ap.add_argument("--report-only", action="store_true", help="report the runs on disk, run none")
    args = ap.parse_args()
    budget = Budget(time_budget_s=args.time_budget_s)
    seeds = list(range(args.seed_from, args.seed_from + args.seeds))
    # setting by setting: a sweep cut short leaves whole settings over every seed
    jobs = [Job(setting, name, seed, budget, args.out) for setting in args.settings for seed in seeds for name in args.runs]
    results = ([r for j in jobs if (r := load(j)) is not None] if args.report_only
               else run_sweep(jobs, args.jobs, run_job, load, describe, console))
    lines = report(results, budget, seeds)
    console.print("\n".join(lines))
    if not args.no_doc:
        write_section(DOC, START, END, lines)


if __name__ == "__main__":
    main()
