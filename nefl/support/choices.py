"""String switches as Literal types, checked where they are stored.

A Literal only binds a type checker, while the values arrive from code, TOML and command lines; a
comparison's `else` would silently turn a typo into some other branch. So every switch is also
checked at run time, and the values stay the plain strings checkpoints and profiles already hold.
"""

from __future__ import annotations

from typing import Any, get_args


def check_choice(choices: Any, value: object, what: str) -> None:
    """Refuse a value outside the Literal type `choices`; the message lists the allowed ones."""
    allowed = get_args(choices)
    if value not in allowed:
        raise ValueError(f"{what} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
