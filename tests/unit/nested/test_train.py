import math
from dataclasses import replace

import pytest
import torch

from nefl.nested.data import BatchLoader
from nefl.nested.state import GlobalState, Layout, module_state
from nefl.nested.train import TrainConfig, evaluate, local_train, recompute_bn_stats
from tests.harness.helpers import FULL, tiny_profile
from tests.harness.tiny_data import blobs as _blobs


def test_paper_lr_schedule() -> None:
    cfg = TrainConfig()
    assert (cfg.lr, cfg.momentum, cfg.weight_decay, cfg.batch_size) == (0.1, 0.0, 0.0, 32)
    lrs = [cfg.lr_at(r, 100) for r in (0, 49, 50, 74, 75, 99)]
    assert lrs == [0.1, 0.1, 0.1 * 0.1, 0.1 * 0.1, 0.1 * 0.1 * 0.1, 0.1 * 0.1 * 0.1]
    assert cfg.for_round(50, 100) == replace(cfg, lr=0.1 * 0.1)


def test_local_training_learns_and_returns_only_upload_delta() -> None:
    layout = Layout.build(tiny_profile([(0.5, 0.5, FULL), (1.0, 1.0, FULL)], in_ch=1))
    state = GlobalState.init(layout, seed=0)
    data = _blobs()
    model = layout.module(0)
    start = state.extract(layout, 0)
    res = local_train(model, start, BatchLoader(data, None, 32, True, False, 0), TrainConfig(local_epochs=5),
                      upload=layout.upload_shapes(0))
    assert res.num_samples == 256 and set(res.delta) == set(layout.upload_shapes(0))
    trained = module_state(model)
    for n, d in res.delta.items():
        assert torch.allclose(start[n] + d, trained[n].float())
    acc, _ = evaluate(model, BatchLoader(data, None, 64, False, False, 0))
    assert acc > 0.9
    # fixed steps (nefl-nl) do not move; learnable ones (nefl) do
    assert res.delta["stages.0.0.step"].abs() > 0


def test_fixed_steps_do_not_train() -> None:
    layout = Layout.build(tiny_profile([(1.0, 1.0, FULL)], in_ch=1, method="nefl-nl"))
    state = GlobalState.init(layout, seed=0)
    res = local_train(layout.module(0), state.extract(layout, 0), BatchLoader(_blobs(64), None, 32, True, False, 0), TrainConfig())
    assert all(res.delta[n].abs().max() == 0 for n in res.delta if n.endswith(".step"))


def test_static_bn_uses_exact_data_statistics() -> None:
    layout = Layout.build(tiny_profile([(1.0, 1.0, FULL)], in_ch=1))
    model = layout.module(0)
    data = _blobs(128)
    recompute_bn_stats(model, BatchLoader(data, None, 32, False, False, 0))
    x = torch.cat([x for x, _ in BatchLoader(data, None, 128, False, False, 0)])
    with torch.no_grad():
        stem = model.stem.conv(x)
    torch.testing.assert_close(model.stem.bn.running_mean, stem.mean((0, 2, 3)), atol=1e-4, rtol=1e-4)
    assert model.stem.bn.momentum == 0.1 and not model.training


def test_cosine_schedule_with_warmup() -> None:
    """The paper's pretrained-ViT protocol: linear warmup, then cosine decay to 0 at the last round."""
    cfg = TrainConfig(lr=0.03, schedule="cosine", warmup_rounds=3)
    lrs = [cfg.lr_at(r, 103) for r in range(103)]
    assert lrs[:3] == pytest.approx([0.01, 0.02, 0.03])
    assert lrs[3] == pytest.approx(0.03)
    assert lrs[53] == pytest.approx(0.015)  # halfway through the decay
    assert lrs[-1] == pytest.approx(0.03 * 0.5 * (1 + math.cos(math.pi * 99 / 100)))
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))
    assert TrainConfig(warmup_rounds=2).lr_at(0, 10) == pytest.approx(0.05)  # warmup before the step schedule too


def test_unknown_schedule_is_refused() -> None:
    with pytest.raises(ValueError, match="learning-rate schedule"):
        TrainConfig(schedule="linear")
