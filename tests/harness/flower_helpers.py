"""`flwr run` of the example app on Flower's simulation engine, for the tests and benchmarks/bench_flower.py.

`flwr run` starts a local SuperLink that stays up, detached, after the run: each call gets its own
Flower home (FLWR_HOME) and ports, and ends every process of that home, by id, when the run is over."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.harness.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "flower-nefl"


def flwr_run(home: Path, run_config: str, federation_config: str, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    """`flwr run examples/flower-nefl --stream -c RUN_CONFIG --federation-config FEDERATION_CONFIG` with this
    checkout's kit on the path and one torch thread per process; its result and wall seconds."""
    bin_dir = str(Path(sys.executable).parent)  # flwr starts flower-superlink from PATH
    env = {**os.environ, "FLWR_HOME": str(home), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()), "FLWR_LOCAL_CONTROL_API_PORT": str(free_port())}
    home.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        run = subprocess.run([str(Path(bin_dir) / "flwr"), "run", str(EXAMPLE), "--stream", "-c", run_config,
                              "--federation-config", federation_config],
                             env=env, cwd=home, capture_output=True, text=True, timeout=timeout)
    finally:
        kill_flower(home)
    return run, time.monotonic() - t0


def kill_flower(home: Path) -> None:
    """End every process started with this Flower home (SuperLink, SuperExec, the simulation, its Ray workers)."""
    mine = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("FLWR_HOME") == str(home):
                mine.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    for p in mine:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(mine, timeout=10)
