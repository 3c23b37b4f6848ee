"""The robustness issue's three attacks, rerun over `aggregator serve` with real processes on mosquitto,
under the default configuration: two honest `edge-client join`s plus one real join that attacks with its
own device key (tests/harness/attack_device.py), against the same two honest devices alone. Writes the
`bench-attacks-serve` section of docs/security.md.

    PYTHONPATH=. python benchmarks/bench_attacks_serve.py [--rounds 10] [--late-rounds 24] [--aggregator RULE ...]
        [--runs RUN ...] [--note TEXT]

Every run uses `serve`'s defaults; `--aggregator default fltrust ...` measures other rules too, each against its
own controls. Each federation's metrics are saved under --out (RULE/RUN.json); `--runs` reruns only those
(a row needs its control: `--runs control neg-weights`), the others' saved metrics make the rest of the table.

  scaled-flip   -9 x its honest delta from round 1 (inside the 10 x weight-norm bound)
  neg-weights   -9 x the weights it was sent (norm 9 x the weight norm) from round 1
  late-start    -9 x its honest delta from round 12, after the adaptive bound's warm-up (the ratchet)
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
from pathlib import Path

from bench_scale import Run, free_port  # benchmarks/ is the script directory, on sys.path
from provenance import commit_label, cpu_name, load_average, write_section

from nefl.support.fsio import atomic_write_text

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "security.md"
START, END = "<!-- bench-attacks-serve:start -->", "<!-- bench-attacks-serve:end -->"
PROFILE = "resnet8-fmnist-w"
PY = sys.executable
ATTACKS = {"scaled-flip": "control", "neg-weights": "control", "late-start": "control-long"}  # run -> its control
RUNS = ("control", "scaled-flip", "neg-weights", "control-long", "late-start")


def federation(rounds: int, attack: tuple[str, int] | None, work: Path, rule: list[str]) -> list[dict]:
    """One federation: mosquitto, serve (its defaults, plus `rule`: the options that choose another aggregation
    rule), two honest joins and, if given, the (kind, first round) attacker."""
    run = Run(work)
    try:
        port = free_port()
        run.mosquitto(port)
        broker = f"mqtt://127.0.0.1:{port}"
        agg = run.start("agg", [PY, "-c", "from aggregator.cli import app; app()", "serve", "--profile", PROFILE,
                                "--broker", broker, "--federation", "b", "--rounds", str(rounds), "--clients-per-round", "3",
                                "--min-clients", "2", "--round-timeout", "90", "--join-wait", "15",
                                "--eval-dataset", "fashion-mnist", "--eval-samples", "2000", "--checkpoint-dir", str(work / "run"),
                                *rule])
        join = ["join", "--broker", broker, "--federation", "b", "--threads", "1", "--max-samples", "300", "--no-calibrate"]
        for i in (1, 2):
            run.start(f"c{i}", [PY, "-c", "from edge_client.cli import app; app()", *join, "--client-id", f"c{i}",
                                "--partition", f"{i}/8"])
        if attack is not None:
            kind, first = attack
            run.start("evil", [PY, "-m", "tests.harness.attack_device", kind, "9", str(first), *join, "--client-id", "evil",
                               "--partition", "3/8"])
        run.finish(agg, 120 * rounds + 300)  # room for a loaded 2-core machine's slow rounds
    finally:
        run.stop()
    return [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]


def bounded(m: dict, clients: set[str], but: frozenset[str] = frozenset()) -> int:
    """Per-submodel tensors the step bound scaled down in round `m` on the submodels these clients trained
    (and no client in `but`)."""
    def trained(who: set[str] | frozenset[str]) -> set[str]:
        return {str(k) for c, k in m.get("assigned", {}).items() if c in who}
    mine = trained(clients) - trained(but)
    return sum(n for k, n in m.get("steps_bounded", {}).items() if k in mine)


def summary(name: str, lines: list[dict], control: list[dict]) -> dict:
    rounds = [m for m in lines if m["round"] >= 1]
    last, base = rounds[-1]["accuracy"], control[-1]["accuracy"]
    honest = {"c1", "c2"}
    evil = [m for m in rounds if "evil" in m.get("participants", [])]
    return {
        "name": name, "rounds": len(rounds), "accuracy": last, "control": base,
        "worst_gap": max(b - a for a, b in zip(last, base)),
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


def write_doc(rows: list[dict], note: str) -> None:
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = ["", f"Generated by `benchmarks/bench_attacks_serve.py` on {when}, commit {commit_label()}, {cpu_name()} "
                        f"({platform.machine()}), load average {load_average()}. {note}".strip(), "",
             f"{PROFILE}, `aggregator serve` with its defaults on mosquitto, 3 participants a round (coverage assignment), "
             "2,000 evaluation images; two honest `edge-client join`s (300 images each) and one attacking join.", "",
             "| run | rounds | final top-1 per submodel | control (honest only) | largest drop vs control | honest updates "
             "missing / dropped | attacker updates: sent / dropped / clipped | tensors step-bounded: attacker's / honest-only "
             "submodels | rejections | mean round s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = " ".join(f"{a:.2f}" for a in r["accuracy"])
        ctl = " ".join(f"{a:.2f}" for a in r["control"])
        lines.append(f"| {r['name']} | {r['rounds']} | {acc} | {ctl} | {r['worst_gap']:+.3f} | {r['honest_missing']} / "
                     f"{r['honest_dropped']} | {r['evil_sent']} / {r['evil_dropped']} / {r['evil_clipped']} | "
                     f"{r.get('evil_bounded', 0)} / {r.get('honest_bounded', 0)} | {r['rejected']} | "
                     f"{r['round_s']:.1f} |")
    write_section(DOC, START, END, [*lines, ""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--late-rounds", type=int, default=24)
    ap.add_argument("--aggregator", nargs="+", default=["default"], help="the rules measured: default (serve's "
                    "defaults) or an --aggregator name (without the centre check; fltrust: root data from the evaluation "
                    "dataset)")
    ap.add_argument("--runs", nargs="*", choices=RUNS, default=list(RUNS),
                    help="the federations to (re)run (none: only rewrite the table from the saved metrics)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "attacks-serve"), help="saved metrics")
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="nefl-attacks-"))
    rows = []
    for rule in args.aggregator:
        options = [] if rule == "default" else ["--aggregator", rule, "--no-centre-check"]
        saved = Path(args.out) / rule
        saved.mkdir(parents=True, exist_ok=True)
        for name in args.runs:
            rounds = args.late_rounds if name in ("control-long", "late-start") else args.rounds
            attack = {"scaled-flip": ("scaled-flip", 1), "neg-weights": ("neg-weights", 1),
                      "late-start": ("scaled-flip", args.late_rounds // 2)}.get(name)
            work = scratch / rule / name
            work.mkdir(parents=True)
            print(f"{rule} {name}: {rounds} rounds in {work}", flush=True)
            atomic_write_text(saved / f"{name}.json", json.dumps(federation(rounds, attack, work, options)))
        runs = {n: json.loads((saved / f"{n}.json").read_text()) for n in RUNS if (saved / f"{n}.json").exists()}
        rows += [summary(f"{n} ({rule})", runs[n], runs[control]) for n, control in ATTACKS.items()
                 if n in runs and control in runs]
    for r in rows:
        print(json.dumps(r))
    write_doc(rows, args.note)


if __name__ == "__main__":
    main()
