"""The interface every architecture family implements, and the pieces all families share.

A family turns a profile entry into a physically smaller module, says which of its tensors are
normalisation layers (kept per submodel when the method says so), and maps torchvision's state dict
onto its own names; its cost function (parameters, MACs, activations from the spec alone) lives in
nefl/nested/families/costs.py, which needs no torch. Conventions every family keeps, because slicing
and NeFedAvg rely on them:

- parameter names are the same in every submodel and in the supernet, and every submodel tensor is
  the leading corner of its supernet tensor, varying only along its first two dimensions;
- block b of stage s lives at `stages.{s}.{b}`; a present block owns a parameter named `step`
  (a scalar, or one entry per residual of the block), initialised to the profile's step size;
- a skipped block has no parameters of its own (except what keeps shapes aligned, e.g. a shortcut).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from nefl.nested.profile import Profile, SubmodelSpec


# (torchvision key, our key, tensor): one torchvision tensor may become several of ours (a packed q/k/v)
Mapped = Iterator[tuple[str, str, torch.Tensor]]


class Family(Protocol):
    name: str

    def build(self, profile: "Profile", sub: "SubmodelSpec", learnable_steps: bool = True) -> nn.Module:
        """Submodel `sub` as a physically smaller module (sub at full width and depth: the supernet)."""

    def norm_tensors(self, supernet: nn.Module, profile: "Profile") -> set[str]:
        """Normalisation tensors that are per submodel (inconsistent) under a per-submodel norm method."""

    def from_torchvision(self, arch: Any, tv_state: dict[str, torch.Tensor]) -> Mapped:
        """torchvision's state dict under our names; raises ValueError naming a key with no counterpart."""

    def keeps_fresh(self, name: str) -> bool:
        """Whether our tensor may stay at its fresh initialisation when the pretrained one does not fit
        (a classifier for other classes, a first layer for other input channels)."""

    def adapt(self, name: str, value: torch.Tensor, shape: torch.Size) -> torch.Tensor | None:
        """A pretrained tensor reshaped to ours where that is meaningful (e.g. position embeddings
        for another image size); None when it is not (a mismatch)."""


def step_parameter(step: float, learnable: bool, count: int = 1) -> nn.Parameter:
    """A block's step size(s): a scalar for one residual, a vector for several (a ViT block's two)."""
    value = torch.tensor(float(step)) if count == 1 else torch.full((count,), float(step))
    return nn.Parameter(value, requires_grad=learnable)


def norm_names(model: nn.Module, kinds: tuple[type[nn.Module], ...]) -> set[str]:
    """Every tensor (affine and running statistics) of the model's normalisation layers of these kinds."""
    names = set()
    for prefix, m in model.named_modules():
        if isinstance(m, kinds):
            names.update(f"{prefix}.{n}" for n, _ in m.named_parameters(recurse=False))
            names.update(f"{prefix}.{n}" for n, b in m.named_buffers(recurse=False)
                         if b is not None and n != "num_batches_tracked")
    return names


def load_torchvision_state(family: Family, model: nn.Module, tv_state: dict[str, torch.Tensor]) -> None:
    """Load a torchvision state dict into a full-size model of ours, checking every name and shape.

    Tensors the family `keeps_fresh` (classifier, first layer) stay at their initialisation when
    their shape differs (the usual fine-tuning setup); any other mismatch raises a ValueError that
    names the first offending key.
    """
    own = model.state_dict()
    mapped: dict[str, torch.Tensor] = {}
    for k, ours, v in family.from_torchvision(model.arch, tv_state):
        if ours not in own:
            raise ValueError(f"torchvision key {k!r} has no counterpart in {model.arch.name}")
        if own[ours].shape != v.shape:
            if family.keeps_fresh(ours):
                continue
            adapted = family.adapt(ours, v, own[ours].shape)
            if adapted is None:
                raise ValueError(f"shape mismatch for {k!r}: torchvision {tuple(v.shape)} vs ours {tuple(own[ours].shape)}")
            v = adapted
        mapped[ours] = v
    missing = [k for k in own if k not in mapped and not k.endswith((".step", "num_batches_tracked"))
               and not family.keeps_fresh(k)]
    if missing:
        raise ValueError(f"torchvision state lacks {missing[:3]}... for {model.arch.name}")
    model.load_state_dict(mapped, strict=False)
