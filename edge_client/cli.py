"""`edge-client`: the device agent's command line.

Each command lives in the module that owns its job; this file only assembles them. The commands
that train (`join`, `plan`) need torch, which the small inference install lacks and which costs
seconds and hundreds of MB to import on a Pi, so their modules are imported only when one of them
runs: `--help`, `probe`, `infer` and `serve` never import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

import typer
from typer.core import TyperGroup

from edge_client.device_cli import probe_command
from edge_client.infer_cli import infer_command, serve_command
from nefl.extras import full_install_required

# name -> (module, function, the function's docstring for `--help`, which must not import the module)
TRAINING_COMMANDS = {
    "join": ("edge_client.join", "join_command",
             "Join a federation: announce, train assigned submodels, upload deltas until the federation ends."),
    "plan": ("edge_client.plan_cli", "plan_command",
             "Show each submodel's cost on this device now, whether it fits, and which one would train."),
}


def _training_command(name: str) -> Any:
    """The real click command behind a placeholder; on the small install, the one-line fix instead."""
    module, function, _ = TRAINING_COMMANDS[name]
    with full_install_required(f"edge-client {name}"):
        callback = getattr(importlib.import_module(module), function)
    single = typer.Typer(add_completion=False)
    single.command(name)(callback)
    return typer.main.get_command(single)


class _Commands(TyperGroup):
    """Swaps a training command's placeholder for the real command once the command line names it."""

    def resolve_command(self, ctx: typer.Context, args: list[str]) -> tuple[str | None, Any, list[str]]:
        name, command, rest = super().resolve_command(ctx, args)
        if name in TRAINING_COMMANDS:
            command = _training_command(name)
        return name, command, rest


def _placeholder() -> None:
    """Never runs: `_Commands.resolve_command` replaces it before click invokes anything."""


app = typer.Typer(cls=_Commands, help="NeFL edge agent: probe the device, join a federation, run exported submodels.",
                  no_args_is_help=True, add_completion=False)
for _name, (_, _, _help) in TRAINING_COMMANDS.items():
    app.command(_name, help=_help)(_placeholder)
app.command("infer")(infer_command)
app.command("serve")(serve_command)
app.command("probe")(probe_command)
