"""Global federation state and the slicing between it and submodels.

Global state = consistent tensors at full size (shared by every submodel as prefix slices) plus
inconsistent tensors kept per submodel (step sizes, and BatchNorm unless the method shares BN; a ViT's
LayerNorm only when its profile asks for per-submodel LayerNorm).
Every submodel tensor is the leading corner [:d0, :d1, ...] of its global tensor: widths are
prefixes and depth only removes whole tensors, so one shape per name says everything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from nefl.nested.families.registry import family_of
from nefl.nested.methods import Method, apply_method, get_method
from nefl.nested.models import build_submodel, build_supernet, pretrained_supernet_state, read_state_file
from nefl.nested.profile import Profile
from nefl.nested.tensors import Tiling, all_finite, corner, tensor_mismatch  # noqa: F401 (re-exported)

BN_STATS = ("running_mean", "running_var")


def module_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """state_dict without num_batches_tracked (a counter, not a weight: never federated)."""
    return {k: v for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}


def load_module_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("num_batches_tracked")]
    if missing or result.unexpected_keys:
        raise ValueError(f"state does not fit the module: missing {missing[:4]}, unexpected {result.unexpected_keys[:4]}")


@dataclass
class Layout:
    """Which tensors each submodel has, their shapes, and which are consistent."""

    profile: Profile  # the ladder actually trained (after the method's derivation)
    method: Method
    global_shapes: dict[str, torch.Size]
    sub_shapes: list[dict[str, torch.Size]]
    inconsistent: frozenset[str]  # names kept per submodel
    local: frozenset[str]  # names never uploaded (static-BN statistics)
    _key_sets: list[frozenset[str]] = field(default_factory=list, repr=False)
    # (submodel, Tiling) -> why tensors tiled that way are not its upload (None: they are); see `tiling_mismatch`
    _tilings: dict[tuple[int, Tiling], str | None] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, profile: Profile, method: Method | str | None = None) -> "Layout":
        method = get_method(method or profile.method) if not isinstance(method, Method) else method
        ladder = apply_method(profile, method)
        with torch.device("meta"):
            supernet = build_supernet(ladder)
            subs = [build_submodel(ladder, s, method.learnable_steps) for s in ladder.submodels]
        bn = family_of(ladder.arch).norm_tensors(supernet, ladder)
        steps = {k for k in module_state(supernet) if k.endswith(".step")}
        stats = {k for k in bn if k.rsplit(".", 1)[1] in BN_STATS}
        inconsistent = steps | (stats if method.static_bn else bn)
        return cls(
            ladder, method,
            {k: v.shape for k, v in module_state(supernet).items()},
            [{k: v.shape for k, v in module_state(m).items()} for m in subs],
            frozenset(inconsistent),
            frozenset(stats if method.static_bn else ()),
        )

    @property
    def num_submodels(self) -> int:
        return len(self.sub_shapes)

    @property
    def stats(self) -> frozenset[str]:
        """The running statistics devices upload (batch norm's, per submodel); a static-BN method uploads none."""
        return frozenset(n for n in self.inconsistent - self.local if n.rsplit(".", 1)[-1] in BN_STATS)

    def upload_shapes(self, k: int) -> dict[str, torch.Size]:
        """Tensors a client training submodel k sends back: everything it trained."""
        return {n: s for n, s in self.sub_shapes[k].items() if n not in self.local}

    def tiling_mismatch(self, k: int, tiling: Tiling) -> str | None:
        """`tensor_mismatch` of an update decoded off the wire against submodel k's upload, worked out
        once per distinct tiling (the decoder hands every update with the same header the same Tiling)."""
        key = (k, tiling)
        if key not in self._tilings:
            if len(self._tilings) >= 256:  # distinct layouts are few; a sender inventing them only evicts
                self._tilings.clear()
            self._tilings[key] = tiling.mismatch(self.upload_shapes(k), f"submodel {k + 1}")
        return self._tilings[key]

    def module(self, k: int) -> nn.Module:
        """A fresh, physically sliced module for submodel k."""
        return build_submodel(self.profile, self.profile.submodels[k], self.method.learnable_steps)


@dataclass
class GlobalState:
    consistent: dict[str, torch.Tensor]
    inconsistent: list[dict[str, torch.Tensor]]

    @classmethod
    def init(cls, layout: Layout, seed: int = 0, supernet_state: dict[str, torch.Tensor] | None = None) -> "GlobalState":
        """Fresh (seeded) or pretrained global state; per-submodel BN starts as the slice of the global BN."""
        if supernet_state is None:
            torch.manual_seed(seed)
            supernet_state = module_state(build_supernet(layout.profile))
        consistent = {n: t.clone() for n, t in supernet_state.items() if n not in layout.inconsistent}
        inconsistent = []
        for k, shapes in enumerate(layout.sub_shapes):
            spec = layout.profile.submodels[k]
            own = {}
            for n, shape in shapes.items():
                if n not in layout.inconsistent:
                    continue
                if n.endswith(".step"):
                    si, bi = (int(x) for x in n.split(".")[1:3])
                    own[n] = torch.full(shape, spec.steps[si][bi])  # a scalar, or one per residual of the block
                else:
                    own[n] = supernet_state[n][corner(shape)].clone()
            inconsistent.append(own)
        return cls(consistent, inconsistent)

    @classmethod
    def pretrained(cls, layout: Layout, path: str | Path, seed: int = 0) -> "GlobalState":
        """The global state initialised from a torchvision state dict file (`--init-from`): mapped onto
        the supernet and checked; a ValueError names the first key that does not fit."""
        try:
            supernet = pretrained_supernet_state(layout.profile, read_state_file(path), seed)
        except ValueError as e:
            raise ValueError(f"--init-from {path}: {e}" if not str(e).startswith("--init-from") else str(e)) from None
        return cls.init(layout, seed, supernet_state=supernet)

    def extract(self, layout: Layout, k: int) -> dict[str, torch.Tensor]:
        """Submodel k's complete weights (copies): consistent slices plus its own tensors."""
        return {n: t.clone() for n, t in self.slices(layout, k).items()}

    def slices(self, layout: Layout, k: int) -> dict[str, torch.Tensor]:
        """Submodel k's weights as views of this state: for what only reads them (the server encodes each
        submodel once a round; extract's copies cost it half of that)."""
        own = self.inconsistent[k]
        return {n: own[n] if n in layout.inconsistent else self.consistent[n][corner(shape)]
                for n, shape in layout.sub_shapes[k].items()}

    def clone(self) -> "GlobalState":
        return GlobalState(
            {n: t.clone() for n, t in self.consistent.items()},
            [{n: t.clone() for n, t in d.items()} for d in self.inconsistent],
        )

    def flat(self) -> dict[str, torch.Tensor]:
        """One flat name -> tensor map (for safetensors files)."""
        out = {f"c/{n}": t for n, t in self.consistent.items()}
        for k, d in enumerate(self.inconsistent):
            out.update({f"ic/{k}/{n}": t for n, t in d.items()})
        return out

    @classmethod
    def from_flat(cls, flat: dict[str, torch.Tensor], layout: Layout) -> "GlobalState":
        """Inverse of flat(); checks every name and shape against the layout."""
        consistent = {n[2:]: t for n, t in flat.items() if n.startswith("c/")}
        inconsistent: list[dict[str, torch.Tensor]] = [{} for _ in range(layout.num_submodels)]
        for n, t in flat.items():
            if n.startswith("ic/"):
                _, k, name = n.split("/", 2)
                if not k.isdigit() or int(k) >= layout.num_submodels:
                    raise ValueError(f"tensor {n!r} names a submodel the profile does not have")
                inconsistent[int(k)][name] = t
        expected_c = {n: s for n, s in layout.global_shapes.items() if n not in layout.inconsistent}
        _check_shapes(consistent, expected_c, "consistent")
        for k, d in enumerate(inconsistent):
            expected = {n: s for n, s in layout.sub_shapes[k].items() if n in layout.inconsistent}
            _check_shapes(d, expected, f"submodel {k + 1}")
        return cls(consistent, inconsistent)


def _check_shapes(got: dict[str, torch.Tensor], expected: dict[str, torch.Size], what: str) -> None:
    problem = tensor_mismatch(got, expected, what)
    if problem:
        raise ValueError(problem)
