"""FedJigsaw's module zoo: base architectures as data, modules with metadata, and the valid-action rule.

A module is a cohesive block (a conv block, a VGG stage, an FC layer, a head) described by the paper's
metadata <source, position, type, d_in, d_out>; its torch layers are rebuilt from the metadata alone, so
a client can instantiate a neighbour's module from the broadcast and fill in the fetched parameters.

Which modules a client may append next is decided here, not in the policy: a candidate is valid when its
d_in equals the current d_out AND some completion (more blocks, then a head) still fits both the block
limit and the client's memory budget. The cheapest completion is precomputed by dynamic programming over
the zoo (training memory is additive in parameters and activations), so an assembly can never dead-end
or overshoot its budget, whatever the policy picks.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Annotated

import msgspec
import torch
from torch import nn

from nefl.nested.cost import ACTIVATION_FACTOR, BYTES, FRAMEWORK_OVERHEAD, Cost
from nefl.nested.profile import PROFILES_DIR

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

BASES_DIR = PROFILES_DIR / "jigsaw"
Dims = tuple[int, int, int]  # (channels, height, width); a feature vector is (features, 1, 1)
TYPES = ("conv", "stage", "fc", "head")  # "stage" carries its conv count: "stage-2"
_TYPE = re.compile(r"^(conv|fc|head|stage-[1-9])$")
Dim = Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]


class ArchError(ValueError):
    """A base-architecture file that cannot describe a model; the message names the fix."""


class ModuleMeta(msgspec.Struct, frozen=True, kw_only=True):
    """The paper's 5-tuple: what a client broadcasts about one module (never its parameters)."""

    source: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]  # client index that owns the module's parameters
    position: Annotated[int, msgspec.Meta(ge=0, le=1024)]  # 0-based layer position in the source's base architecture
    type: Annotated[str, msgspec.Meta(pattern=_TYPE.pattern)]  # conv | stage-N | fc | head
    d_in: tuple[Dim, Dim, Dim]
    d_out: tuple[Dim, Dim, Dim]

    @property
    def key(self) -> str:
        """The module's name in the parameter store: unique per (source, position)."""
        return f"c{self.source}.m{self.position}"

    @property
    def kind(self) -> str:
        return self.type.split("-")[0]


@dataclass(frozen=True)
class BaseArch:
    """A client's base architecture: its modules (last one the head) in order."""

    name: str
    input: Dims
    classes: int
    layers: tuple[tuple[str, Dims, Dims], ...]  # (type, d_in, d_out)

    def metas(self, source: int) -> list[ModuleMeta]:
        return [ModuleMeta(source=source, position=p, type=t, d_in=a, d_out=b) for p, (t, a, b) in enumerate(self.layers)]

    @property
    def blocks(self) -> int:
        """Modules before the head."""
        return len(self.layers) - 1


def _pooled(d: Dims, pool: bool, width: int) -> Dims:
    return (width, d[1] // 2, d[2] // 2) if pool else (width, d[1], d[2])


def parse_base(text: str, origin: str = "<string>") -> BaseArch:
    """A base architecture from its TOML: `convs` (CNN blocks) or `stages` (VGG), then `fc` hidden layers."""
    try:
        raw = tomllib.loads(text)
        name, classes = str(raw["name"]), int(raw["classes"])
        d: Dims = tuple(int(v) for v in raw["input"])  # type: ignore[assignment]
        scale = float(raw.get("width_scale", 1.0))
        layers: list[tuple[str, Dims, Dims]] = []
        for block in raw.get("convs", []):
            out = _pooled(d, bool(block.get("pool", False)), max(1, round(block["width"] * scale)))
            layers.append(("conv", d, out))
            d = out
        for stage in raw.get("stages", []):
            out = _pooled(d, True, max(1, round(stage["width"] * scale)))
            layers.append((f"stage-{int(stage['convs'])}", d, out))
            d = out
        for width in raw.get("fc", []):
            out = (max(1, round(width * scale)), 1, 1)
            layers.append(("fc", d, out))
            d = out
        layers.append(("head", d, (classes, 1, 1)))
    except (tomllib.TOMLDecodeError, KeyError, TypeError, ValueError) as e:
        raise ArchError(f"{origin}: not a base architecture ({type(e).__name__}: {e}); see profiles/jigsaw/cnn-2.toml") from None
    if len(d) != 3 or min(d) < 1 or not layers[:-1] or any(min(o) < 1 for _, _, o in layers):
        raise ArchError(f"{origin}: every layer needs positive dims and at least one block before the head")
    return BaseArch(name, tuple(int(v) for v in raw["input"]), classes, tuple(layers))  # type: ignore[arg-type]


def list_bases() -> list[str]:
    return sorted(p.stem for p in BASES_DIR.glob("*.toml"))


def load_base(name_or_path: str) -> BaseArch:
    path = Path(name_or_path)
    if not path.is_file():
        path = BASES_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        raise ArchError(f"no base architecture {name_or_path!r}: use one of {', '.join(list_bases())} or a TOML path")
    return parse_base(path.read_text(), str(path))


# -- modules as torch layers ---------------------------------------------------------------------------

def _conv_bn_relu(cin: int, cout: int) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


def build_module(meta: ModuleMeta) -> nn.Sequential:
    """The torch layers of a module, from its metadata alone (pooling is implied by d_out's halved size)."""
    if not _TYPE.match(meta.type):
        raise ValueError(f"unknown module type {meta.type!r}: expected one of conv, stage-N, fc, head")
    (cin, h, _), (cout, ho, _) = meta.d_in, meta.d_out
    if meta.kind in ("fc", "head"):
        layers: list[nn.Module] = [nn.Flatten(), nn.Linear(math.prod(meta.d_in), cout)]
        return nn.Sequential(*layers, nn.ReLU(inplace=True)) if meta.kind == "fc" else nn.Sequential(*layers)
    convs = 1 if meta.kind == "conv" else int(meta.type.split("-")[1])
    layers = _conv_bn_relu(cin, cout)
    for _ in range(convs - 1):
        layers += _conv_bn_relu(cout, cout)
    if ho != h:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


def build_model(metas: Sequence[ModuleMeta]) -> nn.Sequential:
    """An assembled model: the modules in order, each a child named by position in the assembly."""
    check_chain(metas)
    return nn.Sequential(*(build_module(m) for m in metas))


def check_chain(metas: Sequence[ModuleMeta]) -> None:
    """Raise unless every module's d_in is its predecessor's d_out and the last one is a head."""
    if not metas or metas[-1].kind != "head":
        raise ValueError("an assembled model ends with a head")
    for a, b in zip(metas, metas[1:]):
        if a.d_out != b.d_in:
            raise ValueError(f"{a.key} outputs {a.d_out} but {b.key} expects {b.d_in}")


def module_cost(meta: ModuleMeta) -> Cost:
    """Parameters, MACs and counted activations (conv and BN outputs, FC outputs) per sample; the
    same conventions as nefl.nested.cost.submodel_cost, so the kit's peak-memory fit applies."""
    (cin, h, w), cout = meta.d_in, meta.d_out[0]
    if meta.kind in ("fc", "head"):
        fan_in = math.prod(meta.d_in)
        return Cost(fan_in * cout + cout, fan_in * cout, cout)
    convs = 1 if meta.kind == "conv" else int(meta.type.split("-")[1])
    params = macs = acts = 0
    for i in range(convs):
        a = cin if i == 0 else cout
        params += a * cout * 9 + 2 * cout
        macs += a * cout * 9 * h * w
        acts += 2 * cout * h * w
    return Cost(params, macs, acts)


def model_cost(metas: Sequence[ModuleMeta]) -> Cost:
    costs = [module_cost(m) for m in metas]
    return Cost(sum(c.params for c in costs), sum(c.macs for c in costs), sum(c.activations for c in costs))


def peak_bytes(metas: Sequence[ModuleMeta], input_dims: Dims, batch_size: int) -> int:
    """Training-memory estimate of an assembled model: the kit's formula (nefl.nested.cost.training_peak_bytes)
    summed module by module, each rounded up, so the budget checks of partial assemblies add up exactly."""
    return fixed_bytes(input_dims, batch_size) + sum(marginal_bytes(m, batch_size) for m in metas)


def marginal_bytes(meta: ModuleMeta, batch_size: int) -> int:
    """What one module adds to the peak estimate (the formula is linear in params and activations),
    rounded up, so a sum of marginals never undercounts `peak_bytes` of the same modules."""
    c = module_cost(meta)
    return math.ceil(c.params * 2 * BYTES + batch_size * c.activations * ACTIVATION_FACTOR * BYTES)


def fixed_bytes(input_dims: Dims, batch_size: int) -> int:
    """The part of the peak that does not depend on the modules: the framework and the input batch."""
    return FRAMEWORK_OVERHEAD + batch_size * math.prod(input_dims) * BYTES


# -- the valid-action rule -----------------------------------------------------------------------------

STOP = -1  # the action index of STOP in `valid_actions`' answer


def _finish_table(modules: Sequence[ModuleMeta], dims: set[Dims], batch_size: int, max_blocks: int,
                  excluded: frozenset[str] = frozenset()) -> tuple[dict[Dims, float], ...]:
    """`table[s][d]`: the fewest bytes that at most s more blocks (none of `excluded`) plus a head add after `d`."""
    blocks = [m for m in modules if m.kind != "head" and m.key not in excluded]
    heads = [m for m in modules if m.kind == "head"]
    best_head = {d: min((marginal_bytes(h, batch_size) for h in heads if h.d_in == d), default=math.inf) for d in dims}
    table = [best_head]
    for _ in range(max_blocks):
        prev = table[-1]
        table.append({d: min([prev[d]] + [marginal_bytes(m, batch_size) + prev[m.d_out] for m in blocks if m.d_in == d])
                      for d in dims})
    return tuple(table)


def common_chain(modules: Sequence[ModuleMeta], input_dims: Dims, batch_size: int) -> list[ModuleMeta]:
    """The one chain every client can train together: the smallest base model among the sources' (its modules in
    position order, head last; ties to the lowest source), which fits every budget that fits a base model."""
    bases: dict[int, list[ModuleMeta]] = {}
    for m in modules:
        bases.setdefault(m.source, []).append(m)
    source = min(bases, key=lambda s: (peak_bytes(bases[s], input_dims, batch_size), s))
    return sorted(bases[source], key=lambda m: (m.kind == "head", m.position))


@dataclass(frozen=True)
class Zoo:
    """The candidate modules one client sees (its own and its neighbours'), with the cheapest way to
    finish an assembly from each dims within a number of blocks: `finish[s][dims]` is the fewest bytes
    that s more blocks at most plus a head add (inf when no head can be reached).

    A module is placed at most once in a chain: Eq. 2 averages one trained copy per borrower, and a block
    repeated at several depths would be a weight-tied layer no base model has. The rule keeps every
    assembly completable: a cheapest completion never uses a module twice (a repeat closes a cycle of dims
    whose removal is cheaper), nor the block it completes (it starts at that block's output), so checking
    each candidate against the cheapest completion without the blocks already placed is exact."""

    modules: tuple[ModuleMeta, ...]
    input: Dims
    batch_size: int
    max_blocks: int
    finish: tuple[dict[Dims, float], ...]

    @classmethod
    def build(cls, modules: Sequence[ModuleMeta], input_dims: Dims, batch_size: int, max_blocks: int) -> "Zoo":
        return cls(tuple(modules), input_dims, batch_size, max_blocks,
                   _finish_table(modules, cls._dims(modules, input_dims), batch_size, max_blocks))

    @staticmethod
    def _dims(modules: Sequence[ModuleMeta], input_dims: Dims) -> set[Dims]:
        return {input_dims} | {m.d_in for m in modules} | {m.d_out for m in modules}

    @cached_property
    def common(self) -> tuple[ModuleMeta, ...]:
        """The federation's common chain as this zoo sees it (`common_chain`)."""
        return tuple(common_chain(self.modules, self.input, self.batch_size))

    def heads_for(self, dims: Dims) -> list[ModuleMeta]:
        """The heads that can close an assembly ending at `dims`, the client's own and its neighbours' alike
        (all cost the same: same dims, same parameters), in zoo order."""
        return [m for m in self.modules if m.kind == "head" and m.d_in == dims]

    def valid_actions(self, chosen: Sequence[ModuleMeta], budget: float) -> tuple[list[int], bool]:
        """Indices into `modules` of the blocks that may come next, and whether STOP may: not placed yet, d_in
        matches the current d_out, and a completion within `max_blocks` and `budget` bytes still exists."""
        current = chosen[-1].d_out if chosen else self.input
        used = fixed_bytes(self.input, self.batch_size) + sum(marginal_bytes(m, self.batch_size) for m in chosen)
        left = self.max_blocks - len(chosen)
        placed = frozenset(m.key for m in chosen)
        finish = _finish_table(self.modules, self._dims(self.modules, self.input), self.batch_size, self.max_blocks,
                               placed) if placed else self.finish

        def fits(need: float) -> bool:
            return not math.isinf(need) and need <= budget

        valid = [i for i, m in enumerate(self.modules)
                 if m.kind != "head" and m.key not in placed and m.d_in == current and left >= 1
                 and fits(used + marginal_bytes(m, self.batch_size) + finish[left - 1].get(m.d_out, math.inf))]
        stop = bool(chosen) and fits(used + finish[0].get(current, math.inf))
        return valid, stop

    def smallest_peak(self) -> float:
        """The least training memory any valid assembly needs (inf when none exists)."""
        return fixed_bytes(self.input, self.batch_size) + self.finish[self.max_blocks].get(self.input, math.inf)


def random_chain(zoo: Zoo, budget: float, generator: torch.Generator) -> list[ModuleMeta]:
    """A chain drawn uniformly step by step from the valid actions (blocks and STOP), then a uniform head:
    the random fixed-chain ablation."""
    chosen: list[ModuleMeta] = []
    while True:
        valid, stop = zoo.valid_actions(chosen, budget)
        a = int(torch.randint(len(valid) + stop, (1,), generator=generator))
        if a == len(valid):
            heads = zoo.heads_for(chosen[-1].d_out)
            return chosen + [heads[int(torch.randint(len(heads), (1,), generator=generator))]]
        chosen.append(zoo.modules[valid[a]])


def module_state_of(model: nn.Sequential, index: int) -> dict[str, torch.Tensor]:
    """The parameters and BN statistics of the `index`-th module of an assembled model, keyed as in
    a standalone `build_module` (so they can travel back to the module's source)."""
    return {k: v.detach().clone() for k, v in model[index].state_dict().items() if not k.endswith("num_batches_tracked")}


def base_for_budget(bases: Sequence[BaseArch], budget: float, batch_size: int) -> BaseArch:
    """The base architecture a device gets: the one with the largest training-peak estimate (the kit's cost
    model, as the device agent picks its NeFL submodel) that fits its memory budget."""
    ranked = sorted(bases, key=lambda b: peak_bytes(b.metas(0), b.input, batch_size))
    fitting = [b for b in ranked if peak_bytes(b.metas(0), b.input, batch_size) <= budget]
    if not fitting:
        need = peak_bytes(ranked[0].metas(0), ranked[0].input, batch_size)
        raise ValueError(f"no base architecture fits a budget of {budget / 2**20:.1f} MiB: the smallest, "
                         f"{ranked[0].name}, needs {need / 2**20:.1f} MiB")
    return fitting[-1]
