"""The coordinate-wise trimmed mean over the updates covering each element (nefl/aggregation/buffered.py)."""

from __future__ import annotations

import torch

from nefl.aggregation.buffered import CoordinateWise


def trimmed_mean(stack: torch.Tensor, trim: float) -> torch.Tensor:
    """Element-wise mean over dim 0 after cutting floor(trim * n) values at each end."""
    n = stack.shape[0]
    cut = min(int(trim * n), (n - 1) // 2)
    return stack.sort(dim=0).values[cut:n - cut].mean(0)


class TrimmedMean(CoordinateWise):
    name = "trimmed-mean"

    def _stat(self, stack: torch.Tensor) -> torch.Tensor:
        return trimmed_mean(stack, self.cfg.trim)
