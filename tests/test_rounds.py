"""Round bookkeeping of the aggregator, in-process (the MQTT side is in test_federation.py)."""

import torch

from aggregator.federation import Federation
from nefl.profile import load_profile
from nefl.state import GlobalState, Layout


def _federation() -> Federation:
    layout = Layout.build(load_profile("resnet8-fmnist-w"))
    return Federation(layout, GlobalState.init(layout, seed=0), "t", clients_per_round=3, min_clients=1, round_timeout=60)


def _update(fed: Federation, client: str) -> None:
    k = fed.round.assignments[client]
    header = {"kind": "update", "federation": "t", "client": client, "round": fed.round.index, "submodel": k,
              "samples": 10, "metrics": {"loss": 1.0, "selection": "submodel 2/5: memory binds"}}
    fed.accept(client, header, {n: torch.zeros(s) for n, s in fed.layout.upload_shapes(k).items()}, 100)


def test_assignments_honour_what_each_device_announced() -> None:
    fed = _federation()
    for c, can in (("a", 1), ("b", 3), ("c", 5)):
        fed.announce(c, {"max_submodel": can, "samples": 10})
    r = fed.open_round(1, now=0.0)
    assert r.assignments == {"a": 0, "b": 2, "c": 4}


def test_device_that_cannot_train_now_is_not_picked() -> None:
    fed = _federation()
    fed.announce("a", {"max_submodel": 2, "samples": 10})
    fed.announce("b", {"max_submodel": 0, "samples": 10, "selection": "skip round: memory binds"})
    assert fed.available() == ["a"]
    assert set(fed.open_round(1, now=0.0).assignments) == {"a"}


def test_a_client_that_declines_mid_round_does_not_hold_the_round() -> None:
    fed = _federation()
    fed.announce("a", {"max_submodel": 5, "samples": 10})
    fed.announce("b", {"max_submodel": 5, "samples": 10})
    fed.open_round(1, now=0.0)
    fed.announce("b", {"max_submodel": 2, "samples": 10, "selection": "submodel 2/5: memory binds"})
    _update(fed, "a")
    assert fed.complete(now=1.0)  # long before the deadline at 60 s
    facts = fed.close_round()
    assert facts["declined"] == {"b": "submodel 2/5: memory binds"} and facts["reported"] == ["a"]
    assert facts["clients"]["a"]["selection"] == "submodel 2/5: memory binds"
