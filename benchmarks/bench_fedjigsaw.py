"""FedJigsaw against HeteroFL and FedRolex (and its two ablations) on Fashion-MNIST; writes docs/fedjigsaw.md's
generated section and docs/img/fedjigsaw-curves.png.

    PYTHONPATH=. python benchmarks/bench_fedjigsaw.py [--quick] [--jobs 2] [--seeds 2] [--rounds 40] [--out DIR]

The sweep: Dirichlet(1.0) ("low non-IID") and Dirichlet(0.1) ("high non-IID") x five methods x the seeds; 10
clients with CNN-2/3/4/6 round-robin, all active every round, as the paper's protocol, scaled to 2 cores: 40
rounds (the first 20 are FedJigsaw's CoRe-Tune phase), 300 images per client (10% of them the reward's validation
split), 300 local test images per client drawn with its own label distribution, evaluation every 4 rounds. With 2
jobs on the 2-core machine a run takes about 2 minutes and the 20 runs about 21 minutes (--rounds 16 with other
work loading the machine to 6-15: 22 minutes). Resumable: every finished run is <out>/<setting>/<method>-seed<S>.json
and is skipped when present. Also measures the decision overhead (the paper's Table 2) in fresh processes:
`_overhead client` (one client's policy: assemble + REINFORCE update) and `_overhead server` (the critic).
--quick: 2 rounds, 60 images per client, one seed, IID-ish Dir(1.0) only, into runs/bench-fedjigsaw-quick.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import resource
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import torch

from aggregator.jigsaw_sim import METHOD_TITLES, METHODS, JigsawConfig, JigsawSimulator, policy_parameters
from nefl.fsio import atomic_write_text
from provenance import commit_label, cpu_name, load_average  # benchmarks/ is the script directory, on sys.path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "fedjigsaw.md"
START, END = "<!-- bench-fedjigsaw:start -->", "<!-- bench-fedjigsaw:end -->"
SETTINGS = {"dir-1.0": 1.0, "dir-0.1": 0.1}
SETTING_TITLES = {"dir-1.0": "Low non-IID, Dir(1.0)", "dir-0.1": "High non-IID, Dir(0.1)"}


@dataclass(frozen=True)
class Budget:
    rounds: int = 40
    samples_per_client: int = 300
    test_per_client: int = 300
    clients: int = 10
    eval_every: int = 4


@dataclass(frozen=True)
class Job:
    setting: str
    method: str
    seed: int
    path: str
    budget: Budget

    @property
    def label(self) -> str:
        return f"{self.setting} {self.method} seed {self.seed}"


def run_job(job: Job) -> dict:
    """Worker: one federation with one torch thread; the summary lands atomically in job.path."""
    torch.set_num_threads(1)
    b = job.budget
    cfg = JigsawConfig(method=job.method, clients=b.clients, rounds=b.rounds, non_iid=SETTINGS[job.setting],
                       seed=job.seed, max_samples_per_client=b.samples_per_client, test_per_client=b.test_per_client,
                       eval_every=b.eval_every, out=str(Path(job.path).with_suffix("")))
    sim = JigsawSimulator(cfg)
    res = sim.run()
    rows = res.rounds
    decisions = [s for r in rows for s in r.get("decision_seconds", [])]
    out = {
        "setting": job.setting, "method": job.method, "seed": job.seed, "budget": dataclasses.asdict(b),
        "accuracy": res.accuracy, "mean": res.mean, "std": res.std, "seconds": res.seconds,
        "trained_accuracy": rows[-1]["trained_accuracy"], "trained_mean": rows[-1]["trained_mean"],
        "trained_std": rows[-1]["trained_std"],
        "curve": [{"round": r["round"] + 1, "mean": r["mean"], "std": r["std"], "trained_mean": r["trained_mean"],
                   "trained_std": r["trained_std"]} for r in rows if "mean" in r],
        "architectures": res.architectures, "bases": [base.name for base in sim.bases],
        "budgets_mib": [x / 2**20 for x in sim.budgets],
        "widths": getattr(sim, "widths", None),
        "bytes_per_round": {k: statistics.fmean(r["bytes"][k] for r in rows) for k in rows[0]["bytes"]},
        "decision_seconds": {"mean": statistics.fmean(decisions), "max": max(decisions)} if decisions else None,
        "policy_update_seconds": statistics.fmean(r["policy_update_seconds"] for r in rows) if decisions else None,
        "critic_seconds": statistics.fmean(r["critic_seconds"] for r in rows if r.get("coretune")) if sim.cfg.coretune_rounds() else None,
        "parameters": dict(zip(("actor", "critic"), policy_parameters(sim))),
    }
    path = Path(job.path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(out, indent=1))
    return out


def load_result(path: Path, budget: Budget) -> dict | None:
    if not path.exists():
        return None
    result = json.loads(path.read_text())
    if result["budget"] != dataclasses.asdict(budget):
        raise SystemExit(f"{path} was run with {result['budget']}, not {dataclasses.asdict(budget)}: delete it or pass another --out")
    return result


def run_sweep(jobs: list[Job], workers: int, budget: Budget) -> list[dict]:
    results = [r for j in jobs if (r := load_result(Path(j.path), budget))]
    todo = [j for j in jobs if not Path(j.path).exists()]
    print(f"{len(jobs)} runs: {len(results)} already done, {len(todo)} to run with {workers} job(s)", flush=True)
    failed = []
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        pending: dict[Future, Job] = {pool.submit(run_job, j): j for j in todo}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                job = pending.pop(fut)
                try:
                    r = fut.result()
                except Exception as exc:  # one broken run must not lose the others' time
                    failed.append(f"{job.label}: {type(exc).__name__}: {exc}")
                    print(failed[-1], flush=True)
                    continue
                results.append(r)
                print(f"{job.label}: local acc {100 * r['mean']:.2f} ± {100 * r['std']:.2f} ({r['seconds']:.0f} s) "
                      f"[{len(results)}/{len(jobs)}]", flush=True)
    if failed:
        raise SystemExit(f"{len(failed)} run(s) failed (finished runs are saved; rerun to resume):\n" + "\n".join(failed))
    return results


# -- decision overhead (Table 2), each side in a fresh process ------------------------------------------

def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def overhead(side: str) -> dict:
    """Peak-RSS growth and latency of one client's policy per round (assemble + REINFORCE update) or of
    the server's critic per round (values + update for 10 clients), after torch and the zoo are loaded."""
    from nefl.jigsaw.coretune import ServerCritic, observation
    from nefl.jigsaw.policy import Agent, assemble, returns
    from nefl.jigsaw.zoo import Zoo, load_base, peak_bytes

    torch.set_num_threads(1)
    bases = [load_base(n) for n in ("cnn-2", "cnn-3", "cnn-4", "cnn-6")]
    mods = [m for c in range(10) for m in bases[c % 4].metas(c)]
    zoo = Zoo.build(mods, (1, 28, 28), 32, 7)
    budget = peak_bytes(bases[3].metas(0), (1, 28, 28), 32) * 1.0 + 2**24
    base_rss = _rss_mib()
    base_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    gen = torch.Generator().manual_seed(0)
    times = []
    if side == "client":
        agent = Agent(10)
        for _ in range(30):
            t0 = time.perf_counter()
            ep = assemble(agent.policy, zoo, 0, torch.rand(10), budget, generator=gen)
            agent.update(ep, 0.5)
            times.append(time.perf_counter() - t0)
        params = sum(p.numel() for p in agent.policy.parameters())
    else:
        agent = Agent(10)
        episodes = [assemble(agent.policy, zoo, c, torch.rand(10), budget, generator=gen) for c in range(10)]
        obs = [torch.stack([observation(torch.rand(10), h, c, 7) for h in ep.history]) for c, ep in enumerate(episodes)]
        critic = ServerCritic(obs[0].shape[1])
        for _ in range(30):
            t0 = time.perf_counter()
            critic.values(obs)
            critic.update(obs, [returns(0.5, len(ep.steps), 0.95) for ep in episodes])
            times.append(time.perf_counter() - t0)
        params = sum(p.numel() for p in critic.critic.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"side": side, "parameters": params, "seconds_mean": statistics.fmean(times[5:]), "seconds_max": max(times[5:]),
            "rss_base_mib": base_rss, "peak_growth_mib": max(0.0, peak - max(base_peak, base_rss))}


def measure_overheads() -> list[dict]:
    out = []
    for side in ("client", "server"):
        proc = subprocess.run([sys.executable, __file__, "_overhead", side], capture_output=True, text=True, timeout=600,
                              env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
        if proc.returncode:
            raise SystemExit(f"overhead measurement ({side}) failed:\n{proc.stderr[-2000:]}")
        out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return out


# -- report ---------------------------------------------------------------------------------------------

def _cell(runs: list[dict], prefix: str = "") -> str:
    """Mean local accuracy (%) ± std across clients, each averaged over seeds; seed range in brackets."""
    means = [100 * r[prefix + "mean"] for r in runs]
    stds = [r[prefix + "std"] for r in runs]
    rng = f" [{min(means):.1f}-{max(means):.1f}]" if len(runs) > 1 else ""
    return f"{statistics.fmean(means):.2f} ± {statistics.fmean(stds):.4f}{rng}"


def plot(groups: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(SETTINGS), figsize=(5 * len(SETTINGS), 6.5), squeeze=False)
    for col, setting in enumerate(SETTINGS):
        for method in METHODS:
            runs = groups.get((setting, method))
            if not runs:
                continue
            xs = [p["round"] for p in runs[0]["curve"]]
            acc = [statistics.fmean(100 * r["curve"][i]["mean"] for r in runs) for i in range(len(xs))]
            var = [statistics.fmean(r["curve"][i]["std"] ** 2 for r in runs) for i in range(len(xs))]
            line = axes[0][col].plot(xs, acc, marker="o", label=METHOD_TITLES[method])[0]
            trained = [statistics.fmean(100 * r["curve"][i]["trained_mean"] for r in runs) for i in range(len(xs))]
            axes[0][col].plot(xs, trained, linestyle=":", color=line.get_color())
            axes[1][col].plot(xs, var, marker="o", label=METHOD_TITLES[method])
        axes[0][col].set_title(SETTING_TITLES[setting])
        axes[0][col].set_ylabel("mean local accuracy (%)")
        axes[1][col].set_ylabel("variance across clients")
        axes[1][col].set_xlabel("round")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("solid: after aggregation · dotted: after local training", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def report(results: list[dict], overheads: list[dict], budget: Budget, seeds: int, command: str, wall: float,
           img: Path, img_link: str) -> str:
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in sorted(results, key=lambda r: r["seed"]):
        groups.setdefault((r["setting"], r["method"]), []).append(r)
    plot(groups, img)
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [START, "", f"Measured {now} by `{command}` on {cpu_name()} (2 cores; shared with other work: load "
             f"{load_average()} at the end), commit {commit_label()}; sweep wall time {wall / 60:.0f} min.",
             f"Budget: {budget.clients} clients (CNN-2/3/4/6 round-robin), {budget.rounds} rounds, "
             f"{budget.samples_per_client} training images per client, {budget.test_per_client} local test images per "
             f"client, {seeds} seeds; FedJigsaw's CoRe-Tune phase is the first {budget.rounds // 2} rounds.", "",
             "Table 1 (ours): mean local top-1 (%) ± standard deviation across the 10 clients (as a fraction, as the "
             "paper), averaged over seeds; [lowest-highest seed mean]. *After aggregation*: each client's model with "
             "the round's aggregated parameters (BN statistics recomputed on its shard); *after local training*: the "
             "model each client holds right after its last local epoch, before anything is sent back.", "",
             "| method | " + " | ".join(f"{SETTING_TITLES[s]}, after aggregation | after local training" for s in SETTINGS)
             + " |", "|---|" + "---|---|" * len(SETTINGS)]
    for method in METHODS:
        cells = [f"{_cell(groups[(s, method)])} | {_cell(groups[(s, method)], 'trained_')}" if (s, method) in groups else "- | -"
                 for s in SETTINGS]
        lines.append(f"| {METHOD_TITLES[method]} | " + " | ".join(cells) + " |")
    lines += ["", f"![accuracy and cross-client variance over rounds]({img_link})", ""]
    lines += ["Table 2 (ours): decision overhead per round, excluding local training, one torch thread, measured in "
              "fresh processes (RSS growth over a process that already imported torch and built the zoo).", "",
              "| component | parameters | latency per round (mean / max) | peak memory growth | process RSS before |",
              "|---|---|---|---|---|"]
    for o in overheads:
        what = "client policy (assemble + REINFORCE update)" if o["side"] == "client" else "server critic (10 clients: values + update)"
        lines.append(f"| {what} | {o['parameters']:,} | {1000 * o['seconds_mean']:.1f} ms / {1000 * o['seconds_max']:.1f} ms "
                     f"| {o['peak_growth_mib']:.1f} MiB | {o['rss_base_mib']:.0f} MiB |")
    for setting in SETTINGS:
        runs = groups.get((setting, "fedjigsaw"), [])
        if runs and runs[0]["decision_seconds"]:
            d = [r["decision_seconds"]["mean"] for r in runs]
            c = [r["critic_seconds"] for r in runs if r["critic_seconds"]]
            lines.append(f"\nInside the federations ({SETTING_TITLES[setting]}, while the machine trained): decision "
                         f"{1000 * statistics.fmean(d):.1f} ms per client per round, REINFORCE update "
                         f"{1000 * statistics.fmean(r['policy_update_seconds'] for r in runs):.1f} ms"
                         + (f", server critic {1000 * statistics.fmean(c):.1f} ms per round" if c else "") + ".")
    lines += ["", "Traffic per round (mean over rounds, seed 0, MB = 10^6 bytes): what moved, against every client "
              "downloading and uploading a whole model.", "", "| setting | method | moved | whole models |", "|---|---|---|---|"]
    for setting in SETTINGS:
        for method in METHODS:
            runs = groups.get((setting, method))
            if runs:
                b = runs[0]["bytes_per_round"]
                moved = sum(v for k, v in b.items() if k != "whole_models")
                lines.append(f"| {SETTING_TITLES[setting]} | {METHOD_TITLES[method]} | {moved / 1e6:.1f} MB | {b['whole_models'] / 1e6:.1f} MB |")
    for setting in SETTINGS:
        runs = groups.get((setting, "fedjigsaw"))
        if not runs:
            continue
        r = runs[0]
        lines += ["", f"Assembled architectures after the last round, FedJigsaw, {SETTING_TITLES[setting]}, seed {r['seed']} "
                  "(cS.mP = client S's module at position P; type > output channels):", "",
                  "| client | base | budget MiB | local top-1 | model |", "|---|---|---|---|---|"]
        for c, arch in enumerate(r["architectures"]):
            lines.append(f"| {c} | {r['bases'][c]} | {r['budgets_mib'][c]:.1f} | {100 * r['accuracy'][c]:.1f} | {' '.join(arch)} |")
        base = groups.get((setting, "heterofl"))
        if base and base[0]["widths"]:
            lines.append(f"\nHeteroFL / FedRolex widths of CNN-6 per client from the same budgets: {base[0]['widths']}.")
    lines += ["", END]
    return "\n".join(lines)


def write_section(doc: Path, text: str) -> None:
    old = doc.read_text() if doc.exists() else f"{START}\n{END}\n"
    if START not in old or END not in old:
        raise SystemExit(f"{doc} lacks the {START} / {END} markers")
    head, rest = old.split(START, 1)
    atomic_write_text(doc, head + text + rest.split(END, 1)[1])


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "_overhead":
        print(json.dumps(overhead(sys.argv[2])))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=Budget.rounds)
    ap.add_argument("--samples", type=int, default=Budget.samples_per_client)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        budget, seeds, settings = Budget(rounds=2, samples_per_client=60, test_per_client=100, eval_every=1), 1, ["dir-1.0"]
        out, doc, img = ROOT / (args.out or "runs/bench-fedjigsaw-quick"), None, None
    else:
        budget, seeds, settings = Budget(rounds=args.rounds, samples_per_client=args.samples), args.seeds, list(SETTINGS)
        # one directory per budget: a finished run is reused only by a sweep of the same budget
        out = ROOT / (args.out or f"runs/bench-fedjigsaw-r{budget.rounds}-n{budget.samples_per_client}")
        doc, img = DOC, ROOT / "docs" / "img" / "fedjigsaw-curves.png"
    jobs = [Job(s, m, seed, str(out / s / f"{m}-seed{seed}.json"), budget) for seed in range(seeds) for s in settings for m in METHODS]
    t0 = time.perf_counter()
    results = run_sweep(jobs, args.jobs, budget)
    overheads = measure_overheads()
    command = "benchmarks/bench_fedjigsaw.py" if sys.argv[1:] else "make bench-fedjigsaw"
    if doc is None:
        doc, img = out / "fedjigsaw.md", out / "fedjigsaw-curves.png"
        link = "fedjigsaw-curves.png"
    else:
        link = "img/fedjigsaw-curves.png"
    text = report(results, overheads, budget, seeds, command + (" " + shlex.join(sys.argv[1:]) if sys.argv[1:] else ""),
                  time.perf_counter() - t0, img, link)
    write_section(doc, text)
    print(f"wrote {doc}")


if __name__ == "__main__":
    main()
