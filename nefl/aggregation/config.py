"""The aggregation rule's config: which registered rule merges a round's updates (nefl/aggregation/registry.py),
its settings, and the centre check's. Torch-free, like the registry, so the command lines show its defaults
and check a rule's name without loading torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nefl.aggregation import registry


@dataclass(frozen=True)
class AggregationConfig:
    """Which rule merges a round's updates, and the centre check that screens them first."""

    rule: str = "nefedavg"  # a name in nefl/aggregation/registry.py
    trim: float = 0.2  # trimmed mean: the fraction cut at each end of every covering set
    krum_fraction: float = 0.3  # multi-Krum: the share of a round's updates assumed hostile
    # drop updates pointing away from the round's majority, clip outsized ones, bound per-submodel tensors' steps at commit
    centre_check: bool = True
    min_agree: float = 0.5  # the least share of the round's other updates an update must point the same way as
    # pointing the same way: a sketch cosine above agree_z / sqrt(sketch size), agree_z spreads of the cosine of unrelated
    # vectors (-weights in a batch-norm net is near orthogonal to honest updates: the sign of its cosine is a coin flip),
    # or above agree_of_strongest x the round's strongest pairwise cosine where that is lower (rounds of weakly aligned
    # honest updates: nested submodels far apart in size)
    agree_z: float = 3.0
    agree_of_strongest: float = 0.5
    # the vote drops updates only while at least this share of the round's voters (updates within the size bound)
    # reach min_agree (a bare half dropped 4 honest updates of 10 in a late round of diverse updates)
    vote_quorum: float = 2 / 3
    max_norm_ratio: float = 3.0  # an update larger than this x the round's median relative norm is clipped to it
    min_cover: int = 3  # fewer covering updates than this: too thin for a robust statistic
    hold: int = 8  # updates the centre check judges together before it judges each arrival on its own
    sketch: int = 4096  # shared-core elements the centre check and Krum compare updates on
    # with the centre check: a per-submodel tensor's step at most step_k x the median of its peers' and history's
    step_k: float = 3.0
    # also each element of a per-submodel tensor's step at most step_element x that tensor's bound (step_k x the median
    # RMS), so a push concentrated in one channel (one batch-norm gamma) is cut there; 0: off (no-attack cost unmeasured)
    step_element: float = 0.0
    step_window: int = 8  # rounds of a tensor's history the step bound and the tensor screen remember
    # with the centre check: each named tensor of an update at most tensor_clip x its reference per-element size (the
    # round's median over the updates carrying it and its history; nefl/aggregation/tensor_screen.py)
    tensor_clip: float = 3.0
    tensor_noise: float = 0.0  # Gaussian noise on each kept update after clipping: std = this x its tensor's reference
    # with the centre check: consistent tensors of at most coordinate_max elements (the classifier) merged per element by
    # a trimmed mean cutting this fraction (at least one) of the covering kept copies at each end where min_cover cover an
    # element (nefl/aggregation/coordinate.py); 0: off
    coordinate_trim: float = 0.2
    coordinate_max: int = 1024
    # also clamp an element fewer copies cover than the tensor's best covered to its row's best covered range (widened);
    # off by default: it slows honest learning of the outer columns (docs/security.md, "The classifier merged per element")
    coordinate_rows: bool = False
    # the held-out gate at commit (nefl/aggregation/gate.py): needs eval data on the server; off until measured
    gate: bool = False
    gate_z: float = 3.0  # a submodel trips when its paired loss or error z exceeds this (after the margin's slack)
    gate_margin: float = 0.02  # nats of loss
    gate_error_margin: float = 0.03  # top-1 accuracy (a share of the gate set)
    gate_samples: int = 512  # held-out images the gate scores every candidate on (the last of the test split)
    gate_attribute: int = 32  # a round of at most this many updates keeps copies, so a tripped round can leave some out
    gate_max_out: float = 0.5  # the most updates left out of one round, as a share of them (at least one)
    # batch norm's running statistics recomputed by the server at commit, as exact batch statistics over stats_samples
    # held-out images of its own (after the gate's, left out of evaluation), in place of the devices' merged values: they
    # are estimates, not learned, so no device's word is needed for them (nefl/aggregation/pipeline.py); a server with
    # no data (serve without --eval-dataset) keeps the devices' merged values
    server_stats: bool = True
    stats_samples: int = 512
    # with server_stats and the per-element merge: each class's classifier row and bias taken back from the round's
    # plain average where that lowers the loss on the server's images (nefl/aggregation/coordinate.py, choose_rows)
    classifier_rows: bool = True
    # with server_stats: every submodel fine-tuned on the server's images at commit (finetune_epochs passes at
    # finetune_lr, merged by NeFedAvg; aggregator/statsdata.py, finetune), before the running statistics and the rows'
    # choice: what clean images do not exercise (a backdoor's trigger path) is unlearned (docs/security.md); the
    # devices' statistics (server_stats off) leave the server no images, and nothing is fine-tuned; 0: off
    finetune_epochs: int = 1
    finetune_lr: float = 0.01
    # with the fine-tuning: the vote does not drop an update that points along the server's own step of the last commit
    # (its fine-tuning on clean images; sketch cosine above the spread): updates of submodels far apart in size can point
    # apart on the shared core, and the vote dropped an honest one there (docs/security.md, "The server's step as a veto")
    server_veto: bool = True

    def __post_init__(self) -> None:
        registry.rule(self.rule)  # refuses a name the registry does not hold
        if not 0 <= self.trim < 0.5:
            raise ValueError(f"--trim must be in [0, 0.5), got {self.trim}")
        if not 0 <= self.krum_fraction < 0.5:
            raise ValueError(f"the Krum attacker fraction must be in [0, 0.5), got {self.krum_fraction}")
        if not 0 <= self.min_agree <= 1:
            raise ValueError(f"--min-agreement must be in [0, 1], got {self.min_agree}")
        if not 0.5 <= self.vote_quorum <= 1:
            raise ValueError(f"the vote's quorum must be in [0.5, 1], got {self.vote_quorum}")
        if not (math.isfinite(self.agree_z) and self.agree_z >= 0 and 0 <= self.agree_of_strongest <= 1):
            raise ValueError(f"need agree_z >= 0 (finite) and agree_of_strongest in [0, 1], got {self.agree_z}, "
                             f"{self.agree_of_strongest}")
        if not (math.isfinite(self.max_norm_ratio) and self.max_norm_ratio >= 1):
            raise ValueError(f"--max-norm-ratio must be a finite number >= 1, got {self.max_norm_ratio}")
        if self.min_cover < 3 or self.hold < 1 or self.sketch < 16:
            raise ValueError("need min_cover >= 3, hold >= 1 and sketch >= 16")
        if not (math.isfinite(self.step_k) and self.step_k >= 1) or self.step_window < 1:
            raise ValueError(f"need step_k >= 1 (finite) and step_window >= 1, got {self.step_k}, {self.step_window}")
        if not (math.isfinite(self.step_element) and (self.step_element == 0 or self.step_element >= 1)):
            raise ValueError(f"need step_element 0 (off) or >= 1 (finite), got {self.step_element}")
        if not (math.isfinite(self.tensor_clip) and self.tensor_clip >= 1 and math.isfinite(self.tensor_noise)
                and self.tensor_noise >= 0):
            raise ValueError(f"need tensor_clip >= 1 and tensor_noise >= 0 (finite), got {self.tensor_clip}, "
                             f"{self.tensor_noise}")
        if not (math.isfinite(self.gate_z) and self.gate_z > 0 and math.isfinite(self.gate_margin)
                and self.gate_margin >= 0 and 0 <= self.gate_error_margin < 1 and self.gate_samples >= 2
                and self.gate_attribute >= 0 and 0 < self.gate_max_out < 1):
            raise ValueError(f"need gate_z > 0, gate_margin >= 0, gate_error_margin in [0, 1), gate_samples >= 2, "
                             f"gate_attribute >= 0 and gate_max_out in (0, 1), got {self.gate_z}, {self.gate_margin}, "
                             f"{self.gate_error_margin}, {self.gate_samples}, "
                             f"{self.gate_attribute}, {self.gate_max_out}")
        if self.stats_samples < 1:
            raise ValueError(f"need stats_samples >= 1, got {self.stats_samples}")
        if self.finetune_epochs < 0 or not (math.isfinite(self.finetune_lr) and self.finetune_lr > 0):
            raise ValueError(f"need --finetune-epochs >= 0 and --finetune-lr > 0 (finite), got {self.finetune_epochs}, "
                             f"{self.finetune_lr}")
        if not 0 <= self.coordinate_trim < 0.5 or self.coordinate_max < 0:
            raise ValueError(f"need coordinate_trim in [0, 0.5) and coordinate_max >= 0, got {self.coordinate_trim}, "
                             f"{self.coordinate_max}")

    @property
    def spec(self) -> registry.Rule:
        """The rule's registry entry: its description, whether it merges partials, whether it needs root data."""
        return registry.rule(self.rule)

    @property
    def mergeable(self) -> bool:
        """Whether partial aggregates of several processes merge exactly (workers and relays)."""
        return self.spec.mergeable


# the paper's NeFedAvg with nothing in front of it: every update merged (running statistics too), no centre check (the
# benchmarks' baseline)
PLAIN_NEFEDAVG = AggregationConfig(centre_check=False, server_stats=False)
