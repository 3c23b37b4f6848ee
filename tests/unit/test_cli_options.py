"""Every command of the four command lines: a short parameter list, and each option declared once.

An option is its flag and its help: the same flag with another help (`--seed` of a load test and of a
simulation) is another option, declared where its command is. The same option in several commands
must come from one declaration (a shared Annotated type, a module constant or an option group's field,
nefl/support/option_groups.py), so its default, constraints and help cannot drift apart.
"""

from __future__ import annotations

import importlib
import inspect
from collections import defaultdict

import pytest
import typer
from typer import _click as click

from nefl.support.option_groups import declarations

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


def test_each_option_is_declared_once() -> None:
    sites: dict[tuple, set[int]] = defaultdict(set)
    users: dict[tuple, set[str]] = defaultdict(set)
    for name, command in ALL:
        params = {p.name: p for p in command.params}
        declared = dict(declarations(command.callback))
        assert set(declared) == set(params) - {"help"}, name  # every option of the command is checked
        for param_name, info in declared.items():
            p = params[param_name]
            key = (tuple(p.opts + p.secondary_opts), info.help)
            sites[key].add(id(info))
            users[key].add(name)
    twice = {key[0]: sorted(users[key]) for key, ids in sites.items() if len(ids) > 1}
    assert not twice, f"declared more than once (share one declaration): {twice}"
