"""`nefl`: inspect submodel ladders (profiles)."""

from __future__ import annotations

import logging

import typer
from rich.table import Table

import nefl.nested.profile
from nefl.nested.cost import full_cost, submodel_cost
from nefl.nested.methods import METHODS, apply_method, get_method
from nefl.nested.profile import ProfileError, list_profiles, load_profile
from nefl.support.cli_options import LogOptions, MethodOption
from nefl.support.logs import console, setup_logging
from nefl.support.option_groups import grouped

log = logging.getLogger(__name__)

app = typer.Typer(help="NeFL core tools: list and inspect submodel ladders.", no_args_is_help=True, add_completion=False)
profile_app = typer.Typer(help="Submodel ladders (TOML profiles).", no_args_is_help=True)
app.add_typer(profile_app, name="profile")


def _human(n: int) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


@profile_app.command("list")
@grouped
def list_command(*, logs: LogOptions) -> None:
    """List the shipped profiles."""
    setup_logging(logs.log_level, logs.log_format)
    names = list_profiles()
    if not names:  # an install that lost its package data must not look like an empty, healthy one
        log.error(f"no profiles found in {nefl.nested.profile.PROFILES_DIR}; reinstall nefl-edge "
                  "(its wheel ships them as nefl/profiles) or restore profiles/ in a checkout")
        raise typer.Exit(2)
    for name in names:
        p = load_profile(name)
        print(f"{name:28s} {p.arch.name:18s} {p.num_submodels} submodels  {p.description}")


@profile_app.command("show")
@grouped
def show_command(
    profile: str = typer.Argument(..., help="Profile name or path to a TOML file."),
    method: MethodOption(f"Show the ladder a method derives: {', '.join(METHODS)}.") = None,
    *,
    logs: LogOptions,
) -> None:
    """Print a ladder: target gamma, actual parameter ratio, parameters and FLOPs per submodel."""
    setup_logging(logs.log_level, logs.log_format)
    try:
        p = load_profile(profile)
        if method:
            p = apply_method(p, get_method(method))
    except (ProfileError, ValueError) as e:
        log.error(str(e))
        raise typer.Exit(2) from None
    full = full_cost(p)
    table = Table(title=f"{p.name} · {p.arch.name} ({p.stem} stem) · input {list(p.input_shape)} · method {p.method}")
    for col in ("submodel", "gamma", "gamma_w", "depth", "params ratio", "params", "FLOPs (MACs)", "FLOPs ratio", "steps"):
        table.add_column(col, justify="right" if col != "steps" else "left")
    for s in p.submodels:
        c = submodel_cost(p, s)
        steps = " | ".join(",".join(f"{v:g}" for v in st) for st in s.steps)
        table.add_row(str(s.index + 1), f"{s.gamma:g}", f"{s.gamma_w:g}", f"{s.depth_ratio:.2f}",
                      f"{c.params / full.params:.3f}", _human(c.params), _human(c.macs), f"{c.macs / full.macs:.3f}", steps)
    console().print(table)
