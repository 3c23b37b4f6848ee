"""What an update must be to reach any rule: exactly submodel k's upload (names, shapes, floating dtype), its values
finite. Judged once where an update comes in (aggregator/federation.py's `accept`, under aggregator/intake.py; the
version buffer's `offer`), so a rule's `add_validated` takes it as given."""

from __future__ import annotations

import torch

from nefl.nested.state import Layout, tensor_mismatch
from nefl.nested.tensors import Tiled, first_non_finite


class UpdateError(ValueError):
    """An update that does not fit its submodel (names, shapes, dtype or values)."""


def check_update(layout: Layout, k: int, delta: dict[str, torch.Tensor], *, values: bool = True) -> None:
    """Raise UpdateError unless `delta` is exactly submodel k's upload under `layout`. values=False skips the value
    scan, for tensors whose values were already proven finite (the wire decoder checks every payload it decodes)."""
    if not 0 <= k < layout.num_submodels:
        raise UpdateError(f"submodel index {k} out of range 0..{layout.num_submodels - 1}")
    if isinstance(delta, Tiled):  # off the wire: float32 views, their layout judged once per header
        problem = layout.tiling_mismatch(k, delta.tiling)
        if problem:
            raise UpdateError(problem)
        return
    problem = tensor_mismatch(delta, layout.upload_shapes(k), f"submodel {k + 1}")
    if problem:
        raise UpdateError(problem)
    for n, t in delta.items():
        if not t.is_floating_point():
            raise UpdateError(f"{n}: dtype {t.dtype} is not floating point")
    bad = first_non_finite(delta) if values else None
    if bad is not None:
        raise UpdateError(f"{bad}: non-finite values")
