"""A busy device still trains what fits (issue 22), with the real agent.

- the stale-announce race: a device announces "skip" right after training, the server reads it only
  after opening the next round with that device in it; the round must not lose the device, which
  trains the task it can train by then. A real `Server` (its message handling and round loop, no
  broker) and a real `Agent` exchange every message through their own code paths.
- a device that has just trained, alone or beside an external CPU hog (busy loops outside its process
  tree), takes the next task whose work its *measured* step time fits, and declines one it does not.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import msgspec
import pytest
import torch

from edge_client.agent import UPLOAD_SHARE, Agent, AgentConfig
from edge_client.device import MIN_BATCHES, DataConfig, DeviceConfig, LocalDevice
from nefl.protocol.messages import Decline
from nefl.protocol.signing import Signer, split_signed
from nefl.protocol.wire import Reassembler
from tests.harness.agent_fakes import T, FakeDevice, FakeServer, FakeTransport
from tests.harness.server_and_agent import Wire, wire_up as _wire


def _run_round(wire: Wire, index: int) -> dict:
    """The server's real round loop in a thread; the test thread plays the network and the agent's shell."""
    facts: dict = {}
    loop = threading.Thread(target=lambda: facts.update(wire.server.driver.run_round(index)), daemon=True)
    loop.start()
    end = time.monotonic() + 60
    while loop.is_alive() and time.monotonic() < end:
        wire.deliver_to_agent()
        wire.agent.tick()
        wire.deliver_to_server()
        time.sleep(0.02)
    loop.join(5)
    assert not loop.is_alive(), "the round did not close"
    return facts


def test_a_skip_announced_before_the_task_does_not_lose_the_device_or_its_round(tmp_path):
    device = FakeDevice(can=5)
    wire = _wire(tmp_path, device)
    wire.deliver_to_server(handle=True)  # the announce "<= 5"
    assert wire.server.fed.available() == ["c1"]
    device.can = 0  # right after a round the device is busy: it announces "skip"...
    wire.agent.plan()
    wire.deliver_to_server()  # ...which waits in the server's inbox while the server opens the next round
    assert wire.server.link.conn.inbox.qsize() == 1
    device.can = 5  # by the time the task arrives, the device can train it
    facts = _run_round(wire, 1)
    assert facts["reported"] == ["c1"] and facts["declined"] == {} and facts["closed_s"] < 25
    assert [r for r, _, _ in device.trained] == [1]
    assert wire.server.fed.available() == ["c1"]  # the idle device said so again; the next round may pick it


def test_a_device_that_truly_cannot_train_declines_and_the_round_does_not_wait(tmp_path):
    device = FakeDevice(can=5)
    wire = _wire(tmp_path, device)
    wire.deliver_to_server(handle=True)
    device.can = 0
    facts = _run_round(wire, 1)
    assert facts["reported"] == [] and list(facts["declined"]) == ["c1"] and "does not fit now" in facts["declined"]["c1"]
    assert facts["closed_s"] < 10 and device.trained == []  # closed on the decline, long before the 30 s deadline
    declines = [Decline.from_json(split_signed(p)[0]) for t, p, _ in wire.transport.published if t == T.decline("c1")]
    assert [(d.round, d.run) for d in declines] == [(1, wire.server.link.run_id)]


# -- the real device: measured step times decide ----------------------------------------------------

@pytest.fixture(scope="module")
def calibration(tmp_path_factory):
    return tmp_path_factory.mktemp("calibration")


@pytest.fixture
def hog():
    """Two busy loops that are not this process's descendants (double fork): someone else's load."""
    pids = []

    def start(n: int = 2) -> None:
        for _ in range(n):
            out = subprocess.run(["sh", "-c", f"timeout 300 {sys.executable} -c 'while 1: pass' >/dev/null 2>&1 & echo $!"],
                                 capture_output=True, text=True, check=True)
            pids.append(int(out.stdout))
        time.sleep(1.0)

    yield start
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)  # `timeout` passes it on to its busy loop
        except ProcessLookupError:
            pass


def _trained_step(transport: FakeTransport) -> float:
    """The seconds per step the device measured in its last round (its update's metrics)."""
    r, done = Reassembler(), None
    for m in transport.on(T.update("c1")):
        done = r.feed(m) or done
    return done.header.metrics["step_s"]


def _give(agent: Agent, server: FakeServer, k: int, round_: int, deadline_s: float) -> None:
    agent.dispatch(T.task("c1"), server.task(k=k, round=round_, deadline_s=deadline_s))
    for m in server.weights(k=k, round=round_):
        agent.dispatch(T.model_chunk(k, 0), m)
    agent.tick()


@pytest.fixture
def one_thread():
    """One torch thread, as the end-to-end tests' devices (`--threads 1`) and the calibration child."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("busy", [pytest.param(False, marks=pytest.mark.extended), True], ids=["just-trained", "beside-a-cpu-hog"])
def test_a_device_takes_the_next_task_its_measured_step_time_fits(tmp_path, calibration, hog, one_thread, busy):
    if busy:
        hog(2)
    server = FakeServer(tmp_path / "s")
    device = LocalDevice(DataConfig("fashion-mnist", "1/8", max_samples=320), DeviceConfig(cache_dir=calibration))
    transport = FakeTransport()
    agent = Agent(AgentConfig("c1", federation="t", pin_file=tmp_path / "pins" / "t.pub",
                              device_key=Signer.load_or_create(tmp_path / "keys", "c1.key")), transport, device)
    agent.dispatch(T.server_status, server.status())  # profile, calibration (cached across the two cases), announce
    k = agent.layout.num_submodels - 1
    if busy:  # the hog is someone else's load (the probe samples in the background: wait for its first reading)
        deadline = time.monotonic() + 30
        while (external := agent.device.prober.snapshot().external_cpu_percent) is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert external is not None and external >= 40, external

    _give(agent, server, k, 1, deadline_s=120.0)  # a first round of the largest submodel: one pass over 320 images
    step = _trained_step(transport)
    assert agent.selection is not None and agent.selection.submodel == agent.layout.num_submodels

    # right after training: a task whose MIN_BATCHES steps fit the time it leaves 2.5 times over is taken...
    roomy = 2.5 * MIN_BATCHES * step / (1 - UPLOAD_SHARE)
    _give(agent, server, k, 2, deadline_s=roomy)
    assert not transport.on(T.decline("c1")), msgspec.json.decode(split_signed(transport.on(T.decline("c1"))[0])[0])
    assert _trained_step(transport) > 0 and agent.last_upload[0] == ("run1", 2)
    predicted = agent.selection.fits[k].seconds / MIN_BATCHES  # the running calibration's step, from the new round
    assert predicted == pytest.approx(_trained_step(transport), rel=0.6)
    # ...and one in which not even a quarter of them fit is declined, never trained
    tight = 0.25 * MIN_BATCHES * _trained_step(transport) / (1 - UPLOAD_SHARE)
    _give(agent, server, k, 3, deadline_s=tight)
    (decline,) = (Decline.from_json(split_signed(p)[0]) for p in transport.on(T.decline("c1")))
    assert (decline.round, decline.submodel) == (3, k) and agent.last_upload[0] == ("run1", 2)
