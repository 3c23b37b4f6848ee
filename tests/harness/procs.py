"""The process harness of the end-to-end tests: free ports, mosquitto, `aggregator serve` and `edge-client join`
as real processes (`Procs`, every one killed at teardown), waiting, and the run's metrics and status files."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nefl.nested.checkpoint import read_metrics
from nefl.nested.profile import load_profile
from nefl.nested.state import Layout

ROOT = Path(__file__).resolve().parents[2]
MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
PROFILE = "resnet20-fmnist-w"
needs_mosquitto = pytest.mark.skipif(not Path(MOSQUITTO).exists(), reason="mosquitto not installed (apt-get install mosquitto)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Procs:
    """Every process a test starts, killed at teardown whatever happened."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.procs = tmp, {}
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    # pinned server keys, calibrations and the aggregator's private keys stay per test
                    "NEFL_CACHE_DIR": str(tmp / "cache"), "NEFL_KEY_DIR": str(tmp / "keys")}

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "w")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.tmp)
        self.procs[name] = p
        return p

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()

    def mosquitto(self, port: int, extra: str = "") -> subprocess.Popen:
        conf = self.tmp / f"mosquitto-{port}.conf"
        # as root, mosquitto drops to user "mosquitto", which cannot read files in pytest's private tmp dirs
        user = "user root\n" if os.geteuid() == 0 else ""
        conf.write_text(f"listener {port} 127.0.0.1\npersistence false\n{user}{extra or 'allow_anonymous true'}\n")
        p = self.start(f"mosquitto-{port}", [MOSQUITTO, "-c", str(conf)])
        wait_for(lambda: port_open(port), 10, "mosquitto to listen")
        return p

    def aggregator(self, name: str, args: list[str]) -> subprocess.Popen:
        # SIGINT raises KeyboardInterrupt in serve (as Ctrl-C does) whatever the test process hands down: in one full
        # CI run serve ignored the test's SIGINT (SIGINT ignored or blocked is inherited across exec; the cause was not
        # found), so the child unblocks it and installs Python's own handler first
        ctrl_c = ("import signal; signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
                  "signal.signal(signal.SIGINT, signal.default_int_handler); ")
        return self.start(name, [sys.executable, "-c", ctrl_c + "from aggregator.cli import app; app()", "serve",
                                 "--profile", PROFILE, "--checkpoint-dir", str(self.tmp / "run"), *args])

    def client(self, name: str, broker: str, args: list[str]) -> subprocess.Popen:
        return self.start(name, [sys.executable, "-c", "from edge_client.cli import app; app()", "join",
                                 "--broker", broker, "--client-id", name, "--threads", "1", *args])

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_for(cond, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def metrics(tmp: Path) -> dict[int, dict]:
    return {m["round"]: m for m in read_metrics(tmp / "run")}  # a round's later scores merged into its line


def server_state(tmp: Path) -> dict:
    try:
        return json.loads((tmp / "run" / "status.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def finish(procs: Procs, name: str, timeout: float) -> None:
    try:
        rc = procs.procs[name].wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{name} did not finish in {timeout}s:\n{procs.log(name)[-3000:]}") from None
    assert rc == 0, procs.log(name)[-3000:]


def step_seconds_now(profile: str = PROFILE, batch: int = 32, steps: int = 3) -> float:
    """Seconds one training step of the profile's full model takes on this machine now (one thread,
    as the tests' devices): what an end-to-end test scales a deadline with when the machine is loaded."""
    layout = Layout.build(load_profile(profile))
    model = layout.module(layout.num_submodels - 1).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(batch, *layout.profile.input_shape)
    y = torch.randint(0, layout.profile.num_classes, (batch,))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = []
        for _ in range(steps + 1):  # the first one pays for allocations
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return sum(times[1:]) / steps


def serve_args(broker: list[str], rounds: int, timeout: float, per_round: int = 3, evaluate: bool = False) -> list[str]:
    args = [*broker, "--federation", "t", "--rounds", str(rounds), "--clients-per-round", str(per_round),
            "--min-clients", "1", "--round-timeout", str(timeout), "--join-wait", "10", "--batch-size", "16"]
    evaluation = ["--eval-dataset", "fashion-mnist", "--eval-samples", "300", "--final-eval-samples", "300"]
    return args + (evaluation if evaluate else [])


def client_args(i: int, samples: int, max_submodel: int, *extra: str) -> list[str]:
    # analytic cost estimates: calibration has its own tests, and would only slow these down
    return ["--federation", "t", "--partition", f"{i}/8", "--max-samples", str(samples), "--max-submodel", str(max_submodel),
            "--no-calibrate", *extra]
