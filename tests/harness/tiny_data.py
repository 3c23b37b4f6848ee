"""A tiny learnable data set for training and evaluation tests."""

from __future__ import annotations

from dataclasses import replace

import torch

from nefl.nested.data import ArrayDataset, get_dataset_info


def blobs(n: int = 256) -> ArrayDataset:
    """Two classes that differ in brightness: learnable in a few steps."""
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 2, (n,), generator=g)
    images = (torch.rand(n, 1, 8, 8, generator=g) * 100 + labels.view(-1, 1, 1, 1) * 150).to(torch.uint8)
    return ArrayDataset(images, labels, replace(get_dataset_info("mnist"), shape=(1, 8, 8)))
