"""`aggregator simulate --mode buffered|sync`: the emulated fleet's options and its run's report (the runs themselves:
aggregator/fleet_sim.py, imported when the command runs, so `--help` needs no torch)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from aggregator.fleet import FleetConfig
from aggregator.staleness_options import BufferSizeOption, MaxStalenessOption, ModeOption, StalenessExponentOption
from aggregator.robust_options import RobustnessOptions
from nefl.aggregation.staleness import Normalise, StalenessConfig
from nefl.support.option_groups import option_group

if TYPE_CHECKING:
    from aggregator.fleet_sim import FleetSimulator
    from aggregator.simulate import SimConfig
    from nefl.aggregation.pipeline import Robustness

_F, _S = FleetConfig(), StalenessConfig()


@option_group("Emulated fleet: buffered asynchronous or synchronous, in simulated time (docs/results.md)")
class FleetOptions:
    mode: ModeOption("buffered (a version whenever K updates arrive, each weighted by its staleness) or sync (rounds wait for "
                     "the slowest or the deadline) on an emulated fleet of mixed speeds (sync: --per-round devices a round); "
                     "omit for the paper's rounds.") = None
    slowest: Annotated[float, typer.Option(min=1, help="The slowest device's step time, in the fastest's.")] = _F.slowest
    budget: Annotated[float, typer.Option(
        min=0, help="A task's time budget, in full-model tasks of the fastest device.")] = _F.budget
    vanish: Annotated[float, typer.Option(
        min=0, max=0.99, help="The chance an online device vanishes within any simulated minute.")] = _F.vanish
    time_budget_s: Annotated[float, typer.Option(min=1, help="Simulated seconds the run lasts.")] = _F.time_budget_s
    eval_every_s: Annotated[float, typer.Option(min=1, help="Evaluate every N simulated seconds.")] = _F.eval_every_s
    buffer_size: BufferSizeOption = _S.buffer_size
    staleness_exponent: StalenessExponentOption = _S.exponent
    max_staleness: MaxStalenessOption = _S.max_staleness
    commit_after_s: Annotated[Optional[float], typer.Option(
        min=0, help="buffered: commit a partial buffer once its oldest update waited this long (simulated s).")] = None
    in_flight: Annotated[Optional[int], typer.Option(
        min=1, help="buffered: devices training at once (default: every online device, each starting again as it "
                    "uploads); sync rounds draw --per-round.")] = _F.in_flight
    normalise: Annotated[Normalise, typer.Option(
        help="buffered: divide an element's staleness-weighted sum by the staleness-weighted coverage (staleness) "
             "or the plain one (coverage: FedBuff's 1/K, stale buffers take shorter steps).")] = _S.normalise

    def configs(self, concurrency: int) -> tuple[FleetConfig, StalenessConfig]:
        fleet = FleetConfig(mode=self.mode or _F.mode, slowest=self.slowest, budget=self.budget, vanish=self.vanish,
                            concurrency=concurrency, in_flight=self.in_flight, time_budget_s=self.time_budget_s,
                            eval_every_s=self.eval_every_s)
        staleness = StalenessConfig(buffer_size=self.buffer_size, exponent=self.staleness_exponent,
                                    max_staleness=self.max_staleness, commit_after_s=self.commit_after_s,
                                    normalise=self.normalise)
        return fleet, staleness


def fleet_robustness(robust: RobustnessOptions) -> Robustness:
    """The server's bounds for a fleet run: the centre check is off unless asked for (buffered mode refuses it, and
    the synchronous run it is compared with must merge alike)."""
    return (robust if robust.centre_check is not None else replace(robust, centre_check=False)).robustness()


def fleet_simulator(cfg: SimConfig, options: FleetOptions, init_from: str | None) -> FleetSimulator:
    """The fleet run `options` names, with `cfg` (its per_round: a synchronous round's devices); a ValueError for what
    only the paper's rounds run."""
    from aggregator.fleet_sim import FleetSimulator  # torch: only when the command runs

    if cfg.attack is not None or init_from:
        raise ValueError("--attack and --init-from run in the paper's rounds only: omit --mode")
    return FleetSimulator(cfg, *options.configs(cfg.per_round))


def at_once(sim: FleetSimulator) -> str:
    """How many devices train at once, in words."""
    fleet = sim.fleet_cfg
    if fleet.mode == "sync":
        return f"{fleet.concurrency} per round"
    return "every online device at once" if fleet.in_flight is None else f"{fleet.in_flight} at once"


def report_fleet(sim: FleetSimulator, console: Console) -> None:
    """Run it: an evaluation line per grid time on stdout (without --out), then the last accuracy and what arrived."""
    cfg, fleet = sim.cfg, sim.fleet_cfg
    console.print(f"{sim.layout.profile.name} · {fleet.mode} on {cfg.clients} emulated devices (1x-{fleet.slowest:g}x), "
                  f"{at_once(sim)}, bounds {[sim.fleet.bound(d) + 1 for d in range(cfg.clients)]}")

    def on_line(line: dict) -> None:
        if cfg.out is None and line["kind"] == "eval":
            print(json.dumps(line), flush=True)

    result = sim.run(on_line)
    last = result.curve[-1]
    staleness_seen = Counter(s for c in result.commits for s in c["staleness"])
    table = Table(title=f"{fleet.mode} · {fleet.time_budget_s:g} simulated s · {len(result.commits)} versions · "
                        f"{result.seconds:.0f} s")
    table.add_column("submodel")
    table.add_column("top-1", justify="right")
    for k, acc in enumerate(last["accuracy"]):
        table.add_row(str(k + 1), f"{100 * acc:.2f}")
    table.add_row("worst", f"{100 * last['worst']:.2f}")
    Console().print(table)
    Console().print(f"tasks {result.tasks}, lost to vanished devices {result.lost}, refused {dict(result.refused)}, "
                    f"staleness of committed updates {dict(sorted(staleness_seen.items()))}")
