"""The pipeline's draws (the centre check's sketch positions): from a server secret where one is given, so that
knowing --seed and the code does not tell where the sketch looks; from the seed in the simulator."""

from __future__ import annotations

import os

import torch

from aggregator.keys import SECRET_BYTES, KeyDir
from nefl.aggregation.pipeline import Pipeline
from nefl.nested.profile import load_profile
from nefl.nested.state import GlobalState, Layout

LAYOUT = Layout.build(load_profile("resnet8-fmnist-w"))
STATE = GlobalState.init(LAYOUT, seed=0)
TASKS = {"a": 0, "b": 2, "c": 4}


def positions(pipeline: Pipeline, index: int) -> torch.Tensor:
    sketch = pipeline.begin_round(STATE, TASKS, index).sketch
    assert sketch.index is not None  # the shared core is larger than the sketch: positions are drawn
    return sketch.index


def test_a_secret_decides_the_positions_and_the_seed_does_not():
    secret = os.urandom(32)
    with_secret = [Pipeline(LAYOUT, seed=s, secret=secret) for s in (0, 7)]
    assert torch.equal(positions(with_secret[0], 3), positions(with_secret[1], 3))  # the seed plays no part
    assert torch.equal(positions(with_secret[0], 3), positions(Pipeline(LAYOUT, secret=secret), 3))  # stable per round
    assert not torch.equal(positions(with_secret[0], 3), positions(with_secret[0], 4))  # and new every round
    public = Pipeline(LAYOUT, seed=0)
    assert not torch.equal(positions(with_secret[0], 3), positions(public, 3))  # not what --seed would give
    assert not torch.equal(positions(with_secret[0], 3), positions(Pipeline(LAYOUT, secret=os.urandom(32)), 3))


def test_the_simulator_keeps_its_seed():
    assert torch.equal(positions(Pipeline(LAYOUT, seed=5), 2), positions(Pipeline(LAYOUT, seed=5), 2))


def test_the_server_secret_lives_beside_its_key(tmp_path):
    keys = KeyDir("lab", tmp_path)
    secret = keys.rule_secret()
    path = keys.path / "aggregation.secret"
    assert len(secret) == SECRET_BYTES and path.read_bytes() == secret and oct(path.stat().st_mode & 0o777) == "0o600"
    assert KeyDir("lab", tmp_path).rule_secret() == secret  # the same across runs
    path.write_bytes(b"short")
    assert len(KeyDir("lab", tmp_path).rule_secret()) == SECRET_BYTES  # a damaged one is replaced
