"""Building any family's submodels and supernet from a profile, and loading torchvision weights.

The architecture code lives in nefl/nested/families/ (one module per family); this module is the one
entry point the rest of the kit uses, so no caller needs to know which family a profile names.
The ResNet classes are re-exported for the callers (export folding, tests) that work on them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from nefl.nested.arch import AnyArch
from nefl.nested.families.base import load_torchvision_state as _load_torchvision_state
from nefl.nested.families.costs import full_steps as _full_steps
from nefl.nested.families.registry import family_of
from nefl.nested.families.resnet import Block, NestedResNet, Shortcut, Stem, torchvision_key  # noqa: F401 (re-exported)
from nefl.nested.profile import Profile, SubmodelSpec


def full_steps(arch: AnyArch) -> tuple[tuple[float, ...], ...]:
    return _full_steps(arch.depths)


def build_submodel(profile: Profile, sub: SubmodelSpec, learnable_steps: bool = True) -> nn.Module:
    return family_of(profile.arch).build(profile, sub, learnable_steps)


def full_spec(profile: Profile) -> SubmodelSpec:
    """Full width, every block present."""
    return SubmodelSpec(-1, 1.0, 1.0, full_steps(profile.arch))


def build_supernet(profile: Profile) -> nn.Module:
    """Full width, every block present: holds every consistent tensor at full size."""
    return build_submodel(profile, full_spec(profile))


def load_torchvision_state(model: nn.Module, tv_state: dict[str, torch.Tensor]) -> None:
    """Load a torchvision state dict (resnet18/34/50, wide_resnet101_2, vit_*, mobilenet_v2) into a
    full model of ours; a classifier or first layer that does not fit stays fresh, anything else
    that does not match raises a ValueError naming the first offending key."""
    _load_torchvision_state(family_of(model.arch), model, tv_state)


def read_state_file(path: str | Path) -> dict[str, torch.Tensor]:
    """A torchvision state dict from a .pth/.pt file (loaded with weights_only=True: no pickled code
    runs) or a .safetensors file; a clear ValueError for anything else."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--init-from {p}: no such file")
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(p))
        except Exception as e:  # safetensors raises its own error types for a malformed header
            raise ValueError(f"--init-from {p}: not a readable safetensors file ({e})") from None
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle/zip errors: say what the file should be
        raise ValueError(f"--init-from {p}: not a torch state dict loadable with weights_only=True ({e})") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"--init-from {p}: expected a state dict (name -> tensor), e.g. torchvision's "
                         "model.state_dict() saved with torch.save")
    return state


def pretrained_supernet_state(profile: Profile, tv_state: dict[str, torch.Tensor], seed: int = 0) -> dict[str, torch.Tensor]:
    """The profile's supernet with torchvision weights loaded onto it; what stays fresh (a classifier
    for other classes) is initialised from `seed`, as a fresh federation would be."""
    torch.manual_seed(seed)
    model = build_supernet(profile)
    load_torchvision_state(model, tv_state)
    return {k: v for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}
