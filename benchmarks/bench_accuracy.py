"""Accuracy of NeFL against its baselines and ablations on Fashion-MNIST; writes docs/results.md's generated section.

    PYTHONPATH=. python benchmarks/bench_accuracy.py [--quick] [--jobs 2] [--seeds 2] [--rounds 20] [--out DIR]

The sweep runs `aggregator.simulate` in-process, one configuration per worker process (one torch thread
each), for two settings (IID, Dirichlet(0.5) label skew) x eight methods x the seeds:
  nefl-w, nefl-d, nefl-wd   NeFL with learnable steps on the resnet20-fmnist-w / -d / -wd ladders
  fjord, heterofl, depthfl  the baselines, each deriving its ladder from the -wd profile's target sizes
  nefl-nl                   ablation: NeFL-WD with fixed step sizes
  nefl-sharedbn             ablation: NeFL-WD with BN shared, sliced and static (HeteroFL's BN)
The default budget (20 rounds, 300 images per client, final evaluation on 2,000 test images) is sized so
the 32 runs fit in about an hour on 2 cores with 2 jobs (docs/benchmarks.md, "Why the benchmarks are as they
are"); static BN (HeteroFL, nefl-sharedbn) recomputes its statistics before evaluating.

--families runs the architecture-families sweep instead (its own section `families` of docs/results.md):
ViT-tiny and MobileNetV2 x0.35 on Fashion-MNIST, each as NeFL-W / NeFL-D / NeFL-WD and against a
width-only (FjORD-style) and a depth-only (DepthFL-style) ladder of the same targets, with ResNet-20
NeFL-WD beside them at a similar parameter count, IID and Dirichlet(0.5), 2 seeds; a smaller budget
(FAMILY_BUDGET) so the 44 runs fit in about 40 minutes on 2 cores. The seed-0 IID NeFL-WD run of each
family keeps its checkpoint (<out>/checkpoints/) for benchmarks/bench_inference.py --checkpoint.

Resumable: every finished run is saved as <out>/<setting>/<method>-seed<S>.json and skipped when present.
--quick is a smoke run of the whole pipeline (2 rounds, 100 images per client, 1 seed, 2 methods, IID)
that writes to runs/bench-accuracy-quick/ (results.md and img/ there), never to docs/.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from rich.console import Console

from aggregator.simulate import SimConfig, Simulator
from nefl.aggregation.config import PLAIN_NEFEDAVG
from nefl.aggregation.pipeline import Robustness
from nefl.aggregation.robust import NormBound
from provenance import commit_label, cpu_name, load_average  # benchmarks/ is the script directory, on sys.path
from sweep import run_sweep
from nefl.nested.cost import full_cost, submodel_cost
from nefl.support.fsio import atomic_write_text
from nefl.nested.methods import Method, apply_method, get_method
from nefl.nested.profile import load_profile

ROOT = Path(__file__).resolve().parent.parent
PLACEHOLDER = "Not yet run: `make bench-accuracy`"
SETTINGS: dict[str, float | None] = {"iid": None, "dirichlet-0.5": 0.5}  # name -> Dirichlet alpha
SETTING_TITLES = {"iid": "IID", "dirichlet-0.5": "Dirichlet(0.5) label skew"}
console = Console()


@dataclass(frozen=True)
class Variant:
    """One line of the tables: a profile (ladder source) and the method that trains it."""

    name: str
    profile: str
    method: str
    description: str
    shared_bn: bool = False

    def resolve(self) -> Method:
        method = get_method(self.method)
        return dataclasses.replace(method, name=self.name, bn="shared_static") if self.shared_bn else method


WD = "resnet20-fmnist-wd"
VARIANTS = {v.name: v for v in (
    Variant("nefl-w", "resnet20-fmnist-w", "nefl", "NeFL-W: width ladder, learnable steps"),
    Variant("nefl-d", "resnet20-fmnist-d", "nefl", "NeFL-D: depth ladder, learnable steps"),
    Variant("nefl-wd", WD, "nefl", "NeFL-WD: width + depth ladder, learnable steps"),
    Variant("fjord", WD, "fjord", "FjORD: width only, per-width BN"),
    Variant("heterofl", WD, "heterofl", "HeteroFL: width only, shared sliced BN, static BN"),
    Variant("depthfl", WD, "depthfl", "DepthFL: contiguous depth prefix, fixed steps"),
    Variant("nefl-nl", WD, "nefl-nl", "ablation: NeFL-WD with fixed steps"),
    Variant("nefl-sharedbn", WD, "nefl", "ablation: NeFL-WD with shared static BN", shared_bn=True),
)}
# The architecture-families sweep (--families): every family's NeFL ladders against width-only and
# depth-only ladders derived from its -wd profile's targets; ResNet-20 beside them.
FAMILY_VARIANTS = {v.name: v for v in (
    Variant("vit-nefl-w", "vit-tiny-fmnist-w", "nefl", "ViT-tiny NeFL-W: whole heads of D, learnable steps"),
    Variant("vit-nefl-d", "vit-tiny-fmnist-d", "nefl", "ViT-tiny NeFL-D: encoder blocks skipped, learnable steps"),
    Variant("vit-nefl-wd", "vit-tiny-fmnist-wd", "nefl", "ViT-tiny NeFL-WD: width and depth, learnable steps"),
    Variant("vit-width", "vit-tiny-fmnist-wd", "fjord", "ViT-tiny width only (FjORD/HeteroFL-style ladder, fixed steps)"),
    Variant("vit-depth", "vit-tiny-fmnist-wd", "depthfl", "ViT-tiny depth only (DepthFL-style contiguous prefix, fixed steps)"),
    Variant("mbv2-nefl-w", "mobilenetv2-fmnist-w", "nefl", "MobileNetV2 NeFL-W: channel multiplier, learnable steps"),
    Variant("mbv2-nefl-d", "mobilenetv2-fmnist-d", "nefl", "MobileNetV2 NeFL-D: residual blocks skipped, learnable steps"),
    Variant("mbv2-nefl-wd", "mobilenetv2-fmnist-wd", "nefl", "MobileNetV2 NeFL-WD: width and depth, learnable steps"),
    Variant("mbv2-width", "mobilenetv2-fmnist-wd", "fjord", "MobileNetV2 width only (FjORD-style, per-width BN)"),
    Variant("mbv2-depth", "mobilenetv2-fmnist-wd", "depthfl", "MobileNetV2 depth only (DepthFL-style prefix, fixed steps)"),
    Variant("resnet20-nefl-wd", WD, "nefl", "ResNet-20 NeFL-WD (beside them, similar parameter count)"),
)}
ALL_VARIANTS = {**VARIANTS, **FAMILY_VARIANTS}
# The paper's Table (CIFAR-10, ResNet18, IID, 100 clients, 500 rounds; worst / avg top-1), labelled as such.
PAPER = {"nefl-wd": (86.86, 87.88), "fjord": (85.12, 87.32), "heterofl": (80.62, 84.26), "depthfl": (64.80, 82.44)}


@dataclass(frozen=True)
class Budget:
    rounds: int
    samples_per_client: int
    eval_samples: int
    clients: int = 20
    per_round: int = 5


@dataclass(frozen=True)
class Job:
    variant: str
    setting: str
    seed: int
    budget: Budget
    path: str
    checkpoint: str | None = None  # where the simulator leaves its final checkpoint (None: nowhere)

    @property
    def label(self) -> str:
        return f"{self.setting}/{self.variant}-seed{self.seed}"

    @property
    def rounds(self) -> int:
        return self.budget.rounds


DEFAULT_BUDGET = Budget(rounds=20, samples_per_client=300, eval_samples=2000)
QUICK_BUDGET = Budget(rounds=2, samples_per_client=100, eval_samples=500)
# sized for the 44 runs to fit in about 40 minutes with 2 jobs (ViT-tiny and MobileNetV2 x0.35 train at ResNet-20's step time)
# Batch 16 rather than 32: twice the local steps for the same images (MobileNetV2 stayed at chance after
# 10 rounds at batch 32 in a probe, its BN statistics barely past their initial values).
FAMILY_BUDGET = Budget(rounds=10, samples_per_client=160, eval_samples=1000)
FAMILY_BATCH = 16
CURVE_POINTS = 6  # evaluations during a run (on CURVE_SAMPLES test images), so a table can say whether it flattened
CURVE_SAMPLES = 1000
PAIRED_REFERENCE = "nefl-wd"  # the method the paired table sets against every other
# the paper's aggregation, for every method: plain NeFedAvg, no centre check, no norm bound (the kit's defences and
# their cost are docs/security.md's)
PAPER_AGGREGATION = Robustness(bound=NormBound(relative=None, adaptive_k=None),
                               aggregation=PLAIN_NEFEDAVG)


def markers(section: str) -> tuple[str, str]:
    """The main sweep owns `bench-accuracy`; a named extra sweep owns `bench-accuracy-NAME`."""
    tag = f"bench-accuracy-{section}" if section else "bench-accuracy"
    return f"<!-- {tag}:start -->", f"<!-- {tag}:end -->"


def run_job(job: Job, progress_queue) -> dict:
    """Worker: one simulation with one torch thread; the result lands atomically in job.path."""
    torch.set_num_threads(1)
    v, b = ALL_VARIANTS[job.variant], job.budget
    cfg = SimConfig(profile=v.profile, method=v.resolve(), dataset="fashion-mnist", clients=b.clients,
                    per_round=b.per_round, rounds=b.rounds, non_iid=SETTINGS[job.setting], seed=job.seed,
                    eval_every=max(1, b.rounds // CURVE_POINTS), eval_samples=CURVE_SAMPLES,
                    final_eval_samples=b.eval_samples, max_samples_per_client=b.samples_per_client,
                    out=job.checkpoint, batch_size=FAMILY_BATCH if job.variant in FAMILY_VARIANTS else 32,
                    robustness=PAPER_AGGREGATION)
    sim = Simulator(cfg)
    res = sim.run(lambda row: progress_queue.put((job.label, row["round"])))
    out = {
        "variant": v.name, "setting": job.setting, "seed": job.seed, "profile": v.profile,
        "method": dataclasses.asdict(sim.layout.method), "budget": dataclasses.asdict(b),
        "gammas": [s.gamma for s in sim.layout.profile.submodels],
        "accuracy": res.accuracy, "worst": res.worst, "avg": res.avg, "seconds": res.seconds,
        "steps": learned_steps(sim),
        "curve": [{"round": row["round"], "worst": row["worst"], "avg": row["avg"]} for row in res.rounds if "worst" in row],
    }
    path = Path(job.path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(out, indent=1))
    return out


def learned_steps(sim: Simulator) -> list[list[float]] | None:
    """Each submodel's step sizes of its present blocks after training (None when steps are frozen):
    evidence that NeFL's learnable steps do move away from their initial 1."""
    if not sim.layout.method.learnable_steps:
        return None
    return [[round(float(v), 4) for n, t in sorted(own.items()) if n.endswith(".step") for v in t.flatten() if float(v) != 0.0]
            for own in sim.state.inconsistent]  # a ViT block has two steps (attention, MLP)


def per_submodel_table(groups: dict, s: str, names: list[str], budget: Budget, title: str) -> list[str]:
    """One setting's per-submodel top-1 table (mean ± half-range over seeds) and its step-size table."""
    lines = ["", f"### {title}: per-submodel top-1 (%), mean ± half-range over seeds", "",
             "| method | " + " | ".join(f"sub {k + 1}" for k in range(5)) + " | worst | avg | s/run |",
             "|---|" + "---|" * 8]
    for name in names:
        runs = groups.get((s, name))
        if runs:
            subs = [spread([r["accuracy"][k] for r in runs]) for k in range(len(runs[0]["accuracy"]))]
            lines.append(f"| {name} | " + " | ".join(subs) + f" | {spread([r['worst'] for r in runs])} "
                         f"| {spread([r['avg'] for r in runs])} | {sum(r['seconds'] for r in runs) / len(runs):.0f} |")
    return lines + steps_table(groups, s, budget)


def steps_table(groups: dict, setting: str, budget: Budget) -> list[str]:
    """min / mean / max of the learned steps per submodel, for the runs that recorded them."""
    rows = [(name, r) for (s, name), runs in groups.items() if s == setting for r in runs if r.get("steps")]
    if not rows:
        return []
    lines = ["", f"Learned step sizes after the last round ({setting_title(setting, budget)}; initialised to 1): "
             "min / mean / max over each submodel's present blocks.", "",
             "| method | seed | " + " | ".join(f"sub {k + 1}" for k in range(len(rows[0][1]["steps"]))) + " |",
             "|---|---|" + "---|" * len(rows[0][1]["steps"])]
    for name, r in rows:
        cells = [f"{min(v):.2f} / {sum(v) / len(v):.2f} / {max(v):.2f}" if v else "-" for v in r["steps"]]
        lines.append(f"| {name} | {r['seed']} | " + " | ".join(cells) + " |")
    return lines


def paired_table(groups: dict, settings: list[str], names: list[str]) -> list[str]:
    """NeFL-WD minus each other method seed by seed: a seed draws the same partition, tiers and clients for every
    method, so the paired difference is free of the partition's share of the seed spread."""
    if PAIRED_REFERENCE not in names:
        return []
    lines = ["", f"`{PAIRED_REFERENCE}` minus each other method, seed by seed (a seed draws the same partition, tiers and "
             "clients for every method): worst / avg submodel top-1 difference in points, its mean over seeds, and the "
             f"seeds where `{PAIRED_REFERENCE}` is ahead.", "",
             "| setting | vs method | worst, per seed | avg, per seed | worst, mean | avg, mean | seeds ahead (worst / avg) |",
             "|---|---|---|---|---|---|---|"]
    for s in settings:
        ref = {r["seed"]: r for r in groups.get((s, PAIRED_REFERENCE), [])}
        for name in names:
            pairs = [(ref[r["seed"]], r) for r in groups.get((s, name), []) if r["seed"] in ref]
            if name == PAIRED_REFERENCE or not pairs:
                continue
            dw, da = ([100 * (a[m] - b[m]) for a, b in pairs] for m in ("worst", "avg"))
            lines.append(f"| {SETTING_TITLES[s]} | {name} | {', '.join(f'{d:+.2f}' for d in dw)} | "
                         f"{', '.join(f'{d:+.2f}' for d in da)} | {sum(dw) / len(dw):+.2f} | {sum(da) / len(da):+.2f} | "
                         f"{sum(d > 0 for d in dw)} / {sum(d > 0 for d in da)} of {len(pairs)} |")
    return lines


def curve_table(groups: dict, setting: str, names: list[str], budget: Budget) -> list[str]:
    """Worst / avg during training (mean over seeds), for the runs that recorded a curve: has it flattened?"""
    rows = {n: runs for n in names if (runs := groups.get((setting, n))) and all(r.get("curve") for r in runs)}
    if not rows:
        return []
    rounds = [c["round"] for c in next(iter(rows.values()))[0]["curve"]]
    lines = ["", f"During training ({setting_title(setting, budget)}): worst / avg submodel top-1 (%), mean over seeds, "
             f"on the first {CURVE_SAMPLES:,} test images (after the last round, its {budget.eval_samples:,}).", "",
             "| method | " + " | ".join(f"round {r}" for r in rounds) + " |", "|---|" + "---|" * len(rounds)]
    for name, runs in rows.items():
        points = [r["curve"] for r in runs]
        cells = [f"{100 * sum(p[i]['worst'] for p in points) / len(points):.1f} / "
                 f"{100 * sum(p[i]['avg'] for p in points) / len(points):.1f}" for i in range(len(rounds))]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def load_result(path: Path, budget: Budget) -> dict | None:
    if not path.exists():
        return None
    result = json.loads(path.read_text())
    if result["budget"] != dataclasses.asdict(budget):
        raise SystemExit(f"{path} was run with {result['budget']}, not {dataclasses.asdict(budget)}: "
                         "delete it or pass another --out")
    return result


# -- report -------------------------------------------------------------------------------------------

def grouped(results: list[dict]) -> dict[tuple[str, str], list[dict]]:
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in sorted(results, key=lambda r: r["seed"]):
        groups.setdefault((r["setting"], r["variant"]), []).append(r)
    return groups


def spread(values: list[float]) -> str:
    """Mean ± half the min-max range over seeds, in percent."""
    pct = [100 * v for v in values]
    return f"{sum(pct) / len(pct):.2f} ± {(max(pct) - min(pct)) / 2:.2f}"


def setting_title(setting: str, budget: Budget) -> str:
    """The setting and its round count: the main and the `long` sweep share settings, so without the
    rounds two figures and two headings of the same doc would read the same."""
    return f"{SETTING_TITLES[setting]}, {budget.rounds} rounds"


def realised_sizes(name: str) -> tuple[list[float], list[float]]:
    """Each submodel's parameters and MACs as fractions of the full model, as the method's ladder has them:
    block-granular depth ladders only approximate the target gammas, so accuracy is read against these."""
    v = ALL_VARIANTS[name]
    ladder = apply_method(load_profile(v.profile), v.resolve())
    full = full_cost(ladder)
    costs = [submodel_cost(ladder, sub) for sub in ladder.submodels]
    return [c.params / full.params for c in costs], [c.macs / full.macs for c in costs]


def plot_setting(setting: str, groups: dict, budget: Budget, seeds: int, path: Path) -> None:
    """Per-submodel accuracy against the realised parameter ratio, so ladders that miss their targets
    (DepthFL's submodels 3 and 4 are the same 0.73 network) are drawn where they really are."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, name in enumerate(VARIANTS):
        runs = groups.get((setting, name))
        if not runs:
            continue
        params, _ = realised_sizes(name)
        per_sub = [[100 * r["accuracy"][k] for r in runs] for k in range(len(params))]
        mean = [sum(a) / len(a) for a in per_sub]
        style = "-" if name.startswith("nefl-") and name not in ("nefl-nl", "nefl-sharedbn") else \
            (":" if name.startswith("nefl") else "--")
        (line,) = ax.plot(params, mean, style, marker="o", color=f"C{i}", label=name)
        ax.fill_between(params, [min(a) for a in per_sub], [max(a) for a in per_sub], color=line.get_color(), alpha=0.15)
    ax.set(xlabel="realised parameter ratio of the submodel (fraction of the full ResNet-20's parameters)",
           ylabel="top-1 accuracy (%)",
           title=f"Fashion-MNIST ResNet-20, {setting_title(setting, budget)}\nmean and min/max over {seeds} seed(s)")
    ax.title.set_fontsize(10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine() -> str:
    return (f"{cpu_name()}, {os.cpu_count()} logical cores, {psutil.virtual_memory().total / 2**30:.0f} GiB, no GPU used; "
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}, torch {torch.__version__}; "
            f"load average at the end {load_average()}")


def ladder_table(names: list[str]) -> list[str]:
    """What each method actually trains for the same target sizes: block-granular ladders (depth) can
    only approximate a target, so a fair reading compares accuracy against these realised sizes."""
    lines = ["", "Realised submodel sizes, parameters / MACs as a fraction of the full ResNet-20 (the targets are "
             "gamma = 0.2, 0.4, 0.6, 0.8, 1; `nefl profile show PROFILE --method M` prints the blocks):", "",
             "| method | " + " | ".join(f"sub {k + 1}" for k in range(5)) + " | mean params | mean MACs |",
             "|---|" + "---|" * 7]
    for name in names:
        p, m = realised_sizes(name)
        lines.append(f"| {name} | " + " | ".join(f"{a:.2f} / {b:.2f}" for a, b in zip(p, m))
                     + f" | {sum(p) / len(p):.2f} | {sum(m) / len(m):.2f} |")
    return lines


def provenance_verb(ran: int) -> str:
    """A report re-rendered from stored runs must not pass off today's commit and machine as the ones that
    trained the models."""
    return "Generated" if ran else "Re-rendered from the stored runs (nothing trained)"


def budget_note(budget: Budget, quick: bool) -> str:
    if quick:
        return "--quick smoke run of the pipeline: these numbers measure nothing."
    if budget == DEFAULT_BUDGET:
        return ("Chosen so the whole sweep (2 settings x 8 methods x 2 seeds) fits in about an hour on 2 cores with "
                "2 jobs; far from convergence, so read the ordering, not the absolute numbers.")
    return (f"Not the default budget ({DEFAULT_BUDGET.rounds} rounds, {DEFAULT_BUDGET.samples_per_client} images per "
            "client) of `make bench-accuracy`: an extra run that checks how the ordering moves with more training.")


def report(results: list[dict], budget: Budget, command: str, wall: float, ran: int, doc: Path, img_dir: Path,
           quick: bool, section: str = "") -> str:
    groups = grouped(results)
    settings = [s for s in SETTINGS if any(k[0] == s for k in groups)]
    names = [n for n in VARIANTS if any(k[1] == n for k in groups)]
    seeds = sorted({r["seed"] for r in results})
    lines = [
        f"## Generated sweep{f' `{section}`' if section else ''}: NeFL vs baselines and ablations "
        "(`benchmarks/bench_accuracy.py`)",
        "",
        f"{provenance_verb(ran)} {datetime.datetime.now().astimezone().isoformat(timespec='minutes')} "
        f"at commit {commit_label()} by",
        "",
        f"    {command}",
        "",
        f"- machine{'' if ran else ' of this re-render'}: {machine()}",
        f"- budget: ResNet-20 (1 input channel), 5 submodels gamma = 0.2 .. 1, {budget.clients} clients, "
        f"{budget.per_round} per round, {budget.rounds} rounds, 1 local epoch, batch 32, SGD lr 0.1 (x0.1 at 1/2 and "
        f"3/4 of the rounds), the paper's tiers; {budget.samples_per_client} training images per client; top-1 on the "
        f"first {budget.eval_samples:,} Fashion-MNIST test images after the last round; seeds {', '.join(map(str, seeds))}; "
        "plain NeFedAvg for every method (no centre check, no norm bound: the paper's aggregation). "
        + budget_note(budget, quick),
        (f"- wall time of this invocation: {wall / 60:.1f} min for {ran} run(s), {len(results) - ran} more read from disk; "
         if ran else f"- this invocation only rewrote the report: all {len(results)} runs were read from disk; ")
        + f"sum of per-run times {sum(r['seconds'] for r in results) / 60:.1f} min",
        "",
        "Worst / average submodel top-1 (%), mean ± half the min-max range over seeds. The last column is "
        "**the paper's** figures (CIFAR-10, ResNet18, IID, 100 clients, 500 rounds on a GPU; "
        "`benchmarks/paper_cifar10_resnet18.sh` reproduces that protocol), not measured here.",
        "",
        "| method | " + " | ".join(f"{SETTING_TITLES[s]} worst | {SETTING_TITLES[s]} avg" for s in settings)
        + " | paper CIFAR-10 ResNet18 IID worst / avg |",
        "|---|" + "---|---|" * len(settings) + "---|",
    ]
    for name in names:
        cells = []
        for s in settings:
            runs = groups.get((s, name), [])
            cells += [spread([r["worst"] for r in runs]), spread([r["avg"] for r in runs])] if runs else ["-", "-"]
        paper = "{:.2f} / {:.2f}".format(*PAPER[name]) if name in PAPER else ""
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {paper} |")
    lines += ["", "Methods: " + "; ".join(f"`{n}` {VARIANTS[n].description} (`{VARIANTS[n].profile}`)" for n in names) + "."]
    lines += paired_table(groups, settings, names)
    lines += ladder_table(names)
    for s in settings:
        img = img_dir / f"accuracy-{section + '-' if section else ''}{s}.png"
        plot_setting(s, groups, budget, len(seeds), img)
        lines += per_submodel_table(groups, s, names, budget, setting_title(s, budget))
        lines += curve_table(groups, s, names, budget)
        rel = os.path.relpath(img, doc.parent)
        lines += ["", f"![per-submodel accuracy, {setting_title(s, budget)}]({rel})", "",
                  "The plot puts each submodel at its realised parameter ratio (the table of realised sizes above), "
                  "not at its target gamma."]
    return "\n".join(lines)


def family_of_variant(name: str) -> str:
    arch = load_profile(ALL_VARIANTS[name].profile).arch
    return {"vit": "ViT-tiny", "mobilenetv2": "MobileNetV2 x0.35", "resnet": "ResNet-20"}[arch.family]


def family_ladders_table(names: list[str]) -> list[str]:
    """Absolute parameters and MACs of every submodel each variant trains (its realised ladder)."""
    lines = ["", "Parameters / MACs (per 1x28x28 sample) of each submodel as each method's ladder has it "
             "(`nefl profile show PROFILE --method M` prints the blocks):", "",
             "| family | method | " + " | ".join(f"sub {k + 1}" for k in range(5)) + " |", "|---|---|" + "---|" * 5]
    for name in names:
        v = ALL_VARIANTS[name]
        ladder = apply_method(load_profile(v.profile), v.resolve())
        cells = []
        for sub in ladder.submodels:
            c = submodel_cost(ladder, sub)
            cells.append(f"{c.params / 1e3:.0f}k / {c.macs / 1e6:.1f}M")
        lines.append(f"| {family_of_variant(name)} | {name} | " + " | ".join(cells) + " |")
    return lines


def families_report(results: list[dict], budget: Budget, command: str, wall: float, ran: int) -> str:
    groups = grouped(results)
    names = [n for n in FAMILY_VARIANTS if any(k[1] == n for k in groups)]
    seeds = sorted({r["seed"] for r in results})
    lines = [
        "## Generated sweep `families`: ViT-tiny and MobileNetV2 beside ResNet-20 "
        "(`benchmarks/bench_accuracy.py --families`)",
        "",
        f"{provenance_verb(ran)} {datetime.datetime.now().astimezone().isoformat(timespec='minutes')} "
        f"at commit {commit_label()} by",
        "",
        f"    {command}",
        "",
        f"- machine{'' if ran else ' of this re-render'}: {machine()}",
        f"- budget: 5 submodels per ladder, {budget.clients} clients, {budget.per_round} per round, {budget.rounds} rounds, "
        f"1 local epoch, batch {FAMILY_BATCH}, SGD lr 0.1 (x0.1 at 1/2 and 3/4 of the rounds), the paper's tiers; "
        f"{budget.samples_per_client} training images per client; top-1 on the first {budget.eval_samples:,} "
        f"Fashion-MNIST test images after the last round; seeds {', '.join(map(str, seeds))}. Far from convergence "
        "(every model here trains from scratch, and transformers are slow starters): read the ordering within a "
        "family and the IID -> non-IID drop, not the absolute numbers.",
        (f"- wall time of this invocation: {wall / 60:.1f} min for {ran} run(s), {len(results) - ran} more read from disk; "
         if ran else f"- this invocation only rewrote the report: all {len(results)} runs were read from disk; ")
        + f"sum of per-run times {sum(r['seconds'] for r in results) / 60:.1f} min",
        "",
        "Worst / average submodel top-1 (%), mean ± half the min-max range over seeds; the last column is the drop "
        "of the average from IID to Dirichlet(0.5) (the paper's claim: transformers degrade less under non-IID data).",
        "",
        "| family | method | full params | IID worst | IID avg | Dir(0.5) worst | Dir(0.5) avg | avg drop |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        v = ALL_VARIANTS[name]
        ladder = apply_method(load_profile(v.profile), v.resolve())
        cells, avgs = [], []
        for s in SETTINGS:
            runs = groups.get((s, name), [])
            cells += [spread([r["worst"] for r in runs]), spread([r["avg"] for r in runs])] if runs else ["-", "-"]
            avgs.append(100 * sum(r["avg"] for r in runs) / len(runs) if runs else None)
        drop = f"{avgs[0] - avgs[1]:+.2f}" if None not in avgs else "-"
        lines.append(f"| {family_of_variant(name)} | {name} | {full_cost(ladder).params / 1e3:.0f}k | "
                     + " | ".join(cells) + f" | {drop} |")
    lines += ["", "Methods: " + "; ".join(f"`{n}` {ALL_VARIANTS[n].description} (`{ALL_VARIANTS[n].profile}`)"
                                          for n in names) + "."]
    lines += family_ladders_table(names)
    for s in SETTINGS:
        if not any(k[0] == s for k in groups):
            continue
        lines += per_submodel_table(groups, s, names, budget, f"Families, {setting_title(s, budget)}")
    return "\n".join(lines)


def write_section(doc: Path, text: str, section: str = "") -> None:
    """Replace what lies between the markers, leaving the hand-written rest of the doc alone."""
    start, end = markers(section)
    current = doc.read_text() if doc.exists() else "# Results\n"
    if start not in current:
        current = current.rstrip() + f"\n\n{start}\n{PLACEHOLDER}\n{end}\n"
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(pattern.sub(lambda _: f"{start}\n{text}\n{end}", current))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 rounds, 100 images/client, 1 seed, 2 methods, IID")
    ap.add_argument("--jobs", type=int, default=2, help="simulations in parallel, one torch thread each (default 2)")
    ap.add_argument("--seeds", type=int, help="seeds 0..N-1 (default 2; --quick: 1)")
    ap.add_argument("--rounds", type=int, help="rounds per run (default 20; --quick: 2)")
    ap.add_argument("--samples", type=int, help="training images per client (default 300; --quick: 100)")
    ap.add_argument("--eval-samples", type=int, help="test images for the final evaluation (default 2000; --quick: 500)")
    ap.add_argument("--methods", help=f"comma-separated subset of {','.join(VARIANTS)}")
    ap.add_argument("--settings", help=f"comma-separated subset of {','.join(SETTINGS)}")
    ap.add_argument("--out", type=Path, help="run results directory (default runs/bench-accuracy; --quick: "
                                             "runs/bench-accuracy-quick, whose results.md and img/ then hold the report)")
    ap.add_argument("--families", action="store_true", help="the architecture-families sweep (ViT-tiny, MobileNetV2, "
                                                            "ResNet-20) instead of the ResNet-20 methods sweep")
    ap.add_argument("--section", default="", help="name of an extra sweep (e.g. another budget): its own marked section "
                                                  "of the doc and its own plots, leaving the main sweep's alone")
    args = ap.parse_args()
    q = args.quick
    if not re.fullmatch(r"[a-z0-9-]*", args.section):
        ap.error("--section takes lower-case letters, digits and dashes")
    base = QUICK_BUDGET if q else FAMILY_BUDGET if args.families else DEFAULT_BUDGET
    budget = Budget(rounds=args.rounds or base.rounds, samples_per_client=args.samples or base.samples_per_client,
                    eval_samples=args.eval_samples or base.eval_samples)
    variants = FAMILY_VARIANTS if args.families else VARIANTS
    quick_methods = ["vit-nefl-wd", "mbv2-nefl-wd"] if args.families else ["nefl-wd", "heterofl"]
    methods = args.methods.split(",") if args.methods else (quick_methods if q else list(variants))
    settings = args.settings.split(",") if args.settings else (["iid"] if q else list(SETTINGS))
    for name in methods:
        if name not in variants:
            ap.error(f"unknown method {name!r}: choose from {', '.join(variants)}")
    for s in settings:
        if s not in SETTINGS:
            ap.error(f"unknown setting {s!r}: choose from {', '.join(SETTINGS)}")
    if args.jobs < 1:
        ap.error("--jobs must be at least 1")
    default_out = "bench-accuracy-families" if args.families else "bench-accuracy"
    out = args.out or ROOT / "runs" / (default_out + ("-quick" if q else ""))
    doc, img_dir = (out / "results.md", out / "img") if q else (ROOT / "docs" / "results.md", ROOT / "docs" / "img")
    for v in {variants[m].profile for m in methods}:
        load_profile(v)  # fail before starting workers if a profile is missing

    def checkpoint(m: str, s: str, seed: int) -> str | None:
        keep = args.families and m.endswith("-nefl-wd") and s == "iid" and seed == 0
        return str(out / "checkpoints" / m) if keep else None

    jobs = [Job(m, s, seed, budget, str(out / s / f"{m}-seed{seed}.json"), checkpoint(m, s, seed))
            for s in settings for m in methods for seed in range(args.seeds or (1 if q else 2))]
    if args.families:  # seed by seed: a sweep cut short still has every method in both settings
        jobs.sort(key=lambda j: j.seed)
    ran = sum(not Path(j.path).exists() for j in jobs)
    started = datetime.datetime.now()
    results = run_sweep(jobs, args.jobs, run_job, lambda j: load_result(Path(j.path), budget),
                        lambda r: f"worst {100 * r['worst']:.2f} avg {100 * r['avg']:.2f} ({r['seconds']:.0f} s)", console)
    wall = (datetime.datetime.now() - started).total_seconds()
    command = "PYTHONPATH=. python benchmarks/bench_accuracy.py " + shlex.join(sys.argv[1:])
    if args.families:
        write_section(doc, families_report(results, budget, command.strip(), wall, ran), args.section or "families")
    else:
        write_section(doc, report(results, budget, command.strip(), wall, ran, doc, img_dir, q, args.section), args.section)
    console.print(f"[green]wrote {doc} and plots in {img_dir}")


if __name__ == "__main__":
    main()
