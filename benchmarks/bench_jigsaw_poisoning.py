"""FedJigsaw with a poisoning borrower: honest clients' local accuracy with one attacker that returns poisoned
copies of the modules it borrows, against the honest control and local-only training, with the sources' screen
of returned copies (nefl/jigsaw/screen.py) off (the fixed 5 x norm bound alone) and on. Prints a markdown table.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/bench_jigsaw_poisoning.py [--seeds 0 1 2] [--clients 6] [--rounds 6] [--screen on] [--jobs 3]
    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/bench_jigsaw_poisoning.py --transport mqtt [--seeds 0 1 2]

--transport mqtt runs each federation of the screen column (control and every attack) as real processes instead:
`aggregator jigsaw-serve` and one `edge-client jigsaw` per client on a mosquitto, client 0 being
tests/harness/jigsaw_poisoner.py, and beside it its simulator twin. Devices score their local test split once, after
the last round; where every device's final accuracy equals its twin's to the bit (the MQTT path is meant to be
bit-identical), the twin's per-round accuracies are the real run's, and the "any round" column comes from them.

Fashion-MNIST, Dirichlet(0.1), --samples images per client, a short policy phase, every model-training round scored.
Client 0 is the attacker (from the model-training phase on); the honest clients are the others. Per run: the honest
clients' mean accuracy after the last round, the largest drop of an honest client's final accuracy below its
control, the lowest (accuracy - local-only accuracy) of any honest client in any round, and the returns the
sources refused and the tensors they clipped over the run (in the control every one of them is honest). The runs
are independent and seeded: --jobs runs them in that many processes, with the same results.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from nefl.jigsaw.sim import ATTACKS, JigsawConfig, JigsawSimulator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.harness, for --transport mqtt


def curves(cfg: JigsawConfig) -> tuple[list[list[float]], dict[str, int]]:
    """Every client's accuracy after each model-training round, and the returns refused (per reason) and tensors
    clipped over the run."""
    torch.set_num_threads(1)
    rows = JigsawSimulator(cfg).run().rounds
    return [row["accuracy"] for row in rows if row["phase"] == "train"], rows[-1].get("rejected", {})


def screened(rejected: dict[str, int]) -> tuple[int, int]:
    """(returns refused by the norm bound or the screen, tensors clipped)."""
    return sum(n for k, n in rejected.items() if k != "clipped"), rejected.get("clipped", 0)


def over_mqtt(cfg: JigsawConfig) -> tuple[list[float], dict[str, int], float]:
    """One federation as real processes: each device's final local test accuracy (client order), the returns its
    sources refused (per reason) and tensors they clipped, summed over the rounds, and the wall seconds."""
    from tests.harness.jigsaw_federation import final_accuracy, rows, start_federation
    from tests.harness.procs import Procs, finish

    with tempfile.TemporaryDirectory(prefix="jigsaw-mqtt-") as d:
        tmp, t0 = Path(d), time.monotonic()
        procs = Procs(tmp)
        try:
            start_federation(procs, tmp, cfg, fetch_timeout=120, round_timeout=900,
                             poisoner=0 if cfg.attack else None, poison=cfg.attack or "x1000")
            finish(procs, "coordinator", 3600)
            final = final_accuracy(tmp)
            rejected = sum((Counter(row.get("rejected", {})) for row in rows(tmp)), Counter())
            return [final[f"d{c}"] for c in range(cfg.clients)], dict(rejected), time.monotonic() - t0
        finally:
            procs.stop_all()


def mqtt_table(configs: dict[tuple[int, str, bool, str | None], JigsawConfig], clients: int) -> None:
    """--transport mqtt: every screened federation over MQTT beside its simulator twin (run in a second process)."""
    honest = range(1, clients)
    with ProcessPoolExecutor(1) as pool:
        twins = {key: pool.submit(curves, cfg) for key, cfg in configs.items()}
        real = {}
        for key, cfg in configs.items():
            if key[1] == "fedjigsaw":
                real[key] = over_mqtt(cfg)
                print(f"mqtt seed {key[0]} attack {key[3]}: {real[key][0]} {real[key][1]} {real[key][2]:.0f} s", flush=True)
        twins = {key: f.result() for key, f in twins.items()}
    print("\n| attack | seed | honest mean acc (MQTT) | worst drop below control (MQTT) | final accuracies equal the "
          "simulator's | worst (acc - local-only) in any round | returns refused / tensors clipped (MQTT) | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for seed in sorted({k[0] for k in configs}):
        local = twins[(seed, "local-only", False, None)][0]
        control = real[(seed, "fedjigsaw", True, None)][0]
        for attack in (None, *ATTACKS):
            key = (seed, "fedjigsaw", True, attack)
            final, rejected, wall = real[key]
            twin = twins[key][0]
            same = final == twin[-1]
            floor = min(twin[t][c] - local[t][c] for t in range(len(twin)) for c in honest) if same else None
            drop = max(control[c] - final[c] for c in honest)
            print(f"| {attack or 'none (control)'} | {seed} | {statistics.fmean(final[c] for c in honest):.3f} | "
                  f"{drop:+.3f} | {'yes' if same else 'no'} | {'n/a' if floor is None else f'{floor:+.3f}'} | "
                  f"{'%d / %d' % screened(rejected)} | {wall:.0f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--screen", choices=("off", "on"), nargs="+", default=["off", "on"],
                    help="the columns to run: the norm bound alone (off), the screen (on)")
    ap.add_argument("--jobs", type=int, default=1, help="runs in parallel processes")
    ap.add_argument("--transport", choices=("sim", "mqtt"), default="sim",
                    help="mqtt: the screen column's federations as real processes, each beside its simulator twin")
    args = ap.parse_args()
    screens = [True] if args.transport == "mqtt" else [s == "on" for s in args.screen]
    configs: dict[tuple[int, str, bool, str | None], JigsawConfig] = {}
    for seed in args.seeds:
        base = dict(clients=args.clients, rounds=args.rounds, policy_rounds=2, critic_warmup=1,
                    max_samples_per_client=args.samples, test_per_client=200, eval_every=1, seed=seed)
        configs[(seed, "local-only", False, None)] = JigsawConfig(method="local-only", **base)
        for screen in screens:
            for attack in (None, *ATTACKS):
                configs[(seed, "fedjigsaw", screen, attack)] = JigsawConfig(screen_returns=screen, attack=attack,
                                                                            attackers=1 if attack else 0, **base)
    if args.transport == "mqtt":
        mqtt_table(configs, args.clients)
        return
    with ProcessPoolExecutor(args.jobs) as pool:
        runs = dict(zip(configs, pool.map(curves, configs.values())))
    rows: dict[str, list[tuple[float, float, float, int, int]]] = {}
    honest = range(1, args.clients)
    for seed in args.seeds:
        local = runs[(seed, "local-only", False, None)][0]
        for screen in screens:
            control = runs[(seed, "fedjigsaw", screen, None)][0]
            for attack in (None, *ATTACKS):
                run, rejected = runs[(seed, "fedjigsaw", screen, attack)]
                final = statistics.fmean(run[-1][c] for c in honest)
                drop = max(control[-1][c] - run[-1][c] for c in honest)
                floor = min(run[t][c] - local[t][c] for t in range(len(run)) for c in honest)
                rows.setdefault(f"{'screen' if screen else 'norm bound only'} | {attack or 'none (control)'}", []).append(
                    (final, drop, floor, *screened(rejected)))
                print(f"seed {seed} screen {screen} attack {attack}: {final:.3f} {drop:+.3f} {floor:+.3f} "
                      f"{dict(rejected)}", flush=True)
        rows.setdefault("local-only | none", []).append((statistics.fmean(local[-1][c] for c in honest), 0.0, 0.0, 0, 0))
    print("\n| returns judged by | attack | honest mean acc | worst drop below control | worst (acc - local-only) in any round "
          "| returns refused / tensors clipped, all seeds |")
    print("|---|---|---|---|---|---|")
    for name, vals in rows.items():
        mean = statistics.fmean(v[0] for v in vals)
        print(f"| {name} | {mean:.3f} ({', '.join(f'{v[0]:.3f}' for v in vals)}) | {max(v[1] for v in vals):+.3f} | "
              f"{min(v[2] for v in vals):+.3f} | {sum(v[3] for v in vals)} / {sum(v[4] for v in vals)} |")


if __name__ == "__main__":
    main()
