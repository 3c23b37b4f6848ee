"""Round bookkeeping of the aggregator, in-process (the MQTT side is in tests/e2e/test_serve_join.py)."""

import json
import logging
import random

import pytest
import torch

from aggregator.federation import ClientLimits, Federation, Rejected, Update
from nefl.nested.checkpoint import UPDATES_TOTAL_KEY
from nefl.nested.profile import load_profile
from nefl.nested.state import GlobalState, Layout
from nefl.protocol.messages import Announce, Decline


def _federation(assignment: str = "coverage", per_round: int = 3) -> Federation:
    layout = Layout.build(load_profile("resnet8-fmnist-w"))
    return Federation(layout, GlobalState.init(layout, seed=0), "t", clients_per_round=per_round, min_clients=1,
                      round_timeout=60, assignment=assignment)


def join(fed: Federation, client: str, msg: Announce) -> None:
    """What a device does on connect: status "online", then its announce."""
    fed.set_online(client, True)
    fed.announce(client, msg)


def _update(fed: Federation, client: str) -> None:
    k = fed.round.assignments[client]
    fed.accept(Update(client, fed.round.index, k, 10, {n: torch.zeros(s) for n, s in fed.layout.upload_shapes(k).items()},
                      100, {"loss": 1.0, "selection": "submodel 2/5: memory binds"}))


def _round(fed: Federation, index: int) -> dict:
    """Open a round, every participant reports, close it; returns the round's facts."""
    for c in fed.open_round(index, now=0.0).assignments:
        _update(fed, c)
    return fed.close_round()


def test_assignments_honour_what_each_device_announced() -> None:
    fed = _federation("largest")
    for c, can in (("a", 1), ("b", 3), ("c", 5)):
        join(fed, c, Announce(client=c, max_submodel=can, samples=10))
    r = fed.open_round(1, now=0.0)
    assert r.assignments == {"a": 0, "b": 2, "c": 4}


def test_device_that_cannot_train_now_is_not_picked() -> None:
    fed = _federation()
    join(fed, "a", Announce(client="a", max_submodel=2, samples=10))
    join(fed, "b", Announce(client="b", max_submodel=0, samples=10, selection="skip round: memory binds"))
    assert fed.available() == ["a"]
    assert set(fed.open_round(1, now=0.0).assignments) == {"a"}


def _decline(client: str, round_: int, k: int, reason: str = "") -> Decline:
    return Decline(client=client, federation="t", run="r", round=round_, submodel=k, reason=reason)


def test_a_client_that_declines_mid_round_does_not_hold_the_round() -> None:
    fed = _federation("largest")
    join(fed, "a", Announce(client="a", max_submodel=5, samples=10))
    join(fed, "b", Announce(client="b", max_submodel=5, samples=10))
    fed.open_round(1, now=0.0)
    fed.decline("b", _decline("b", 1, 4, "submodel 5 does not fit now (memory binds)"))
    _update(fed, "a")
    assert fed.complete(now=1.0)  # long before the deadline at 60 s
    facts = fed.close_round()
    assert facts["declined"] == {"b": "submodel 5 does not fit now (memory binds)"} and facts["reported"] == ["a"]
    assert facts["clients"]["a"]["selection"] == "submodel 2/5: memory binds"


def test_an_announce_sent_before_the_task_is_not_a_refusal_of_it() -> None:
    """The race of issue 22: a device announced "skip" right after training; the server read it only
    after opening the next round with that device in it. The round must keep waiting for the device
    (which may well train the task), and the announce only counts for later rounds."""
    fed = _federation("largest")
    join(fed, "a", Announce(client="a", max_submodel=5, samples=10, session="s", seq=1))
    r = fed.open_round(1, now=0.0)
    fed.announce("a", Announce(client="a", max_submodel=0, samples=10, selection="skip round", session="s", seq=2))
    assert r.assignments == {"a": 4} and r.declined == {} and not fed.complete(now=1.0)
    _update(fed, "a")
    assert fed.close_round()["reported"] == ["a"]
    assert fed.available() == []  # ...while the next round does not pick it until it announces again


def test_a_decline_counts_only_for_the_open_task_it_names() -> None:
    fed = _federation("largest")
    join(fed, "a", Announce(client="a", max_submodel=3, samples=10))
    fed.open_round(2, now=0.0)
    for stale in (_decline("a", 1, 2), _decline("a", 2, 1), _decline("b", 2, 2)):
        with pytest.raises(Rejected) as e:
            fed.decline("a", stale)
        assert e.value.reason in ("stale_decline", "client_mismatch")
    assert fed.round.assignments == {"a": 2}
    fed.decline("a", _decline("a", 2, 2))
    assert fed.round.assignments == {} and fed.complete(now=1.0)
    with pytest.raises(Rejected, match="stale_decline"):  # twice is once too many
        fed.decline("a", _decline("a", 2, 2))


def test_an_announce_older_than_one_already_taken_is_dropped() -> None:
    fed = _federation()
    join(fed, "a", Announce(client="a", max_submodel=3, samples=10, session="s", seq=5))
    with pytest.raises(Rejected, match="stale_announce"):
        fed.announce("a", Announce(client="a", max_submodel=0, samples=10, session="s", seq=4))
    fed.announce("a", Announce(client="a", max_submodel=3, samples=10, session="s", seq=5))  # a redelivery: harmless
    fed.announce("a", Announce(client="a", max_submodel=1, samples=10, session="new", seq=1))  # a restarted agent
    assert fed.clients["a"].max_submodel == 0


def test_coverage_trains_every_submodel_with_two_identical_clients() -> None:
    """The reported bug: two devices that can train everything got submodel 5 every round under
    `largest`; coverage rotates through the least-trained submodels instead."""
    fed = _federation(per_round=2)
    for c in ("a", "b"):
        join(fed, c, Announce(client=c, max_submodel=5, samples=10))
    facts = [_round(fed, i) for i in (1, 2, 3)]
    assert [f["assigned"] for f in facts] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}, {"a": 5, "b": 1}]
    assert facts[-1][UPDATES_TOTAL_KEY] == fed.trained_updates == [2, 1, 1, 1, 1]


def test_a_federation_resumes_from_its_checkpoint_meta() -> None:
    """What a checkpoint carries besides the weights, under the meta keys older checkpoints have; a resumed
    federation continues where the saved one stopped, and a meta without them leaves a fresh one as it is."""
    fed = _federation(per_round=2)
    for c in ("a", "b"):
        join(fed, c, Announce(client=c, max_submodel=5, samples=10))
    for i in (1, 2):
        _round(fed, i)
    saved = json.loads(json.dumps(fed.state_dict()))
    assert set(saved) == {"update_guard", "step_bound", "tensor_sizes", UPDATES_TOTAL_KEY} and saved[UPDATES_TOTAL_KEY] == [1, 1, 1, 1, 0]
    resumed = _federation(per_round=2)
    resumed.load_state_dict({"round": 2, **saved})
    assert resumed.state_dict() == saved and resumed.trained_updates == [1, 1, 1, 1, 0]
    fresh = _federation()
    before = fresh.state_dict()
    fresh.load_state_dict({"round": 2})
    assert fresh.state_dict() == before
    with pytest.raises(ValueError, match="3 update counts for 5 submodels"):
        fresh.load_state_dict({UPDATES_TOTAL_KEY: [1, 2, 3]})


def test_paper_policy_in_a_federation_uses_fixed_tiers_when_given() -> None:
    layout = Layout.build(load_profile("resnet8-fmnist-w"))
    fed = Federation(layout, GlobalState.init(layout, seed=0), "t", 1, 1, 60, assignment="paper", tiers={"a": 0})
    join(fed, "a", Announce(client="a", max_submodel=3, samples=10))
    assert {_round(fed, i)["assigned"]["a"] for i in range(1, 40)} == {1, 2, 3}


def test_a_submodel_untrained_for_three_rounds_is_warned_about(caplog) -> None:
    fed = _federation("largest", per_round=2)
    for c in ("a", "b"):
        join(fed, c, Announce(client=c, max_submodel=5, samples=10))
    with caplog.at_level(logging.WARNING, logger="aggregator.federation"):
        for i in (1, 2):
            _round(fed, i)
        assert not caplog.records
        _round(fed, 3)
    assert fed.trained_updates == [0, 0, 0, 0, 6]
    assert len(caplog.records) == 1
    msg = caplog.records[0].getMessage()
    assert "submodel(s) 1, 2, 3, 4 untrained for 3+ rounds" in msg and "--assignment coverage" in msg


def test_an_untrained_submodel_warning_names_the_deadline_when_it_binds(caplog) -> None:
    fed = _federation("coverage", per_round=2)
    why = "submodel 4/5 (gamma 0.8): deadline binds: submodel 5 would take 70.3 s, deadline 48 s"
    for c in ("a", "b"):
        join(fed, c, Announce(client=c, max_submodel=4, samples=10, selection=why))
    with caplog.at_level(logging.WARNING, logger="aggregator.federation"):
        for i in (1, 2, 3):
            _round(fed, i)
    msg = caplog.records[-1].getMessage()
    assert "submodel(s) 5 untrained" in msg and "raise --round-timeout" in msg and f"a: {why}" in msg


def test_unknown_policy_and_foreign_counts_are_refused() -> None:
    layout = Layout.build(load_profile("resnet8-fmnist-w"))
    with pytest.raises(ValueError, match="--assignment must be one of 'coverage', 'largest', 'paper'"):
        Federation(layout, GlobalState.init(layout, seed=0), "t", 1, 1, 60, assignment="magic")
    with pytest.raises(ValueError, match="3 update counts for 5 submodels"):
        Federation(layout, GlobalState.init(layout, seed=0), "t", 1, 1, 60, trained_updates=[1, 2, 3])


def _limited(**limits) -> Federation:
    layout = Layout.build(load_profile("resnet8-fmnist-w"))
    return Federation(layout, GlobalState.init(layout, seed=0), "t", clients_per_round=3, min_clients=1, round_timeout=60,
                      limits=ClientLimits(**limits))


def test_the_client_table_is_bounded_and_evicts_offline_clients_first() -> None:
    fed = _limited(max_clients=3)
    for c in ("a", "b", "c"):
        fed.set_online(c, True)
        fed.announce(c, Announce(client=c, max_submodel=1, samples=10), now=0.0)
    with pytest.raises(Rejected) as e:
        fed.announce("d", Announce(client="d", max_submodel=1, samples=10), now=1.0)
    assert e.value.reason == "client_table_full"
    fed.set_online("b", False, now=2.0)
    fed.announce("d", Announce(client="d", max_submodel=1, samples=10), now=3.0)
    assert sorted(fed.clients) == ["a", "c", "d"]


def test_offline_clients_are_forgotten_and_statuses_are_bounded_too() -> None:
    fed = _limited(max_clients=2, forget_after_s=100.0)
    fed.set_online("a", True)
    fed.announce("a", Announce(client="a", max_submodel=1, samples=10), now=0.0)
    fed.set_online("a", False, now=10.0)
    assert fed.forget_offline(now=50.0) == [] and fed.forget_offline(now=111.0) == ["a"]
    for i in range(50):  # statuses of ids that never announce cannot grow the server's memory
        fed.set_online(f"ghost{i}", True)
    assert len(fed.presence) == 2


def test_announces_are_rate_limited_per_client() -> None:
    fed = _limited(announces_per_minute=5)
    fed.set_online("a", True)
    for i in range(5):
        fed.announce("a", Announce(client="a", max_submodel=1, samples=10), now=float(i))
    with pytest.raises(Rejected) as e:
        fed.announce("a", Announce(client="a", max_submodel=1, samples=10), now=5.0)
    assert e.value.reason == "rate_limited"
    fed.set_online("b", True)
    fed.announce("b", Announce(client="b", max_submodel=1, samples=10), now=5.0)  # others are not affected
    fed.announce("a", Announce(client="a", max_submodel=1, samples=10), now=61.0)  # nor is a, a minute later


def test_an_announce_naming_another_client_is_refused() -> None:
    fed = _limited()
    with pytest.raises(Rejected) as e:
        fed.announce("a", Announce(client="b", max_submodel=1, samples=10))
    assert e.value.reason == "client_mismatch"


def test_a_participant_gone_offline_holds_the_round_only_for_the_grace_period() -> None:
    fed = _federation()
    for c in ("a", "b"):
        join(fed, c, Announce(client=c, max_submodel=5, samples=10))
    fed.open_round(1, now=0.0)
    _update(fed, "a")
    fed.set_online("b", False, now=5.0)  # its last will (or a broker restart sending every will)
    assert fed.gone_offline() == ["b"]
    assert not fed.complete(now=10.0)  # within the 10 s grace: it may come back and report
    fed.set_online("b", True, now=12.0)
    assert not fed.complete(now=20.0)  # it came back: wait for it again
    fed.set_online("b", False, now=21.0)
    assert fed.complete(now=31.5)  # gone for good: long before the 60 s deadline
    assert fed.close_round()["went_offline"] == ["b"]


@pytest.mark.parametrize("seed", range(5))
def test_complete_agrees_with_waiting_for_through_any_sequence_of_events(seed: int) -> None:
    """`complete` checks the participant it waited for last time first (O(1) per message); whatever happens in
    between (reports, refusals, declines, wills, returns, time), it answers as the full scan of `waiting_for` does."""
    rng = random.Random(seed)
    fed = _federation(per_round=8)
    clients = [f"c{i}" for i in range(8)]
    for c in clients:
        join(fed, c, Announce(client=c, max_submodel=5, samples=10))
    fed.open_round(1, now=0.0)
    now = 0.0
    for _ in range(60):
        now += rng.choice([0.0, 0.5, 3.0, 11.0])
        c, event = rng.choice(clients), rng.choice(["report", "refuse", "decline", "offline", "online", "none", "none"])
        r = fed.round
        if event == "report" and c in r.assignments and c not in r.received:
            _update(fed, c)
        elif event == "decline" and c in r.assignments and c not in r.received:
            fed.decline(c, _decline(c, 1, r.assignments[c]))
        elif event == "refuse":
            fed.refused(c, 1, "update_norm")
        elif event in ("offline", "online"):
            fed.set_online(c, event == "online", now=now)
        assert fed.complete(now=min(now, 59.0)) == (not fed.waiting_for(min(now, 59.0)))
    assert fed.complete(now=60.0)  # the deadline
