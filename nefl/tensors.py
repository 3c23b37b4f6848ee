"""Tensor checks shared by the wire format, NeFedAvg, slicing and checkpoints.

Kept apart from nefl/state.py so that code that only moves tensors (the wire format) does not
import the model and profile machinery.
"""

from __future__ import annotations

import torch


def corner(shape: torch.Size | tuple[int, ...]) -> tuple[slice, ...]:
    """The leading corner [:d0, :d1, ...]: where a submodel tensor sits in its global tensor."""
    return tuple(slice(0, d) for d in shape)


def all_finite(t: torch.Tensor) -> bool:
    """No NaN/inf, checked cheaply: a finite sum proves it (NaN and inf propagate into any sum);
    only a non-finite sum (possibly an overflow of huge finite values) needs the element-wise check."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def tensor_mismatch(got: dict[str, torch.Tensor], expected: dict[str, torch.Size], what: str) -> str | None:
    """Why `got` is not exactly the named tensors of `expected` (None when it is)."""
    if set(got) != set(expected):
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        return f"{what}: tensor names differ: missing {missing[:3]}, unexpected {extra[:3]}"
    for n, t in got.items():
        if t.shape != expected[n]:
            return f"{what}: tensor {n!r} has shape {tuple(t.shape)}, expected {tuple(expected[n])}"
    return None
