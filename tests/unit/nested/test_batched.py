"""Clients of one submodel trained together (nefl/nested/batched.py) against the same clients trained one after the
other with `local_train`.

Tolerances. In float64 both paths do the same arithmetic up to the order of the sums inside the kernels, so after
several steps with momentum and weight decay each tensor's delta agrees to 1e-6 of its norm: float64 rounding is
1e-16, amplified by training from initialisation by up to ~1e6 in three steps, and the deltas are handed over
in float32, whose rounding (6e-8) a difference of 1e-10 can tip either way (this amplification is also
why float32 deltas after several steps are no test of the batching: float32 training itself moves 8-40% off
float64 in three steps). In float32 one step is compared, per client over all its tensors: the batched
convolutions are grouped ones, which oneDNN computes with other kernels than a single client's, and float32
convolution kernels differ from float64 by up to ~1e-3 of a client's update on this data (measured: torch's own
non-oneDNN kernels 4e-4 to 1e-3; the batched path 2e-4; with oneDNN off both paths agree to 1e-8). So the bound
is 1e-3. Single BatchNorm affine tensors, whose gradients are sums that cancel, differ by up to 1e-2 and are not
bounded one by one.
"""

from __future__ import annotations

import pytest
import torch

from nefl.nested.batched import batched_train
from nefl.nested.profile import load_profile
from nefl.nested.state import GlobalState, Layout
from nefl.nested.train import TrainConfig, TrainResult, local_train

CLIENTS = 3


def _batches(clients: int, steps: int, batch: int, dtype: torch.dtype, seed: int = 0) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Every client its own seeded Fashion-MNIST-shaped batches (the loader of a client is a list: one per epoch)."""
    gen = torch.Generator().manual_seed(seed)
    return [[(torch.randn(batch, 1, 28, 28, generator=gen, dtype=dtype), torch.randint(0, 10, (batch,), generator=gen))
             for _ in range(steps)] for _ in range(clients)]


def _one_by_one(layout: Layout, k: int, start: dict[str, torch.Tensor], loaders: list, cfg: TrainConfig,
                dtype: torch.dtype, device: str = "cpu") -> list[TrainResult]:
    model = layout.module(k).to(dtype)
    return [local_train(model, start, batches, cfg, upload=layout.upload_shapes(k), device=device) for batches in loaders]


def _together(layout: Layout, k: int, start: dict[str, torch.Tensor], loaders: list, cfg: TrainConfig,
              dtype: torch.dtype, device: str = "cpu", autocast: torch.dtype | None = None) -> list[TrainResult]:
    return batched_train(layout.module(k).to(dtype), start, loaders, cfg, upload=list(layout.upload_shapes(k)),
                         device=device, autocast=autocast)


def _worst(got: list[TrainResult], ref: list[TrainResult]) -> float:
    """The largest difference of a client's tensor delta, relative to the norm of the reference delta."""
    return max(float((g.delta[n] - r.delta[n]).norm() / r.delta[n].norm())
               for g, r in zip(got, ref) for n in r.delta if r.delta[n].norm() > 0)


def _worst_client(got: list[TrainResult], ref: list[TrainResult]) -> float:
    """The largest difference of a client's whole update (every tensor), relative to its norm."""
    def flat(r: TrainResult) -> torch.Tensor:
        return torch.cat([r.delta[n].reshape(-1) for n in sorted(r.delta)])
    return max(float((flat(g) - flat(r)).norm() / flat(r).norm()) for g, r in zip(got, ref))


def _layout(method: str | None = None) -> Layout:
    return Layout.build(load_profile("resnet20-fmnist-wd"), method)


@pytest.mark.parametrize("k", [0, 2, 4])  # 0 and 2 skip blocks (depth-scaled, learnable step sizes); 4 is the full model
def test_batched_clients_train_as_one_by_one_in_float64(k: int) -> None:
    layout = _layout()
    start = GlobalState.init(layout, seed=1).extract(layout, k)
    cfg = TrainConfig(lr=0.1, momentum=0.9, weight_decay=5e-4, local_epochs=2)
    loaders = _batches(CLIENTS, steps=2, batch=16, dtype=torch.float64)
    ref = _one_by_one(layout, k, start, loaders, cfg, torch.float64)
    got = _together(layout, k, start, loaders, cfg, torch.float64)
    assert _worst(got, ref) < 1e-6
    for g, r in zip(got, ref):
        assert set(g.delta) == set(layout.upload_shapes(k))
        assert (g.num_samples, g.metrics["steps"]) == (r.num_samples, r.metrics["steps"]) == (32, 4)
        assert g.loss == pytest.approx(r.loss, rel=1e-12) and g.accuracy == r.accuracy
    # the clients did differ: each has its own batches, so its own delta and BN statistics
    assert float((got[0].delta["stem.conv.weight"] - got[1].delta["stem.conv.weight"]).norm()) > 1e-3
    assert float((got[0].delta["stem.bn.running_mean"] - got[1].delta["stem.bn.running_mean"]).norm()) > 1e-3
    assert all(float(g.delta[n].abs()) > 0 for g in got for n in g.delta if n.endswith(".step"))


def test_fixed_step_sizes_stay_fixed_when_batched() -> None:
    """nefl-nl: the step sizes are not trained, in either path."""
    layout = _layout("nefl-nl")
    start = GlobalState.init(layout, seed=0).extract(layout, 1)
    loaders = _batches(2, steps=2, batch=16, dtype=torch.float64)
    got = _together(layout, 1, start, loaders, TrainConfig(), torch.float64)
    ref = _one_by_one(layout, 1, start, loaders, TrainConfig(), torch.float64)
    steps = [n for n in layout.upload_shapes(1) if n.endswith(".step")]
    assert steps and all(float(g.delta[n].abs()) == 0 for g in got for n in steps)
    assert _worst(got, ref) < 1e-6


def _float32_step(device: str, ks: tuple[int, ...] = (0, 4)) -> None:
    layout = _layout()
    state = GlobalState.init(layout, seed=0)
    for k in ks:
        start = state.extract(layout, k)
        loaders = _batches(CLIENTS, steps=1, batch=32, dtype=torch.float32, seed=k)
        ref = _one_by_one(layout, k, start, loaders, TrainConfig(), torch.float32, device)
        got = _together(layout, k, start, loaders, TrainConfig(), torch.float32, device)
        assert _worst_client(got, ref) < 1e-3
        assert all(g.loss == pytest.approx(r.loss, rel=1e-5) for g, r in zip(got, ref))


def test_one_float32_step_agrees_within_the_order_of_its_sums() -> None:
    _float32_step("cpu")


def test_clients_trained_together_need_batches_of_one_size() -> None:
    layout = _layout()
    start = GlobalState.init(layout, seed=0).extract(layout, 0)
    loaders = [_batches(1, 1, 32, torch.float32)[0], _batches(1, 1, 16, torch.float32)[0]]
    with pytest.raises(ValueError, match="one size"):
        _together(layout, 0, start, loaders, TrainConfig(), torch.float32)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_one_float32_step_agrees_on_cuda() -> None:
    _float32_step("cuda")


@cuda
def test_bf16_autocast_trains_on_cuda() -> None:
    """bfloat16 autocast: both paths run, and the losses stay within bfloat16's precision of float32's."""
    layout = _layout()
    start = GlobalState.init(layout, seed=0).extract(layout, 4)
    loaders = _batches(CLIENTS, steps=3, batch=32, dtype=torch.float32)
    full = _together(layout, 4, start, loaders, TrainConfig(), torch.float32, "cuda")
    half = _together(layout, 4, start, loaders, TrainConfig(), torch.float32, "cuda", autocast=torch.bfloat16)
    alone = local_train(layout.module(4), start, loaders[0], TrainConfig(), device="cuda", autocast=torch.bfloat16)
    for h, f in zip(half, full):
        assert all(bool(torch.isfinite(d).all()) for d in h.delta.values())
        assert h.loss == pytest.approx(f.loss, rel=0.05)
    assert alone.loss == pytest.approx(full[0].loss, rel=0.05)
