"""The aggregation rules by name (nefl/aggregation/registry.py): every registered rule begins through the seam,
names and help come from the registry alone, and the registry loads no torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest
import torch

import aggregator.robust_options as ro
from nefl.aggregation import registry
from nefl.aggregation.aggregate import RoundAggregate, RoundContext
from nefl.aggregation.centre_check import Screened
from nefl.aggregation.config import AggregationConfig
from nefl.aggregation.nefedavg import Mergeable, NeFedAvg
from nefl.aggregation.pipeline import Pipeline, Robustness
from nefl.nested.state import GlobalState, Layout
from tests.harness.helpers import FULL, tiny_profile
from tests.harness.brute_force import random_updates

ROOT = Path(__file__).resolve().parents[3]


def layout_and_state() -> tuple[Layout, GlobalState]:
    layout = Layout.build(tiny_profile([(0.5, 0.5, FULL), (1.0, 1.0, FULL)]))
    return layout, GlobalState.init(layout, seed=0)


def root_update(layout: Layout):
    return lambda state, k, index: {n: torch.ones(s) for n, s in layout.upload_shapes(k).items()}


class Toy(NeFedAvg):
    """A rule only this test registers: what the if-chain this registry replaced could not have begun."""

    name = "toy"


@pytest.mark.parametrize("name", list(registry.RULES))
@pytest.mark.parametrize("centre_check", [False, True])
def test_every_registered_rule_begins_adds_and_finalizes(name: str, centre_check: bool) -> None:
    spec = registry.RULES[name]
    cls = spec.load()
    assert issubclass(cls, RoundAggregate) and cls.name == name
    layout, state = layout_and_state()
    cfg = AggregationConfig(rule=name, centre_check=centre_check)
    assert cfg.spec is spec and cfg.mergeable == spec.mergeable
    rule = Pipeline(layout, Robustness(aggregation=cfg), reference=root_update(layout) if spec.root_data else None)
    ups = random_updates(layout, [1, 2], torch.Generator().manual_seed(0))
    agg = rule.begin_round(state, {f"c{i}": k for i, (k, _, _) in enumerate(ups)}, 1)
    assert type(agg.inner if centre_check else agg) is cls and agg.name == name
    assert isinstance(agg, Screened) == centre_check
    assert isinstance(agg, Mergeable) == spec.mergeable  # the registry's flag, behind the centre check too
    for i, (k, d, ns) in enumerate(ups):
        agg.add(k, d, ns, client=f"c{i}")
    new = agg.finalize(state)
    assert set(new.consistent) == set(state.consistent)


def test_a_rule_that_needs_root_data_refuses_to_start_without_it() -> None:
    layout, _ = layout_and_state()
    for spec in registry.RULES.values():
        if spec.root_data:
            with pytest.raises(ValueError, match="--root-data"):
                Pipeline(layout, Robustness(aggregation=AggregationConfig(rule=spec.name)))


def test_a_registered_rule_is_one_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registering a rule is all the config, the Pipeline and the help need."""
    with pytest.raises(ValueError, match="aggregator must be one of 'nefedavg'"):
        AggregationConfig(rule="toy")
    monkeypatch.setitem(registry.RULES, "toy", registry.Rule("toy", "a test's", f"{__name__}:Toy", mergeable=True))
    layout, state = layout_and_state()
    agg = Pipeline(layout, Robustness(aggregation=AggregationConfig(rule="toy", centre_check=False))).begin_round(state, {"a": 0}, 1)
    assert type(agg) is Toy and agg.name == "toy"
    assert "toy (a test's)" in registry.help_text()
    assert type(Toy.begin(RoundContext(layout, AggregationConfig(rule="toy")))) is Toy


def test_the_aggregator_option_and_the_config_take_their_names_from_the_registry() -> None:
    option = get_args(ro.Rule)[1]
    assert option.help == registry.help_text()
    for spec in registry.RULES.values():
        assert f"{spec.name} ({spec.description})" in option.help
        AggregationConfig(rule=spec.name)


def test_the_registry_and_the_options_load_no_torch() -> None:
    code = ("import sys; sys.modules['torch'] = None; import aggregator.robust_options; "
            "from nefl.aggregation.registry import RULES; from nefl.aggregation.config import AggregationConfig; "
            "[AggregationConfig(rule=r).mergeable for r in RULES]")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
