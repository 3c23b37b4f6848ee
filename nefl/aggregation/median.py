"""The coordinate-wise median over the updates covering each element (nefl/aggregation/buffered.py)."""

from __future__ import annotations

import torch

from nefl.aggregation.buffered import CoordinateWise


def coordinate_median(stack: torch.Tensor) -> torch.Tensor:
    """Element-wise median over dim 0, the mean of the two middle values for an even count."""
    s = stack.sort(dim=0).values
    n = s.shape[0]
    return (s[(n - 1) // 2] + s[n // 2]) / 2


class Median(CoordinateWise):
    name = "median"

    def _stat(self, stack: torch.Tensor) -> torch.Tensor:
        return coordinate_median(stack)
