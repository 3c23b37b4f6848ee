"""A federation's aggregation, composed in one place from its Robustness: everything between an update that
passed intake and a committed state, in the order it acts.

1. the update bound (`guard`: norm bound, fixed, relative or adaptive; clip or reject), per update at intake;
2. the centre check in front of the rule the config names in nefl/aggregation/registry.py, with every tensor of an
   update judged by its size against the round's and its history's (`begin_round`);
3. at commit: DP noise on the sums (Mergeable rules), finalize, the step bound on every tensor (with the centre
   check), the state check (finite, within max_weight_abs), and the tensor sizes' history (`commit`).

`serve`, its workers and coordinator, and `simulate` all hold one through aggregator/federation.py.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from nefl.aggregation.aggregate import ReferenceUpdate, RoundAggregate, RoundContext, Weighting
from nefl.aggregation.centre_check import Screened, screened
from nefl.aggregation.config import AggregationConfig
from nefl.aggregation.gate import Gate
from nefl.aggregation.nefedavg import as_mergeable
from nefl.aggregation.robust import NormBound, UpdateGuard, check_state, reference_norm
from nefl.aggregation.step_bound import StepBound
from nefl.aggregation.tensor_screen import SizeHistory
from nefl.nested.state import GlobalState, Layout
from nefl.support.settings import DEFAULT_MAX_ABS


@dataclass(frozen=True)
class Robustness:
    """What an update and a new global state must satisfy to count, and the rule that merges the
    round's updates (docs/security.md)."""

    bound: NormBound = NormBound()
    max_weight_abs: float = DEFAULT_MAX_ABS  # a committed state never holds |w| above this
    dp_noise_multiplier: float = 0.0  # DP-FedAvg: noise std = multiplier x the clip norm (bound.max_norm)
    dp_seed: int | None = None  # None: fresh OS randomness (what DP needs); a seed only for tests
    aggregation: AggregationConfig = AggregationConfig()

    def __post_init__(self) -> None:
        if self.dp_noise_multiplier > 0 and (self.bound.mode != "clip" or self.bound.max_norm is None):
            raise ValueError("DP noise needs every update clipped: give --max-update-norm and --clip")
        if self.dp_noise_multiplier > 0 and (not self.aggregation.mergeable or self.aggregation.centre_check):
            raise ValueError("DP noise is calibrated to plain NeFedAvg: a robust rule or the centre check drops or "
                             "rescales updates by what other clients sent; use --aggregator nefedavg --no-centre-check")


@dataclass(frozen=True)
class Commit:
    """What `Pipeline.commit` made of a round's aggregate."""

    state: GlobalState | None  # the new global state; None: not committed, the old one stays
    problem: str | None  # why not
    bounded: dict[int, int]  # submodel -> its tensors the step bound scaled down


class Pipeline:
    """A federation's aggregation (see the module docstring). `reference`: the server's root updates, for a rule
    whose registry entry needs root data. The rule's and the centre check's draws (the sketch's positions) come
    from `secret` mixed with the round where one is given (a server: positions nobody can compute in advance,
    docs/security.md), else from `seed` (the simulator: reproducible)."""

    def __init__(self, layout: Layout, robustness: Robustness = Robustness(), weighting: Weighting = "uniform",
                 reference: ReferenceUpdate | None = None, seed: int = 0, secret: bytes | None = None,
                 gate: Gate | None = None) -> None:
        cfg = robustness.aggregation
        if cfg.spec.root_data and reference is None:
            raise ValueError(f"--aggregator {cfg.rule} needs root data on the server: give --root-data DATASET "
                             "(or --eval-dataset, whose test split it uses by default)")
        self.layout, self.robustness, self.cfg, self.weighting = layout, robustness, cfg, weighting
        self.reference, self.seed, self.secret = reference, seed, secret
        self.gate, self.commits = gate, 0  # the held-out gate (nefl/aggregation/gate.py), last at commit
        self.guard = UpdateGuard(robustness.bound, layout.num_submodels)
        self.steps = StepBound(layout, cfg) if cfg.centre_check else None
        self.sizes = SizeHistory(sorted(set(layout.global_shapes) - layout.inconsistent - layout.local),
                                                 frozenset(layout.inconsistent), cfg) if cfg.centre_check else None
        self.noise = torch.Generator()
        if robustness.dp_seed is None:
            self.noise.seed()
        else:
            self.noise.manual_seed(robustness.dp_seed)

    @property
    def name(self) -> str:
        return self.cfg.rule

    @property
    def mergeable(self) -> bool:
        """Whether the round's aggregates are Mergeable (partials of workers and relays merge into them)."""
        return self.cfg.mergeable

    def begin_round(self, state: GlobalState, assignments: Mapping[str, int], index: int = 0,
                    weight_norm: Callable[[int], float] | None = None) -> RoundAggregate:
        """A fresh aggregate for round `index`, which starts from `state` with these (client -> submodel) tasks;
        `weight_norm(k)`: the norm of submodel k's weights (a worker holds no weights, its plan has them)."""
        seed = self.round_seed(index)
        inner = self.cfg.spec.load().begin(RoundContext(self.layout, self.cfg, self.weighting, index, seed, self.reference))
        if not self.cfg.centre_check:
            return inner
        weight_norm = weight_norm or functools.cache(lambda k: reference_norm(state, self.layout, k))  # once a round
        return screened(inner, self.cfg, weight_norm, assignments, seed, self.sizes.begin())

    def round_seed(self, index: int) -> int:
        """Round `index`'s draws: keyed BLAKE2b of the round under the secret (63 bits), else from the seed."""
        if self.secret is None:
            return self.seed * 1_000_003 + index
        digest = hashlib.blake2b(index.to_bytes(8, "big"), key=self.secret, digest_size=8).digest()
        return int.from_bytes(digest, "big") >> 1

    def commit(self, agg: RoundAggregate, state: GlobalState) -> Commit:
        """The round's new state from `agg` (begun from `state`, which is not modified), unless it is not finite
        and bounded; the step bound's history moves on only with a committed state."""
        rb = self.robustness
        if rb.dp_noise_multiplier > 0:
            as_mergeable(agg).add_noise(rb.dp_noise_multiplier * rb.bound.max_norm, self.noise)
        candidate = agg.finalize(state)
        bounded = self.steps.apply(state, candidate, agg.updates) if self.steps is not None else {}
        problem = check_state(candidate, rb.max_weight_abs)
        self.commits += 1
        if problem is None and self.gate is not None:  # last: judge the finished candidate on held-out images
            verdict = self.gate.judge(candidate, state, range(self.layout.num_submodels), self.round_seed((1 << 40) + self.commits))
            if verdict.tripped:
                problem = "gate: " + ", ".join(f"submodel {k} loss +{d:.3f}" for k, d in sorted(verdict.tripped.items()))
            else:
                self.gate.committed(candidate)
        if problem is None and self.steps is not None:
            self.steps.commit()
            if isinstance(agg, Screened):
                self.sizes.commit(agg.sizes)
        return Commit(candidate if problem is None else None, problem, bounded)
