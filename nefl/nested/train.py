"""Local training and evaluation of one submodel, with the paper's optimiser defaults (TrainConfig,
which lives in the torch-free nefl/support/settings.py so command lines can show it without importing torch)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from nefl.nested.state import load_module_state, module_state
from nefl.support.settings import TrainConfig  # noqa: F401 (re-exported: nefl.nested.train.TrainConfig)

Batches = Iterable[tuple[torch.Tensor, torch.Tensor]]


class OutOfTime(ValueError):
    """Not even one step fits the time budget: nothing was trained."""


@dataclass
class TrainResult:
    delta: dict[str, torch.Tensor]
    num_samples: int
    loss: float
    accuracy: float
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)


def local_train(
    model: nn.Module, start: dict[str, torch.Tensor], batches: Batches, config: TrainConfig,
    upload: Iterable[str] | None = None, device: str = "cpu", time_budget_s: float | None = None,
    step_estimate_s: float = 0.0, autocast: torch.dtype | None = None,
) -> TrainResult:
    """Train from `start` for `config.local_epochs` passes over `batches` (already cut at the batch
    size by the caller) at `config.lr`; return the delta of `upload` names.

    With `time_budget_s`, a step is started only if it is expected to end within the budget (the
    mean of the steps so far; `step_estimate_s` before the first): a device with more data than its
    round deadline allows trains what fits instead of refusing the round, and does not overrun its
    deadline by a step. `metrics` says how many steps ran and whether the budget cut the epochs
    short; `num_samples` is the samples seen in the last (possibly partial) pass. OutOfTime when not
    even the first step fits. `autocast`: a lower precision (torch.bfloat16) for the forward pass.
    Loss and accuracy are summed on the device (no host synchronisation per step), in float64 as
    Python's floats would be."""
    load_module_state(model, start)
    model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    loss_fn = nn.CrossEntropyLoss()
    t0 = time.perf_counter()
    steps = 0
    last_pass: tuple = (0, 0, 0.0)  # (seen, correct, loss sum) of the last pass that took a step
    out_of_time = False
    for _ in range(config.local_epochs):
        if out_of_time:
            break
        seen = 0
        correct = torch.zeros((), dtype=torch.int64, device=device)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for x, y in batches:
            elapsed = time.perf_counter() - t0
            if time_budget_s is not None and elapsed + (elapsed / steps if steps else step_estimate_s) > time_budget_s:
                out_of_time = True
                break
            x, y = x.to(device), y.to(device)
            if time_budget_s is not None and torch.device(device).type == "cuda":
                torch.cuda.synchronize(device)  # the budget is wall time: the steps still queued count
            opt.zero_grad(set_to_none=True)
            with torch.autocast(torch.device(device).type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                out = model(x)
                loss = loss_fn(out if autocast is None else out.float(), y)
            loss.backward()
            opt.step()
            loss_sum += loss.detach().double() * len(y)
            correct += (out.argmax(1) == y).sum()
            seen += len(y)
            steps += 1
        if seen:
            last_pass = (seen, correct, loss_sum)
    seen, correct, loss_sum = last_pass[0], int(last_pass[1]), float(last_pass[2])
    if steps == 0 and out_of_time:
        raise OutOfTime(f"not even one step fits the {time_budget_s:.1f} s left (a step takes about {step_estimate_s:.2f} s)")
    if seen == 0:
        raise ValueError("no training data: the client's partition is empty")
    trained = module_state(model)
    names = list(start) if upload is None else list(upload)
    delta = {n: (trained[n].detach().cpu().float() - start[n].float()) for n in names}
    return TrainResult(delta, seen, loss_sum / seen, correct / seen, time.perf_counter() - t0,
                       {"steps": steps, "budget_cut": int(out_of_time)})


@torch.no_grad()
def evaluate(model: nn.Module, batches: Batches, device: str = "cpu") -> tuple[float, float]:
    """Top-1 accuracy and mean loss."""
    model.to(device).eval()
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    seen = correct = 0
    loss_sum = 0.0
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        out = model(x)
        loss_sum += loss_fn(out, y).item()
        correct += (out.argmax(1) == y).sum().item()
        seen += len(y)
    if seen == 0:
        raise ValueError("no evaluation data")
    return correct / seen, loss_sum / seen


@torch.no_grad()
def recompute_bn_stats(model: nn.Module, batches: Batches, device: str = "cpu") -> None:
    """HeteroFL's static BN: exact (cumulative) batch statistics over the given data."""
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    saved = [m.momentum for m in bns]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None
    model.to(device).train()
    for x, _ in batches:
        model(x.to(device))
    for m, mom in zip(bns, saved):
        m.momentum = mom
    model.eval()
