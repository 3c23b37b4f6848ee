"""Tensor checks shared by the wire format, NeFedAvg, slicing and checkpoints.

Kept apart from nefl/state.py so that code that only moves tensors (the wire format) does not
import the model and profile machinery.
"""

from __future__ import annotations

import torch


def corner(shape: torch.Size | tuple[int, ...]) -> tuple[slice, ...]:
    """The leading corner [:d0, :d1, ...]: where a submodel tensor sits in its global tensor."""
    return tuple(slice(0, d) for d in shape)


def ring(outer: torch.Size | tuple[int, ...], inner: torch.Size | tuple[int, ...] | None) -> list[tuple[slice, ...]]:
    """The elements of corner `outer` outside corner `inner` (inner <= outer in every dim), as disjoint
    boxes, one per dim where they differ: dims before d cut to inner, [inner_d, outer_d) at d, dims
    after d at outer's extent. No inner: the whole corner."""
    if inner is None:
        return [corner(outer)]
    return [tuple(slice(0, inner[j]) for j in range(d)) + (slice(inner[d], outer[d]),)
            + tuple(slice(0, outer[j]) for j in range(d + 1, len(outer)))
            for d in range(len(outer)) if inner[d] < outer[d]]


class Tiled(dict):
    """Tensors that are views exactly tiling one flat float32 buffer, `flat`, as nefl/wire.py decodes an
    update: a check over all of them (finite values, the norm) is one pass over `flat`, not one per tensor.
    Only the decoder builds one; anything derived from it (a clipped copy) is a plain dict again."""

    flat: torch.Tensor


def all_finite(t: torch.Tensor) -> bool:
    """No NaN/inf, checked cheaply: a finite sum proves it (NaN and inf propagate into any sum);
    only a non-finite sum (possibly an overflow of huge finite values) needs the element-wise check."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def first_non_finite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The name of the first tensor holding a NaN/inf (None when all are finite). One fused norm over
    all tensors (the optimizers' foreach kernel) proves the common case in one call instead of one
    reduction per tensor; a non-finite norm (NaN/inf, or an overflow of huge finite values) falls back
    to the exact per-tensor check, so the answer is the same as `all_finite` on each."""
    values = [t for t in tensors.values() if t.numel()]
    if not values or bool(torch.isfinite(torch.stack(torch._foreach_norm(values))).all()):
        return None
    return next((n for n, t in tensors.items() if not all_finite(t)), None)


def tensor_mismatch(got: dict[str, torch.Tensor], expected: dict[str, torch.Size], what: str) -> str | None:
    """Why `got` is not exactly the named tensors of `expected` (None when it is)."""
    if set(got) != set(expected):
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        return f"{what}: tensor names differ: missing {missing[:3]}, unexpected {extra[:3]}"
    for n, t in got.items():
        if t.shape != expected[n]:
            return f"{what}: tensor {n!r} has shape {tuple(t.shape)}, expected {tuple(expected[n])}"
    return None
