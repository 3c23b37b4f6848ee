"""The research simulator's speed (issue 45): rounds per second and the share of a round spent outside training, for
today's code against this tree's one-by-one and batched (`--batch-clients`) paths on the same run; writes
docs/benchmarks.md's section.

    PYTHONPATH=. python benchmarks/bench_sim.py [--repeats 3] [--device cpu] [--baseline main] [--no-doc] [--profile-only]

Every variant runs in its own process (`--child`), the same seeded run (same seed, config, data): the baseline
imports a temporary git worktree of `--baseline`, the others this tree. Variants run in turn, repeat by repeat, so a
drifting machine slows them alike; medians over the repeats are reported. A round's time is the driver's open-to-commit
wall time (its `wall_s`); training is the sum of the clients' `train_s` (the optimiser loop: forward, backward, step,
and the batches it draws; a batched group's time shared by its clients); what is left is per-client setup, slicing,
copies, the server's checks and NeFedAvg. The first round (warm-up) and the last (it evaluates) are left out. The
paper protocol's time is estimated from measured per-step times of its own model (resnet18-cifar10-wd, batch 32, every
submodel). A cProfile of a short one-by-one run first splits a round's time into its parts (its own section).
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

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
SECTION = "## Simulator speed (`make bench-sim`)"
# The run: the shape (resnet20-fmnist-wd, 10 of 100 clients a round over the 5 tiers, batch 32, E = 1) cut
# to 128 images a client (4 steps) so that repeats fit 2 shared cores
RUN = dict(profile="resnet20-fmnist-wd", clients=100, per_round=10, rounds=5, local_epochs=1, batch_size=32,
           max_samples_per_client=128, eval_every=0, final_eval_samples=500, seed=0)
VARIANTS = {"today": {}, "one-by-one": {}, "batched": {"batch_clients": True}}
# the paper's CIFAR-10 ResNet18 protocol (benchmarks/paper_cifar10_resnet18.sh)
PAPER = dict(profile="resnet18-cifar10-wd", rounds=500, per_round=10, local_epochs=5, images_per_client=500, batch=32,
             methods=4)


def child(variant: str, device: str) -> dict:
    """One seeded run of `variant` in this process; its per-round times."""
    import torch

    from aggregator.simulate import SimConfig, Simulator

    torch.set_num_threads(1)
    sim = Simulator(SimConfig(**RUN, device=device, **VARIANTS[variant]))
    rows: list[dict] = []
    t0 = time.perf_counter()
    sim.run(rows.append)
    measured = rows[1:-1]
    out = {"variant": variant, "device": device, "seconds": time.perf_counter() - t0,
           "round_s": [r["wall_s"] for r in measured],
           "train_s": [sum(c["train_s"] for c in r["clients"].values()) for r in measured],
           "steps": [len(r["clients"]) * -(-RUN["max_samples_per_client"] // RUN["batch_size"]) * RUN["local_epochs"]
                     for r in measured]}
    if device.startswith("cuda"):
        try:
            out["gpu_utilisation"] = torch.cuda.utilization()
        except Exception as e:  # needs pynvml; say why there is no figure
            out["gpu_utilisation"] = f"n/a ({type(e).__name__})"
    return out


PROFILE_SECTION = "## Simulator: where a round's time goes (`make bench-sim`)"
# (file, function) whose cumulative time makes each part; training is local_train less what it calls for batches and weights
PARTS = {"batches": ("nefl/nested/data.py", "_batches"), "load": ("nefl/nested/state.py", "load_module_state"),
         "extract": ("nefl/nested/state.py", "extract"), "accept": ("aggregator/federation.py", "accept"),
         "close": ("aggregator/rounds.py", "close_round"), "evaluate": ("aggregator/evaluation.py", "accuracy"),
         "start": ("aggregator/rounds.py", "evaluate_start"),
         "train": ("nefl/nested/train.py", "local_train"), "run": ("aggregator/simulate.py", "run")}


def profile_parts(device: str, rounds: int) -> dict[str, float]:
    """cProfile's cumulative seconds of PARTS over a `rounds`-round run of the one-by-one path (every round evaluated)."""
    import cProfile
    import pstats

    import torch

    from aggregator.simulate import SimConfig, Simulator

    torch.set_num_threads(1)
    sim = Simulator(SimConfig(**{**RUN, "rounds": rounds, "eval_every": 1, "eval_samples": RUN["final_eval_samples"]},
                              device=device))
    prof = cProfile.Profile()
    prof.runcall(sim.run)
    stats = pstats.Stats(prof).stats  # (file, line, function) -> (calls, primitive calls, own s, cumulative s, callers)
    return {part: sum(v[3] for (f, _, fn), v in stats.items() if f.endswith(path) and fn == name)
            for part, (path, name) in PARTS.items()}


def profile_report(parts: dict[str, float], rounds: int, measured: str) -> list[str]:
    training = parts["train"] - parts["batches"] - parts["load"]
    rows = [("training: forward, backward, SGD step (local_train less the two below)", training),
            ("batches: indexing, augmentation on tensors, normalisation", parts["batches"]),
            ("weights into the client's module (load_state_dict)", parts["load"]),
            ("submodel slicing and copies (GlobalState.extract)", parts["extract"]),
            ("server checks and NeFedAvg's add (Federation.accept)", parts["accept"]),
            ("close: NeFedAvg finalize, state check (close_round less its evaluations)",
             parts["close"] - (parts["evaluate"] - parts["start"])),
            ("evaluation of the 5 submodels", parts["evaluate"])]
    other = parts["run"] - sum(t for _, t in rows)
    return [PROFILE_SECTION, "", measured, "",
            f"cProfile over a {rounds}-round run of the one-by-one path (the run of \"Simulator speed\", every round evaluated on "
            f"{RUN['final_eval_samples']} test images, the initial state too), cumulative seconds:", "",
            "| part | s | share |", "|---|---:|---:|",
            *(f"| {name} | {t:.2f} | {100 * t / parts['run']:.1f}% |" for name, t in [*rows, ("the rest", other)]),
            f"| whole run | {parts['run']:.2f} | 100% |"]


def paper_steps(device: str, steps: int = 3) -> list[float]:
    """Seconds per SGD step (batch 32, 3x32x32 images) of every submodel of the paper protocol's ladder, after a warm-up."""
    import torch

    from nefl.nested.profile import load_profile
    from nefl.nested.state import GlobalState, Layout
    from nefl.nested.train import TrainConfig, local_train

    torch.set_num_threads(1)
    layout = Layout.build(load_profile(PAPER["profile"]))
    state = GlobalState.init(layout, seed=0)
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(PAPER["batch"], 3, 32, 32, generator=gen), torch.randint(0, 10, (PAPER["batch"],), generator=gen))
               for _ in range(steps + 1)]
    per_step = []
    for k in range(layout.num_submodels):
        model = layout.module(k)
        local_train(model, state.extract(layout, k), batches[:1], TrainConfig(), device=device)
        res = local_train(model, state.extract(layout, k), batches[1:], TrainConfig(), device=device)
        per_step.append(res.seconds / steps)
    return per_step


def _run_child(variant: str, device: str, tree: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, __file__, "--child", variant, "--device", device], env=env, cwd=tree,
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"{variant} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def summarise(runs: list[dict]) -> dict:
    """Medians over every measured round of every repeat of one variant."""
    rounds = [r for run in runs for r in run["round_s"]]
    train = [t for run in runs for t in run["train_s"]]
    outside = [1 - t / r for run in runs for t, r in zip(run["train_s"], run["round_s"])]
    steps = [s for run in runs for s in run["steps"]]
    return {"round_s": _median(rounds), "rounds_per_s": 1 / _median(rounds), "outside": _median(outside),
            "step_s": _median([t / s for t, s in zip(train, steps)]), "rounds": len(rounds),
            "round_spread": (min(rounds), max(rounds)), "gpu": [run.get("gpu_utilisation") for run in runs]}


def report(results: dict[str, list[dict]], per_step: list[float], device: str, baseline: str, started: float,
           command: str) -> list[str]:
    from provenance import measured_by, provenance  # benchmarks/ is the script directory, on sys.path

    s = {v: summarise(runs) for v, runs in results.items()}
    today = s["today"]["round_s"]
    repeats = len(next(iter(results.values())))
    lines = [SECTION, "", measured_by(command, provenance(started, f"device {device}")), "",
             f"{RUN['profile']}, {RUN['clients']} clients in 5 tiers, {RUN['per_round']} a round (paper assignment), "
             f"{RUN['max_samples_per_client']} Fashion-MNIST images each (E = {RUN['local_epochs']}, batch {RUN['batch_size']}: "
             f"{-(-RUN['max_samples_per_client'] // RUN['batch_size'])} steps a client), seed {RUN['seed']}, one torch "
             f"thread; {repeats} repeats of a {RUN['rounds']}-round run per variant, taken in turn; rounds 2-{RUN['rounds'] - 1} "
             f"measured (round 1 warms up, the last evaluates). \"today\" is commit {baseline}. Medians; the spread is "
             "the fastest and slowest measured round.", "",
             "| variant | s / round | rounds / s | vs today | outside training | s / step (a client's) | spread s | rounds |",
             "|---|---:|---:|---:|---:|---:|---|---:|"]
    for v, m in s.items():
        lines.append(f"| {v} | {m['round_s']:.2f} | {m['rounds_per_s']:.3f} | {today / m['round_s']:.2f}x | "
                     f"{100 * m['outside']:.1f}% | {m['step_s'] * 1000:.1f} ms | {m['round_spread'][0]:.2f}-{m['round_spread'][1]:.2f} | "
                     f"{m['rounds']} |")
    if device.startswith("cuda"):
        lines += ["", "GPU utilisation (torch.cuda.utilization at the end of each run): "
                  + "; ".join(f"{v}: {m['gpu']}" for v, m in s.items())]
    steps_per_client = PAPER["local_epochs"] * -(-PAPER["images_per_client"] // PAPER["batch"])
    steps = PAPER["rounds"] * PAPER["per_round"] * steps_per_client
    mean_step = statistics.fmean(per_step)
    outside = s["one-by-one"]["outside"]
    hours = steps * mean_step / (1 - outside) / 3600
    lines += ["", f"The paper's CIFAR-10 ResNet18 protocol ({PAPER['profile']}, {PAPER['rounds']} rounds x "
              f"{PAPER['per_round']} clients x E = {PAPER['local_epochs']} x {steps_per_client} steps of batch {PAPER['batch']} "
              f"= {steps:,} steps a method), estimated from one step of each submodel measured here on {device} "
              f"({', '.join(f'{1000 * t:.0f}' for t in per_step)} ms, mean {1000 * mean_step:.0f} ms; submodels assigned "
              f"about evenly) and the one-by-one path's {100 * outside:.1f}% outside training: {hours:.1f} h a method, "
              f"{PAPER['methods'] * hours:.1f} h for its {PAPER['methods']} methods on one such device, one thread."]
    if not device.startswith("cuda"):
        lines += ["", "On a CPU the batched path is meant to lose: it saves kernel launches and per-client setup, which a "
                  "CPU barely spends (the share outside training above), and pays for grouped convolutions and BatchNorm "
                  "under vmap; it is there for GPUs (issue 45 measured ~2 s of a 4.4-5.7 s CUDA round outside training)."]
    return lines


def _baseline_tree(rev: str, tmp: Path) -> tuple[Path, str]:
    tree = tmp / "baseline"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev], check=True, capture_output=True)
    sha = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return tree, sha


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--baseline", default="main", help="the git revision whose simulator is 'today'")
    ap.add_argument("--no-doc", action="store_true", help="print the table, leave docs/benchmarks.md alone")
    ap.add_argument("--profile-rounds", type=int, default=2, help="rounds of the profiled run")
    ap.add_argument("--profile-only", action="store_true", help="only the profile of where a round's time goes")
    ap.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.device)))
        return
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from provenance import replace_section

    from provenance import measured_by, provenance

    command = "make bench-sim" + ("" if args.device == "cpu" else f" DEVICE={args.device}")
    t0 = time.time()
    parts = profile_parts(args.device, args.profile_rounds)
    profile = profile_report(parts, args.profile_rounds, measured_by(command, provenance(t0, f"device {args.device}")))
    print("\n".join(profile))
    if not args.no_doc:
        replace_section(DOC, PROFILE_SECTION, profile)
    if args.profile_only:
        return
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        tree, sha = _baseline_tree(args.baseline, Path(tmp))
        try:
            results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
            for r in range(args.repeats):
                for v in VARIANTS:
                    results[v].append(_run_child(v, args.device, tree if v == "today" else ROOT))
                    print(f"repeat {r + 1} {v}: rounds {results[v][-1]['round_s']} s, training {results[v][-1]['train_s']} s",
                          flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    per_step = paper_steps(args.device)
    lines = report(results, per_step, args.device, sha, started, command)
    print("\n".join(lines))
    if not args.no_doc:
        replace_section(DOC, SECTION, lines)
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
