"""FedJigsaw against local training and the partial-training baselines (and its two ablations) on Fashion-MNIST;
writes docs/fedjigsaw.md's generated section and docs/img/fedjigsaw-curves.png.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/bench_fedjigsaw.py [--quick] [--jobs 2] [--seeds 3] [--rounds 40]
        [--policy-rounds 20] [--samples 300] [--test-samples 300] [--eval-every 4] [--small] [--out DIR]
        [--note TEXT] [--render]

The sweep: Dirichlet(1.0) ("low non-IID") and Dirichlet(0.1) ("high non-IID") x the six methods of `aggregator
jigsaw` x the seeds; 10 clients whose base architectures follow from their memory budgets, all active every round,
as the paper's protocol, scaled to 2 cores: the methods with a policy first run the policy phase on the task data
(--policy-rounds, the critic's values counting after its warm-up), then every method trains --rounds rounds on its task
shard (--samples images per client, 10% of them the reward's validation split), scored on --test-samples local test
images per client drawn with its own label distribution, every --eval-every rounds. Resumable: every finished run is
<out>/<setting>/<method>-seed<S>.json (<out> named after the budget) and is skipped when present; --render writes
the doc from the runs finished so far. Also measures the decision overhead (the
paper's Table 2) in fresh processes: `_overhead client` (one client's policy: execute with the switching rule, and
a policy-phase assemble + REINFORCE update) and `_overhead server` (CoRe-Tune's step for 10 clients).
--quick: 2 + 2 rounds, 60 images per client, one seed, Dir(1.0) only, into runs/bench-fedjigsaw-quick.
--small: the small-data sweep (40 images per client; its own variants and ablations, and a reference that is not
federated: one model trained on every client's images pooled, `pooled_reference`) into its own section.
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
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import torch

from nefl.jigsaw.shards import initial_modules, module_seed
from nefl.jigsaw.sim import JigsawConfig, JigsawSimulator
from nefl.jigsaw.zoo import build_model, common_chain
from nefl.nested.data import BatchLoader
from nefl.nested.state import load_module_state
from nefl.nested.train import local_train
from nefl.support.fsio import atomic_write_text
from nefl.jigsaw.methods import METHODS, JigsawMethod
from provenance import commit_label, cpu_name, load_average, write_section  # benchmarks/ is the script directory, on sys.path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "fedjigsaw.md"
START, END = "<!-- bench-fedjigsaw:start -->", "<!-- bench-fedjigsaw:end -->"
SETTINGS = {"dir-1.0": 1.0, "dir-0.1": 0.1}
SETTING_TITLES = {"dir-1.0": "Low non-IID, Dir(1.0)", "dir-0.1": "High non-IID, Dir(0.1)"}
TITLES = {name: m.title for name, m in METHODS.items()}
# the "done when": FedJigsaw ahead of training alone at both skews, of the PT baselines at Dir(0.1)
CLAIMS = [("dir-1.0", "local-only"), ("dir-0.1", "local-only"), ("dir-0.1", "pt-heterofl"), ("dir-0.1", "pt-fedrolex"),
          ("dir-1.0", "pt-heterofl"), ("dir-1.0", "pt-fedrolex")]


@dataclass(frozen=True)
class Budget:
    rounds: int = JigsawConfig.rounds  # model-training rounds
    policy_rounds: int = JigsawConfig.policy_rounds
    critic_warmup: int = JigsawConfig.critic_warmup
    samples_per_client: int = 300  # training images per client
    test_per_client: int = 300
    val_samples: int = JigsawConfig.val_samples  # held-out validation images per client (the reward)
    clients: int = JigsawConfig.clients
    eval_every: int = 4
    local_epochs: int = JigsawConfig.local_epochs
    batch_size: int = JigsawConfig.batch_size


# the small-data setting of issue 43, where clients have too little data alone
SMALL = Budget(rounds=8, policy_rounds=4, critic_warmup=1, samples_per_client=40, test_per_client=300, eval_every=0,
               local_epochs=5, batch_size=16)
SMALL_START, SMALL_END = "<!-- bench-fedjigsaw-small:start -->", "<!-- bench-fedjigsaw-small:end -->"
# the small-data sweep's variants: a method, or a method with other settings (the untrained policy); the claim's
# four (FedJigsaw against training alone, the learned policy against the untrained one, one shared chain) over every
# seed first, the ablations and the partial-training baselines after, so a sweep cut short still answers the claim
VARIANTS = {"local-only": ("local-only", {}), "fedjigsaw": ("fedjigsaw", {}), "untrained-policy": ("fedjigsaw", {"policy_rounds": 0}),
            "shared-chain": ("shared-chain", {}),
            # training alone for as many rounds as FedJigsaw trains on the task (its policy phase trains too)
            "local-only-equal": ("local-only", {"rounds": SMALL.rounds + SMALL.policy_rounds}),
            "frozen-policy": ("fedjigsaw", {"policy_lr": 0.0}),
            "no-prior": ("fedjigsaw", {"common_prior": 0.0}),
            "untrained-no-prior": ("fedjigsaw", {"policy_rounds": 0, "common_prior": 0.0}), "shared-body": ("shared-body", {}),
            "random-chain": ("random-chain", {}),
            "no-coretune": ("no-coretune", {}), "no-symbio": ("no-symbio", {}),
            "pt-heterofl": ("pt-heterofl", {}), "pt-fedrolex": ("pt-fedrolex", {}),
            # not a federation: a reference for what sharing could lend (pooled_reference)
            "pooled": ("pooled", {})}
CLAIMED = 4
# the learned policy against the untrained one, with the common-chain prior (the default) and without it
LEARNED = [("fedjigsaw", "untrained-policy", "With the prior (the default)"),
           ("no-prior", "untrained-no-prior", "Without the prior (--common-prior 0)")]
VARIANT_TITLES = {**TITLES, "untrained-policy": "FedJigsaw, untrained policy (--policy-rounds 0)",
                  "frozen-policy": "FedJigsaw, policy phase that does not learn (--policy-lr 0)",
                  "no-prior": "FedJigsaw without the common-chain prior (--common-prior 0)",
                  "untrained-no-prior": "FedJigsaw without the prior, untrained policy (--common-prior 0 --policy-rounds 0)",
                  "local-only-equal": f"Local only, {SMALL.rounds + SMALL.policy_rounds} rounds (FedJigsaw's policy + model-training rounds)",
                  "pooled": "Reference, not federated: one model on every client's images pooled, then a round on the client's own"}


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


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def summarise(sim: JigsawSimulator, rows: list[dict]) -> dict:
    """What the report needs of one run: accuracy, curves, chain changes, decision cost, memory, traffic."""
    train = [r for r in rows if r["phase"] == "train"]
    policy = [r for r in rows if r["phase"] == "policy"]
    last = train[-1]
    quarter = train[-max(1, len(train) // 4):]
    decisions = [s for r in train for s in r["decision_seconds"]]
    changes = [r["chain_changes"] for r in train if "chain_changes" in r]
    final = [[d.split(":")[0] for d in arch] for arch in last["architectures"]]
    blocks = [chain[:-1] for chain in final]
    users: dict[str, set[int]] = {}
    for c, chain in enumerate(final):
        for k in chain:
            users.setdefault(k, set()).add(c)
    return {
        "accuracy": last["accuracy"], "mean": last["mean"], "std": last["std"],
        "trained_accuracy": last["trained_accuracy"], "trained_mean": last["trained_mean"], "trained_std": last["trained_std"],
        "curve": [{"round": r["train_round"] + 1, "mean": r["mean"], "std": r["std"], "trained_mean": r["trained_mean"]}
                  for r in train if "mean" in r],
        "chain_changes": changes, "chain_changes_last_quarter": _mean([r["chain_changes"] for r in quarter if "chain_changes" in r]),
        "policy_chain_changes": _mean([r["chain_changes"] for r in policy[1:]]),
        "decision_seconds": {"mean": statistics.fmean(decisions), "max": max(decisions)},
        "policy_decision_seconds": _mean([s for r in policy for s in r["decision_seconds"]]),
        "policy_update_seconds": _mean([r["policy_update_seconds"] for r in policy]),
        "critic_seconds": _mean([r["critic_seconds"] for r in policy if "critic_seconds" in r]),
        "peak_mib": {"mean": statistics.fmean(last["peak_mib"]), "max": max(last["peak_mib"])},
        "val_accuracy_spread": _mean([statistics.pstdev(r["val_accuracy"]) for r in policy]),
        "policy_phase": [{"round": r["round"] + 1, "val_accuracy": statistics.fmean(r["val_accuracy"]),
                          "reward": statistics.fmean(r["reward"]), "advantage_abs": r["advantage_abs"],
                          "critic_abs_error": r.get("critic_abs_error"), "critic_warm": r.get("critic_warm")} for r in policy],
        "own_share": statistics.fmean(sum(k.startswith(f"c{c}.") for k in chain) / len(chain) for c, chain in enumerate(blocks)),
        # None for the PT baselines, whose clients train windows of one model, not chains of modules
        "users_per_module": _mean([len(u) for k, u in users.items() if k not in {ch[-1] for ch in final}]),
        "users_per_head": _mean([len(u) for k, u in users.items() if k in {ch[-1] for ch in final}]),
        "peer_heads": sum(not chain[-1].startswith(f"c{c}.") for c, chain in enumerate(final)),
        "trainers_per_module": [r.get("trainers_per_module") for r in train],
        "bytes_per_round": {k: statistics.fmean(r["bytes"][k] for r in train) for k in train[0]["bytes"]},
        "architectures": [sim.fed.describe(c) for c in range(sim.cfg.clients)], "bases": [b.name for b in sim.bases],
        "budgets_mib": [x / 2**20 for x in sim.budgets], "widths": last.get("widths"),
        "parameters": dict(zip(("actor", "critic"), sim.fed.policy_parameters())),
    }


def _config(job: Job, method: str, overrides: dict) -> JigsawConfig:
    b = job.budget
    settings = dict(clients=b.clients, rounds=b.rounds, policy_rounds=b.policy_rounds, critic_warmup=b.critic_warmup,
                    non_iid=SETTINGS[job.setting], seed=job.seed, max_samples_per_client=b.samples_per_client,
                    test_per_client=b.test_per_client, val_samples=b.val_samples, eval_every=b.eval_every,
                    local_epochs=b.local_epochs, batch_size=b.batch_size, out=str(Path(job.path).with_suffix("")))
    return JigsawConfig(method=method, **{**settings, **overrides})


def run_job(job: Job) -> dict:
    """Worker: one federation (or a pooled reference) with one torch thread; the summary lands atomically in
    job.path."""
    torch.set_num_threads(1)
    method, overrides = VARIANTS.get(job.method, (job.method, {}))
    if method == "pooled":
        summary = pooled_reference(JigsawSimulator(_config(job, "local-only", {})))
    else:
        sim = JigsawSimulator(_config(job, method, overrides))
        res = sim.run()
        summary = {"seconds": res.seconds, **summarise(sim, res.rounds)}
    out = {"setting": job.setting, "method": job.method, "seed": job.seed, "budget": dataclasses.asdict(job.budget), **summary}
    path = Path(job.path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(out, indent=1))
    return out


def pooled_reference(sim: JigsawSimulator) -> dict:
    """A reference for what sharing could lend: the common chain trained on every client's training images pooled
    in one place, for as many passes over them as a FedJigsaw client makes over its own (policy phase and model
    training), then scored per client on its local test after a round of its own training (BatchNorm statistics
    on its own data), as the federations' chains are scored. Not a bound: under strong label skew a client's own
    model can beat it, hence the report's oracle row (per client the better of the two)."""
    t0 = time.perf_counter()
    cfg = sim.cfg
    chain = common_chain([m for c in range(cfg.clients) for m in sim.bases[c].metas(c)], sim.input, cfg.batch_size)
    source = initial_modules(sim.bases[chain[0].source].metas(chain[0].source), module_seed(cfg.seed, chain[0].source))
    start = {f"{j}.{k}": v for j, m in enumerate(chain) for k, v in source[m.key].items()}
    pooled = torch.cat([d.train for d in sim.data]).sort().values
    batches = BatchLoader(sim.train, pooled, cfg.batch_size, shuffle=True, augment=True, seed=cfg.seed, drop_last=True)
    epochs = (cfg.policy_rounds + cfg.rounds) * cfg.local_epochs
    res = local_train(build_model(chain), start, batches, dataclasses.replace(sim.train_cfg, local_epochs=epochs))
    state = {k: start[k] + res.delta[k] for k in start}
    accs = []
    for c, shard in enumerate(sim.shards):
        model = build_model(chain)
        tuned = local_train(model, state, sim.task_loaders(c, cfg.policy_rounds + cfg.rounds).train, sim.train_cfg)
        load_module_state(model, {k: state[k] + tuned.delta[k] for k in state})
        accs.append(shard.score(model))
    mean, std = statistics.fmean(accs), statistics.pstdev(accs)
    return {"seconds": time.perf_counter() - t0, "accuracy": accs, "mean": mean, "std": std, "trained_accuracy": accs,
            "trained_mean": mean, "trained_std": std, "users_per_module": None, "users_per_head": None, "peer_heads": 0,
            "trainers_per_module": [], "policy_phase": []}


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
    """Peak-RSS growth and latency per round of one client's decision (execution: greedy assembly and the
    switching rule; policy phase: sampled assembly + REINFORCE update) or of CoRe-Tune's server step for 10
    clients, after torch and the zoo are loaded."""
    from nefl.jigsaw.coretune import CoReTune, PolicyReport, observation
    from nefl.jigsaw.observations import ObservationLog
    from nefl.jigsaw.policy import TOKEN_FEATURES, PolicyAgent, assemble, chain_log_prob, tokens_for
    from nefl.jigsaw.zoo import Zoo, load_base, peak_bytes

    torch.set_num_threads(1)
    bases = [load_base(n) for n in ("cnn-2", "cnn-3", "cnn-4", "cnn-6")]
    mods = [m for c in range(10) for m in bases[c % 4].metas(c)]
    zoo = Zoo.build(mods, (1, 28, 28), 32, 7)
    budget = peak_bytes(bases[3].metas(0), (1, 28, 28), 32) * 1.05
    log, data, gen = ObservationLog(), torch.rand(10), torch.Generator().manual_seed(0)
    base_rss = _rss_mib()
    base_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    times: dict[str, list[float]] = {"execute": [], "explore": []}
    agent = PolicyAgent(10)
    if side == "client":
        current = bases[3].metas(0)
        for r in range(30):
            tokens = tokens_for(0, log, r)
            t0 = time.perf_counter()
            ep = assemble(agent.policy, zoo, tokens, data, budget, 0, temperature=0.0)
            chain_log_prob(agent.policy, zoo, tokens, data, budget, 0, ep.metas)
            chain_log_prob(agent.policy, zoo, tokens, data, budget, 0, current)
            times["execute"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ep = assemble(agent.policy, zoo, tokens, data, budget, 0, generator=gen)
            agent.update(ep, 0.5)
            times["explore"].append(time.perf_counter() - t0)
            log.record([m.key for m in ep.metas], 0.5, r)
        params = sum(p.numel() for p in agent.policy.parameters())
    else:
        episodes = [assemble(agent.policy, zoo, tokens_for(c, log, 0), data, budget, c, generator=gen) for c in range(10)]
        reports = [PolicyReport(federation="f", client=c, round=0, accuracy=0.5, cap=0.5, samples=54, data_feature=data.tolist(),
                                chain=[(m.source, m.position) for m in ep.metas],
                                observations=[observation(data, s.state, 7).tolist() for s in ep.steps])
                   for c, ep in enumerate(episodes)]
        server = CoReTune("f", 10 + TOKEN_FEATURES + 1, 0.9, 0.1, 0.95, warmup_rounds=0)
        for _ in range(30):
            t0 = time.perf_counter()
            server.step(reports)
            times["explore"].append(time.perf_counter() - t0)
        params = sum(p.numel() for p in server.critic.critic.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"side": side, "parameters": params, "peak_growth_mib": max(0.0, peak - max(base_peak, base_rss)),
            "rss_base_mib": base_rss, **{f"{k}_ms": 1000 * statistics.fmean(v[5:]) for k, v in times.items() if v}}


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

def _spread(runs: list[dict], key: str = "mean") -> tuple[float, float, float]:
    """Mean over seeds of the clients' mean accuracy (points), and the lowest and highest seed."""
    xs = [100 * r[key] for r in runs]
    return statistics.fmean(xs), min(xs), max(xs)


def _cell(runs: list[dict], prefix: str = "") -> str:
    """Mean local accuracy (%) ± std across clients, each averaged over seeds; seed range in brackets."""
    mean, lo, hi = _spread(runs, prefix + "mean")
    std = statistics.fmean(r[prefix + "std"] for r in runs)
    return f"{mean:.2f} ± {std:.4f}" + (f" [{lo:.1f}-{hi:.1f}]" if len(runs) > 1 else "")


def verdicts(groups: dict) -> list[str]:
    """The issue's claims, per seed: FedJigsaw's mean minus the other method's (same seed, same partition), and
    whether the mean difference beats the seed spread (the wider seed range of the two methods)."""
    lines = ["| setting | FedJigsaw vs | difference per seed (points) | mean difference | seed spread | ahead by more than the spread? |",
             "|---|---|---|---|---|---|"]
    for setting, other in CLAIMS:
        a, b = groups.get((setting, "fedjigsaw")), groups.get((setting, other))
        if not a or not b:
            continue
        by_seed = {r["seed"]: r for r in b}
        diffs = [100 * (r["mean"] - by_seed[r["seed"]]["mean"]) for r in a if r["seed"] in by_seed]
        spread = max(_spread(a)[2] - _spread(a)[1], _spread(b)[2] - _spread(b)[1])
        mean = statistics.fmean(diffs)
        lines.append(f"| {SETTING_TITLES[setting]} | {TITLES[other]} | {', '.join(f'{d:+.1f}' for d in diffs)} | {mean:+.2f} "
                     f"| {spread:.2f} | {'yes' if mean > spread else 'no'} |")
    return lines


def plot(groups: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, len(SETTINGS), figsize=(5.5 * len(SETTINGS), 9.5), squeeze=False)
    for col, setting in enumerate(SETTINGS):
        for method in METHODS:
            runs = groups.get((setting, method))
            if not runs:
                continue
            xs = [p["round"] for p in runs[0]["curve"]]
            acc = [statistics.fmean(100 * r["curve"][i]["mean"] for r in runs) for i in range(len(xs))]
            var = [statistics.fmean(r["curve"][i]["std"] ** 2 for r in runs) for i in range(len(xs))]
            axes[0][col].plot(xs, acc, marker="o", markersize=3, label=TITLES[method])
            axes[1][col].plot(xs, var, marker="o", markersize=3, label=TITLES[method])
            if runs[0]["chain_changes"]:
                n = len(runs[0]["chain_changes"])
                changes = [statistics.fmean(100 * r["chain_changes"][i] for r in runs) for i in range(n)]
                axes[2][col].plot(range(1, n + 1), changes, label=TITLES[method])
        axes[0][col].set_title(SETTING_TITLES[setting])
        axes[0][col].set_ylabel("mean local accuracy (%)")
        axes[1][col].set_ylabel("variance across clients")
        axes[2][col].set_ylabel("chains changed (% of clients)")
        axes[2][col].set_xlabel("model-training round")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def _groups(groups: dict, keep: Callable[[JigsawMethod], bool]) -> Iterator[tuple[str, str, list[dict]]]:
    """(setting, method, runs) for every measured pair whose method `keep` accepts, settings first."""
    for setting in SETTINGS:
        for method, m in METHODS.items():
            if keep(m) and groups.get((setting, method)):
                yield setting, method, groups[(setting, method)]


def sharing_effect(groups: dict) -> list[str]:
    """Where module sharing helps or hurts: each client's accuracy minus its own accuracy under local-only (same
    seed, same data, same base), split by whether its final chain borrows blocks, and for chains with a block
    that another client trains too (whose copy Eq. 2 averages with its own)."""
    lines = ["| setting | method | clients | own blocks only: n, vs local-only | with borrowed blocks: n, vs local-only "
             "| a block co-trained with another client: n, vs local-only |", "|---|---|---|---|---|---|"]
    for setting, method, runs in _groups(groups, lambda m: m.assemble):
        local = {r["seed"]: r for r in groups.get((setting, "local-only"), [])}
        parts: dict[str, list[float]] = {"own": [], "borrowed": [], "co-trained": []}
        for r in runs:
            if r["seed"] not in local:
                continue
            blocks = [[d.split(":")[0] for d in arch[:-1]] for arch in r["architectures"]]
            users: dict[str, int] = {}
            for chain in blocks:
                for k in chain:
                    users[k] = users.get(k, 0) + 1
            for c, chain in enumerate(blocks):
                diff = 100 * (r["accuracy"][c] - local[r["seed"]]["accuracy"][c])
                parts["own" if all(k.startswith(f"c{c}.") for k in chain) else "borrowed"].append(diff)
                if any(users[k] > 1 for k in chain):
                    parts["co-trained"].append(diff)
        if parts["own"] or parts["borrowed"]:
            cells = [f"{len(v)}, {statistics.fmean(v):+.1f}" if v else "0, -" for v in parts.values()]
            lines.append(f"| {SETTING_TITLES[setting]} | {TITLES[method]} | {len(parts['own']) + len(parts['borrowed'])} | "
                         + " | ".join(cells) + " |")
    return lines


def _phase_mean(runs: list[dict], key: str, part: slice) -> str:
    """Mean of a policy-phase series over the rounds in `part`, all seeds."""
    xs = [p[key] for r in runs for p in r["policy_phase"][part] if p[key] is not None]
    return f"{statistics.fmean(xs):.3f}" if xs else "-"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.1f}"


def measured_line(command: str, note: str, results: list[dict], planned: int) -> str:
    """A generated section's provenance: when, by which command, on what machine and commit, how many runs."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"Measured {now} by `{command}` on {cpu_name()} ({note}; load {load_average()} at the end), commit "
            f"{commit_label()}; {len(results)} of {planned} planned runs finished, "
            f"{sum(r['seconds'] for r in results) / 60:.0f} min of run time summed over them.")


def report(results: list[dict], overheads: list[dict], budget: Budget, planned: int, command: str,
           img: Path, img_link: str, note: str) -> list[str]:
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in sorted(results, key=lambda r: r["seed"]):
        groups.setdefault((r["setting"], r["method"]), []).append(r)
    plot(groups, img)
    seeds = sorted({r["seed"] for r in results})
    lines = ["", measured_line(command, note, results, planned),
             f"Budget: {budget.clients} clients, seeds {', '.join(map(str, seeds))}; the methods with a policy first run {budget.policy_rounds} "
             f"policy-phase rounds on the task (rewarded on {budget.val_samples} held-out images per client; the critic's "
             f"values drive the advantages after {budget.critic_warmup}), then every method trains {budget.rounds} rounds "
             f"on {budget.samples_per_client} task images per client (modules carried over), scored every "
             f"{budget.eval_every} rounds on {budget.test_per_client} local test images per client.", "",
             "Table 1 (ours): mean local top-1 (%) ± standard deviation across the clients (as a fraction, as the "
             "paper), averaged over seeds; [lowest-highest seed mean]. *After aggregation*: each client's model with "
             "the round's aggregated parameters (BN statistics recomputed on its shard); *after local training*: the "
             "model each client holds right after its local epoch, before anything is sent back.", "",
             "| method | " + " | ".join(f"{SETTING_TITLES[s]}, after aggregation | after local training" for s in SETTINGS)
             + " |", "|---|" + "---|---|" * len(SETTINGS)]
    for method in METHODS:
        cells = [f"{_cell(groups[(s, method)])} | {_cell(groups[(s, method)], 'trained_')}" if (s, method) in groups else "- | -"
                 for s in SETTINGS]
        lines.append(f"| {TITLES[method]} | " + " | ".join(cells) + " |")
    lines += ["", "The issue's claims, seed by seed (after aggregation, the last evaluation):", "", *verdicts(groups), "",
              f"![accuracy, cross-client variance and chain changes over the model-training rounds]({img_link})", "",
              "Stability and what the policies chose (mean over seeds): chains changed per round, as a share of the "
              "clients (policy phase: sampling; model training: execution with the switching rule), the share of a "
              "client's blocks (head excluded) that are its own at the end, and how many clients use each module "
              "that is used at all.", "",
              "| setting | method | chains changed, policy phase | chains changed, model training | last quarter | "
              "own blocks | clients per used module |", "|---|---|---|---|---|---|---|"]
    for setting, method, runs in _groups(groups, lambda m: m.family == "modules"):
        pol = [r["policy_chain_changes"] for r in runs if r["policy_chain_changes"] is not None]
        whole = statistics.fmean(statistics.fmean(r["chain_changes"]) for r in runs)
        lines.append(f"| {SETTING_TITLES[setting]} | {TITLES[method]} | "
                     + (f"{100 * statistics.fmean(pol):.0f}%" if pol else "-")
                     + f" | {100 * whole:.1f}% | {100 * statistics.fmean(r['chain_changes_last_quarter'] for r in runs):.1f}% "
                     f"| {statistics.fmean(r['own_share'] for r in runs):.2f} | {statistics.fmean(r['users_per_module'] for r in runs):.2f} |")
    lines += ["", "Module sharing, client by client (final chains, all seeds pooled): each client's accuracy minus its "
              "own under local-only (points), by whether its chain borrows blocks, and for chains with a block that "
              "another client's chain uses too (so Eq. 2 averages their copies).", "", *sharing_effect(groups)]
    lines += ["", "Policy phase (FedJigsaw and its ablations, mean over seeds and clients): accuracy on the held-out "
              "validation split (the reward's Acc), the critic's mean |V - return| and the mean |advantage|, over the "
              "first and the last five rounds.", "",
              "| setting | method | validation accuracy, first 5 / last 5 | critic abs. error, first 5 / last 5 | "
              "abs. advantage, first 5 / last 5 |", "|---|---|---|---|---|"]
    for setting, method, runs in _groups(groups, lambda m: m.assemble):
        cells = [f"{_phase_mean(runs, key, slice(0, 5))} / {_phase_mean(runs, key, slice(-5, None))}"
                 for key in ("val_accuracy", "critic_abs_error", "advantage_abs")]
        lines.append(f"| {SETTING_TITLES[setting]} | {TITLES[method]} | " + " | ".join(cells) + " |")
    lines += ["", "Table 2 (ours, the paper's columns): decision latency per client per round, measured inside the "
              "federations while the machine trained (model-training phase; policy phase in brackets), and the "
              "kit's training-peak estimate of the models the clients train (mean / max over clients; the "
              "framework's fixed ~170 MiB included), both skews and all seeds pooled.", "",
              "| method | decision latency, ms (policy phase) | client model training peak, MiB (mean / max) | "
              "policy / critic parameters |", "|---|---|---|---|"]
    for method, m in METHODS.items():
        runs = [r for s in SETTINGS for r in groups.get((s, method), [])]
        if not runs:
            continue
        pol = [r["policy_decision_seconds"] for r in runs if r["policy_decision_seconds"] is not None]
        lines.append(f"| {TITLES[method]} | {_ms(statistics.fmean(r['decision_seconds']['mean'] for r in runs))}"
                     + (f" ({_ms(statistics.fmean(pol))})" if pol else "")
                     + f" | {statistics.fmean(r['peak_mib']['mean'] for r in runs):.1f} / {max(r['peak_mib']['max'] for r in runs):.1f} "
                     f"| {runs[0]['parameters']['actor']:,} / {runs[0]['parameters']['critic']:,} |")
    lines += ["", "Decision overhead measured alone, in fresh processes on one thread (RSS growth over a process "
              "that already imported torch and built a 10-client zoo):", "",
              "| component | parameters | latency per round | peak memory growth | process RSS before |", "|---|---|---|---|---|"]
    for o in overheads:
        if o["side"] == "client":
            what = "client policy"
            lat = f"execute (greedy + switching rule) {o['execute_ms']:.1f} ms; explore (sample + REINFORCE) {o['explore_ms']:.1f} ms"
        else:
            what, lat = "CoRe-Tune server step (10 clients: Exp, values, critic update)", f"{o['explore_ms']:.1f} ms"
        lines.append(f"| {what} | {o['parameters']:,} | {lat} | {o['peak_growth_mib']:.1f} MiB | {o['rss_base_mib']:.0f} MiB |")
    lines += ["", "Traffic per model-training round (mean, seed 0, MB = 10^6 bytes): what moved, against every client "
              "downloading and uploading a whole model.", "", "| setting | method | moved | whole models |", "|---|---|---|---|"]
    for setting, method, runs in _groups(groups, lambda m: True):
        b = runs[0]["bytes_per_round"]
        moved = sum(v for k, v in b.items() if k != "whole_models")
        lines.append(f"| {SETTING_TITLES[setting]} | {TITLES[method]} | {moved / 1e6:.1f} MB | {b['whole_models'] / 1e6:.1f} MB |")
    for setting in SETTINGS:
        runs = groups.get((setting, "fedjigsaw"))
        if not runs:
            continue
        r = runs[0]
        lines += ["", f"Chains after the last round, FedJigsaw, {SETTING_TITLES[setting]}, seed {r['seed']} "
                  "(cS.mP = client S's module at position P; type > output channels):", "",
                  "| client | base | budget MiB | local top-1 | chain |", "|---|---|---|---|---|"]
        for c, arch in enumerate(r["architectures"]):
            lines.append(f"| {c} | {r['bases'][c]} | {r['budgets_mib'][c]:.1f} | {100 * r['accuracy'][c]:.1f} | {' '.join(arch)} |")
        pt = groups.get((setting, "pt-heterofl"))
        if pt and pt[0]["widths"]:
            lines.append(f"\nHeteroFL / FedRolex (PT) widths of CNN-6 per client from the same budgets: {pt[0]['widths']}.")
    return [*lines, ""]


def small_report(results: list[dict], budget: Budget, planned: int, command: str, note: str) -> list[str]:
    """The small-data section: per setting, each variant's mean and spread over the declared seeds, FedJigsaw
    against each other variant seed by seed, and how many clients train each used module."""
    seeds = sorted({r["seed"] for r in results})
    lines = ["", measured_line(command, note, results, planned),
             f"Setting: Fashion-MNIST, {budget.clients} clients (CNN family, bases from their budgets), "
             f"{budget.samples_per_client} training images per client, {budget.local_epochs} local epochs at batch "
             f"{budget.batch_size}; the reward's validation split: {budget.val_samples} held-out images per client; "
             f"{budget.policy_rounds} policy-phase rounds (the methods with a policy; critic values after "
             f"{budget.critic_warmup}) then {budget.rounds} model-training rounds; scored on {budget.test_per_client} "
             f"local test images per client after the last round: the model each client keeps (its chain as it trained "
             f"it in the last round, or its local path where the guard prefers it; the PT baselines' global model's "
             f"window). Seeds declared before running: {', '.join(map(str, range(max(seeds) + 1 if seeds else 0)))}."]
    for setting in SETTINGS:
        runs = [r for r in results if r["setting"] == setting]
        if runs:
            lines += _small_setting(setting, runs, budget)
    return [*lines, ""]


def _small_setting(setting: str, results: list[dict], budget: Budget) -> list[str]:
    groups: dict[str, list[dict]] = {}
    for r in sorted(results, key=lambda r: r["seed"]):
        groups.setdefault(r["method"], []).append(r)
    lines = ["", f"**{SETTING_TITLES[setting]}.**", "",
             "| variant | mean local top-1 (%), mean over seeds | std over seeds | per seed | worst client, mean over seeds "
             "| after its own last training, per seed | clients per used block | clients per used head | peer heads "
             "| min per run |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name in VARIANTS:
        runs = groups.get(name)
        if not runs:
            continue
        means, trained = [100 * r["mean"] for r in runs], [100 * r["trained_mean"] for r in runs]
        lines.append(f"| {VARIANT_TITLES[name]} | {statistics.fmean(means):.2f} | "
                     f"{statistics.stdev(means) if len(means) > 1 else 0.0:.2f} | {', '.join(f'{m:.1f}' for m in means)} | "
                     f"{statistics.fmean(100 * min(r['accuracy']) for r in runs):.1f} | "
                     f"{', '.join(f'{m:.1f}' for m in trained)} | "
                     f"{_users(runs, 'users_per_module')} | {_users(runs, 'users_per_head')} | "
                     f"{statistics.fmean(r['peer_heads'] for r in runs):.1f} | "
                     f"{statistics.fmean(r['seconds'] for r in runs) / 60:.1f} |")
    lines += ["", "FedJigsaw against each other variant, seed by seed (same partition, same budgets): the difference "
              "of the clients' mean accuracy, its mean and standard deviation over seeds, and whether the mean "
              "difference is beyond the seed spread (the larger of the two variants' standard deviations over seeds).", "",
              "| FedJigsaw vs | difference per seed (points) | mean | std | seed spread | beyond the spread? |",
              "|---|---|---|---|---|---|"]
    for name in VARIANTS:
        if name != "fedjigsaw" and (row := _versus(groups, "fedjigsaw", name, VARIANT_TITLES[name])):
            lines.append(row)
    learned = [row for a, b, title in LEARNED if (row := _versus(groups, a, b, title))]
    if learned:
        lines += ["", "The learned policy against the untrained one (the same settings, no policy phase), with and "
                  "without the common-chain prior:", "",
                  "| learned vs untrained | difference per seed (points) | mean | std | seed spread | beyond the spread? |",
                  "|---|---|---|---|---|---|", *learned]
    # an oracle above the pooled reference: per client the better of it and training alone, picked on the test itself
    alone = {r["seed"]: r["accuracy"] for r in groups.get("local-only", [])}
    groups = {**groups, "oracle": [{"seed": r["seed"], "mean": statistics.fmean(map(max, r["accuracy"], alone[r["seed"]]))}
                                   for r in groups.get("pooled", []) if r["seed"] in alone]}
    ceiling = [row for name, title in (("pooled", "The pooled reference"), ("oracle", "Per client the better of the pooled "
                                       "reference and training alone, picked on the test split (an oracle)"))
               if (row := _versus(groups, name, "local-only", title))]
    if ceiling:
        lines += ["", "How much sharing could lend at all: references that are not federated, against training alone:", "",
                  "| reference vs local only | difference per seed (points) | mean | std | seed spread | beyond the spread? |",
                  "|---|---|---|---|---|---|", *ceiling]
    policy = [r for name in ("fedjigsaw", "no-coretune", "no-symbio") for r in groups.get(name, [])]
    if policy:
        acc = statistics.fmean(p["val_accuracy"] for r in policy for p in r["policy_phase"])
        noise = (acc * (1 - acc) / budget.val_samples) ** 0.5
        spread = statistics.fmean(r["val_accuracy_spread"] for r in policy)
        lines += ["", f"The reward's sampling noise: at the policy phase's mean validation accuracy {acc:.3f}, "
                  f"{budget.val_samples} images give a standard error of {noise:.3f}, against a spread of "
                  f"{spread:.3f} (std across clients in a round, mean over rounds and runs)."]
    trainers = [(name, [t for r in groups.get(name, []) for t in r["trainers_per_module"][-5:] if t]) for name in VARIANTS]
    lines += ["", "Clients training each borrowed or own module in the last five model-training rounds (mean over the "
              "modules trained in a round, runs pooled): " + "; ".join(
                  f"{VARIANT_TITLES[n]} {statistics.fmean(ts):.2f}" for n, ts in trainers if ts) + "."]
    return lines


def _versus(groups: dict[str, list[dict]], a: str, b: str, title: str) -> str | None:
    """A table row: variant a's mean minus b's, seed by seed, its mean and std, and whether the mean is beyond the
    seed spread (the larger of the two variants' standard deviations over seeds); None under two common seeds."""
    mine, other = ({r["seed"]: 100 * r["mean"] for r in groups.get(v, [])} for v in (a, b))
    common = sorted(set(mine) & set(other))
    if len(common) < 2:
        return None
    diffs = [mine[k] - other[k] for k in common]
    spread = max(statistics.stdev(mine.values()), statistics.stdev(other.values()))
    mean = statistics.fmean(diffs)
    return (f"| {title} | {', '.join(f'{d:+.1f}' for d in diffs)} | {mean:+.2f} | {statistics.stdev(diffs):.2f} | "
            f"{spread:.2f} | {'yes' if abs(mean) > spread else 'no'} ({'ahead' if mean > 0 else 'behind'}) |")


def _users(runs: list[dict], key: str) -> str:
    """Clients per used module or head, mean over runs; a dash for the PT baselines, which train windows."""
    values = [r[key] for r in runs if r[key] is not None]
    return f"{statistics.fmean(values):.2f}" if values else "-"


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "_overhead":
        print(json.dumps(overhead(sys.argv[2])))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=Budget.rounds)
    ap.add_argument("--policy-rounds", type=int, default=Budget.policy_rounds)
    ap.add_argument("--samples", type=int, default=Budget.samples_per_client, help="Training images per client.")
    ap.add_argument("--test-samples", type=int, default=Budget.test_per_client, help="Local test images per client.")
    ap.add_argument("--small", action="store_true", help="The small-data sweep (Dir(1.0) and Dir(0.1), 40 images per "
                                                         "client) into its own section of the doc.")
    ap.add_argument("--eval-every", type=int, default=Budget.eval_every, help="Model-training rounds between evaluations.")
    ap.add_argument("--render", action="store_true",
                    help="Write the doc from this budget's finished runs only (a sweep still running, or one cut short).")
    ap.add_argument("--out", default=None)
    ap.add_argument("--note", default="2 cores shared with other engineers' work", help="How the machine was used.")
    args = ap.parse_args()
    if args.small:
        budget, seeds = SMALL, args.seeds
        out = ROOT / (args.out or "runs/bench-fedjigsaw-small")
        groups = [list(VARIANTS)[:CLAIMED], list(VARIANTS)[CLAIMED:]]
        jobs = [Job(setting, v, seed, str(out / setting / f"{v}-seed{seed}.json"), budget)
                for group in groups for seed in range(seeds) for setting in SETTINGS for v in group]
        results = [r for j in jobs if (r := load_result(Path(j.path), budget))] if args.render else run_sweep(jobs, args.jobs, budget)
        command = "benchmarks/bench_fedjigsaw.py " + shlex.join(sys.argv[1:])
        write_section(DOC, SMALL_START, SMALL_END, small_report(results, budget, len(jobs), command, args.note))
        return
    if args.quick:
        budget = Budget(rounds=2, policy_rounds=2, critic_warmup=1, samples_per_client=60, test_per_client=100,
                        val_samples=40, eval_every=1)
        seeds, settings = 1, ["dir-1.0"]
        out, doc, img = ROOT / (args.out or "runs/bench-fedjigsaw-quick"), None, None
    else:
        budget = Budget(rounds=args.rounds, policy_rounds=args.policy_rounds, critic_warmup=min(Budget.critic_warmup, args.policy_rounds),
                        samples_per_client=args.samples, test_per_client=args.test_samples, eval_every=args.eval_every)
        seeds, settings = args.seeds, list(SETTINGS)
        # one directory per budget: a finished run is reused only by a sweep of the same budget
        out = ROOT / (args.out or f"runs/bench-fedjigsaw-p{budget.policy_rounds}-r{budget.rounds}-n{budget.samples_per_client}"
                              f"-t{budget.test_per_client}-v{budget.val_samples}-e{budget.eval_every}")
        doc, img = DOC, ROOT / "docs" / "img" / "fedjigsaw-curves.png"
    # the claims' methods over every seed first, the ablations after: a sweep cut short still answers the done-when
    claimed = ["fedjigsaw", *dict.fromkeys(other for _, other in CLAIMS)]
    order = [claimed, [m for m in METHODS if m not in claimed]]
    jobs = [Job(s, m, seed, str(out / s / f"{m}-seed{seed}.json"), budget)
            for group in order for seed in range(seeds) for s in settings for m in group]
    if args.render:
        results = [r for j in jobs if (r := load_result(Path(j.path), budget))]
        print(f"{len(results)} of {len(jobs)} runs finished")
    else:
        results = run_sweep(jobs, args.jobs, budget)
    overheads = measure_overheads()
    command = "benchmarks/bench_fedjigsaw.py" if sys.argv[1:] else "make bench-fedjigsaw"
    if doc is None:
        doc, img = out / "fedjigsaw.md", out / "fedjigsaw-curves.png"
        link = "fedjigsaw-curves.png"
    else:
        link = "img/fedjigsaw-curves.png"
    lines = report(results, overheads, budget, len(jobs), command + (" " + shlex.join(sys.argv[1:]) if sys.argv[1:] else ""),
                   img, link, args.note)
    write_section(doc, START, END, lines)


if __name__ == "__main__":
    main()
