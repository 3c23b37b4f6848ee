"""The defence as an attacker's oracle: whether the kit's aggregation accepts a candidate update in a round of known
honest updates, asked through the Pipeline's public API only (begin_round, add_validated, commit, `dropped`), so
the adaptive attack follows whatever the defence becomes.

A candidate is accepted when the screening does not drop it and the committed step carries at least `1 - slack` of
its undefended contribution: (defended step with it - defended step without it) projected on (NeFedAvg's step with
it - NeFedAvg's step without it). Clipping, per-tensor bounds and step bounds all show there, wherever the defence
applies them. The oracle has no history of earlier rounds (the step bound's and the adaptive norm bound's pools
start empty), and its draws come from the seed it is given: the simulator's own, or, against a server, one the
attacker picks (the server's secret is not known to it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from nefl.aggregation.attack_search import flat
from nefl.aggregation.config import PLAIN_NEFEDAVG
from nefl.aggregation.pipeline import Pipeline, Robustness
from nefl.nested.state import GlobalState, Layout

Delta = dict[str, torch.Tensor]
CANDIDATE = "candidate"  # the candidate's client id in the oracle's rounds
SLACK = 0.1  # accepted: at least 90% of the candidate's undefended contribution reaches the committed step


class PipelineOracle:
    """Round `index` of `defended` from `state` with the `honest` (submodel, delta) updates; the candidate trains
    submodel `k`."""

    def __init__(self, defended: Pipeline, state: GlobalState, honest: Sequence[tuple[int, Delta]], k: int, index: int,
                 slack: float = SLACK) -> None:
        self.defended, self.state, self.honest, self.k, self.index, self.slack = defended, state, list(honest), k, index, slack
        plain = replace(defended.robustness, aggregation=PLAIN_NEFEDAVG)
        self.plain = Pipeline(defended.layout, plain, defended.weighting, None, defended.seed, defended.secret)
        self.base = self._step(self.defended, None)
        self.plain_base = self._step(self.plain, None)

    def _assignments(self, with_candidate: bool) -> dict[str, int]:
        out = {f"honest-{i}": k for i, (k, _) in enumerate(self.honest)}
        return {**out, CANDIDATE: self.k} if with_candidate else out

    def _round(self, pipeline: Pipeline, candidate: Delta | None) -> tuple[torch.Tensor | None, bool]:
        """The committed state's flat difference from `state` (None: not committed) and whether the candidate was
        dropped."""
        agg = pipeline.begin_round(self.state, self._assignments(candidate is not None), self.index)
        for i, (k, delta) in enumerate(self.honest):
            agg.add_validated(k, delta, client=f"honest-{i}")
        if candidate is not None:
            agg.add_validated(self.k, candidate, client=CANDIDATE)
        done = pipeline.commit(agg, self.state)
        if done.state is None:
            return None, True
        step = flat(done.state.flat()) - flat(self.state.flat())
        return step, CANDIDATE in agg.dropped

    def _step(self, pipeline: Pipeline, candidate: Delta | None) -> torch.Tensor:
        step, _ = self._round(pipeline, candidate)
        if step is None:
            raise ValueError("the honest updates alone do not commit: nothing to attack")
        return step

    def influence(self, candidate: Delta) -> float:
        """The share of the candidate's undefended contribution the defended commit carries (0 when dropped or not
        committed)."""
        step, dropped = self._round(self.defended, candidate)
        if step is None or dropped:
            return 0.0
        wanted = self._step(self.plain, candidate) - self.plain_base
        return float((step - self.base) @ wanted) / max(float(wanted @ wanted), 1e-30)

    def __call__(self, candidate: Delta) -> bool:
        return self.influence(candidate) >= 1 - self.slack


def own_state(layout: Layout, k: int, weights: Delta) -> GlobalState:
    """A global state holding submodel k's `weights` (what a device was sent): the rest is the layout's seeded
    initialisation, which a round of submodel-k updates leaves as it is."""
    state = GlobalState.init(layout, 0)
    for name, view in state.slices(layout, k).items():
        view.copy_(weights[name])
    return state


def device_oracle(layout: Layout, k: int, weights: Delta, honest: Sequence[Delta], index: int, seed: int,
                  robustness: Robustness = Robustness()) -> PipelineOracle:
    """What a device that attacks a server can ask: the defence with the server's defaults (or `robustness`), over its
    known updates of its own submodel, from the weights it was sent; draws from its own `seed`."""
    return PipelineOracle(Pipeline(layout, robustness, seed=seed), own_state(layout, k, weights), [(k, d) for d in honest],
                          k, index)
