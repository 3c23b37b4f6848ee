"""Tensor checks shared by the wire format, NeFedAvg, slicing and checkpoints.

Kept apart from nefl/nested/state.py so that code that only moves tensors (the wire format) does not
import the model and profile machinery.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
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


class Tiling:
    """The names and shapes of the tensors that tile a flat buffer, in buffer order. The wire decoder
    makes one per distinct safetensors header and hands the same object to every update that repeats
    it (every honest update of a submodel does), so a check of an update's layout is a comparison with
    a layout already checked, not one per tensor (a resnet20 update has 116). Immutable; equal by value,
    hashed once."""

    __slots__ = ("names", "shapes", "_offsets", "_strides", "_hash")

    def __init__(self, names: tuple[str, ...], shapes: tuple[torch.Size, ...]) -> None:
        self.names, self.shapes = names, shapes
        sizes = [math.prod(s) for s in shapes]
        self._offsets = tuple(itertools.accumulate(sizes, initial=0))
        self._strides = tuple(_contiguous_strides(s) for s in shapes)
        self._hash = hash((names, shapes))

    @property
    def numel(self) -> int:
        return self._offsets[-1]

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors as views of `flat` (1-D, contiguous, `numel` elements): one as_strided each, fewer
        calls than slicing then reshaping."""
        base = flat.storage_offset()
        return {n: flat.as_strided(s, st, base + o) for n, s, st, o in zip(self.names, self.shapes, self._strides, self._offsets)}

    def placement(self, names: list[str]) -> tuple[list[int], list[tuple[int, ...]]]:
        """Where each named tensor starts in the buffer (elements) and its strides."""
        at = {n: i for i, n in enumerate(self.names)}
        return [self._offsets[at[n]] for n in names], [self._strides[at[n]] for n in names]

    def mismatch(self, expected: dict[str, torch.Size], what: str) -> str | None:
        """`tensor_mismatch` of tensors tiled this way."""
        return tensor_mismatch(dict(zip(self.names, self.shapes)), expected, what, shaped=True)

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, Tiling) and self._hash == other._hash
                                 and (self.names, self.shapes) == (other.names, other.shapes))

    def __hash__(self) -> int:
        return self._hash


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return tuple(reversed(strides))


def byte_view(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bytes in C order as a flat uint8 array: numpy's reshape and view cost a fraction of torch's
    dispatch (detach, reshape, view, numpy; a resnet20 state has 488 tensors), and a contiguous tensor is not
    copied. numpy has no bfloat16, so such a tensor is read as int16: the same bytes."""
    t = t.detach()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().reshape(-1).view(np.uint8)


_ROW = 4096  # elements per float32 partial sum of squares: short sums stay accurate; the partials combine in float64


def l2_norm(t: torch.Tensor) -> float:
    """L2 norm of one tensor at float32 speed with float64's range and accuracy: float32 sums of squares of
    4096-element rows (a float32 sum over millions of elements drifts by ~1%, and a float64 cast of the
    whole tensor costs many times as much), combined in float64. A row that overflows (or holds NaN/inf), or a
    total small enough for squares to underflow, takes the exact float64 path. Finite for finite input of
    any float32 size, NaN or inf otherwise: so it doubles as the finite check."""
    if t.dtype == torch.float32 and t.numel() >= _ROW and t.device.type == "cpu":
        flat = t.detach().reshape(-1)
        total = _kept(_row_squares_torch(flat, flat.numel() // _ROW)) if flat.data_ptr() % 4 else array_norm(flat.numpy())
        if total is not None:
            return total
    return float(torch.linalg.vector_norm(t, dtype=torch.float64))


def _kept(squares: float) -> float | None:
    """The norm from row-wise float32 squares, None where the exact float64 path must decide: a row that
    overflowed or held NaN/inf, or a total small enough for squares to underflow."""
    total = math.sqrt(squares)
    return total if math.isfinite(total) and total > 1e-18 else None


def array_norm(x: np.ndarray) -> float | None:
    """l2_norm's row-wise float32 way for a flat, aligned float32 numpy array, without a torch call: under a
    fleet's load the server's core runs other processes between updates, and each torch call then pays for
    cold dispatch. None where l2_norm's exact float64 path must decide: too short, not aligned, a row that
    overflows or holds NaN/inf, or a total small enough for squares to underflow."""
    if x.dtype != np.float32 or x.ndim != 1 or x.size < _ROW or not x.flags.aligned:
        return None
    return _kept(_row_squares_blas(x, x.size // _ROW))


def _row_squares_blas(flat: np.ndarray, rows: int) -> float:
    """The float32 sums of squares of `rows` 4096-element rows and of the tail, summed in float64: one batched
    BLAS product of the rows with themselves (numpy's OpenBLAS: fewer calls than torch's row norms and the
    reductions around them)."""
    body, tail = flat[:rows * _ROW].reshape(rows, 1, _ROW), flat[rows * _ROW:]
    with np.errstate(over="ignore", invalid="ignore"):  # an overflowing row takes the float64 path of l2_norm
        return float(np.matmul(body, body.transpose(0, 2, 1)).sum(dtype=np.float64)) + float(np.dot(tail, tail))


def _row_squares_torch(flat: torch.Tensor, rows: int) -> float:
    """The same with torch's row norms, for a buffer at an address that is no multiple of 4 (an update decoded
    in place, where the MQTT packet's topic and the chunk header left it): numpy takes such an array through a
    buffered copy, many times slower than torch's row norms."""
    rows_sq = torch.linalg.vector_norm(flat[:rows * _ROW].view(rows, _ROW), dim=1).square().sum(dtype=torch.float64)
    return float(rows_sq) + float(torch.linalg.vector_norm(flat[rows * _ROW:], dtype=torch.float64) ** 2)


class Tiled(dict):
    """Tensors that are views exactly tiling one flat float32 buffer, `flat`, as nefl/nested/tensorfile.py decodes an
    update: a check over all of them (finite values, the norm) is one pass over `flat`, not one per tensor,
    and `tiling` says their names and shapes in one object. Only the decoder builds one; anything derived
    from it (a clipped copy) is a plain dict again. `normed` caches the norm (`norm`) with the
    buffer's version counter, which every in-place write to `flat` or a view of it bumps.

    lazy=True (an aggregator's updates, which it checks and sums as flat buffers) makes the views on the
    first use of any dict method instead of at once: 116 views cost a resnet20 update about as much as
    hashing it. A C extension that reads a dict's storage directly (PyDict_Next: msgspec, safetensors'
    writer) would see an unused lazy one empty, so one is never handed to those."""

    flat: torch.Tensor
    tiling: Tiling
    normed: tuple[int, float] | None = None

    def __init__(self, flat: torch.Tensor, tiling: Tiling, lazy: bool = False, array: np.ndarray | None = None) -> None:
        """array: `flat`'s memory as numpy already has it (the decoder's), else made on first use."""
        super().__init__()
        self.flat, self.tiling, self._empty, self._array = flat, tiling, True, array
        if not lazy:
            self._fill()

    def array(self) -> np.ndarray:
        """`flat` as a numpy array (the same memory), made once: a torch call per use is dear on a cold core."""
        if self._array is None:
            self._array = self.flat.numpy()
        return self._array

    def norm(self) -> float:
        """L2 norm of `flat` (l2_norm), kept with the buffer's version counter: the decoder's finite check, the
        bound and the centre check all ask, and a write into the buffer recomputes it."""
        version = self.flat._version
        if self.normed is None or self.normed[0] != version:
            self.normed = (version, l2_norm(self.flat))
        return self.normed[1]

    def _fill(self) -> None:
        if self._empty:
            self._empty = False
            dict.update(self, self.tiling.views(self.flat))


def _filling(name: str) -> Callable:
    method = getattr(dict, name)

    @functools.wraps(method)
    def filled(self: Tiled, *args: Any, **kwargs: Any) -> Any:
        self._fill()
        return method(self, *args, **kwargs)

    return filled


for _name in ("__getitem__", "__setitem__", "__delitem__", "__iter__", "__reversed__", "__len__", "__contains__", "__eq__",
              "__ne__", "__or__", "__ior__", "__repr__", "keys", "values", "items", "get", "pop", "popitem", "setdefault",
              "update", "copy", "clear"):
    setattr(Tiled, _name, _filling(_name))


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


def tensor_mismatch(got: dict[str, torch.Tensor] | dict[str, torch.Size], expected: dict[str, torch.Size], what: str,
                    shaped: bool = False) -> str | None:
    """Why `got` is not exactly the named tensors of `expected` (None when it is); `shaped`: `got` maps
    names to shapes, not tensors."""
    if set(got) != set(expected):
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        return f"{what}: tensor names differ: missing {missing[:3]}, unexpected {extra[:3]}"
    for n, t in got.items():
        shape = t if shaped else t.shape
        if shape != expected[n]:
            return f"{what}: tensor {n!r} has shape {tuple(shape)}, expected {tuple(expected[n])}"
    return None
