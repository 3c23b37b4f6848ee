"""Small shared tensors merged per element by a trimmed mean (nefl/aggregation/coordinate.py, in the centre check):
`trimmed` against a per-element brute force over nested corners, and through the pipeline a classifier-bias push of
any size that moves the committed bias no further than the honest copies' edge."""

from __future__ import annotations

import math
import random

import pytest
import torch

from nefl.aggregation.config import AggregationConfig
from nefl.aggregation.coordinate import small_tensors, trimmed, within_rows
from nefl.aggregation.pipeline import Pipeline, Robustness
from nefl.nested.state import GlobalState, Layout
from tests.harness.helpers import FULL, tiny_profile

WIDTHS = [(0.5, 0.5, FULL), (0.75, 0.75, FULL), (1.0, 1.0, FULL)]


def committed(layout: Layout, cfg: AggregationConfig, state: GlobalState,
              ups: list[tuple[int, dict[str, torch.Tensor]]]) -> GlobalState:
    """The state one round of `ups` (submodel, delta) commits through the centre check configured by `cfg`."""
    pipeline = Pipeline(layout, Robustness(aggregation=cfg))
    agg = pipeline.begin_round(state, {f"c{i}": k for i, (k, _) in enumerate(ups)}, 1)
    for i, (k, d) in enumerate(ups):
        agg.add(k, {n: t.clone() for n, t in d.items()}, client=f"c{i}")
    new = pipeline.commit(agg, state).state
    assert new is not None
    return new


@pytest.mark.parametrize("seed", range(4))
def test_trimmed_matches_a_per_element_brute_force(seed: int) -> None:
    """Copies in random leading corners of a 2-D tensor: each element's mean of its covering copies sorted, with
    max(1, floor(trim x count)) cut at each end, where at least 3 cover it."""
    rng = random.Random(seed)
    shape, trim = torch.Size((4, 6)), rng.choice([0.1, 0.2, 0.3])
    copies = [torch.randn(rng.randint(1, 4), rng.randint(1, 6)) for _ in range(rng.randint(1, 12))]
    mean, count = trimmed(copies, shape, trim)
    for i in range(shape[0]):
        for j in range(shape[1]):
            values = sorted(float(c[i, j]) for c in copies if i < c.shape[0] and j < c.shape[1])
            cut = max(1, math.floor(trim * len(values)))
            assert int(count[i, j]) == len(values)
            if len(values) >= 3:
                kept = values[cut:len(values) - cut]
                assert float(mean[i, j]) == pytest.approx(sum(kept) / len(kept), abs=1e-9)


def honest(layout: Layout, k: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {n: torch.randn(s, generator=gen) * 0.01 for n, s in layout.upload_shapes(k).items()}


@pytest.mark.parametrize("push", [0.05, 5.0])
@pytest.mark.parametrize("size, attackers", [(10, 2), (3, 1)])
def test_a_bias_push_moves_the_classifier_bias_no_further_than_the_honest_edge(push: float, size: int,
                                                                               attackers: int) -> None:
    """Honest updates and 20% (or one of a round of three, as over `serve`) that are honest but for +push on the
    classifier's bias for class 0: the committed step of that element lies within the honest copies' range
    whatever the push (trimming off: the push goes in, diluted by the mean)."""
    layout = Layout.build(tiny_profile(WIDTHS))
    bias = next(n for n in sorted(small_tensors(layout, 1024)) if n.endswith("bias") and layout.global_shapes[n].numel() == 5)
    state, gen = GlobalState.init(layout, seed=0), torch.Generator().manual_seed(2)
    ups = [(i % 3, honest(layout, i % 3, gen)) for i in range(size)]
    for _, d in ups[size - attackers:]:
        d[bias][0] += push
    steps = {}
    for trim in (0.2, 0.0):
        new = committed(layout, AggregationConfig(coordinate_trim=trim), state, ups)
        steps[trim] = float(new.consistent[bias][0] - state.consistent[bias][0])
    honest_values = [float(d[bias][0]) for _, d in ups[:size - attackers]]
    assert min(honest_values) - 1e-6 <= steps[0.2] <= max(honest_values) + 1e-6
    if push >= 1:  # the mean takes a share of the push the size clips let through
        assert steps[0.0] > max(honest_values)


@pytest.mark.parametrize("seed", range(4))
def test_within_rows_holds_thin_elements_to_their_rows_best_covered_range(seed: int) -> None:
    """Each element covered by fewer copies than the tensor's best covered, in a row holding some of those, is clamped
    to [min, max] of its row's best covered steps, each end scaled away from 0 by sqrt(the most copies averaged / its
    own); the best covered and the rows without any are left as they are."""
    gen = torch.Generator().manual_seed(seed)
    step = torch.randn(5, 7, generator=gen, dtype=torch.float64) * 3
    count = torch.randint(1, 4, (5, 7), generator=gen)
    count[0, 0] = 4
    count[4] = torch.randint(1, 4, (7,), generator=gen)
    kept = (count - 1).clamp_min(1)
    out = within_rows(step, count, kept)
    core = count == 4
    for i in range(5):
        row = [float(step[i, j]) for j in range(7) if core[i, j]]
        for j in range(7):
            want = float(step[i, j])
            if row and not core[i, j]:
                w = math.sqrt(float(kept[core].max()) / float(kept[i, j]))
                lo, hi = min(row), max(row)
                want = min(max(want, min(lo, lo * w)), max(hi, hi * w))
            assert float(out[i, j]) == pytest.approx(want)


def test_a_push_on_the_outer_columns_of_the_classifier_is_held_to_its_rows_honest_steps() -> None:
    """With `coordinate_rows`: honest updates of three submodels and one attacker on the widest, pushing its copy of one class's classifier
    row, whose outer columns only the widest submodel's two updates (too few to trim) cover: every committed step of
    that row lies within sqrt(5) (copies averaged in the core / in the outer columns) x the range of the row's honest
    steps in the columns all seven cover."""
    layout = Layout.build(tiny_profile(WIDTHS))
    weight = next(n for n in sorted(small_tensors(layout, 1024)) if n.endswith("weight") and layout.global_shapes[n][0] == 5)
    state, gen = GlobalState.init(layout, seed=0), torch.Generator().manual_seed(3)
    ups = [(k, honest(layout, k, gen)) for k in (0, 0, 0, 1, 1, 2, 2)]
    ups[-1][1][weight][1] += 5.0
    new = committed(layout, AggregationConfig(coordinate_rows=True), state, ups)
    inner = layout.sub_shapes[0][weight][1]
    assert inner < layout.global_shapes[weight][1]
    honest_core = [float(d[weight][1, j]) for _, d in ups[:-1] for j in range(inner)]
    step = new.consistent[weight][1] - state.consistent[weight][1]
    widen = math.sqrt(5 / 2)
    assert min(honest_core) * widen - 1e-6 <= float(step.min()) and float(step.max()) <= max(honest_core) * widen + 1e-6
