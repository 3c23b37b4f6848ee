"""An authenticated device that poisons its updates, against the default aggregation, with real
processes on mosquitto: two honest `edge-client join`s and one real join whose delta is replaced by an
attack (tests/harness/attack_device.py). benchmarks/bench_attacks_serve.py runs the long versions and the
control federation for docs/security.md; this keeps the short one in the suite."""

from __future__ import annotations

import sys

import pytest

from tests.harness.procs import Procs, client_args, finish, free_port, metrics, needs_mosquitto, serve_args

pytestmark = pytest.mark.slow

ROUNDS = 4


def attacker(procs: Procs, broker: str, kind: str, scale: float = 9.0, first: int = 1, *extra: str):
    return procs.start("evil", [sys.executable, "-m", "tests.harness.attack_device", kind, str(scale), str(first), "join",
                                "--broker", broker, "--client-id", "evil", "--threads", "1", *client_args(3, 160, 5), *extra])


@pytest.mark.extended
@needs_mosquitto
@pytest.mark.timeout(420)
def test_a_flipped_scaled_delta_is_left_out_and_the_honest_ones_are_kept(procs, tmp_path):
    port = free_port()
    procs.mosquitto(port)
    broker = f"mqtt://127.0.0.1:{port}"
    procs.aggregator("agg", [*serve_args(["--broker", broker], ROUNDS, 90, per_round=3, evaluate=True),
                             "--profile", "resnet8-fmnist-w"])
    for i in (1, 2):
        procs.client(f"c{i}", broker, client_args(i, 160, 5))
    attacker(procs, broker, "scaled-flip")
    finish(procs, "agg", 360)
    m = metrics(tmp_path)
    rounds = [m[r] for r in range(1, ROUNDS + 1)]
    assert all(r["committed"] for r in rounds)
    for r in rounds:  # no honest update is rejected or left out
        assert set(r["reported"]) >= {"c1", "c2"}, r["reported"]
        assert r["rejected"] == {} and not ({"c1", "c2"} & set(r.get("dropped", {}))), r
    attacked = [r for r in rounds if "evil" in r["reported"]]
    assert attacked, "the attacker never got an update in"
    left_out = [r for r in attacked if r.get("dropped", {}).get("evil") == "against_centre"]
    # its flipped delta points away from the two honest ones; at most one round where its own honest
    # direction was itself at odds with theirs may only clip it
    assert len(left_out) >= len(attacked) - 1, [(r.get("dropped"), r.get("agreement")) for r in attacked]
