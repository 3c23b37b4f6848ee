"""Every command of the four command lines: a short parameter list, and each option declared once.

A flag is declared once: the commands that take it share one declaration (a shared Annotated type, an
option group's field, or a SharedOption whose help each command words for itself, nefl/support/option_groups.py),
so its type, constraints and environment variable cannot drift apart. Two commands that mean different things
by a flag give one of them another name.
"""

from __future__ import annotations

import importlib
import inspect
from collections import defaultdict
from collections.abc import Callable

import pytest
import typer
from typer.models import OptionInfo
from typer import _click as click

from nefl.support.option_groups import declaration_of, declarations

APPS = ("nefl.cli", "aggregator.cli", "edge_client.cli", "export.cli")
MAX_PARAMETERS = 20


def _commands(group: object, path: str) -> list[tuple[str, object]]:
    """(command line, click command) of every command under a click group, sub-apps' included."""
    found = []
    for name in group.list_commands(None):
        _, command, _ = group.resolve_command(click.Context(group), [name])  # a lazy group imports the module here
        if hasattr(command, "list_commands"):
            found += _commands(command, f"{path} {name}")
        else:
            found.append((f"{path} {name}", command))
    return found


ALL = [c for module in APPS for c in _commands(typer.main.get_command(importlib.import_module(module).app),
                                                module.split(".")[0])]


def test_every_app_has_its_commands() -> None:
    names = {name for name, _ in ALL}
    assert {"aggregator serve", "aggregator simulate", "aggregator rollout status", "edge_client join",
            "edge_client serve", "nefl profile show", "export onnx"} <= names
    assert len(names) >= 24


@pytest.mark.parametrize("name,command", ALL, ids=[name for name, _ in ALL])
def test_a_command_function_takes_at_most_20_parameters(name: str, command: object) -> None:
    declared = inspect.signature(inspect.unwrap(command.callback)).parameters
    assert len(declared) <= MAX_PARAMETERS, f"{name}: {len(declared)} parameters; group its options"


def _declared_twice(key: Callable[[object, object], list]) -> dict[object, list[str]]:
    """Keys (of a click option and its typer declaration) that more than one declaration makes, and their commands.
    Declarations are held by identity, and held: a per-call object's id could be reused by the next one."""
    sites: dict[object, dict[int, object]] = defaultdict(dict)
    users: dict[object, set[str]] = defaultdict(set)
    for name, command in ALL:
        params = {p.name: p for p in command.params}
        declared = dict(declarations(command.callback))
        assert set(declared) == set(params) - {"help"}, name  # every option of the command is checked
        for param_name, info in declared.items():
            p = params[param_name]
            if isinstance(info, OptionInfo):  # an argument has no flag: its position is its command's
                for k in key(p, info):
                    source = declaration_of(info)
                    sites[k][id(source)] = source
                    users[k].add(name)
    return {k: sorted(users[k]) for k, found in sites.items() if len(found) > 1}


def test_each_flag_is_declared_once() -> None:
    twice = _declared_twice(lambda p, _: p.opts + p.secondary_opts)
    assert not twice, f"declared more than once (share one declaration, or name what differs): {twice}"
