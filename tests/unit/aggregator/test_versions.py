"""Buffered mode of `aggregator serve` in-process (aggregator/versions.py): tasks from the newest version by the
coverage rule, updates judged against the version the server signed, commits at K, refusals with their reason code
(the MQTT side is tests/e2e/test_buffered_serve.py)."""

from __future__ import annotations

from collections import Counter

import msgspec
import pytest
import torch

from aggregator.federation import Federation, Rejected, Update
from aggregator.fleet import CoverageConfig
from aggregator.versions import OPEN_PER_CLIENT, RESUME_TASK_GAP, Versions
from nefl.aggregation.config import PLAIN_NEFEDAVG, AggregationConfig
from nefl.aggregation.pipeline import Robustness
from nefl.aggregation.robust import NormBound
from nefl.aggregation.staleness import StalenessConfig
from nefl.nested.checkpoint import UPDATES_TOTAL_KEY
from nefl.nested.profile import load_profile
from nefl.nested.state import GlobalState, Layout
from nefl.protocol.messages import Announce, Decline
from nefl.protocol.wire import ChunkHeader

PLAIN = Robustness(aggregation=PLAIN_NEFEDAVG)


def _versions(k: int = 2, max_staleness: int = 2, robustness: Robustness = PLAIN, rule: CoverageConfig = CoverageConfig(),
              devices: dict[str, int] | None = None) -> Versions:
    layout = Layout.build(load_profile("resnet8-fmnist-w"))
    fed = Federation(layout, GlobalState.init(layout, seed=0), "t", clients_per_round=3, min_clients=1,
                     round_timeout=60, robustness=robustness)
    for c, can in (devices or {"a": 1, "b": 3}).items():
        fed.set_online(c, True)
        fed.announce(c, Announce(client=c, max_submodel=can, samples=10))
    return Versions(fed, StalenessConfig(buffer_size=k, max_staleness=max_staleness), rule=rule)


def _update(v: Versions, client: str, number: int, k: int, scale: float = 0.01) -> Update:
    shapes = v.fed.layout.upload_shapes(k)
    return Update(client, number, k, 10, {n: torch.full(s, scale) for n, s in shapes.items()}, 100, {"loss": 1.0})


def _answer(v: Versions, client: str, scale: float = 0.01) -> None:
    """The device answers its oldest open task."""
    task = next(iter(v.open[client].values()))
    v.accept(_update(v, client, task.number, task.submodel, scale), now=0.0)


def test_every_able_device_gets_a_task_of_the_newest_version_within_its_bound() -> None:
    v = _versions()
    assert v.wanting() == ["a", "b"]
    a, b = v.issue("a"), v.issue("b")
    assert (a.submodel, a.version, b.submodel, b.version) == (0, 0, 2, 0)
    assert a.number != b.number and v.wanting() == []


def test_a_commit_at_k_updates_moves_the_version_and_the_state_and_says_each_staleness() -> None:
    v = _versions(k=2)
    before = v.fed.state.clone()
    for c in ("a", "b"):
        v.issue(c)
    _answer(v, "a")
    assert not v.due(0.0)
    _answer(v, "b")
    assert v.due(0.0)
    facts = v.commit()
    assert facts["committed"] and facts["version"] == facts["round"] == 1 == v.version
    assert facts["staleness"] == [0, 0] and facts["reported"] == ["a", "b"] and facts["updates_per_submodel"][:3] == [1, 0, 1]
    assert facts[UPDATES_TOTAL_KEY] == v.fed.trained_updates and v.fed.trained_updates[:3] == [1, 0, 1]
    assert v.fed.state is v.buffer.state
    moved = [n for n, t in v.fed.state.flat().items() if not torch.equal(t, before.flat()[n])]
    assert moved, "the committed version did not change the weights"
    assert sorted(v.wanting()) == ["a", "b"]  # their tasks are answered, and the version is newer
    assert len(v.buffer) == 0


def test_an_update_weighs_with_the_version_its_task_named_not_with_one_it_claims() -> None:
    v = _versions(k=1, max_staleness=4)
    old = v.issue("a")
    v.issue("b")
    _answer(v, "b")
    v.commit()  # version 1: a's task still names version 0
    v.accept(_update(v, "a", old.number, old.submodel), now=0.0)
    facts = v.commit()
    assert facts["staleness"] == [1]
    assert next(iter(facts["clients"].values()))["version"] == 0


def test_an_update_beyond_the_staleness_bound_is_refused_stale_and_the_device_is_told() -> None:
    v = _versions(k=1, max_staleness=1)
    old = v.issue("a")
    for _ in range(2):  # two versions pass while a trains
        v.issue("b")
        _answer(v, "b")
        v.commit()
    with pytest.raises(Rejected) as e:
        v.accept(_update(v, "a", old.number, old.submodel), now=0.0)
    assert e.value.reason == "stale"
    v.refused("a", old.number, e.value.reason)  # what the intake does with a signed update's refusal
    told = v.refusals.pop()
    assert (told.client, told.task.number, told.task.version, told.current, told.reason) == ("a", old.number, 0, 2, "stale")
    assert old.number not in v.open["a"] and len(v.buffer) == 0


def test_unassigned_wrong_submodel_and_duplicate_updates_are_refused() -> None:
    v = _versions(k=5)
    t = v.issue("b")
    with pytest.raises(Rejected, match="unassigned"):
        v.accept(_update(v, "a", t.number, t.submodel), now=0.0)  # another device's task
    with pytest.raises(Rejected, match="submodel_mismatch"):
        v.accept(_update(v, "b", t.number, 0), now=0.0)
    v.accept(_update(v, "b", t.number, t.submodel), now=0.0)
    with pytest.raises(Rejected, match="unassigned"):
        v.accept(_update(v, "b", t.number, t.submodel), now=0.0)  # answered once
    assert len(v.buffer) == 1


def test_header_checks_come_before_the_payload() -> None:
    v = _versions()
    t = v.issue("a")
    header = ChunkHeader(kind="update", federation="t", round=t.number, submodel=0, client="a", digest="0" * 64,
                         dtype="fp32", samples=10, metrics={}, size=1, chunk=1, count=1)
    assert v.check_header("a", header) == 0
    for bad, reason in ((dict(kind="model"), "wrong_kind"), (dict(federation="x"), "wrong_federation"),
                        (dict(client="b"), "client_mismatch"), (dict(round=t.number + 7), "unassigned")):
        with pytest.raises(Rejected, match=reason):
            v.check_header("a", msgspec.structs.replace(header, **bad))


def test_the_update_bound_of_the_sync_path_applies() -> None:
    v = _versions(k=5, robustness=Robustness(aggregation=AggregationConfig(centre_check=False), bound=NormBound(max_norm=1.0)))
    t = v.issue("a")
    with pytest.raises(Rejected, match="norm"):
        v.accept(_update(v, "a", t.number, t.submodel, scale=10.0), now=0.0)
    assert len(v.buffer) == 0


def test_refused_settings_fail_at_construction() -> None:
    with pytest.raises(ValueError, match="centre check"):
        _versions(robustness=Robustness())
    with pytest.raises(ValueError, match="median"):
        _versions(robustness=Robustness(aggregation=AggregationConfig(rule="median", centre_check=False)))


def test_steering_spreads_a_device_s_tasks_over_its_bound_and_the_lag_rule_stays_selectable() -> None:
    v = _versions(k=1, devices={"big": 3, "small": 1})
    given = []
    for _ in range(8):
        for c in ("big", "small"):
            t = v.issue(c)
            given.append((c, t.submodel))
            _answer(v, c)
            v.commit()
    big = [k for c, k in given if c == "big"]
    # the default steers: the big device's first task is its bound, then whatever within it was given least; the
    # small device keeps submodel 0 trained, so the big one's tasks go to 1 and 2 alike
    assert big[0] == 2 and all(k == 0 for c, k in given if c == "small")
    assert sorted(Counter(k for _, k in given).values()) == [8 - 4, 4, 8] and set(big) == {1, 2}
    lag = _versions(k=1, rule=CoverageConfig(steer_window=None, lag=2), devices={"big": 3})
    picks = []
    for _ in range(6):
        picks.append(lag.issue("big").submodel)
        _answer(lag, "big")
        lag.commit()
    # the lag rule: its bound mostly, a submodel below it untasked for `lag` versions now and then
    assert picks[0] == 2 and picks.count(2) > picks.count(1) >= 2, picks


def test_a_decline_settles_the_task_and_the_device_gets_another() -> None:
    v = _versions()
    t = v.issue("b")
    with pytest.raises(Rejected, match="stale_decline"):
        v.decline("b", Decline(client="b", federation="t", run="r", round=t.number + 1, submodel=t.submodel))
    v.decline("b", Decline(client="b", federation="t", run="r", round=t.number, submodel=t.submodel))
    assert "b" in v.wanting()


def test_a_device_keeps_a_bounded_number_of_open_tasks() -> None:
    v = _versions(k=1)
    first = v.issue("a")
    for _ in range(OPEN_PER_CLIENT):
        v.issue("a")
    assert len(v.open["a"]) == OPEN_PER_CLIENT and first.number not in v.open["a"]


def test_state_dict_resumes_version_coverage_and_task_numbers_with_an_empty_buffer() -> None:
    v = _versions(k=1)
    v.issue("a")
    _answer(v, "a")
    v.commit()
    v.issue("b")
    _answer(v, "b")  # buffered, then "the server stops"
    meta = v.state_dict()
    assert meta == {"mode": "buffered", "version": 1, "coverage": v.coverage.state_dict(), "next_task": 3}
    again = Versions.resumed(v.fed, v.cfg, meta["version"], CoverageConfig(), meta)
    assert (again.version, again.coverage.state_dict(), len(again.buffer)) == (1, v.coverage.state_dict(), 0)
    assert again.issue("a").number == 3 + RESUME_TASK_GAP  # the run before may have given 3, 4, ... after its commit
    fresh = Versions.resumed(v.fed, v.cfg, 0, CoverageConfig(), {})
    assert (fresh.version, fresh.next_task) == (0, 1)


@pytest.mark.parametrize("args, says", [
    (["--aggregator", "median"], "buffered mode weighs each by its staleness"),
    (["--centre-check"], "the centre check votes among a round's participants"),
    (["--dp-noise-multiplier", "1.0", "--max-update-norm", "1", "--clip"], "DP noise's accountant assumes sampled rounds"),
    (["--workers", "2"], "--workers/--remote-workers split a round's updates"),
    (["--assignment", "largest"], "buffered mode gives each task by its own coverage rule"),
])
def test_serve_refuses_what_buffered_mode_cannot_run_in_one_line_and_exit_2(tmp_path, args, says) -> None:
    from typer.testing import CliRunner

    from aggregator.cli import app
    result = CliRunner().invoke(app, ["serve", "--profile", "resnet8-fmnist-w", "--mode", "buffered", "--checkpoint-dir",
                                      str(tmp_path / "run"), "--broker", "mqtt://127.0.0.1:1", *args])
    assert result.exit_code == 2, result.output
    (line,) = [x for x in result.output.splitlines() if x.strip()]
    assert line.startswith("error: --mode buffered refuses this: ") and says in line, line
    assert not (tmp_path / "run").exists()  # refused before anything was started or written
