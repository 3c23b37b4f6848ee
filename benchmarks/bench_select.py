"""Probe + select time per round once calibrated (target: well under 10 ms).

    PYTHONPATH=. python benchmarks/bench_select.py [--profile resnet20-fmnist-wd] [--rounds 2000]

Calibrates first (one child process, cached: instant after `edge-client plan` with the same settings),
then times only what a round does: one probe snapshot and one selection.
"""

from __future__ import annotations

import argparse
import statistics
import time

from edge_client.costmodel import calibrate
from edge_client.probe import Prober
from edge_client.select import DeviceBudget, select_submodel
from nefl.nested.profile import load_profile
from nefl.nested.state import Layout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="resnet20-fmnist-wd")
    ap.add_argument("--rounds", type=int, default=2000)
    args = ap.parse_args()
    layout = Layout.build(load_profile(args.profile))
    table = calibrate(layout, 32, threads=1)
    prober, budget = Prober(), DeviceBudget.parse("300MB", 0.5)
    time.sleep(0.2)
    times = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        sel = select_submodel(table, budget.apply(prober.snapshot()), 600, 5, deadline_s=600.0, speed=budget.cpu_budget)
        times.append(time.perf_counter() - t0)
    ms = sorted(t * 1e3 for t in times)
    print(f"{args.profile}: probe + select over {args.rounds} rounds: median {statistics.median(ms):.3f} ms, "
          f"p99 {ms[int(0.99 * len(ms))]:.3f} ms, max {ms[-1]:.3f} ms; last choice: {sel.reason}")


if __name__ == "__main__":
    main()
