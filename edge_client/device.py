"""What the agent asks of the device it runs on: its data, what it can train now, and the training.

Kept apart from the agent's message handling so that the handling can be unit-tested with a fake
device (no dataset, no torch training), and so that everything that costs time or memory on a Pi
lives in one place.
"""

from __future__ import annotations

import logging
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from edge_client.cache import CALIBRATION_DIR
from edge_client.costmodel import CostTable, calibrate, estimate_costs
from edge_client.load import RunningCalibration
from edge_client.probe import Prober
from edge_client.select import DeviceBudget, Selection, select_submodel
from nefl.nested.data import BatchLoader, load_dataset, load_image_folder, parse_partition, partition_iid
from nefl.nested.state import Layout
from nefl.nested.train import TrainConfig, TrainResult, local_train
from nefl.protocol.messages import DeviceSummary, Task, TrainingSettings, finite_or_none

PARTITION_SEED = 0  # every client must cut the same permutation, or partitions overlap
MIN_BATCHES = 10  # a submodel is worth a round if at least this many batches fit the time budget
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataConfig:
    dataset: str = "fashion-mnist"
    partition: str = "1/1"
    data_root: str | None = None
    data_dir: str | None = None  # the device's own images (ImageFolder layout) instead of a torchvision split
    max_samples: int | None = None


@dataclass(frozen=True)
class DeviceConfig:
    max_submodel: int = 1000
    memory_budget: str | None = None  # emulate a smaller device (see edge_client.select.DeviceBudget)
    cpu_budget: float | None = None
    calibrate: bool = True  # measure one training step per submodel (cached) instead of the analytic estimate
    seed: int = 0
    torch_device: str = "cpu"
    recalibrate: bool = False  # measure again instead of reusing the cached calibration
    cache_dir: Path = CALIBRATION_DIR


class TrainTask(Protocol):
    """What training reads of a task: an MQTT `Task`, or a Flower one (nefl.protocol.messages.FlowerTask); read-only,
    as both are frozen messages."""

    @property
    def round(self) -> int: ...
    @property
    def submodel(self) -> int: ...
    @property
    def lr(self) -> float: ...
    @property
    def epochs(self) -> int: ...
    @property
    def batch_size(self) -> int: ...


class Device(Protocol):
    """The agent's view of the device (a fake in the agent's unit tests)."""

    samples: int

    def summary(self) -> DeviceSummary: ...

    def plan(self, layout: Layout, training: TrainingSettings, budget_s: float, cap: int,
             hold: int | None = None) -> Selection: ...

    def train(self, layout: Layout, task: Task, start: dict[str, torch.Tensor], budget_s: float) -> TrainResult: ...


class LocalDevice:
    """This machine: its data shard, its probes and cost model, and torch training."""

    def __init__(self, data: DataConfig, cfg: DeviceConfig) -> None:
        self.cfg = cfg
        self.train_set = (load_image_folder(data.data_dir, data.dataset) if data.data_dir
                          else load_dataset(data.dataset, data.data_root, train=True))
        index, parts = parse_partition(data.partition)
        self.indices = partition_iid(len(self.train_set), parts, PARTITION_SEED)[index][: data.max_samples]
        self.samples = len(self.indices)
        self.budget = DeviceBudget.parse(cfg.memory_budget, cfg.cpu_budget)
        self.prober = Prober()
        self._costs: dict[tuple[str, int], CostTable] = {}
        self.running = RunningCalibration()  # corrected after every round from the measured step time

    def summary(self) -> DeviceSummary:
        """What the server logs about this device, from the same probe that drives selection."""
        snap = self.budget.apply(self.prober.snapshot())
        mb = lambda n: None if n is None else n >> 20  # noqa: E731
        return DeviceSummary(machine=platform.machine()[:64], system=platform.system()[:64], cpus=snap.cpu_count,
                             mem_total_mb=mb(snap.memory_total), mem_available_mb=mb(snap.memory_available),
                             cpu_percent=finite_or_none(snap.cpu_percent), torch_threads=torch.get_num_threads())

    def costs(self, layout: Layout, batch: int) -> CostTable:
        """Per-submodel step time and peak memory, measured once per profile and batch size (cached on disk)."""
        key = (layout.profile.hash, batch)
        if key not in self._costs:
            if self.cfg.calibrate:
                n = layout.num_submodels
                log.info(f"calibrating: one training step per submodel of {layout.profile.name} at batch {batch} "
                         f"on {self.cfg.torch_device} (cached in {self.cfg.cache_dir} for later runs)")
                self._costs[key] = calibrate(layout, batch, device=self.cfg.torch_device, cache_dir=self.cfg.cache_dir,
                                             force=self.cfg.recalibrate, load=self.prober.snapshot,
                                             on_result=lambda k: log.info(f"calibrated submodel {k + 1}/{n}"))
            else:
                self._costs[key] = estimate_costs(layout, batch, threads=torch.get_num_threads())
        return self._costs[key]

    def plan(self, layout: Layout, training: TrainingSettings, budget_s: float, cap: int,
             hold: int | None = None) -> Selection:
        """The largest submodel that fits memory now and can do at least MIN_BATCHES batches in the
        training time `budget_s`: the device then trains as many batches as that time allows, not a
        fixed epoch."""
        work = min(self.samples, MIN_BATCHES * training.batch_size)
        return select_submodel(self.costs(layout, training.batch_size), self.budget.apply(self.prober.snapshot()),
                               work, 1, budget_s, cap, speed=self.budget.cpu_budget, hold=hold, running=self.running)

    def train(self, layout: Layout, task: TrainTask, start: dict[str, torch.Tensor], budget_s: float) -> TrainResult:
        torch.manual_seed(self.cfg.seed + task.round)
        table, k = self.costs(layout, task.batch_size), task.submodel
        predicted = self.running.step_seconds(table.costs[k], table, self.prober.snapshot())
        loader = BatchLoader(self.train_set, self.indices, task.batch_size, True, True, self.cfg.seed * 100003 + task.round)
        config = TrainConfig(lr=task.lr, batch_size=task.batch_size, local_epochs=task.epochs)
        # --cpu-budget stretches work to the emulated speed, so it also shrinks the time to work in
        res = local_train(layout.module(k), start, loader, config, upload=layout.upload_shapes(k),
                          device=self.cfg.torch_device, time_budget_s=budget_s * self.budget.cpu_budget,
                          step_estimate_s=predicted or 0.0)
        self._learn(task, table, predicted, res)
        time.sleep(self.budget.padding(res.seconds))  # really run as the slower device
        return res

    def _learn(self, task: Task, table: CostTable, predicted: float | None, res: TrainResult) -> None:
        """Compare the step time measured in this round with the prediction, log both, and correct the
        cost model for the next rounds (the snapshot's interval is this round's training)."""
        steps = int(res.metrics.get("steps", 0))
        if not steps:
            return
        measured = res.seconds / steps
        res.metrics["step_s"] = round(measured, 4)
        during = self.prober.snapshot()
        cost = table.costs[task.submodel]
        if predicted is None or self.running.observe(cost, table, measured, during) is None:
            return
        res.metrics["predicted_step_s"] = round(predicted, 4)
        log.info(f"round {task.round}: submodel {task.submodel + 1} took {measured:.3f} s a step, predicted "
                 f"{predicted:.3f} s ({measured / predicted - 1:+.0%}); others wanted {self.running.others_busy:.1f} "
                 f"of {during.cpu_count} cores; idle-device step now {self.running.measured[cost.index]:.3f} s "
                 f"(calibrated {cost.step_seconds:.3f} s, x{self.running.ratio(cost):.2f}: the scale of untrained submodels near it)",
                 extra={"round": task.round, "submodel": task.submodel + 1})
