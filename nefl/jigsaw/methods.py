"""The methods of the FedJigsaw simulator (`aggregator jigsaw`): FedJigsaw, its ablations and its baselines.

A method is a set of switches on the same machinery, so the simulator asks what a method does, never which
method it is. Names are unique across the kit's commands: `aggregator simulate --method heterofl` is the
NeFL paper's HeteroFL preset on a ResNet ladder (nefl.nested.methods); the FedJigsaw paper's partial-training
baselines on the FedJigsaw base architectures are `pt-heterofl` and `pt-fedrolex` here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from nefl.nested.profile import METHOD_NAMES as NEFL_METHOD_NAMES

Family = Literal["modules", "widths"]
Fixed = Literal["base", "shared", "shared-body", "random"]


@dataclass(frozen=True)
class JigsawMethod:
    name: str
    title: str
    family: Family  # modules: clients train chains of modules (FedJigsaw, ablations, local only); widths: PT baselines
    summary: str
    share: bool = False  # SymbioArchitect: neighbours' modules are candidates, trained copies go back to their source
    assemble: bool = False  # AttenAssemble chooses the chain (policy phase, then execution); else the base model, fixed
    coretune: bool = False  # the server's critic and Exp during the policy phase
    rolling: bool = False  # widths: FedRolex's window rolling by one index per round (else HeteroFL's prefix)
    fixed: Fixed = "base"  # modules without a policy: the chain every round (own base model, one shared, random)


METHODS: dict[str, JigsawMethod] = {m.name: m for m in (
    JigsawMethod("fedjigsaw", "FedJigsaw", "modules", "assembles from its own and its neighbours' modules; "
                 "policy phase with CoRe-Tune, then stable execution", share=True, assemble=True, coretune=True),
    JigsawMethod("no-coretune", "W/O CoRe-Tune", "modules", "FedJigsaw without the server's critic and Exp",
                 share=True, assemble=True),
    JigsawMethod("no-symbio", "W/O SymbioArchitect", "modules", "FedJigsaw over the client's own modules only "
                 "(no sharing), with CoRe-Tune", assemble=True, coretune=True),
    JigsawMethod("local-only", "Local only", "modules", "each client trains its own base model alone"),
    JigsawMethod("shared-chain", "One shared chain", "modules", "every client trains the same chain, head included: the "
                 "smallest base model in the federation, from its first owner (Eq. 2 averages all copies)",
                 share=True, fixed="shared"),
    JigsawMethod("shared-body", "One shared body, own heads", "modules", "every client trains shared-chain's blocks "
                 "under its own head (a personal head on a shared body)", share=True, fixed="shared-body"),
    JigsawMethod("random-chain", "Random fixed chain", "modules", "each client draws one valid chain (head included) "
                 "uniformly from its own and its neighbours' modules and keeps it", share=True, fixed="random"),
    JigsawMethod("pt-heterofl", "HeteroFL (PT)", "widths", "width prefix of the largest base architecture, "
                 "widest level that fits the budget"),
    JigsawMethod("pt-fedrolex", "FedRolex (PT)", "widths", "as pt-heterofl with the window rolling by one index "
                 "per round", rolling=True),
)}
assert not set(METHODS) & set(NEFL_METHOD_NAMES), "a method name must mean one algorithm across the kit's commands"


def get_method(name: str) -> JigsawMethod:
    """The method, or a ValueError naming the fix (a NeFL preset's name points at its command)."""
    if name in METHODS:
        return METHODS[name]
    hint = (f" ({name!r} is a NeFL preset of `aggregator simulate`; here the partial-training baselines are "
            "pt-heterofl and pt-fedrolex)") if name in NEFL_METHOD_NAMES else ""
    raise ValueError(f"unknown method {name!r}: use one of {', '.join(METHODS)}{hint}")
