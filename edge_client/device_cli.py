"""The `probe` and `plan` commands: show the device's state and what it would train now.

Exit codes: 0 ok, 2 bad input (unknown profile, unreadable size), 3 (`plan`) no submodel fits.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import torch
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from edge_client.costmodel import CACHE_DIR, HOT_LIMIT_C, CostTable, calibrate, estimate_costs
from edge_client.probe import DeviceSnapshot, Prober, is_hot, is_throttled
from edge_client.select import DEFAULT_SAFETY_MARGIN, DeviceBudget, Selection, format_bytes, select_submodel
from nefl.profile import ProfileError, load_profile
from nefl.state import Layout

EXIT_BAD_INPUT, EXIT_NOTHING_FITS = 2, 3
console = Console()


def _fail(message: str) -> typer.Exit:
    Console(stderr=True).print(f"[red]error:[/] {message}")
    return typer.Exit(EXIT_BAD_INPUT)


def _sample(interval: float) -> DeviceSnapshot:
    """A snapshot after `interval` s, so the CPU utilisation covers a real interval."""
    prober = Prober()
    time.sleep(interval)
    return prober.snapshot()


def _pct(v: float | None) -> str:
    return "?" if v is None else f"{v:.0f}%"


def _snapshot_table(s: DeviceSnapshot) -> Table:
    t = Table("source", "reading", title="device snapshot")
    t.add_row("memory available / total", f"{format_bytes(s.memory_available)} / {format_bytes(s.memory_total)}")
    t.add_row("this process RSS", format_bytes(s.process_rss))
    t.add_row("CPU utilisation", f"{_pct(s.cpu_percent)} of {s.cpu_count} cores")
    t.add_row("load per core (1 min)", "?" if s.load_per_core is None else f"{s.load_per_core:.2f}")
    for i, g in enumerate(s.gpus):
        t.add_row(f"GPU {i} {g.name}", f"{format_bytes(g.memory_used)} / {format_bytes(g.memory_total)} used, {_pct(g.utilization)} busy")
    if s.jetson_gpu_load is not None:
        t.add_row("Jetson GPU load", _pct(s.jetson_gpu_load))
    for z in s.thermal:
        t.add_row(f"thermal {z.zone}", f"{z.celsius:.1f} C")
    if s.throttled is not None:
        t.add_row("Pi throttled flags", f"0x{s.throttled:x}" + (" (throttled now)" if is_throttled(s) else ""))
    if s.battery is not None:
        t.add_row("battery", f"{s.battery.percent:.0f}%" + (" (plugged)" if s.battery.plugged else ""))
    for source, why in s.unknown.items():
        t.add_row(f"[dim]{source}[/]", f"[dim]unknown: {why}[/]")
    return t


def probe_command(
    as_json: bool = typer.Option(False, "--json", help="Print the snapshot as JSON."),
    interval: float = typer.Option(0.5, min=0.0, help="Seconds over which CPU utilisation is sampled."),
) -> None:
    """Print one snapshot of memory, CPU/GPU load, thermals, throttling and battery."""
    snap = _sample(interval)
    if as_json:
        print(json.dumps(snap.to_dict(), indent=1))
    else:
        console.print(_snapshot_table(snap))


def _calibrated(layout: Layout, batch_size: int, threads: int | None, cache_dir: Path, force: bool) -> CostTable:
    with Progress(SpinnerColumn(), TextColumn("calibrating {task.description}"), BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task(layout.profile.name, total=layout.num_submodels)
        return calibrate(layout, batch_size, threads=threads, cache_dir=cache_dir, force=force,
                         on_result=lambda k: bar.advance(task))


def _plan_table(table: CostTable, sel: Selection) -> Table:
    t = Table("#", "gamma", "params", "MFLOPs", "est. peak", "calibrated peak", "step", "round time", "fits",
              title=f"{table.profile} ({table.method}), batch {table.batch_size}, {table.threads} thread(s)")
    for c, f in zip(table.costs, sel.fits):
        why = [w for w, bad in (("cap", f.capped), ("memory", f.memory_ok is False), ("deadline", f.time_ok is False)) if bad]
        mark = "[green]yes[/]" if f.fits else f"[red]no ({', '.join(why)})[/]"
        chosen = " <-" if c.index == sel.index else ""
        t.add_row(
            f"{c.index + 1}{chosen}", f"{c.gamma:g}", f"{c.params:,}", f"{c.macs / 1e6:.1f}",
            format_bytes(c.estimated_peak),
            format_bytes(c.measured_peak) if c.measured_peak is not None else (c.error or "-"),
            "-" if c.step_seconds is None else f"{c.step_seconds * 1e3:.0f} ms",
            "-" if f.seconds is None else f"{f.seconds:.1f} s", mark,
        )
    return t


def plan_command(
    profile: str = typer.Option(..., "--profile", "-p", help="Profile name (see `nefl profiles`) or TOML path."),
    method: Optional[str] = typer.Option(None, help="Method preset; default: the profile's."),
    batch_size: int = typer.Option(32, min=1, help="Local batch size."),
    samples: int = typer.Option(600, min=1, help="Local training samples per round."),
    epochs: int = typer.Option(5, min=1, help="Local epochs per round."),
    deadline: Optional[float] = typer.Option(None, min=0.0, help="Round deadline for local training, seconds."),
    max_submodel: Optional[int] = typer.Option(None, min=1, help="Never train a submodel above this number."),
    memory_budget: Optional[str] = typer.Option(None, help="Emulate a device with this much free memory, e.g. 300MB."),
    cpu_budget: Optional[float] = typer.Option(None, help="Emulate a device this fraction as fast, e.g. 0.5."),
    safety_margin: float = typer.Option(DEFAULT_SAFETY_MARGIN, min=0.0, max=0.9, help="Fraction of available memory left free."),
    hot_limit: float = typer.Option(HOT_LIMIT_C, help="A thermal zone at or above this (C) counts as throttled."),
    threads: Optional[int] = typer.Option(None, min=1, help="Torch threads for training; default: torch's (one per core)."),
    calibrate_costs: bool = typer.Option(True, "--calibrate/--no-calibrate", help="Measure one real step per submodel (cached)."),
    recalibrate: bool = typer.Option(False, help="Ignore the cache and measure again."),
    cache_dir: Path = typer.Option(CACHE_DIR, help="Where calibrations are cached."),
    as_json: bool = typer.Option(False, "--json", help="Print costs and the selection as JSON."),
) -> None:
    """Show each submodel's cost on this device now, whether it fits, and which one would train."""
    try:
        layout = Layout.build(load_profile(profile), method)
        budget = DeviceBudget.parse(memory_budget, cpu_budget)
    except (ProfileError, ValueError) as e:
        raise _fail(str(e)) from None
    snap = budget.apply(_sample(0.5))
    table = (_calibrated(layout, batch_size, threads, cache_dir, recalibrate) if calibrate_costs
             else estimate_costs(layout, batch_size, threads=threads or torch.get_num_threads()))
    sel = select_submodel(table, snap, samples, epochs, deadline, max_submodel, safety_margin,
                          budget.cpu_budget, hot_limit)
    if as_json:
        print(json.dumps({"snapshot": snap.to_dict(), "selection": sel.to_dict(),
                          "costs": [c.__dict__ for c in table.costs]}, indent=1, default=str))
    else:
        console.print(_plan_table(table, sel))
        state = "throttled" if is_throttled(snap) or is_hot(snap, hot_limit) else "not throttled"
        console.print(f"usable memory {format_bytes(sel.usable_memory)} (available {format_bytes(snap.memory_available)}"
                      f" minus {safety_margin:.0%}), CPU {_pct(snap.cpu_percent)}, {state}, speed x{budget.cpu_budget:g}")
        console.print(f"[bold]choice:[/] {sel.reason}")
    if sel.index is None:
        raise typer.Exit(EXIT_NOTHING_FITS)
