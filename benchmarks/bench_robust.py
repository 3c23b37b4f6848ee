"""What each aggregation rule does against poisoning, and what it costs; writes docs/security.md's
generated section (`make bench-robust`).

    PYTHONPATH=. python benchmarks/bench_robust.py [--jobs 2] [--seeds 3] [--part all|fractions|attacks|adaptive|no-attack|cost]
        [--rules RULE ...] [--settings iid dir0.5] [--fractions 0.1 0.2 0.3] [--attacks ATTACK ...] [--out DIR] [--section NAME]

Accuracy (`aggregator.simulate` in-process, one torch thread per job, resumable: each finished run is
saved as <out>/<part>/<name>.json and skipped when present):
  fractions  0 / 10 / 20 / 30 % attackers, IID and Dirichlet(0.5), for the model-poisoning attack of the
             robustness issue (a flipped honest delta scaled x9, inside the server's 10 x weight-norm bound)
  attacks    every other attack at 20 %, IID: sign flip, -9 x the weights, Gaussian noise (9 x the honest
             norm), label flipping, the pixel-pattern backdoor (clean accuracy and attack success on
             triggered test images) and "a little is enough" (built against median and trimmed mean)
  adaptive   issue 41's attacks by an attacker who has read the defence, at 0 / 10 / 20 / 30 %, IID and
             Dirichlet(0.5): classifier-bias push, per-submodel-tensor poisoning, the boosted and the durable
             backdoor (attack success too), a layer-local poison, min-max, min-sum and the adaptive search against
             the kit's own aggregation
  no-attack  the default and `no-finetune` against plain NeFedAvg, and the default against NeFedAvg with the same
             server images (BASELINES), without attackers, IID and Dirichlet(0.5), seeds 0-5 (NO_ATTACK_SEEDS)
  for each rule: plain NeFedAvg (no centre check: the kit before this benchmark), the default (NeFedAvg
  behind the centre check), median, trimmed mean, multi-Krum and FLTrust (each without the centre check).
Cost (--part cost): aggregation time and held memory per round of each rule at 10 and 100 updates of
resnet20-fmnist-w, against NeFedAvg, one thread, synthetic honest-like updates.
--rules, --settings, --fractions and --attacks run a part of the grid (a reduced one on a small machine); the
tables show every saved run of --out and leave out those with none. --section: the generated section of
docs/security.md to write (bench-robust).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from rich.console import Console

from aggregator.simulate import SimConfig, Simulator
from nefl.aggregation.attacks import Attack
from nefl.support.settings import BACKDOORS
from nefl.support.fsio import atomic_write_text
from nefl.nested.profile import load_profile
from nefl.aggregation.pipeline import Pipeline, Robustness
from nefl.aggregation.config import PLAIN_NEFEDAVG, AggregationConfig
from nefl.nested.state import GlobalState, Layout
from provenance import commit_label, cpu_name, load_average, write_section  # benchmarks/ is the script directory, on sys.path
from sweep import run_sweep

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "security.md"
console = Console()

RULES: dict[str, AggregationConfig] = {
    "nefedavg": PLAIN_NEFEDAVG,
    "default": AggregationConfig(),
    "gate": AggregationConfig(gate=True),  # the default plus the held-out gate at commit (nefl/aggregation/gate.py)
    "no-finetune": AggregationConfig(finetune_epochs=0),  # the default without the server's fine-tuning at commit
    "median": AggregationConfig(rule="median", centre_check=False),
    "trimmed-mean": AggregationConfig(rule="trimmed-mean", centre_check=False),
    "krum": AggregationConfig(rule="krum", centre_check=False),
    "fltrust": AggregationConfig(rule="fltrust", centre_check=False),
}
# the no-attack part's second baseline: NeFedAvg with the server's images (its running statistics and fine-tuning), no
# defence: what the default costs apart from what the server's images add
BASELINES: dict[str, AggregationConfig] = {
    "nefedavg-server": AggregationConfig(centre_check=False, classifier_rows=False)}
SETTINGS: dict[str, float | None] = {"iid": None, "dir0.5": 0.5}
FRACTION_ATTACKS = ("scaled-flip",)
OTHER_ATTACKS = ("sign-flip", "neg-weights", "noise", "label-flip", "backdoor", "alie")
ADAPTIVE_ATTACKS = ("bias-push", "bn-poison", "layer-local", "boosted-backdoor", "durable-backdoor", "min-max", "min-sum",
                    "adaptive")
FRACTIONS = (0.1, 0.2, 0.3)
# the seeds of the tables, declared before they were run: 0, 1, 2 (issue 41 asks for at least 3)
SEEDS = 3
# the seeds over which the default's cost without attackers is reported, declared before they were run (the issue
# asks for at most 1 point of average accuracy against plain NeFedAvg): 2 seeds move by about 2 points each
NO_ATTACK_SEEDS = 6


@dataclass(frozen=True)
class Budget:
    profile: str = "resnet8-fmnist-w"
    clients: int = 10
    rounds: int = 10
    samples_per_client: int = 150
    batch_size: int = 16  # twice the local steps of batch 32 for the same images: more learning per CPU second
    eval_samples: int = 1000


@dataclass(frozen=True)
class Job:
    part: str
    rule: str
    attack: str  # "none" for the attack-free runs
    fraction: float
    setting: str
    seed: int
    budget: Budget
    out: str

    @property
    def label(self) -> str:
        return f"{self.setting}/{self.attack}-{int(100 * self.fraction)}/{self.rule}-s{self.seed}"

    @property
    def path(self) -> str:
        return str(Path(self.out) / self.part / (self.label.replace("/", "_") + ".json"))

    @property
    def rounds(self) -> int:
        return self.budget.rounds


def run_job(job: Job, progress_queue) -> dict:
    torch.set_num_threads(1)
    b = job.budget
    attack = None if job.attack == "none" else Attack(job.attack)
    cfg = SimConfig(profile=b.profile, dataset="fashion-mnist", clients=b.clients, per_round=b.clients, rounds=b.rounds,
                    non_iid=SETTINGS[job.setting], seed=job.seed, eval_every=0, final_eval_samples=b.eval_samples,
                    max_samples_per_client=b.samples_per_client, batch_size=b.batch_size,
                    robustness=Robustness(aggregation={**RULES, **BASELINES}[job.rule]),
                    attack=attack, attackers=job.fraction)
    sim = Simulator(cfg)
    res = sim.run(lambda row: progress_queue.put((job.label, row["round"])))
    honest = set(sim.client_index) - sim.attackers
    rows = res.rounds
    out = {**asdict(job), "accuracy": res.accuracy, "worst": res.worst, "avg": res.avg, "backdoor": res.backdoor,
           "seconds": res.seconds, "attackers": sorted(sim.attackers),
           "honest_dropped": sum(len(set(r.get("dropped", {})) & honest) for r in rows),
           "honest_updates": sum(len(set(r["reported"]) & honest) for r in rows),
           "attacker_dropped": sum(len(set(r.get("dropped", {})) & sim.attackers) for r in rows),
           "attacker_updates": sum(len(set(r["reported"]) & sim.attackers) for r in rows),
           "rejected": sum(sum(r["rejected"].values()) for r in rows),
           "close_s": statistics.fmean(r["close_s"] for r in rows)}
    Path(job.path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(job.path), json.dumps(out, indent=1))
    return out


def load(job: Job) -> dict | None:
    path = Path(job.path)
    if not path.exists():
        return None
    result = json.loads(path.read_text())
    if result["budget"] != asdict(job.budget):
        raise SystemExit(f"{path} was run with {result['budget']}, not {asdict(job.budget)}: delete it or pass another --out")
    return result


@dataclass(frozen=True)
class Grid:
    """The part of the grid to run: all of it unless narrowed on the command line."""

    rules: tuple[str, ...] = tuple(RULES)
    settings: tuple[str, ...] = tuple(SETTINGS)
    fractions: tuple[float, ...] = FRACTIONS
    attacks: tuple[str, ...] = (*FRACTION_ATTACKS, *OTHER_ATTACKS, *ADAPTIVE_ATTACKS)


def jobs_for(part: str, seeds: int, budget: Budget, out: str, grid: Grid = Grid()) -> list[Job]:
    jobs = []
    for setting in SETTINGS if part in ("fractions", "adaptive") else ["iid"]:
        for seed in range(seeds):
            for rule in RULES:
                cases: list[tuple[str, str, float]] = []
                if part == "fractions":
                    cases = [("fractions", "none", 0.0)] + [("fractions", a, f) for a in FRACTION_ATTACKS for f in FRACTIONS]
                elif part == "attacks":
                    cases = [("attacks", a, 0.2) for a in OTHER_ATTACKS]
                elif part == "adaptive":  # its 0 % column is the fractions part's attack-free run
                    cases = [("fractions", "none", 0.0)] + [("adaptive", a, f) for a in ADAPTIVE_ATTACKS for f in FRACTIONS]
                jobs += [Job(p, rule, a, f, setting, seed, budget, out) for p, a, f in cases
                         if rule in grid.rules and setting in grid.settings
                         and (a == "none" or (a in grid.attacks and (p == "attacks" or f in grid.fractions)))]
    return jobs


def no_attack_jobs(budget: Budget, out: str) -> list[Job]:
    return [Job("fractions", rule, "none", 0.0, setting, seed, budget, out)
            for setting in SETTINGS for seed in range(NO_ATTACK_SEEDS) for rule in ("nefedavg", *BASELINES, "default", "no-finetune")]


# -- cost ---------------------------------------------------------------------------------------------
def cost_table(profile: str = "resnet20-fmnist-w", counts: tuple[int, ...] = (10, 100)) -> list[dict]:
    """Aggregation CPU time (add every update, then finalize) and the memory the aggregate holds at its
    peak, per rule, on honest-like updates (a shared direction plus noise, spread over the submodels)."""
    torch.set_num_threads(1)
    layout = Layout.build(load_profile(profile))
    state = GlobalState.init(layout, 0)
    root = lambda s, k, i: {n: torch.randn(sh) for n, sh in layout.upload_shapes(k).items()}  # noqa: E731
    rows = []
    for n in counts:
        gen = torch.Generator().manual_seed(n)
        common = {name: torch.randn(sh, generator=gen) for name, sh in layout.global_shapes.items()}
        ks = [i % layout.num_submodels for i in range(n)]
        updates = [{name: common[name][tuple(slice(0, d) for d in sh)] + torch.randn(sh, generator=gen)
                    for name, sh in layout.upload_shapes(k).items()} for k in ks]
        assignments = {f"c{i}": k for i, k in enumerate(ks)}
        for name, cfg in RULES.items():
            rule = Pipeline(layout, Robustness(aggregation=cfg), reference=root if cfg.spec.root_data else None)
            agg = rule.begin_round(state, assignments, 1)
            t0 = time.thread_time()
            peak = 0
            for i, (k, d) in enumerate(zip(ks, updates)):
                agg.add_validated(k, {m: t.clone() for m, t in d.items()}, client=f"c{i}", owned=True)
                peak = max(peak, agg.held_bytes)
            agg.finalize(state)
            rows.append({"updates": n, "rule": name, "cpu_s": time.thread_time() - t0, "held_mib": peak / 2**20})
            console.print(f"{n} updates, {name}: {rows[-1]['cpu_s']:.3f} s CPU, {rows[-1]['held_mib']:.1f} MiB held")
    return rows


# -- report -------------------------------------------------------------------------------------------
def pct(values: list[float]) -> str:
    v = [100 * x for x in values]
    return f"{statistics.fmean(v):.1f} ± {(max(v) - min(v)) / 2:.1f}"


def cell(runs: list[dict], key: str) -> str:
    if not runs:
        return "-"
    if key == "backdoor":
        vals = [max(r["backdoor"]) for r in runs if r["backdoor"]]
        return pct(vals) if vals else "-"
    return pct([r[key] for r in runs])


def find(results: list[dict], **match) -> list[dict]:
    return sorted((r for r in results if all(r[k] == v for k, v in match.items())), key=lambda r: r["seed"])


def fraction_tables(results: list[dict]) -> list[str]:
    lines = []
    for setting in SETTINGS:
        for attack in FRACTION_ATTACKS:
            key_title = "worst / avg clean top-1 (%); honest updates the rule dropped / all honest updates"
            lines += ["", f"**{attack}, {'IID' if setting == 'iid' else 'Dirichlet(0.5)'}**: {key_title}; "
                          "mean ± half the seed range.", "",
                      "| rule | " + " | ".join(f"{int(100 * f)}% attackers" for f in (0.0, *FRACTIONS)) + " |",
                      "|---|" + "---|" * (1 + len(FRACTIONS))]
            for rule in RULES:
                cells = []
                for f in (0.0, *FRACTIONS):
                    runs = find(results, part="fractions", rule=rule, setting=setting,
                                attack="none" if f == 0 else attack, fraction=f)
                    dropped = f" ({sum(r['honest_dropped'] for r in runs)}/{sum(r['honest_updates'] for r in runs)})" if runs else ""
                    cells.append(f"{cell(runs, 'worst')} / {cell(runs, 'avg')}{dropped}")
                lines.append(f"| {rule} | " + " | ".join(cells) + " |")
    return lines


def attack_tables(results: list[dict], fraction_results: list[dict]) -> list[str]:
    lines = []
    for setting in ["iid"]:
        lines += ["", f"**Every attack at 20 % attackers, {'IID' if setting == 'iid' else 'Dirichlet(0.5)'}**: worst / avg "
                      "clean top-1 (%); bd: backdoor success, the largest share of triggered test images any submodel calls the "
                      "target (%); honest updates the rule dropped / all honest updates.", "",
                  "| rule | no attack | " + " | ".join(OTHER_ATTACKS) + " |", "|---|---|" + "---|" * len(OTHER_ATTACKS)]
        for rule in RULES:
            base = find(fraction_results, part="fractions", rule=rule, setting=setting, attack="none")
            cells = [f"{cell(base, 'worst')} / {cell(base, 'avg')}"]
            for attack in OTHER_ATTACKS:
                runs = find(results, part="attacks", rule=rule, setting=setting, attack=attack)
                dropped = f" ({sum(r['honest_dropped'] for r in runs)}/{sum(r['honest_updates'] for r in runs)})" if runs else ""
                backdoor = f"; bd {cell(runs, 'backdoor')}" if attack == "backdoor" else ""
                cells.append(f"{cell(runs, 'worst')} / {cell(runs, 'avg')}{backdoor}{dropped}")
            lines.append(f"| {rule} | " + " | ".join(cells) + " |")
    return lines


def adaptive_tables(results: list[dict], fraction_results: list[dict]) -> list[str]:
    """Issue 41's attacks, per setting: a row per attack and rule, a column per attacker share."""
    lines = []
    for setting in SETTINGS:
        mine = [r for r in results if r["setting"] == setting]
        if not mine:
            continue
        lines += ["", f"**Attacks that know the defence, {'IID' if setting == 'iid' else 'Dirichlet(0.5)'}**: worst / avg "
                      "clean top-1 (%); bd: backdoor success, the largest share of triggered test images any submodel calls "
                      "the target (%); honest updates the rule dropped / all honest updates; seeds "
                      f"{', '.join(str(s) for s in sorted({r['seed'] for r in mine}))}.", "",
                  "| attack | rule | " + " | ".join(f"{int(100 * f)}% attackers" for f in (0.0, *FRACTIONS)) + " |",
                  "|---|---|" + "---|" * (1 + len(FRACTIONS))]
        for attack in ADAPTIVE_ATTACKS:
            for rule in RULES:
                if not find(mine, attack=attack, rule=rule):
                    continue
                cells = []
                for f in (0.0, *FRACTIONS):
                    runs = (find(fraction_results, rule=rule, setting=setting, attack="none") if f == 0
                            else find(mine, rule=rule, attack=attack, fraction=f))
                    dropped = f" ({sum(r['honest_dropped'] for r in runs)}/{sum(r['honest_updates'] for r in runs)})" if runs else ""
                    backdoor = f"; bd {cell(runs, 'backdoor')}" if f > 0 and attack in BACKDOORS else ""
                    cells.append(f"{cell(runs, 'worst')} / {cell(runs, 'avg')}{backdoor}{dropped}" if runs else "-")
                lines.append(f"| {attack} | {rule} | " + " | ".join(cells) + " |")
    return lines


def no_attack_lines(results: list[dict]) -> list[str]:
    """The default's (and `no-finetune`'s) cost without attackers, seed by seed: average clean accuracy against plain
    NeFedAvg's, and the default's against NeFedAvg with the same server images (BASELINES)."""
    lines = []
    for rule, base in (("default", "nefedavg"), ("no-finetune", "nefedavg"), ("default", "nefedavg-server")):
        lines += ["", f"**No attackers, seeds 0-{NO_ATTACK_SEEDS - 1}** (declared before they were run): average clean "
                      f"top-1 (%) of {rule} against {base}, seed by seed; honest updates {rule} dropped.", "",
                  "| setting | " + " | ".join(f"seed {s}" for s in range(NO_ATTACK_SEEDS)) + " | mean | cost |",
                  "|---|" + "---|" * (NO_ATTACK_SEEDS + 2)]
        for setting in SETTINGS:
            pairs = [(find(results, rule=base, setting=setting, seed=s), find(results, rule=rule, setting=setting, seed=s))
                     for s in range(NO_ATTACK_SEEDS)]
            done = [(p[0], d[0]) for p, d in pairs if p and d]
            cells = [f"{100 * d[0]['avg']:.1f} vs {100 * p[0]['avg']:.1f} ({d[0]['honest_dropped']})" if p and d else "-"
                     for p, d in pairs]
            tail = ["-", "-"]
            if done:
                plain, mine = (statistics.fmean(100 * pair[i]["avg"] for pair in done) for i in (0, 1))
                tail = [f"{mine:.1f} vs {plain:.1f}", f"{plain - mine:.2f}"]
            lines.append(f"| {'IID' if setting == 'iid' else 'Dirichlet(0.5)'} | " + " | ".join(cells + tail) + " |")
    return lines


def cost_lines(rows: list[dict]) -> list[str]:
    lines = ["", "Aggregation per round (`--part cost`): CPU seconds of adding every update and finalising, and the "
                 "most tensor memory the aggregate held, on resnet20-fmnist-w updates (one thread).", "",
             "| rule | 10 updates: CPU s | held MiB | 100 updates: CPU s | held MiB |", "|---|---|---|---|---|"]
    for rule in RULES:
        cells = []
        for n in (10, 100):
            r = next((r for r in rows if r["rule"] == rule and r["updates"] == n), None)
            base = next((r for r in rows if r["rule"] == "nefedavg" and r["updates"] == n), None)
            cells += [f"{r['cpu_s']:.3f} ({r['cpu_s'] / base['cpu_s']:.1f}x)", f"{r['held_mib']:.1f}"] if r and base else ["-", "-"]
        lines.append(f"| {rule} | " + " | ".join(cells) + " |")
    return lines


def write_doc(results: dict[str, list[dict]], no_attack: list[dict], cost: list[dict], budget: Budget, seeds: int,
              section: str, note: str) -> None:
    """The section's tables, those with saved runs: the fractions, the no-attack cost, every attack at 20 %, issue 41's
    attacks, the aggregation cost."""
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    fractions, attacks, adaptive = results["fractions"], results["attacks"], results["adaptive"]
    runs = fractions + attacks + adaptive + [r for r in no_attack if r["seed"] >= seeds]
    body = ["", f"Generated by `benchmarks/bench_robust.py` on {when}, commit {commit_label()}, {cpu_name()} "
                f"({platform.machine()}), load average {load_average()}. {note}".strip(), "",
            f"Budget: {budget.profile}, {budget.clients} clients all training every round (tiers as in the paper), "
            f"{budget.rounds} rounds, {budget.samples_per_client} images per client, seeds declared before running "
            f"0-{SEEDS - 1} (runs here: {', '.join(str(s) for s in sorted({r['seed'] for r in runs}))}), final "
            f"evaluation on {budget.eval_samples} test images; attackers are a seeded draw of the clients. "
            f"{len(runs)} runs, {sum(r['seconds'] for r in runs) / 60:.0f} min of run time in all."]
    if any(r["attack"] != "none" for r in fractions):
        body += fraction_tables(fractions)
    if any(r["rule"] == "nefedavg" for r in no_attack) and any(r["rule"] == "default" for r in no_attack):
        body += no_attack_lines(no_attack)
    if attacks:
        body += attack_tables(attacks, fractions)
    body += adaptive_tables(adaptive, fractions)
    if cost:
        body += cost_lines(cost)
    write_section(DOC, f"<!-- {section}:start -->", f"<!-- {section}:end -->", [*body, ""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=SEEDS)
    ap.add_argument("--part", choices=["all", "fractions", "attacks", "adaptive", "no-attack", "cost"], default="all")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "robust"))
    ap.add_argument("--section", default="bench-robust", help="the generated section of docs/security.md to write")
    ap.add_argument("--rounds", type=int, default=Budget.rounds)
    ap.add_argument("--note", default="", help="conditions worth stating (a shared machine, say)")
    ap.add_argument("--rules", nargs="+", choices=list(RULES), default=list(RULES),
                    help="run only these rules (the table still shows every rule's saved runs)")
    ap.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS), help="run only these")
    ap.add_argument("--fractions", nargs="+", type=float, choices=FRACTIONS, default=list(FRACTIONS), help="run only these")
    ap.add_argument("--attacks", nargs="+", choices=Grid.attacks, default=list(Grid.attacks), help="run only these")
    args = ap.parse_args()
    budget = replace(Budget(), rounds=args.rounds)
    grid = Grid(tuple(args.rules), tuple(args.settings), tuple(args.fractions), tuple(args.attacks))
    describe = lambda r: (f"worst {100 * r['worst']:.1f} avg {100 * r['avg']:.1f}"  # noqa: E731
                          + (f" backdoor {100 * max(r['backdoor']):.1f}" if r["backdoor"] else "") + f" ({r['seconds']:.0f} s)")
    parts = ("fractions", "attacks", "adaptive")
    for part in parts:
        if args.part in ("all", part):
            run_sweep(jobs_for(part, args.seeds, budget, args.out, grid), args.jobs, run_job, load, describe, console)
    # loaded once every sweep is done: the adaptive part runs the fractions part's attack-free runs
    results = {part: [r for j in jobs_for(part, args.seeds, budget, args.out) if j.part == part and (r := load(j)) is not None]
               for part in parts}
    clean = [j for j in no_attack_jobs(budget, args.out) if j.rule in args.rules and j.setting in args.settings]
    if args.part in ("all", "no-attack"):
        run_sweep(clean, args.jobs, run_job, load, describe, console)
    no_attack = [r for j in no_attack_jobs(budget, args.out) if (r := load(j)) is not None]
    cost_path = Path(args.out) / "cost.json"
    if args.part in ("all", "cost"):
        atomic_write_text(cost_path, json.dumps(cost_table(), indent=1))
    cost = json.loads(cost_path.read_text()) if cost_path.exists() else []
    write_doc(results, no_attack, cost, budget, args.seeds, args.section, args.note)


if __name__ == "__main__":
    sys.exit(main())
