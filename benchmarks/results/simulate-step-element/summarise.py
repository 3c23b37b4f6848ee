"""Summarise the saved simulator runs beside this file (step_element off vs on): final top-1 per submodel (%),
tensors step-bounded and updates dropped over the run, and the on - off difference of average and worst per setting.
    python benchmarks/results/simulate-step-element/summarise.py"""
import json
import statistics
from pathlib import Path

D = Path(__file__).resolve().parent


def final(name: str) -> tuple[list[float], int, int]:
    rows = [json.loads(line) for line in (D / name / "metrics.jsonl").read_text().splitlines() if line.strip()]
    acc = [round(100 * a, 1) for a in [r for r in rows if "accuracy" in r][-1]["accuracy"]]
    return acc, sum(sum(r.get("steps_bounded", {}).values()) for r in rows), sum(len(r.get("dropped", {})) for r in rows)


runs = {p.name: final(p.name) for p in sorted(D.iterdir()) if (p / "metrics.jsonl").exists()}
for name, (acc, bounded, dropped) in runs.items():
    print(f"{name}: {acc} worst {min(acc)} avg {statistics.fmean(acc):.2f} bounded {bounded} dropped {dropped}")
for setting in ("dir", "iid"):
    pairs = [(runs[f"{setting}-s{s}-off"][0], runs[f"{setting}-s{s}-on"][0]) for s in range(6)
             if f"{setting}-s{s}-on" in runs and f"{setting}-s{s}-off" in runs]
    d_avg = [statistics.fmean(b) - statistics.fmean(a) for a, b in pairs]
    d_worst = [min(b) - min(a) for a, b in pairs]
    print(f"{setting}: {len(pairs)} seeds, avg off {statistics.fmean(statistics.fmean(a) for a, _ in pairs):.2f} "
          f"on {statistics.fmean(statistics.fmean(b) for _, b in pairs):.2f}, on - off avg {statistics.fmean(d_avg):+.2f} "
          f"(per seed {[round(d, 2) for d in d_avg]}), worst {statistics.fmean(d_worst):+.2f} "
          f"(per seed {[round(d, 1) for d in d_worst]})")
