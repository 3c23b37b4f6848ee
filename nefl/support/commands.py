"""Command groups that import a command's module only when that command runs.

The modules behind `aggregator`, `edge-client` and `nefl-export` commands need torch, which takes
seconds to import (and is absent from the small inference install). A group lists its commands
with their one-line help from here, so `aggregator --help` imports none of them; `aggregator serve
--help` imports only serve's module, which keeps its heavy imports inside the command.
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple

import typer
from typer.core import TyperGroup

from nefl.support.extras import full_install_required


class Lazy(NamedTuple):
    module: str
    function: str  # a command function, or a typer.Typer of subcommands
    help: str  # the function's docstring (a sub-app's help), listed by the group's --help (tests/test_packaging.py holds them equal)


def _placeholder() -> None:
    """Never runs: the group swaps in the real command before click invokes anything."""


def _click_command(name: str, callback: Any) -> Any:
    """The click command of a command function, or the click group of a sub-app."""
    if isinstance(callback, typer.Typer):
        return typer.main.get_group(callback)
    single = typer.Typer(add_completion=False)
    single.command(name)(callback)
    return typer.main.get_command(single)


def lazy_app(name: str, help: str, commands: dict[str, Lazy]) -> typer.Typer:
    """A typer app whose commands are `commands`, each imported when the command line names it
    (on the small install, a command whose module needs the full one gives the one-line fix)."""

    class Group(TyperGroup):
        def resolve_command(self, ctx: typer.Context, args: list[str]) -> tuple[str | None, Any, list[str]]:
            found, command, rest = super().resolve_command(ctx, args)
            if found in commands:
                module, function, _ = commands[found]
                with full_install_required(f"{name} {found}"):
                    callback = getattr(importlib.import_module(module), function)
                command = _click_command(found, callback)
            return found, command, rest

    app = typer.Typer(cls=Group, help=help, no_args_is_help=True, add_completion=False)
    for command_name, command in commands.items():
        app.command(command_name, help=command.help)(_placeholder)
    return app
