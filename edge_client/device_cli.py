"""The `probe` command: show the device's state.

It needs only psutil and rich, never torch, so it runs on the small inference install; `plan`,
which measures training steps, lives in `edge_client.plan_cli`.
"""

from __future__ import annotations

import json
import time

import typer
from rich.console import Console
from rich.table import Table

from edge_client.probe import DeviceSnapshot, Prober, format_bytes, is_throttled
from nefl.support.cli_options import JsonOption
from nefl.support.cpu import MIN_WINDOW_S

console = Console()


def sample_snapshot(interval: float) -> DeviceSnapshot:
    """A snapshot after `interval` s, so the CPU utilisation covers a real interval."""
    prober = Prober()
    time.sleep(interval)
    return prober.snapshot()


def format_percent(v: float | None) -> str:
    return "?" if v is None else f"{v:.0f}%"


def _snapshot_table(s: DeviceSnapshot) -> Table:
    t = Table("source", "reading", title="device snapshot")
    t.add_row("memory available / total", f"{format_bytes(s.memory_available)} / {format_bytes(s.memory_total)}")
    t.add_row("this process RSS", format_bytes(s.process_rss))
    t.add_row("CPU utilisation", f"{format_percent(s.cpu_percent)} of {s.cpu_count} cores")
    t.add_row("  of it by other processes", format_percent(s.external_cpu_percent))
    t.add_row("load per core (1 min)", "?" if s.load_per_core is None else f"{s.load_per_core:.2f}")
    for i, g in enumerate(s.gpus):
        t.add_row(f"GPU {i} {g.name}", f"{format_bytes(g.memory_used)} / {format_bytes(g.memory_total)} used, "
                                        f"{format_percent(g.utilization)} busy")
    if s.jetson_gpu_load is not None:
        t.add_row("Jetson GPU load", format_percent(s.jetson_gpu_load))
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
    as_json: JsonOption = False,
    interval: float = typer.Option(0.5, min=0.0, help=f"Seconds over which CPU utilisation is sampled (under {MIN_WINDOW_S:g} s: unknown)."),
) -> None:
    """Print one snapshot of memory, CPU/GPU load, thermals, throttling and battery.

    With --json, the snapshot is printed as JSON."""
    snap = sample_snapshot(interval)
    if as_json:
        print(json.dumps(snap.to_dict(), indent=1))
    else:
        console.print(_snapshot_table(snap))
