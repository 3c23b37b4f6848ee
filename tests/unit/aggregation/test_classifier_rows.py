"""The classifier's rows chosen on the server's images (nefl/aggregation/coordinate.py, choose_rows; the pipeline's
`classifier_rows`): a class's row comes back from the round's plain average only where that lowers the loss on the
server's labelled images, so honest pushes the per-element merge cut come back and a push that hurts clean images
does not."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator.statsdata import ServerStatistics, head_names
from nefl.aggregation.config import AggregationConfig
from nefl.aggregation.coordinate import choose_rows, head_loss
from nefl.aggregation.pipeline import Pipeline, Robustness
from nefl.nested.data import ArrayDataset, get_dataset_info
from nefl.nested.profile import load_profile
from nefl.nested.state import GlobalState, Layout
from tests.harness.helpers import aligned_deltas

LAYOUT = Layout.build(load_profile("resnet8-fmnist-w"))


def brute_loss(weight: torch.Tensor, bias: torch.Tensor, features: list[torch.Tensor], labels: torch.Tensor) -> float:
    """Cross-entropy written out image by image: log-sum-exp of the logits minus the label's logit."""
    total = 0.0
    for x in features:
        for i in range(len(x)):
            logits = [sum(float(x[i, j]) * float(weight[c, j]) for j in range(x.shape[1])) + float(bias[c])
                      for c in range(len(bias))]
            top = max(logits)
            total += top + math.log(sum(math.exp(v - top) for v in logits)) - logits[int(labels[i])]
    return total


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), classes=st.integers(2, 5), width=st.integers(2, 5), images=st.integers(1, 6),
       subs=st.integers(1, 3))
def test_choose_rows_is_the_class_by_class_greedy_choice_on_the_servers_loss(seed: int, classes: int, width: int,
                                                                             images: int, subs: int) -> None:
    g = torch.Generator().manual_seed(seed)
    merged = (torch.randn(classes, width, generator=g), torch.randn(classes, generator=g))
    average = (torch.randn(classes, width, generator=g), torch.randn(classes, generator=g))
    widths = sorted(torch.randint(1, width + 1, (subs,), generator=g).tolist())  # each submodel's nested corner
    features = [torch.randn(images, w, generator=g) for w in widths]
    labels = torch.randint(0, classes, (images,), generator=g)
    weight, bias, taken = choose_rows(merged, average, features, labels)
    # the reference: class by class in order, a row taken where the written-out loss falls
    w, b, want = merged[0].double().clone(), merged[1].double().clone(), []
    for c in range(classes):
        w2, b2 = w.clone(), b.clone()
        w2[c], b2[c] = average[0][c].double(), average[1][c].double()
        if brute_loss(w2, b2, features, labels) < brute_loss(w, b, features, labels):
            w, b = w2, b2
            want.append(c)
    assert taken == want
    for c in range(classes):
        src = average if c in taken else merged
        assert torch.equal(weight[c], src[0][c]) and torch.equal(bias[c], src[1][c])
    got = brute_loss(weight, bias, features, labels)
    assert got <= brute_loss(*merged, features, labels) + 1e-9
    assert head_loss(weight, bias, features, labels) == pytest.approx(got, rel=1e-5, abs=1e-5)  # float32 here


def test_a_row_that_hurts_the_servers_images_stays_merged_and_one_that_helps_comes_back() -> None:
    """Two classes told apart by the feature's sign: the average pushes class 0's bias far up (every image would be
    called 0) and sharpens class 1's row; only class 1 is taken."""
    x = torch.tensor([[1.0], [2.0], [-1.0], [-2.0]])
    labels = torch.tensor([1, 1, 0, 0])
    merged = (torch.tensor([[-0.5], [0.5]]), torch.zeros(2))
    average = (torch.tensor([[-0.5], [2.0]]), torch.tensor([40.0, 0.0]))
    weight, bias, taken = choose_rows(merged, average, [x], labels)
    assert taken == [1]
    assert bias[0] == 0 and weight[1, 0] == 2.0


def images(n: int = 96) -> ArrayDataset:
    """The server's images: random pixels, every one labelled class 1 (so raising class 0 raises their loss)."""
    g = torch.Generator().manual_seed(1)
    return ArrayDataset(torch.randint(0, 256, (n, 1, 28, 28), generator=g, dtype=torch.uint8),
                        torch.ones(n, dtype=torch.long), get_dataset_info("fashion-mnist"))


def one_round(rows: bool, push: float) -> tuple[GlobalState, GlobalState, dict]:
    """A round of 5 updates (submodels 1-5, small steps in one direction, so the centre check keeps all), the last
    with `push` added to the classifier's bias of class 0, through a server holding `images()` (without its fine-tuning,
    which moves every row: test_finetune)."""
    state = GlobalState.init(LAYOUT, seed=0)
    pipeline = Pipeline(LAYOUT, Robustness(aggregation=AggregationConfig(classifier_rows=rows, finetune_epochs=0)),
                        statistics=ServerStatistics(LAYOUT, images()))
    tasks = {f"c{k}": k for k in range(LAYOUT.num_submodels)}
    agg = pipeline.begin_round(state, tasks, 1)
    for client, delta in aligned_deltas(LAYOUT, state, tasks, 0.003).items():
        k = tasks[client]
        if k == LAYOUT.num_submodels - 1:
            delta["fc.bias"][0] += push
        agg.add_validated(k, delta, 10, client=client)
    done = pipeline.commit(agg, state)
    assert done.state is not None
    return state, done.state, agg.facts()


def test_head_names_are_the_classifiers() -> None:
    assert head_names(LAYOUT) == ("fc.weight", "fc.bias")


def test_through_the_pipeline_rows_come_only_from_the_merge_or_the_average_and_a_bias_push_is_not_taken() -> None:
    state, off, _ = one_round(False, 5.0)
    _, on, facts = one_round(True, 5.0)
    taken = facts.get("rows_from_average", [])
    assert 0 not in taken  # the push raises class 0 on every image, all of class 1
    step_on = on.consistent["fc.bias"] - state.consistent["fc.bias"]
    step_off = off.consistent["fc.bias"] - state.consistent["fc.bias"]
    assert step_on[0] == step_off[0] and abs(float(step_on[0])) < 0.1
    for c in range(10):  # every other tensor, and every row not taken, commits as without the choice
        if c not in taken:
            assert torch.equal(on.consistent["fc.weight"][c], off.consistent["fc.weight"][c])
    for n, t in off.consistent.items():
        if n not in ("fc.weight", "fc.bias"):
            assert torch.equal(t, on.consistent[n]), n
    _, _, facts = one_round(True, 0.0)
    assert facts.get("rows_from_average")  # without the push some class's plain average fits the images better
