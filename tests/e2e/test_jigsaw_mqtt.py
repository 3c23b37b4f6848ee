"""FedJigsaw over MQTT end to end: `aggregator jigsaw-serve` and four `edge-client jigsaw` processes on real mosquitto.

The runs are tiny (Fashion-MNIST shards of 160 images, the two smallest base architectures, one policy round and
two model-training rounds) so that each takes tens of seconds on two loaded cores; most of it is five processes
importing torch and loading the dataset.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nefl.jigsaw.sim import JigsawConfig, JigsawSimulator
from tests.harness.jigsaw_federation import final_accuracy, rows, start_federation
from tests.harness.procs import Procs, finish, needs_mosquitto, wait_for

CFG = JigsawConfig(archs=("cnn-2", "cnn-3"), clients=4, rounds=2, policy_rounds=1, critic_warmup=0,
                   max_samples_per_client=160, val_samples=40, probe_samples=32, test_per_client=40, eval_every=0, seed=3)


@pytest.mark.extended
@pytest.mark.slow
@needs_mosquitto
def test_four_devices_over_mqtt_reproduce_the_simulator(tmp_path: Path) -> None:
    procs = Procs(tmp_path)
    try:
        start_federation(procs, tmp_path, CFG)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as the devices: the same kernels, the same float order
        try:
            sim = JigsawSimulator(CFG)
            result = sim.run()
        finally:
            torch.set_num_threads(threads)
        finish(procs, "coordinator", 240)
        got = rows(tmp_path)
        assert [(r["round"], r["phase"], r["trained"]) for r in got] == [(0, "policy", 4), (1, "train", 4), (2, "train", 4),
                                                                          (3, "end", 4)]
        for mine, twin in zip(got, result.rounds):
            assert [mine["val_accuracy"][str(c)] for c in range(4)] == twin["val_accuracy"]  # bit-identical
            assert [[tuple(k) for k in mine["chains"][str(c)]] for c in range(4)] == \
                [[tuple(int(x[1:]) for x in key.split(".")) for key in chain] for chain in twin["chains"]]
            assert mine["rejected"] == {}
        final = final_accuracy(tmp_path)
        assert [final[f"d{c}"] for c in range(4)] == result.accuracy
        for c in range(4):  # the final chain's parameters, as the device trained them in the last round
            twin = {k: v for k, v in sim.fed.model(c).state_dict().items() if not k.endswith("num_batches_tracked")}
            mine = load_file(str(tmp_path / f"d{c}" / "final.safetensors"))
            assert set(mine) == set(twin)
            assert all(torch.equal(mine[k], twin[k]) for k in twin), c  # one torch thread on both sides: same float order
        moved = {k: sum(r["bytes"].get(k, 0) for r in got) for k in ("module_out", "module_in", "return_out", "return_in")}
        # each side counts what it sent or received into its next report: a source that reported its last round before
        # a borrower's fetch reached it (a fast host) never reports those module bytes, nor a return that came
        # after its last report; the receiving side of a module and the sending side of a return always report first
        assert 0 < moved["module_out"] <= moved["module_in"] and 0 < moved["return_in"] <= moved["return_out"], moved
    finally:
        procs.stop_all()


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory: pytest.TempPathFactory):
    """d3 returns every borrowed module scaled x1000; d2 is killed in the first model-training round."""
    tmp = tmp_path_factory.mktemp("hostile")
    procs = Procs(tmp)
    try:
        start_federation(procs, tmp, CFG, fetch_timeout=5, round_timeout=60, poisoner=3)
        wait_for(lambda: len(rows(tmp)) >= 1, 180, "the policy round to close")
        procs.procs["d2"].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        finish(procs, "coordinator", 240)
        yield tmp, procs, time.monotonic() - killed_at
    finally:
        procs.stop_all()


@pytest.mark.extended
@pytest.mark.slow
@needs_mosquitto
def test_a_device_that_goes_offline_mid_round_is_not_waited_for(hostile_run) -> None:
    tmp, procs, _ = hostile_run
    got = rows(tmp)
    assert [r["round"] for r in got] == [0, 1, 2, 3]
    assert got[1]["trained"] >= 3 and "2" not in got[2]["val_accuracy"] and got[2]["trained"] == 3
    final = final_accuracy(tmp)
    assert set(final) == {"d0", "d1", "d3"} and all(a > 0.1 for a in final.values()), final


@pytest.mark.extended
@pytest.mark.slow
@needs_mosquitto
def test_a_poisoned_module_is_rejected_counted_and_its_source_unhurt(hostile_run) -> None:
    tmp, procs, _ = hostile_run
    got = rows(tmp)
    assert sum(r["rejected"].get("norm_bound", 0) for r in got) >= 1, [r["rejected"] for r in got]
    assert "poisoned" in procs.log("d3")
    for c in (0, 1):  # honest sources: their final chains are finite and score well above chance
        state = load_file(str(tmp / f"d{c}" / "final.safetensors"))
        assert all(torch.isfinite(v).all() and v.abs().max() < 1e3 for v in state.values())
    final = final_accuracy(tmp)
    assert final["d0"] > 0.2 and final["d1"] > 0.2, final
