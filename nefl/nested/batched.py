"""Several clients of one submodel trained together: torch.func.vmap over stacked per-client weights.

Every client keeps what it has in `local_train`: its own batches (the same seeded loader), its own BatchNorm
batch statistics and running statistics (buffers stacked per client and updated in place under vmap), its own
step sizes (learnable ones are parameters like any other; fixed ones stay frozen) and its own SGD state. The
clients only share the kernel launches, so results agree with training them one after the other up to the
floating-point order of the batched kernels (tests/unit/nested/test_batched.py says how close).

Clients train in lockstep, so they must see batches of the same sizes: callers group clients by submodel and
sample count (`group_key`)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn
from torch.func import functional_call, vmap

from nefl.nested.state import load_module_state
from nefl.nested.train import Batches, TrainConfig, TrainResult


def _sgd_step(params: list[torch.Tensor], grads: list[torch.Tensor], bufs: list[torch.Tensor] | None,
              config: TrainConfig) -> list[torch.Tensor] | None:
    """torch.optim.SGD's update (no dampening or Nesterov), in place on the stacked parameters; the momentum
    buffers it keeps (None without momentum)."""
    if config.weight_decay:
        grads = torch._foreach_add(grads, params, alpha=config.weight_decay)
    if config.momentum:
        if bufs is None:
            bufs = [g.detach().clone() for g in grads]
        else:
            torch._foreach_mul_(bufs, config.momentum)
            torch._foreach_add_(bufs, grads)
        grads = bufs
    torch._foreach_add_(params, grads, alpha=-config.lr)
    return bufs


def _stacked(tensors: dict[str, torch.Tensor], names: Sequence[str], clients: int, device: str) -> dict[str, torch.Tensor]:
    """One copy of every named tensor per client, stacked along a new leading dimension, on `device`."""
    return {n: tensors[n].detach().to(device).unsqueeze(0).repeat((clients,) + (1,) * tensors[n].dim()) for n in names}


def batched_train(model: nn.Module, start: dict[str, torch.Tensor], loaders: Sequence[Batches], config: TrainConfig,
                  upload: Sequence[str] | None = None, device: str = "cpu",
                  autocast: torch.dtype | None = None) -> list[TrainResult]:
    """`local_train` for len(loaders) clients that all start from `start` (one submodel's weights), trained
    together; one TrainResult per loader, in order. Every loader must yield batches of the same sizes in the
    same order. `autocast`: a lower precision (torch.bfloat16) for the forward and backward passes."""
    clients = len(loaders)
    if clients == 0:
        return []
    load_module_state(model, start)
    model.to(device).train()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    own = dict(model.named_parameters()) | dict(model.named_buffers())
    fixed = [n for n in own if n not in trainable]  # frozen step sizes, BN statistics and counters
    params = {n: t.requires_grad_() for n, t in _stacked(own, trainable, clients, device).items()}
    state = _stacked(own, fixed, clients, device)

    def loss_of(p: dict[str, torch.Tensor], s: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor):
        with torch.autocast(torch.device(device).type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            out = functional_call(model, (p, s), (x,))
            loss = nn.functional.cross_entropy(out if autocast is None else out.float(), y)
        return loss, (out.detach().argmax(-1) == y).sum()

    # vmap over the forward pass only; autograd's backward through the batched ops gives each client its own
    # gradient (the clients' losses are independent) and is as fast on a CPU as one client after the other,
    # where vmap(grad(...)) splits every convolution's backward in two
    losses_of = vmap(loss_of, randomness="different")  # dropout (MobileNet) draws per client
    t0 = time.perf_counter()
    bufs = None
    steps = 0
    zeros = torch.zeros(clients, dtype=torch.float64, device=device)
    last = (0, zeros, zeros)  # (seen, correct, loss sum) of the last pass, per client on the device: no sync per step
    for _ in range(config.local_epochs):
        seen, correct, loss_sum = 0, zeros.clone(), zeros.clone()
        for batch in zip(*loaders, strict=True):
            xs, ys = zip(*batch)
            if len({len(y) for y in ys}) != 1:
                raise ValueError("clients trained together need batches of one size: group them by sample count")
            x, y = torch.stack(xs).to(device), torch.stack(ys).to(device)
            loss, hits = losses_of(params, state, x, y)
            leaves = list(params.values())
            grads = torch.autograd.grad(loss.sum(), leaves, allow_unused=True, materialize_grads=True)
            with torch.no_grad():
                bufs = _sgd_step(leaves, list(grads), bufs, config)
            loss_sum += loss.detach().double() * y.shape[1]
            correct += hits
            seen += y.shape[1]
            steps += 1
        if seen:
            last = (seen, correct, loss_sum)
    seen, correct, loss_sum = last
    if seen == 0:
        raise ValueError("no training data: the client's partition is empty")
    names = list(start) if upload is None else list(upload)
    trained = params | state
    deltas = {n: (trained[n].detach().cpu().float() - start[n].float()) for n in names}
    seconds = (time.perf_counter() - t0) / clients  # each client's share of the group's time
    return [TrainResult({n: d[c] for n, d in deltas.items()}, seen, loss / seen, hits / seen, seconds,
                        {"steps": steps, "budget_cut": 0})
            for c, (loss, hits) in enumerate(zip(loss_sum.tolist(), correct.tolist()))]
