"""Option groups: options several commands share, declared once as a dataclass and taken as one parameter.

A group is a frozen dataclass whose fields are typer options (`Annotated[T, typer.Option(...)] = default`, the
default read from the config it feeds). A command decorated with `@grouped` declares `mqtt: BrokerOptions`;
typer sees one option per field (the decorator rewrites the command's `__signature__`, which typer reads),
and the command gets the group's instance back. Groups nest: a field whose type is a group adds its options
too. Torch-free, so `--help` of a command stays fast.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Iterator
from copy import copy
from typing import Annotated, Any, TypeVar

import typer
from typer.models import OptionInfo, ParameterInfo

T = TypeVar("T")
_PANEL = "__option_panel__"


def option_group(panel: str | None = None) -> Callable[[type[T]], type[T]]:
    """Make a class a frozen dataclass of options; `panel` names the box `--help` shows them in."""

    def make(cls: type[T]) -> type[T]:
        group = dataclasses.dataclass(frozen=True)(cls)
        setattr(group, _PANEL, panel)
        return group

    return make


class SharedOption:
    """One option several commands take, declared once: its flags, type, constraints and environment variable.
    A command declares `seed: SeedOption("Seed of the deltas.") = Config.seed`: the call is the Annotated type,
    the help (what the option means to that command) its one parameter, the default its config's."""

    def __init__(self, kind: Any, *flags: str, help: str, **settings: Any) -> None:
        self.kind, self.flags, self.help, self.settings = kind, flags, help, settings

    def __call__(self, help: str | None = None) -> Any:
        info = typer.Option(*self.flags, help=help or self.help, **self.settings)
        info.declaration = self  # type: ignore[attr-defined]  # which declaration made it (`declaration_of`)
        return Annotated[self.kind, info]


def declaration_of(info: ParameterInfo) -> object:
    """What declared an option: its SharedOption, or the typer.Option itself."""
    return getattr(info, "declaration", info)


def is_group(annotation: Any) -> bool:
    """Whether a parameter's type is an option group (made by option_group)."""
    return isinstance(annotation, type) and dataclasses.is_dataclass(annotation) and hasattr(annotation, _PANEL)


def _typer_info(annotation: Any) -> ParameterInfo | None:
    """The typer.Option (or Argument) inside an Annotated type, if any."""
    if typing.get_origin(annotation) is Annotated:
        return next((m for m in annotation.__metadata__ if isinstance(m, ParameterInfo)), None)
    return None


@functools.cache
def _fields(group: type) -> tuple[tuple[str, Any, Any], ...]:
    """(name, annotation, default) of each field; `...` where a field has no default (a required option).
    Once per group: evaluating its annotations again would make new typer.Option objects."""
    hints = typing.get_type_hints(group, include_extras=True)
    return tuple((f.name, hints[f.name], ... if f.default is dataclasses.MISSING else f.default)
                 for f in dataclasses.fields(group))


def _expand(name: str, annotation: Any, default: Any, panel: str | None) -> Iterator[inspect.Parameter]:
    """The typer-visible parameters of one declared parameter: itself, or a group's fields (recursively)."""
    if is_group(annotation):
        for field_name, field_type, field_default in _fields(annotation):
            yield from _expand(field_name, field_type, field_default, getattr(annotation, _PANEL) or panel)
        return
    info = _typer_info(annotation)
    if panel is not None and isinstance(info, OptionInfo) and info.rich_help_panel is None:
        info = copy(info)  # the declaration may be shared: its copy carries the panel
        info.rich_help_panel = panel
        annotation = Annotated[typing.get_args(annotation)[0], info]
    yield inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def _pack(annotation: Any, values: dict[str, Any]) -> Any:
    """A group's instance from the flat values typer parsed (nested groups first)."""
    return annotation(**{name: _pack(field_type, values) if is_group(field_type) else values[name]
                         for name, field_type, _ in _fields(annotation)})


def grouped(command: Callable[..., Any]) -> Callable[..., Any]:
    """A command whose group parameters typer sees as their options, and that gets them back as instances.
    Calling it with the flat option values (as typer does; omitted ones take their defaults) runs `command`."""
    hints = typing.get_type_hints(command, include_extras=True)
    declared = inspect.signature(command).parameters.values()
    groups = {p.name: hints[p.name] for p in declared if is_group(hints.get(p.name))}
    own = {p.name for p in declared} - set(groups)
    params = [q for p in declared
              for q in _expand(p.name, hints.get(p.name, p.annotation), p.default, None)]
    names = [p.name for p in params]
    if len(set(names)) != len(names):
        raise TypeError(f"{command.__qualname__}: an option name appears twice: "
                        f"{sorted({n for n in names if names.count(n) > 1})}")
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    required = {p.name for p in params if p.default is ... or p.default is inspect.Parameter.empty} - own

    @functools.wraps(command)
    def run(**values: Any) -> Any:
        unknown, missing = set(values) - set(names), required - set(values)
        if unknown or missing:
            raise TypeError(f"{command.__qualname__}(): unexpected options {sorted(unknown)}, missing {sorted(missing)}")
        flat = {**defaults, **values}
        return command(**{k: v for k, v in values.items() if k in own},
                       **{name: _pack(group, flat) for name, group in groups.items()})

    run.__signature__ = inspect.Signature(params, return_annotation=None)  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in params}
    return run


def declarations(command: Callable[..., Any]) -> Iterator[tuple[str, ParameterInfo]]:
    """(option name, the typer.Option or Argument that declares it) for each option a command takes, groups'
    included: one object per declaration, shared by every command that uses that declaration, except a
    SharedOption's, made per use and naming it (`declaration_of`)."""
    target = inspect.unwrap(command)
    hints = typing.get_type_hints(target, include_extras=True)

    def walk(name: str, annotation: Any, default: Any) -> Iterator[tuple[str, ParameterInfo]]:
        if is_group(annotation):
            for field in _fields(annotation):
                yield from walk(*field)
        elif isinstance(info := _typer_info(annotation) or default, ParameterInfo):
            yield name, info

    for p in inspect.signature(target).parameters.values():
        yield from walk(p.name, hints.get(p.name, p.annotation), p.default)
