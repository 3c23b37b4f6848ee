"""The robustness options `aggregator serve` and `aggregator simulate` share reach the AggregationConfig."""

from __future__ import annotations

import dataclasses

import pytest
import typer
from typer import _click as click

import aggregator.cli
from aggregator.robust_options import RobustnessOptions
from nefl.aggregation.config import AggregationConfig

REQUIRED = {"serve": [], "simulate": ["--profile", "resnet20-fmnist-wd"]}


def parsed(command: str, args: list[str]) -> RobustnessOptions:
    """The robustness group as the command's own command line fills it."""
    group = typer.main.get_command(aggregator.cli.app)
    _, cmd, _ = group.resolve_command(click.Context(group), [command])
    values = cmd.make_context(command, [*REQUIRED[command], *args]).params
    return RobustnessOptions(**{f.name: values[f.name] for f in dataclasses.fields(RobustnessOptions)})


@pytest.mark.parametrize("command", sorted(REQUIRED))
def test_tensor_clip_and_noise_reach_the_aggregation_config(command: str) -> None:
    agg = parsed(command, ["--tensor-clip", "1.5", "--tensor-noise", "0.25"]).robustness().aggregation
    assert (agg.tensor_clip, agg.tensor_noise) == (1.5, 0.25)
    default, agg = AggregationConfig(), parsed(command, []).robustness().aggregation
    assert (agg.tensor_clip, agg.tensor_noise) == (default.tensor_clip, default.tensor_noise)


@pytest.mark.parametrize("args", [["--tensor-clip", "0.5"], ["--tensor-noise", "-1"]])
def test_a_tensor_clip_below_one_or_a_negative_noise_is_refused(args: list[str]) -> None:
    with pytest.raises(click.exceptions.BadParameter):
        parsed("serve", args)


@pytest.mark.parametrize("command", sorted(REQUIRED))
def test_step_element_reaches_the_aggregation_config(command: str) -> None:
    assert parsed(command, ["--step-element", "2"]).robustness().aggregation.step_element == 2.0
    assert parsed(command, []).robustness().aggregation.step_element == AggregationConfig().step_element


def test_a_step_element_between_zero_and_one_is_refused_with_its_reason() -> None:
    with pytest.raises(ValueError, match="step_element"):
        parsed("serve", ["--step-element", "0.5"]).robustness()
