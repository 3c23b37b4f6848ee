"""Whether clustering could tell the attackers apart: the pairwise cosines of a round's updates, as the centre check
sketches them (the shared core), in one bench_robust run with attackers (docs/security.md, "Why no clustering
defence").

    PYTHONPATH=.:benchmarks OMP_NUM_THREADS=1 python benchmarks/update_cosines.py [--setting dir0.5]
        [--attack boosted-backdoor] [--fraction 0.2] [--seed 0]

Per round: the attackers' cosine with each other, the most alike honest pair (and which clients they are), the
largest attacker-honest cosine, and each update's mean cosine with the others, lowest first (A: an attacker), the
two premises of FLAME (attackers are outliers) and FoolsGold (attackers are more alike than honest clients are).
"""

from __future__ import annotations

import argparse
import queue
from itertools import combinations

import numpy as np

import bench_robust as br  # benchmarks/ is the script directory, on sys.path
from nefl.aggregation import centre_check
from nefl.aggregation.coverage import pairwise_cosines

Round = tuple[list[str], np.ndarray]  # the round's clients, in arrival order, and their sketches


def record(rounds: list[Round]) -> None:
    """Patch the centre check to keep every round's clients and sketches (a diagnostic: nothing else changes)."""
    add, finalize = centre_check.Screened.add_validated, centre_check.Screened.finalize

    def add_validated(self, k, delta, num_samples=1, *, client="", owned=False):
        self.__dict__.setdefault("_arrived", []).append((client, self.count))
        return add(self, k, delta, num_samples, client=client, owned=owned)

    def finalize_recorded(self, state):
        arrived = self.__dict__.get("_arrived", [])
        rows = [i for _, i in arrived]
        rounds.append(([c for c, _ in arrived], self.sketches[rows].astype(np.float64)))
        return finalize(self, state)

    centre_check.Screened.add_validated, centre_check.Screened.finalize = add_validated, finalize_recorded


def describe(r: int, clients: list[str], sketches: np.ndarray, attackers: set[str]) -> str:
    norms = np.linalg.norm(sketches, axis=1)
    cos = pairwise_cosines(sketches, norms, sketches, norms)  # the centre check's own cosine
    bad = [i for i, c in enumerate(clients) if c in attackers]
    good = [i for i in range(len(clients)) if i not in bad]
    aa = ", ".join(f"{cos[a, b]:.2f}" for a, b in combinations(bad, 2)) or "-"
    pair = max(((cos[a, b], clients[a], clients[b]) for a, b in combinations(good, 2)), default=None)
    ah = max((cos[a, h] for a in bad for h in good), default=float("nan"))
    mean = (cos.sum(1) - 1) / max(1, len(clients) - 1)
    order = np.argsort(mean)
    ranks = "".join("A" if i in bad else "." for i in order)
    top = f"{pair[0]:.2f} ({pair[1]}, {pair[2]})" if pair else "-"
    return f"| {r + 1} | {aa} | {top} | {ah:.2f} | `{ranks}` | {' '.join(f'{mean[i]:.2f}' for i in order)} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setting", choices=list(br.SETTINGS), default="dir0.5")
    ap.add_argument("--attack", choices=list(br.ADAPTIVE_ATTACKS), default="boosted-backdoor")
    ap.add_argument("--fraction", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/update-cosines", help="Where bench_robust's run writes its summary.")
    args = ap.parse_args()
    rounds: list[Round] = []
    record(rounds)
    job = br.Job("adaptive", "default", args.attack, args.fraction, args.setting, args.seed, br.Budget(), args.out)
    out = br.run_job(job, queue.Queue())
    attackers = set(out["attackers"])
    print(f"{args.setting}, {args.attack} at {args.fraction:.0%}, seed {args.seed}, the default rule: worst / avg "
          f"{out['worst']:.3f} / {out['avg']:.3f}; attackers {sorted(attackers)}\n")
    print("| round | attackers' cosine | most alike honest pair | largest attacker-honest | mean cosine order (A: attacker) "
          "| mean cosines, lowest first |\n|---|---|---|---|---|---|")
    for r, (clients, sketches) in enumerate(rounds):
        print(describe(r, clients, sketches, attackers))


if __name__ == "__main__":
    main()
