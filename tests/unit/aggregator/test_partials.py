"""The coordinator's checks of a worker's partial aggregate (aggregator/partials.py `check_partial`), against
brute force: a partial passes exactly when it is what the receipts the coordinator saw allow, and the norms
it lets into the adaptive bound's history are recomputed (a group of one) or bounded (larger groups)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator.partials import NORM_SLACK, Held, check_partial
from nefl.aggregation.aggregate import update_weight
from nefl.aggregation.nefedavg import NeFedAvg
from nefl.aggregation.robust import update_norm
from nefl.nested.state import Layout
from nefl.protocol.messages import PartialSummary
from nefl.protocol.wire import WireError
from tests.harness.helpers import random_ladder

checks = settings(max_examples=25, deadline=None)


def honest(seed: int, n: int, weighting: str) -> tuple[Layout, NeFedAvg, dict[str, Held], dict[str, dict], PartialSummary]:
    """A worker's partial of n random updates (random submodels, scales, sample counts), its receipts and summary."""
    rng = random.Random(seed)
    layout = Layout.build(random_ladder(rng))
    agg = NeFedAvg(layout, weighting)
    held, deltas = {}, {}
    for i in range(n):
        k = rng.randrange(layout.num_submodels)
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        scale = 10 ** rng.uniform(-4, 1)
        delta = {name: torch.randn(s, generator=g) * scale for name, s in layout.upload_shapes(k).items()}
        samples = rng.randint(1, 50)
        agg.add(k, delta, samples)
        c = f"c{i}"
        held[c] = Held("w1", k, update_weight(weighting, samples), update_norm(delta))
        deltas[c] = {"k": k, "delta": delta, "w": update_weight(weighting, samples)}
    summary = PartialSummary(run="r", round=1, weights=[float(w) for w in agg.weights], updates=list(agg.updates),
                             clients=sorted(held))
    return layout, agg, held, deltas, summary


def tensors(agg: NeFedAvg) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in agg.partial_tensors().items()}


@checks
@given(seed=st.integers(0, 10_000), n=st.integers(1, 8), weighting=st.sampled_from(["uniform", "samples"]))
def test_an_honest_partial_passes_and_a_group_of_one_reveals_its_norm(seed, n, weighting):
    layout, agg, held, deltas, summary = honest(seed, n, weighting)
    merged, norms = check_partial(layout, summary, tensors(agg), held, "w1", weighting)
    assert merged.updates == agg.updates and torch.equal(merged.weights, agg.weights)
    assert set(norms) == set(held)
    for c, d in deltas.items():
        alone = sum(1 for e in deltas.values() if e["k"] == d["k"]) == 1
        want = update_norm(d["delta"]) if alone else held[c].norm
        assert norms[c] == pytest.approx(want, rel=1e-5)


@checks
@given(seed=st.integers(0, 10_000), n=st.integers(1, 6), grow=st.floats(0.3, 4.0), shrink=st.floats(0.05, 1.0),
       weighting=st.sampled_from(["uniform", "samples"]))
def test_a_partial_is_refused_exactly_when_a_group_outgrows_its_receipts(seed, n, grow, shrink, weighting):
    """Scale one group sum by `grow` and every receipted norm by `shrink` (a worker that inflates sums or
    understates norms to drag the adaptive bound down): refused iff some group's sum, computed here in
    float64 from the deltas themselves, exceeds the weighted sum of its claimed norms."""
    layout, agg, held, deltas, summary = honest(seed, n, weighting)
    k0 = next(iter(deltas.values()))["k"]
    sent = tensors(agg)
    for name in sent:
        if name.startswith(f"{k0}/"):
            sent[name] *= grow
    claimed = {c: Held(h.worker, h.submodel, h.weight, h.norm * shrink) for c, h in held.items()}
    expect_ok = True
    for k in {d["k"] for d in deltas.values()}:
        members = [d for d in deltas.values() if d["k"] == k]
        total = {name: sum(d["w"] * d["delta"][name].double() for d in members) for name in members[0]["delta"]}
        norm = math.sqrt(sum(float((t ** 2).sum()) for t in total.values())) * (grow if k == k0 else 1.0)
        allowed = sum(d["w"] * update_norm(d["delta"]) * shrink for d in members)
        ratio = norm / allowed
        if abs(ratio - 1) < 1e-3:
            return  # within float rounding of the line: either answer is right
        expect_ok &= ratio <= 1 + NORM_SLACK
    if expect_ok:
        check_partial(layout, summary, sent, claimed, "w1", weighting)
    else:
        with pytest.raises(WireError, match="bad_partial"):
            check_partial(layout, summary, sent, claimed, "w1", weighting)


@checks
@given(seed=st.integers(0, 10_000), n=st.integers(2, 6), lie=st.sampled_from(["count", "weight", "stranger", "drop",
                                                                             "other worker", "shape", "missing"]))
def test_counts_weights_and_clients_must_be_the_receipts(seed, n, lie):
    layout, agg, held, _, summary = honest(seed, n, "uniform")
    sent = tensors(agg)
    k = held["c0"].submodel
    if lie == "count":
        summary = PartialSummary(**{**_fields(summary), "updates": [u + (i == k) for i, u in enumerate(summary.updates)]})
    elif lie == "weight":
        summary = PartialSummary(**{**_fields(summary), "weights": [w * (1.5 if i == k else 1) for i, w in enumerate(summary.weights)]})
    elif lie == "stranger":  # a client no receipt of this worker announced
        summary = PartialSummary(**{**_fields(summary), "clients": [*summary.clients, "zz"]})
    elif lie == "drop":  # drops a client it does not name
        summary = PartialSummary(**{**_fields(summary), "dropped": {"zz": "against_centre"}})
    elif lie == "other worker":  # a client another worker receipted
        held = {**held, "c0": Held("w2", k, 1.0, held["c0"].norm)}
    elif lie == "shape":
        name = next(iter(sent))
        sent[name] = torch.zeros(3)
    else:  # tensors of a submodel it claims updates for are missing
        sent = {n: t for n, t in sent.items() if not n.startswith(f"{k}/")}
    with pytest.raises(WireError, match="bad_partial"):
        check_partial(layout, summary, sent, held, "w1")


def test_an_update_the_centre_check_dropped_is_named_but_not_summed():
    layout, agg, held, deltas, summary = honest(3, 4, "uniform")
    # rebuild the partial without c1, as the worker's centre check would have
    part = NeFedAvg(layout)
    for c, d in deltas.items():
        if c != "c1":
            part.add(d["k"], d["delta"])
    dropped = PartialSummary(run="r", round=1, weights=[float(w) for w in part.weights], updates=list(part.updates),
                             clients=sorted(held), dropped={"c1": "against_centre"})
    _, norms = check_partial(layout, dropped, tensors(part), held, "w1")
    assert "c1" not in norms and set(norms) == set(held) - {"c1"}
    with pytest.raises(WireError, match="bad_partial"):  # counting the dropped one is a lie
        check_partial(layout, PartialSummary(**{**_fields(dropped), "updates": list(agg.updates)}), tensors(part), held, "w1")


def _fields(summary: PartialSummary) -> dict:
    return {f: getattr(summary, f) for f in summary.__struct_fields__}
