"""The options `aggregator serve` and `aggregator simulate` share, meaning the same in both: how a
federation's learning rate runs over the rounds and how its updates are screened and merged. The options
whose wording or default differs between the two (rounds, seed, assignment, ...) stay with each command.
Torch-free, so the commands' --help answers at once."""

from __future__ import annotations

from dataclasses import field

from aggregator.assignment import Assignment
from aggregator.robust_options import RobustnessOptions
from nefl.support.cli_options import ScheduleOption, WarmupOption
from nefl.support.option_groups import SharedOption, option_group
from nefl.support.settings import TrainConfig

# both commands' --assignment; each gives its default
AssignmentOption = SharedOption(Assignment, "--assignment", help=(
    "Which submodel a participant trains within the bound it announced: coverage (every submodel each round when the "
    "pool allows), largest (the bound), or paper (tier t picks among t-2..t+2)."))


@option_group("Learning-rate schedule")
class RunSpec:
    lr_schedule: ScheduleOption = TrainConfig.schedule
    warmup_rounds: WarmupOption = TrainConfig.warmup_rounds
    robust: RobustnessOptions = field(default_factory=RobustnessOptions)

    def check(self) -> None:
        """Fail now, in one line, on a schedule the training would refuse."""
        TrainConfig(schedule=self.lr_schedule, warmup_rounds=self.warmup_rounds)
