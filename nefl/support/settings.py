"""Settings the command lines show as defaults, in a module that imports no torch.

`--help` of a command must not wait seconds for torch, yet each default lives in one place, its
config dataclass or constant, read by the code that uses it and by the command line alike. The
ones a command line shows live here: the training protocol, NeFedAvg's weighting choice, the
update bounds' defaults, FLTrust's root set size and the simulated attacks' config (nefl/nested/train.py,
nefl/aggregation/aggregate.py, nefl/aggregation/robust.py, aggregator/rootdata.py and nefl/aggregation/attacks.py
use them from here). The aggregation rule's config is nefl/aggregation/config.py, torch-free beside the
registry of rules it names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from nefl.support.choices import check_choice

# step: the paper's ResNet protocol (x0.1 at the milestones); cosine: its pretrained-ViT protocol
Schedule = Literal["step", "cosine"]


@dataclass(frozen=True)
class TrainConfig:
    """The paper's protocol: SGD lr 0.1, no momentum or weight decay, batch 32, E local epochs.

    The one source of these defaults: the server, the simulator, the device cost model and the
    command lines read them from here (`TrainConfig.lr` ...), so they cannot drift apart."""

    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    batch_size: int = 32
    local_epochs: int = 1
    milestones: tuple[float, ...] = (0.5, 0.75)  # fractions of the rounds where lr drops x0.1
    lr_decay: float = 0.1
    schedule: Schedule = "step"
    warmup_rounds: int = 0  # linear warmup from lr / warmup_rounds, before either schedule

    def __post_init__(self) -> None:
        check_choice(Schedule, self.schedule, "learning-rate schedule")
        if self.warmup_rounds < 0:
            raise ValueError(f"warmup rounds must be >= 0, got {self.warmup_rounds}")

    def lr_at(self, round_index: int, total_rounds: int) -> float:
        """The round's lr. Per round, not per step: a task carries one lr, so a device needs no global
        step counter (the paper's 500 warmup steps of its ViT protocol are ~3 rounds: 156 steps a round)."""
        if round_index < self.warmup_rounds:
            return self.lr * (round_index + 1) / self.warmup_rounds
        if self.schedule == "cosine":
            done = (round_index - self.warmup_rounds) / max(1, total_rounds - self.warmup_rounds)
            return self.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, done)))
        drops = sum(1 for m in self.milestones if round_index >= m * total_rounds)
        return self.lr * self.lr_decay**drops

    def for_round(self, round_index: int, total_rounds: int) -> TrainConfig:
        """What a client trains round `round_index` with: the schedule's lr, everything else as is."""
        return replace(self, lr=self.lr_at(round_index, total_rounds))


# uniform: every update of a submodel counts the same (the paper); samples: by the client's sample count
Weighting = Literal["uniform", "samples"]

# Margins over honest updates' norms of more than 10x (relative to the submodel's weight norm) and 5x (to the
# median of its last 20 accepted norms): docs/security.md, "Bounded updates and differential privacy".
DEFAULT_RELATIVE = 10.0
DEFAULT_ADAPTIVE_K = 10.0
DEFAULT_WINDOW = 20
DEFAULT_WARMUP = 3  # clients with a recent norm: a median of 3 votes outvotes one attacker
# Far above any |w| of a trained state (the largest are BatchNorm running variances): 1e6 trips only on a
# broken state, never on training (docs/security.md).
DEFAULT_MAX_ABS = 1e6

# FLTrust's root set (aggregator/rootdata.py): the paper uses 100; a few batches more steady a cosine on small models
DEFAULT_ROOT_SAMPLES = 256

# the submodel ladder `aggregator serve` (ServeConfig) and `aggregator loadtest` start from
DEFAULT_PROFILE = "resnet20-fmnist-w"

# test images a served round is scored on (`aggregator serve --eval-samples`): resnet20-fmnist-w scores 1,000 in
# about 8 s on one x86 core, a few times that on a Raspberry Pi 4, well inside the 120 s round timeout;
# the last round is scored on the whole test split (docs/operations.md, "Evaluation")
DEFAULT_EVAL_SAMPLES = 1000

# Poisoning attacks of the simulator's attack suite (nefl/aggregation/attacks.py mounts them)
AttackName = Literal["sign-flip", "scaled-flip", "neg-weights", "noise", "label-flip", "backdoor", "alie", "bias-push",
                     "bn-poison", "boosted-backdoor", "durable-backdoor", "layer-local", "min-max", "min-sum", "adaptive"]
DATA_ATTACKS = ("label-flip", "backdoor", "boosted-backdoor", "durable-backdoor")  # trained on poisoned data
BACKDOORS = ("backdoor", "boosted-backdoor", "durable-backdoor")  # trained on triggered images: measured by their attack success
# Perturbation directions of min-max, min-sum and adaptive (Shejwalkar & Houmansadr, NDSS 2021): the inverse unit
# mean of the honest updates, their inverse coordinate-wise standard deviation, or the inverse sign of their mean
Direction = Literal["unit-mean", "std", "sign"]
# each attack's `scale` unless one is given: the sizes of docs/security.md's measurements (issue 41's for the new ones)
ATTACK_SCALES: dict[str, float] = {"bias-push": 2.7, "bn-poison": 2.0, "boosted-backdoor": 2.5,
                                   "durable-backdoor": 2.5, "layer-local": 2.0}
DEFAULT_ATTACK_SCALE = 9.0


@dataclass(frozen=True)
class Attack:
    kind: AttackName
    # scaled-flip: -scale x the honest delta; neg-weights: norm scale x the weights'; noise: x the honest norm;
    # bias-push: the upload's norm, x the honest one; bn-poison: per-submodel tensors moved by -scale x their weights
    # (running variances x (1 + scale)); boosted-, durable-backdoor: x its trained delta; layer-local: the poison's norm, x the
    # honest delta's. None: the kind's ATTACK_SCALES entry, else DEFAULT_ATTACK_SCALE
    scale: float | None = None
    target: int = 0  # backdoor, bias-push: the class a triggered image (every image) should become
    poison: float = 0.5  # backdoor: the share of the attacker's images that carry the trigger
    direction: Direction = "unit-mean"  # min-max, min-sum, adaptive: the perturbation's direction
    tolerance: float = 0.01  # min-max, min-sum, adaptive: the binary search stops when gamma is known to this (relative)

    def __post_init__(self) -> None:
        check_choice(AttackName, self.kind, "attack")
        check_choice(Direction, self.direction, "attack direction")
        if self.scale is None:
            object.__setattr__(self, "scale", ATTACK_SCALES.get(self.kind, DEFAULT_ATTACK_SCALE))
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"attack scale must be a positive finite number, got {self.scale}")
        if not 0 < self.poison <= 1:
            raise ValueError(f"poison share must be in (0, 1], got {self.poison}")
        if not 0 < self.tolerance < 1:
            raise ValueError(f"attack tolerance must be in (0, 1), got {self.tolerance}")

    @property
    def on_data(self) -> bool:
        return self.kind in DATA_ATTACKS

    @property
    def backdoor(self) -> bool:
        return self.kind in BACKDOORS


PAPER_WINDOW = 2  # the paper's tier t chooses among submodels t-2 .. t+2 (assignment "paper", simulated tiers)
