"""The `plan` command: which submodel this device would train now, and why.

It measures real training steps, so it needs torch, imported when `plan` runs (`plan --help` and
the small install's `edge-client --help` never do). Exit codes: 0 ok, 2 bad input (unknown profile,
unreadable size), 3 no submodel fits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from edge_client.cache import CALIBRATION_DIR
from edge_client.device_cli import format_percent, sample_snapshot
from edge_client.probe import HOT_LIMIT_C, format_bytes, is_hot, is_throttled
from edge_client.select import DEFAULT_SAFETY_MARGIN, DeviceBudget, Selection, select_submodel
from nefl.nested.profile import ProfileError, load_profile
from nefl.support.cli_options import (BatchSizeOption, JsonOption, MaxSubmodelOption, MemoryBudgetOption, MethodOption,
                                      ProfileOption, ThreadsOption, TorchDeviceOption)
from nefl.support.extras import full_install_required
from nefl.support.settings import TrainConfig

if TYPE_CHECKING:
    from edge_client.costmodel import CostTable
    from nefl.nested.state import Layout

EXIT_BAD_INPUT, EXIT_NOTHING_FITS = 2, 3
CacheDirOption = Annotated[Path, typer.Option("--cache-dir", help="Where calibrations are cached.")]
CalibrateOption = Annotated[bool, typer.Option(
    "--calibrate/--no-calibrate", help="Measure one training step per submodel (cached) or use the analytic estimate.")]
CpuBudgetOption = Annotated[Optional[float], typer.Option(
    "--cpu-budget", help="Emulate a device this fraction as fast, e.g. 0.5 (`join` sleeps after each training round to "
                         "really take that long).")]
RecalibrateOption = Annotated[bool, typer.Option(
    "--recalibrate/--no-recalibrate", help="Ignore the cached calibration and measure again.")]
console = Console()


def _fail(message: str) -> typer.Exit:
    Console(stderr=True).print(f"[red]error:[/] {message}")
    return typer.Exit(EXIT_BAD_INPUT)


def _calibrated(layout: Layout, batch_size: int, threads: int | None, cache_dir: Path, force: bool,
                device: str) -> CostTable:
    from edge_client.costmodel import calibrate

    with Progress(SpinnerColumn(), TextColumn("calibrating {task.description}"), BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task(layout.profile.name, total=layout.num_submodels)
        return calibrate(layout, batch_size, device=device, threads=threads, cache_dir=cache_dir, force=force,
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
    profile: ProfileOption(),
    method: MethodOption() = None,
    batch_size: BatchSizeOption = TrainConfig.batch_size,
    samples: int = typer.Option(600, min=1, help="Local training samples per round."),
    epochs: int = typer.Option(5, min=1, help="Local epochs per round."),
    deadline: Optional[float] = typer.Option(None, min=0.0, help="Round deadline for local training, seconds."),
    max_submodel: MaxSubmodelOption("Never train a submodel above this number (1-based).") = None,
    memory_budget: MemoryBudgetOption() = None,
    cpu_budget: CpuBudgetOption = None,
    safety_margin: float = typer.Option(DEFAULT_SAFETY_MARGIN, min=0.0, max=0.9, help="Fraction of available memory left free."),
    hot_limit: float = typer.Option(HOT_LIMIT_C, help="A thermal zone at or above this (C) counts as throttled."),
    threads: ThreadsOption() = None,
    calibrate_costs: CalibrateOption = True,
    recalibrate: RecalibrateOption = False,
    cache_dir: CacheDirOption = CALIBRATION_DIR,
    device: TorchDeviceOption("torch device the costs are measured on: cpu, or cuda (Jetson / GPU).") = "cpu",
    as_json: JsonOption = False,
) -> None:
    """Show each submodel's cost on this device now, whether it fits, and which one would train.

    With --json, the costs and the selection are printed as JSON."""
    with full_install_required("edge-client plan"):  # here, not at the top: `plan --help` needs no torch
        import torch

        from edge_client.costmodel import estimate_costs
        from nefl.nested.state import Layout
    try:
        layout = Layout.build(load_profile(profile), method)
        budget = DeviceBudget.parse(memory_budget, cpu_budget)
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {device}: torch sees no CUDA device here (see docs/deploy.md for Jetson torch)")
    except (ProfileError, ValueError) as e:
        raise _fail(str(e)) from None
    snap = budget.apply(sample_snapshot(0.5))
    table = (_calibrated(layout, batch_size, threads, cache_dir, recalibrate, device) if calibrate_costs
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
                      f" minus {safety_margin:.0%}), CPU {format_percent(snap.cpu_percent)}, {state},"
                      f" speed x{budget.cpu_budget:g}")
        console.print(f"[bold]choice:[/] {sel.reason}")
    if sel.index is None:
        raise typer.Exit(EXIT_NOTHING_FITS)
