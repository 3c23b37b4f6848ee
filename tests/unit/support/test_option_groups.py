"""nefl/support/option_groups.py: a group's fields are a command's options, and come back as the group."""

from __future__ import annotations

from dataclasses import field
from typing import Annotated, Optional

import pytest
import typer
from typer.testing import CliRunner

from nefl.support.option_groups import declarations, grouped, option_group

Shared = Annotated[Optional[str], typer.Option("--shared", envvar="TEST_SHARED", help="Declared once.")]


@option_group("Inner panel")
class Inner:
    shared: Shared = None
    flag: Annotated[bool, typer.Option("--flag", help="On when given.")] = False


@option_group()
class Outer:
    count: Annotated[int, typer.Option(min=1, help="How many.")] = 3
    name: Annotated[str, typer.Option(help="A name.")] = "x"
    inner: Inner = field(default_factory=Inner)


@option_group()
class Required:
    url: Annotated[str, typer.Option(help="Must be given.")]


calls: list[tuple] = []


@grouped
def command(word: str = typer.Option("hi", help="Its own option."), *, outer: Outer, required: Required) -> None:
    """A command with groups."""
    calls.append((word, outer, required))


def _app() -> typer.Typer:
    app = typer.Typer(add_completion=False)
    app.command()(command)
    return app


def test_typer_sees_each_field_as_an_option_and_the_command_gets_the_groups() -> None:
    calls.clear()
    result = CliRunner().invoke(_app(), ["--count", "5", "--shared", "s", "--flag", "--url", "u"])
    assert result.exit_code == 0, result.output
    assert calls == [("hi", Outer(count=5, name="x", inner=Inner(shared="s", flag=True)), Required(url="u"))]


def test_help_lists_the_options_with_their_defaults_constraints_env_and_panels() -> None:
    result = CliRunner().invoke(_app(), ["--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    out = result.output
    for text in ("--word", "Its own option.", "--count", "x>=1", "[default: 3]", "--shared", "TEST_SHARED", "--url",
                 "[required]", "Inner panel"):
        assert text in out, text
    assert "--no-flag" not in out  # the declaration's flag names are kept


def test_required_field_and_constraints_are_enforced() -> None:
    assert CliRunner().invoke(_app(), []).exit_code == 2  # --url missing
    assert CliRunner().invoke(_app(), ["--url", "u", "--count", "0"]).exit_code == 2


def test_a_direct_call_takes_the_flat_options_and_defaults_the_rest() -> None:
    calls.clear()
    command(url="u", count=2)
    word, outer, required = calls[0]
    assert outer == Outer(count=2) and required == Required("u")
    with pytest.raises(TypeError, match="colour"):
        command(url="u", colour="red")
    with pytest.raises(TypeError, match="missing.*url"):
        command(count=2)


@option_group()
class Clash:
    count: Annotated[int, typer.Option(help="Another count.")] = 1


def test_an_option_name_twice_in_one_command_is_refused() -> None:
    def both(*, outer: Outer, clash: Clash) -> None: ...

    with pytest.raises(TypeError, match="count"):
        grouped(both)


def test_declarations_name_one_object_per_declaration() -> None:
    first = dict(declarations(command))
    again = dict(declarations(command))
    assert set(first) == {"word", "count", "name", "shared", "flag", "url"}
    assert all(first[k] is again[k] for k in first)  # a group's fields are evaluated once
