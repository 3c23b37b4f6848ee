"""The robustness issues' attacks, rerun over `aggregator serve` with real processes on mosquitto,
under the default configuration: two honest `edge-client join`s plus one real join that attacks with its
own device key (tests/harness/attack_device.py), against a control without the attack. Writes a section of
docs/security.md (`--section`, default `bench-attacks-serve`).

    PYTHONPATH=. python benchmarks/bench_attacks_serve.py [--rounds 12] [--late-rounds 24] [--aggregator RULE ...]
        [--runs RUN ...] [--serve-args "--step-element 1"] [--out DIR] [--section NAME] [--note TEXT]

Every run uses `serve`'s defaults; `--aggregator default fltrust ...` measures other rules too, each against its
own controls; `--serve-args` adds serve options to every federation (controls included), named in the rows.
Each federation's metrics are saved under --out (RULE/RUN.json); `--runs` reruns only those (a row needs
its control: `--runs control neg-weights`), the others' saved metrics make the rest of the table.

Issue 20's attacks, against `control` (the two honest devices alone):
  scaled-flip   -9 x its honest delta from round 1 (inside the 10 x weight-norm bound)
  neg-weights   -9 x the weights it was sent (norm 9 x the weight norm) from round 1
  late-start    -9 x its honest delta from round 12, after the adaptive bound's warm-up (the ratchet)
Issue 41's, from round 1 with each attack's default scale (nefl/aggregation/attacks.py), against `honest-3` (the
third device honest, as issue 41 measures): bias-push, bn-poison, layer-local, boosted-backdoor, alie, min-max,
min-sum and adaptive, also against `control` (the attacker left out: what a perfect filter leaves). Reported: each
submodel's top-1 at every round against the control's at that round (each round's committed checkpoint is copied as
it appears and scored after the run; older saved runs hold only the rounds serve scored, which depend on timing),
and for the backdoor (and the honest third) the share of triggered test images (not of the target class) each
submodel calls the target, at every round.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shlex
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench_scale import Run, free_port  # benchmarks/ is the script directory, on sys.path
from provenance import commit_label, cpu_name, load_average, write_section

from aggregator.evaluation import Evaluator
from nefl.aggregation.attacks import triggered_test
from nefl.nested.checkpoint import load_checkpoint
from nefl.nested.data import load_dataset
from nefl.support.fsio import atomic_write_text
from nefl.support.settings import BACKDOORS, Attack

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "security.md"
PROFILE = "resnet8-fmnist-w"
PY = sys.executable
EVAL_SAMPLES = 2000
NEW_ATTACKS = ("bias-push", "bn-poison", "layer-local", "boosted-backdoor", "alie", "min-max", "min-sum", "adaptive")
# run -> its control; the honest third's row shows what the defence does to it (drops, clips, backdoor baseline)
ATTACKS = {"scaled-flip": "control", "neg-weights": "control", "late-start": "control-long", "honest-3": "honest-3",
           **{a: "honest-3" for a in NEW_ATTACKS}}
RUNS = ("control", "scaled-flip", "neg-weights", "control-long", "late-start", "honest-3", *NEW_ATTACKS)
BACKDOOR_TARGET = Attack("backdoor").target


def attack_of(name: str, rounds: int) -> tuple[str, str, int] | None:
    """A run's attacking device: (kind, scale, first round), None for a control, `honest` for the honest third."""
    if name in NEW_ATTACKS:
        return name, "default", 1
    if name == "honest-3":
        return "honest", "default", 1
    return {"scaled-flip": ("scaled-flip", "9", 1), "neg-weights": ("neg-weights", "9", 1),
            "late-start": ("scaled-flip", "9", rounds // 2)}.get(name)


class SnapshotKeeper:
    """Copies each committed checkpoint of a running serve (its CURRENT pointer) to keep/ROUND, so that every round's
    model can be scored afterwards (serve keeps the last two)."""

    def __init__(self, run_dir: Path, keep: Path) -> None:
        self.run_dir, self.keep = run_dir, keep
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        seen = None
        while not self.done.wait(0.3):
            try:
                name = (self.run_dir / "CURRENT").read_text().strip()
                if name != seen:
                    target = self.keep / name
                    shutil.copytree(self.run_dir / "checkpoints" / name, target / "checkpoints" / name)
                    (target / "CURRENT").write_text(name + "\n")
                    seen = name
            except (FileNotFoundError, FileExistsError, shutil.Error):
                pass  # not written yet, or replaced while copied: the next poll tries again

    def stop(self) -> list[Path]:
        self.done.set()
        self.thread.join()
        return sorted(p for p in self.keep.iterdir() if p.is_dir()) if self.keep.exists() else []


def scores(snapshots: list[Path], backdoor: bool) -> dict[str, dict[int, list[float]]]:
    """Per committed round: each submodel's top-1 on the evaluation images (every round, whichever rounds serve
    scored while it ran: those depend on timing) and, with `backdoor`, its share of triggered test images (not of the
    target class) it calls the backdoor's target."""
    torch.set_num_threads(1)
    test = load_dataset("fashion-mnist", train=False)
    sets = {"accuracy": test, **({"backdoor": triggered_test(test, BACKDOOR_TARGET)} if backdoor else {})}
    out: dict[str, dict[int, list[float]]] = {key: {} for key in sets}
    evaluators: dict[str, Evaluator] = {}
    for snap in snapshots:
        ck = load_checkpoint(snap)
        for key, data in sets.items():
            if key not in evaluators:
                evaluators[key] = Evaluator.for_dataset(ck.layout, "fashion-mnist", EVAL_SAMPLES, test=data)
            out[key][int(ck.meta["round"])] = [round(a, 4) for a in evaluators[key].accuracy(ck.state, threads=1)]
    return out


def federation(rounds: int, attack: tuple[str, str, int] | None, work: Path, rule: list[str]) -> dict:
    """One federation: mosquitto, serve (its defaults, plus `rule`: the options that choose another aggregation
    rule), two honest joins and, if given, the (kind, scale, first round) device (kind `honest`: a plain join). Its
    metrics lines, every committed round's top-1 from its kept checkpoints and, for the honest third and the
    backdoors, every round's backdoor success."""
    run = Run(work)
    keeper = None
    try:
        port = free_port()
        run.mosquitto(port)
        broker = f"mqtt://127.0.0.1:{port}"
        agg = run.start("agg", [PY, "-c", "from aggregator.cli import app; app()", "serve", "--profile", PROFILE,
                                "--broker", broker, "--federation", "b", "--rounds", str(rounds), "--clients-per-round", "3",
                                "--min-clients", "2", "--round-timeout", "90", "--join-wait", "15",
                                "--eval-dataset", "fashion-mnist", "--eval-samples", str(EVAL_SAMPLES),
                                "--checkpoint-dir", str(work / "run"), *rule])
        join = ["join", "--broker", broker, "--federation", "b", "--threads", "1", "--max-samples", "300", "--no-calibrate"]
        for i in (1, 2):
            run.start(f"c{i}", [PY, "-c", "from edge_client.cli import app; app()", *join, "--client-id", f"c{i}",
                                "--partition", f"{i}/8"])
        keeper = SnapshotKeeper(work / "run", work / "keep")
        if attack is not None:
            kind, scale, first = attack
            device = (["-c", "from edge_client.cli import app; app()"] if kind == "honest"
                      else ["-m", "tests.harness.attack_device", kind, scale, str(first)])
            run.start("evil", [PY, *device, *join, "--client-id", "evil", "--partition", "3/8"])
        run.finish(agg, 120 * rounds + 300)  # room for a loaded 2-core machine's slow rounds
    finally:
        run.stop()
        snapshots = keeper.stop() if keeper is not None else []
    lines = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    # the honest third's backdoor success is the baseline
    backdoor = attack is not None and (attack[0] == "honest" or attack[0] in BACKDOORS)
    return {"metrics": lines, **(scores(snapshots, backdoor) if snapshots else {})}


def saved_run(path: Path) -> dict:
    """A saved federation: its metrics lines and per-round scores (older files hold only the lines)."""
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {"metrics": data}


def evaluated(run: dict) -> dict[int, list[float]]:
    """Round -> top-1 per submodel on the evaluation images: every round's checkpoint where they were kept, else the
    rounds serve scored on them (not its final score, on the whole test split)."""
    if run.get("accuracy"):
        return {int(r): a for r, a in run["accuracy"].items()}
    return {m["round"]: m["accuracy"] for m in run["metrics"]
            if m["round"] >= 1 and m.get("accuracy") and m.get("eval_samples", EVAL_SAMPLES) == EVAL_SAMPLES}


def bounded(m: dict, clients: set[str], but: frozenset[str] = frozenset()) -> int:
    """Per-submodel tensors the step bound scaled down in round `m` on the submodels these clients trained
    (and no client in `but`)."""
    def trained(who: set[str] | frozenset[str]) -> set[str]:
        return {str(k) for c, k in m.get("assigned", {}).items() if c in who}
    mine = trained(clients) - trained(but)
    return sum(n for k, n in m.get("steps_bounded", {}).items() if k in mine)


def drops(ours: dict[int, list[float]], theirs: dict[int, list[float]]) -> dict[int, float]:
    """Round -> the largest amount by which any submodel's top-1 in `ours` is below `theirs`, at rounds both scored."""
    return {r: round(max(b - a for a, b in zip(ours[r], theirs[r])), 4) for r in ours if r in theirs}


def summary(name: str, run: dict, control: dict, after: int, excluded: dict | None = None) -> dict:
    """One run's row. `excluded`: the federation without the third device (the attacker left out), the best a
    defence can do where it cannot recover the attacker's honest work."""
    rounds = [m for m in run["metrics"] if m["round"] >= 1 and "reported" in m]  # not the background scores' lines
    served = {m["round"]: m["accuracy"] for m in run["metrics"] if m.get("accuracy")}
    base = {m["round"]: m["accuracy"] for m in control["metrics"] if m.get("accuracy")}
    last, ctl = served[max(served)], base[max(base)]  # the final scores, on the whole test split
    honest = {"c1", "c2"}
    evil = [m for m in rounds if "evil" in m.get("participants", [])]
    ours, theirs = evaluated(run), evaluated(control)
    gaps = drops(ours, theirs)
    left_out = drops(ours, evaluated(excluded)) if excluded is not None else {}
    backdoor = {int(r): v for r, v in run.get("backdoor", {}).items()}
    return {
        "name": name, "rounds": len(rounds), "accuracy": last, "control": ctl,
        "worst_gap": max(b - a for a, b in zip(last, ctl)),
        "gaps": gaps, "worst_gap_after": max((g for r, g in gaps.items() if r > after), default=None),
        "left_out_after": max((g for r, g in left_out.items() if r > after), default=None),
        "backdoor": backdoor, "backdoor_max": max((max(v) for v in backdoor.values()), default=None),
        "backdoor_last": backdoor[max(backdoor)] if backdoor else None,
        "honest_missing": sum(len(honest - set(m["reported"])) for m in rounds),
        "honest_dropped": sum(len(honest & set(m.get("dropped", {}))) for m in rounds),
        "evil_sent": sum("evil" in m["reported"] for m in evil),
        "evil_dropped": sum("evil" in m.get("dropped", {}) for m in evil),
        "evil_clipped": sum("evil" in m.get("clipped_to_centre", {}) for m in evil),
        "evil_bounded": sum(bounded(m, {"evil"}) for m in evil),
        "honest_bounded": sum(bounded(m, honest, frozenset({"evil"})) for m in rounds),
        "rejected": sum(sum(m["rejected"].values()) for m in rounds),
        "round_s": sum(m["wall_s"] for m in rounds) / len(rounds),
    }


def write_doc(rows: list[dict], note: str, section: str, after: int) -> None:
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = ["", f"Generated by `benchmarks/bench_attacks_serve.py` on {when}, commit {commit_label()}, {cpu_name()} "
                        f"({platform.machine()}), load average {load_average()}. {note}".strip(), "",
             f"{PROFILE}, `aggregator serve` with its defaults on mosquitto, 3 participants a round (coverage assignment), "
             f"{EVAL_SAMPLES:,} evaluation images; two honest `edge-client join`s (300 images each) and one attacking join "
             "(control: issue 20's attacks, the two honest devices alone; issue 41's, the third device honest).", "",
             "| run | rounds | final top-1 per submodel | control | largest drop vs control: final / any evaluated round "
             f"after round {after} | honest updates missing / dropped | attacker updates: sent / dropped / clipped | "
             "tensors step-bounded: attacker's / honest-only submodels | rejections | mean round s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = " ".join(f"{a:.2f}" for a in r["accuracy"])
        ctl = " ".join(f"{a:.2f}" for a in r["control"])
        later = "-" if r.get("worst_gap_after") is None else f"{r['worst_gap_after']:+.3f}"
        lines.append(f"| {r['name']} | {r['rounds']} | {acc} | {ctl} | {r['worst_gap']:+.3f} / {later} | "
                     f"{r['honest_missing']} / {r['honest_dropped']} | {r['evil_sent']} / {r['evil_dropped']} / "
                     f"{r['evil_clipped']} | {r.get('evil_bounded', 0)} / {r.get('honest_bounded', 0)} | {r['rejected']} | "
                     f"{r['round_s']:.1f} |")
    gapped = [r for r in rows if r.get("gaps")]
    if gapped:
        rounds = sorted({g for r in gapped for g in r["gaps"]})
        lines += ["", "Largest drop of any submodel's top-1 below the control's, at every evaluated round:", "",
                  "| run | " + " | ".join(f"r{g}" for g in rounds) + " |", "|---|" + "---|" * len(rounds)]
        lines += [f"| {r['name']} | " + " | ".join(f"{r['gaps'][g]:+.2f}" if g in r["gaps"] else "-" for g in rounds) + " |"
                  for r in gapped]
    compared = [r for r in rows if r.get("left_out_after") is not None]
    if compared:
        lines += ["", f"Against the attacker left out (the two honest devices alone: `control`, the best a defence can do "
                      f"without recovering the attacker's own training): the largest drop of any submodel's top-1 at an "
                      f"evaluated round after round {after}, below the honest control and below the attacker left out "
                      "(negative: above it):", "",
                  "| run | below the honest control | below the attacker left out |", "|---|---|---|"]
        lines += [f"| {r['name']} | {r['worst_gap_after']:+.3f} | {r['left_out_after']:+.3f} |" for r in compared]
    doors = [r for r in rows if r.get("backdoor")]
    if doors:
        lines += ["", "Backdoor success per submodel (triggered test images not of the target class that it calls the "
                      "target), at the final round, and the largest over every round's committed model:", "",
                  "| run | final, per submodel | largest in any round |", "|---|---|---|"]
        lines += [f"| {r['name']} | {' '.join(f'{a:.3f}' for a in r['backdoor_last'])} | {r['backdoor_max']:.3f} |"
                  for r in doors]
    write_section(DOC, f"<!-- {section}:start -->", f"<!-- {section}:end -->", [*lines, ""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--late-rounds", type=int, default=24)
    ap.add_argument("--aggregator", nargs="+", default=["default"], help="the rules measured: default (serve's "
                    "defaults) or an --aggregator name (without the centre check; fltrust: root data from the evaluation "
                    "dataset)")
    ap.add_argument("--runs", nargs="*", choices=RUNS, default=list(RUNS),
                    help="the federations to (re)run (none: only rewrite the table from the saved metrics)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "attacks-serve"), help="saved metrics")
    ap.add_argument("--section", default="bench-attacks-serve", help="the generated section of docs/security.md")
    ap.add_argument("--after", type=int, default=3, help="the drop vs control is judged at evaluated rounds after this")
    ap.add_argument("--serve-args", default="", help="serve options added to every federation, one string")
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="nefl-attacks-"))
    rows = []
    for rule in args.aggregator:
        options = [*([] if rule == "default" else ["--aggregator", rule, "--no-centre-check"]),
                   *shlex.split(args.serve_args)]
        label = " ".join([rule, *shlex.split(args.serve_args)])
        saved = Path(args.out) / rule
        saved.mkdir(parents=True, exist_ok=True)
        for name in args.runs:
            rounds = args.late_rounds if name in ("control-long", "late-start") else args.rounds
            work = scratch / rule / name
            work.mkdir(parents=True)
            print(f"{rule} {name}: {rounds} rounds in {work}", flush=True)
            t0 = time.monotonic()
            result = federation(rounds, attack_of(name, rounds), work, options)
            atomic_write_text(saved / f"{name}.json", json.dumps(result))
            print(f"{rule} {name}: {time.monotonic() - t0:.0f} s", flush=True)
        runs = {n: saved_run(saved / f"{n}.json") for n in RUNS if (saved / f"{n}.json").exists()}
        rows += [summary(f"{n} ({label})", runs[n], runs[control], args.after,
                         runs.get("control") if control == "honest-3" else None)
                 for n, control in ATTACKS.items() if n in runs and control in runs]
    for r in rows:
        print(json.dumps(r))
    write_doc(rows, args.note, args.section, args.after)


if __name__ == "__main__":
    main()
