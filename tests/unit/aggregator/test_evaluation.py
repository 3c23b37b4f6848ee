"""One evaluation path for the server and the simulator: static-BN statistics are recomputed before
scoring and kept in the federation's state, so checkpoints and exports carry them."""

import torch

from aggregator.evaluation import Evaluator
from aggregator.federation import Federation, state_digest, Update
from nefl.nested.checkpoint import load_checkpoint, save_checkpoint
from nefl.nested.data import BatchLoader
from nefl.protocol.messages import Announce
from nefl.nested.state import GlobalState, Layout, load_module_state, module_state
from nefl.nested.train import TrainConfig, local_train, recompute_bn_stats
from tests.harness.helpers import FULL, tiny_profile
from tests.harness.tiny_data import blobs as _blobs

PROFILE = tiny_profile([(0.5, 0.5, FULL), (1.0, 1.0, FULL)], in_ch=1)


def _trained_federation(method: str) -> Federation:
    """Two tiny submodels, one round in which both are trained."""
    layout = Layout.build(PROFILE, method)
    fed = Federation(layout, GlobalState.init(layout, seed=0), "t", 2, 1, 60)
    data = _blobs(64)
    for c in ("a", "b"):
        fed.set_online(c, True)
        fed.announce(c, Announce(client=c, max_submodel=2, samples=len(data)))
    for c, k in fed.open_round(1, now=0.0).assignments.items():
        res = local_train(layout.module(k), fed.state.extract(layout, k), BatchLoader(data, None, 32, True, False, 0),
                          TrainConfig(), upload=layout.upload_shapes(k))
        fed.accept(Update(c, 1, k, res.num_samples, res.delta, 0))
    assert fed.close_round()["committed"]
    return fed


def test_heterofl_evaluation_records_calibrated_bn_statistics(tmp_path) -> None:
    fed = _trained_federation("heterofl")
    layout, data = fed.layout, _blobs(64)
    before = fed.state.clone()
    evaluator = Evaluator(layout, data, data, calibration_samples=48, seed=0)
    evaluator.accuracy(fed.state)
    assert layout.local, "HeteroFL keeps its BN statistics local"
    for k in range(layout.num_submodels):
        fresh = layout.module(k)
        load_module_state(fresh, before.extract(layout, k))
        recompute_bn_stats(fresh, evaluator.calib)
        expected = module_state(fresh)
        for name in layout.local & fed.state.inconsistent[k].keys():
            assert not torch.equal(fed.state.inconsistent[k][name], before.inconsistent[k][name]), name
            assert torch.equal(fed.state.inconsistent[k][name], expected[name]), name
    save_checkpoint(tmp_path, fed.state, layout, {"round": 1})
    assert state_digest(load_checkpoint(tmp_path, PROFILE).state) == state_digest(fed.state)


def test_evaluation_leaves_per_submodel_bn_alone() -> None:
    fed = _trained_federation("nefl")
    digest = state_digest(fed.state)
    Evaluator(fed.layout, _blobs(64)).accuracy(fed.state)
    assert state_digest(fed.state) == digest
