"""A federation's aggregation, composed in one place from its Robustness: everything between an update that
passed intake and a committed state, in the order it acts.

1. the update bound (`guard`: norm bound, fixed, relative or adaptive; clip or reject), per update at intake;
2. the centre check in front of the rule the config names in nefl/aggregation/registry.py, with every tensor of an
   update judged by its size against the round's and its history's (`begin_round`);
3. at commit: DP noise on the sums (Mergeable rules), finalize, the step bound on every tensor (with the centre
   check), the server's own running statistics (`statistics`, where it holds data: they replace the devices') and
   its choice of the classifier's rows on the same images, the state check (finite, within max_weight_abs), and the
   tensor sizes' history (`commit`).

`serve`, its workers and coordinator, and `simulate` all hold one through aggregator/federation.py.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from nefl.aggregation.aggregate import ReferenceUpdate, RoundAggregate, RoundContext, Weighting
from nefl.aggregation.centre_check import Screened, screened
from nefl.aggregation.config import AggregationConfig
from nefl.aggregation.coordinate import Copies, choose_rows
from nefl.aggregation.attribution import Recorded, leave_out, without
from nefl.aggregation.gate import Baseline, Gate, Verdict, pooled
from nefl.aggregation.nefedavg import as_mergeable
from nefl.aggregation.robust import NormBound, UpdateGuard, check_state, reference_norm
from nefl.aggregation.step_bound import StepBound
from nefl.aggregation.tensor_screen import SizeHistory
from nefl.nested.state import GlobalState, Layout
from nefl.support.settings import DEFAULT_MAX_ABS


class Statistics(Protocol):
    """The server's own images at commit (aggregator/statsdata.py): every submodel fine-tuned on them in a candidate
    state, and its batch-norm running statistics recomputed there, in place; and the classifier's inputs there, for its
    rows' choice."""

    head: tuple[str, str] | None  # the classifier's (weight, bias) names; None: no row choice

    def __call__(self, state: GlobalState) -> None: ...

    def finetune(self, state: GlobalState, lr: float, epochs: int) -> dict[str, torch.Tensor]: ...

    def features(self, state: GlobalState) -> tuple[list[torch.Tensor], torch.Tensor]: ...


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
    docs/security.md), else from `seed` (the simulator: reproducible). `statistics`: the server's running statistics
    (AggregationConfig.server_stats), which then replace the devices' in every candidate (the step bound leaves them
    out), and whose images fine-tune every candidate (AggregationConfig.finetune_epochs) and choose the classifier's
    rows (AggregationConfig.classifier_rows)."""

    def __init__(self, layout: Layout, robustness: Robustness = Robustness(), weighting: Weighting = "uniform",
                 reference: ReferenceUpdate | None = None, seed: int = 0, secret: bytes | None = None,
                 gate: Gate | None = None, statistics: Statistics | None = None) -> None:
        cfg = robustness.aggregation
        if cfg.spec.root_data and reference is None:
            raise ValueError(f"--aggregator {cfg.rule} needs root data on the server: give --root-data DATASET "
                             "(or --eval-dataset, whose test split it uses by default)")
        self.layout, self.robustness, self.cfg, self.weighting = layout, robustness, cfg, weighting
        self.reference, self.seed, self.secret = reference, seed, secret
        self.gate = gate  # the held-out gate (nefl/aggregation/gate.py), last at commit
        self.statistics = statistics
        # the server's own step (its fine-tuning) of the last commit, which the next round's vote may not drop an update
        # along (AggregationConfig.server_veto); `_stepped`: each finished candidate's, until one commits
        self.server_step: dict[str, torch.Tensor] | None = None
        self._stepped: dict[int, dict[str, torch.Tensor]] = {}
        self.guard = UpdateGuard(robustness.bound, layout.num_submodels)
        server_held = layout.stats if statistics is not None else frozenset()
        self.steps = StepBound(layout, cfg, server_held) if cfg.centre_check else None
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
        `weight_norm(k)`: the norm of submodel k's weights (a worker holds no weights, its plan has them). With the
        gate, the aggregate also keeps the round's updates, so that a tripped round can leave some out."""
        agg = self._begin(state, assignments, index, weight_norm)
        if self.gate is None:
            return agg
        return Recorded(agg, self.cfg.gate_attribute, index, weight_norm)

    def _begin(self, state: GlobalState, assignments: Mapping[str, int], index: int,
               weight_norm: Callable[[int], float] | None) -> RoundAggregate:
        seed = self.round_seed(index)
        inner = self.cfg.spec.load().begin(RoundContext(self.layout, self.cfg, self.weighting, index, seed, self.reference))
        if not self.cfg.centre_check:
            return inner
        weight_norm = weight_norm or functools.cache(lambda k: reference_norm(state, self.layout, k))  # once a round
        return screened(inner, self.cfg, weight_norm, assignments, seed, self.sizes.begin(), self.server_step)

    def round_seed(self, index: int) -> int:
        """Round `index`'s draws: keyed BLAKE2b of the round under the secret (63 bits), else from the seed."""
        if self.secret is None:
            return self.seed * 1_000_003 + index
        digest = hashlib.blake2b(index.to_bytes(8, "big"), key=self.secret, digest_size=8).digest()
        return int.from_bytes(digest, "big") >> 1

    def commit(self, agg: RoundAggregate, state: GlobalState) -> Commit:
        """The round's new state from `agg` (begun from `state`, which is not modified), unless it is not finite
        and bounded or the gate refuses it and every round without a few of its updates; the step bound's history
        moves on only with a committed state."""
        rb = self.robustness
        if rb.dp_noise_multiplier > 0:
            as_mergeable(agg).add_noise(rb.dp_noise_multiplier * rb.bound.max_norm, self.noise)
        chosen: RoundAggregate | None = agg.inner if isinstance(agg, Recorded) else agg
        candidate, bounded, problem = self._finish(chosen, state)
        if problem is None and self.gate is not None:  # last: judge the finished candidate on held-out images
            chosen, candidate, bounded, problem = self._gate(agg, chosen, state, candidate, bounded)
        if problem is None and self.steps is not None:
            self.steps.commit()
            if isinstance(chosen, Screened):
                self.sizes.commit(chosen.sizes)
        if problem is None and self.cfg.server_veto:
            self.server_step = self._stepped.get(id(candidate))
        self._stepped.clear()
        return Commit(candidate if problem is None else None, problem, bounded)

    def _finish(self, agg: RoundAggregate, state: GlobalState) -> tuple[GlobalState, dict[int, int], str | None]:
        """The aggregate's candidate state, the step bound applied, fine-tuned on the server's images and their running
        statistics in place of the devices', and why it cannot commit (None: it can)."""
        candidate = agg.finalize(state)
        bounded = self.steps.apply(state, candidate, agg.updates) if self.steps is not None else {}
        if self.statistics is not None:
            if self.cfg.finetune_epochs:
                self._stepped[id(candidate)] = self.statistics.finetune(candidate, self.cfg.finetune_lr,
                                                                        self.cfg.finetune_epochs)
            self.statistics(candidate)
            if self.cfg.classifier_rows and isinstance(agg, Screened):
                self._classifier_rows(agg.copies, candidate)
        return candidate, bounded, check_state(candidate, self.robustness.max_weight_abs)

    def _classifier_rows(self, copies: Copies, candidate: GlobalState) -> None:
        """Each class's classifier row taken back from the rule's average where that lowers the loss on the server's
        images (nefl/aggregation/coordinate.py, choose_rows); the classes taken go to the round's facts."""
        head = self.statistics.head
        if head is None or not all(n in copies.average for n in head):
            return
        features, labels = self.statistics.features(candidate)
        merged = tuple(candidate.consistent[n] for n in head)
        average = tuple(copies.average[n] for n in head)
        weight, bias, copies.from_average = choose_rows(merged, average, features, labels)
        candidate.consistent[head[0]], candidate.consistent[head[1]] = weight, bias

    def _gate(self, agg: RoundAggregate, chosen: RoundAggregate, state: GlobalState, candidate: GlobalState,
              bounded: dict[int, int]) -> tuple[RoundAggregate | None, GlobalState, dict[int, int], str | None]:
        """The held-out gate on a finished candidate (nefl/aggregation/gate.py). Where the round's updates were
        kept (nefl/aggregation/attribution.py), each one whose removal makes the candidate better on the gate set
        (the paired z of its harm, pooled over the submodels, above gate_z) is left out first; then a candidate that
        still trips leaves out the fewest further updates that make it pass, or the round is refused."""
        gate, subs = self.gate, range(self.layout.num_submodels)
        base = gate.baseline(state, subs)
        verdict = gate.judge(candidate, base)
        if not (isinstance(agg, Recorded) and agg.attributable and len(agg.parts) >= 2):
            if verdict.tripped:
                return None, state, {}, _refusal(verdict)
            gate.committed(candidate, verdict)
            return chosen, candidate, bounded, None
        n = len(agg.parts)
        max_out = min(n - 1, max(1, int(self.cfg.gate_max_out * n)))
        pending = self.steps.pending() if self.steps is not None else None  # the whole round's, before any trial
        tried: dict[frozenset[int], Verdict | None] = {}  # the screen's one-out trials are the search's first step

        def trial(o: frozenset[int]) -> Verdict | None:
            if o not in tried:
                tried[o] = self._trial(agg, state, base, o)
            return tried[o]

        harm = self._harm(len(agg.parts), verdict, trial)
        out = frozenset(sorted(harm, key=lambda i: -harm[i])[:max_out])
        agg.gate_facts = {**({"harm_z": {agg.parts[i].client: round(z, 2) for i, z in sorted(harm.items())}} if harm else {}),
                          **({"tripped": {k + 1: {"loss": round(t.loss, 4), "top1": round(t.top1, 4)}
                                          for k, t in sorted(verdict.tripped.items())},
                              "worst_z": round(verdict.rank[0], 2)} if verdict.tripped else {})}
        if out:
            chosen, candidate, bounded, verdict = self._without(agg, state, base, out)
        if verdict.tripped:
            found = leave_out(n, max_out, trial)
            if found is None:
                agg.gate_dropped = {}
                return None, state, {}, _refusal(verdict)
            chosen, candidate, bounded, verdict = self._without(agg, state, base, found)
            out = found
        agg.chosen = chosen
        agg.gate_dropped = {agg.parts[i].client: "gate" for i in sorted(out)}
        if out:
            agg.gate_facts["left_out"] = sorted(agg.gate_dropped)
        elif pending is not None:  # the whole round commits: its step-bound history, not the last trial's
            self.steps.restore(pending)
        gate.committed(candidate, verdict)
        return chosen, candidate, bounded, None

    def _rebuild(self, agg: Recorded, state: GlobalState, out: frozenset[int]
                 ) -> tuple[RoundAggregate, GlobalState, dict[int, int], str | None]:
        """The round's aggregate without the updates `out`, finished (`_finish`)."""
        kept = without(agg.parts, out)
        sub = self._begin(state, {p.client: p.k for p in kept}, agg.index, agg.weight_norm)
        for p in kept:
            sub.add_validated(p.k, p.delta, p.samples, client=p.client)
        return sub, *self._finish(sub, state)

    def _trial(self, agg: Recorded, state: GlobalState, base: Baseline, out: frozenset[int]) -> Verdict | None:
        _, candidate, _, problem = self._rebuild(agg, state, out)
        return None if problem is not None else self.gate.judge(candidate, base)

    def _without(self, agg: Recorded, state: GlobalState, base: Baseline, out: frozenset[int]
                 ) -> tuple[RoundAggregate, GlobalState, dict[int, int], Verdict]:
        """The round without `out`, rebuilt last so the step bound's pending history is this one's, and judged."""
        sub, candidate, bounded, _ = self._rebuild(agg, state, out)
        return sub, candidate, bounded, self.gate.judge(candidate, base)

    def _harm(self, n: int, verdict: Verdict, trial: Callable[[frozenset[int]], Verdict | None]) -> dict[int, float]:
        """Update index (of the round's `n`) -> how much worse the round is with it than without it (`trial`): the
        gate's paired z (loss and error, with the gate's slack), the largest of that per submodel and that of the
        per-image mean over the submodels, for those above gate_z. Per submodel, because the mean dilutes a poison of
        one submodel's own tensors (its batch norm, its step sizes) by the number of submodels; the mean, because a
        harm spread thin over every submodel may stay under the bar in each."""
        full = pooled(verdict.scores.values())
        harm = {}
        for i in range(n):
            v = trial(frozenset({i}))
            if v is not None:
                z = max(self.gate.worse_z(full, pooled(v.scores.values())),
                        *(self.gate.worse_z(verdict.scores[k], v.scores[k]) for k in verdict.scores))
                if z > self.gate.z:
                    harm[i] = z
        return harm


def _refusal(verdict: Verdict) -> str:
    return "gate: " + ", ".join(f"submodel {k + 1} loss {t.loss:+.3f}, top-1 {t.top1:+.3f}"
                                for k, t in sorted(verdict.tripped.items()))
