"""nefl/support/threads.py: a process that takes a stream of updates runs torch's and the BLAS's operations on one
thread, and gets the cores no other process keeps busy back for one large job (evaluation, FLTrust's root training)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from nefl.support.threads import free_cores

ROOT = Path(__file__).resolve().parents[3]

PROBE = """
import json, numpy, torch
import nefl.support.threads as threads
from threadpoolctl import threadpool_info
from nefl.support.threads import one_per_process, spare_cores

def blas():
    return sorted({p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"})

out = {"default": torch.get_num_threads()}
with spare_cores():  # before one_per_process: nothing to give back, nothing changed
    out["before"] = torch.get_num_threads()
one_per_process()
out["ingest"], out["ingest_blas"] = torch.get_num_threads(), blas()
threads.busy_elsewhere = lambda: 0.0  # an idle machine
with spare_cores():
    out["evaluation"] = torch.get_num_threads()
out["after"] = torch.get_num_threads()
threads.busy_elsewhere = lambda: float(out["default"])  # every core busy elsewhere
with spare_cores():
    out["busy"] = torch.get_num_threads()
print(json.dumps(out))
"""


def test_an_ingest_process_runs_on_one_thread_and_a_large_job_on_the_spare_cores() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = str(ROOT)
    got = json.loads(subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True,
                                    timeout=120).stdout)
    assert got["default"] == got["before"] >= 1
    assert got["ingest"] == 1 and got["ingest_blas"] in ([1], [])  # numpy without an OpenBLAS has no pool to limit
    assert got["evaluation"] == got["default"] and got["after"] == 1
    assert got["busy"] == 1


@given(st.integers(1, 256), st.floats(0, 1000))
def test_a_large_job_takes_the_cores_other_processes_leave_free(cores: int, busy: float) -> None:
    got = free_cores(cores, busy)
    assert 1 <= got <= cores
    assert got == 1 or got <= cores - busy + 0.25  # never a thread onto a core another process keeps busy
    assert got == cores or got + 1 > cores - busy + 0.25  # and no free core left out


def test_back_to_back_large_jobs_read_the_window_since_the_previous_one_without_waiting(monkeypatch) -> None:
    from nefl.support import threads

    waits: list[float] = []
    monkeypatch.setattr(threads, "_last", None)
    sleep = time.sleep
    monkeypatch.setattr(threads.time, "sleep", lambda s: (waits.append(s), sleep(s)))
    assert threads.busy_elsewhere() >= 0.0
    assert sum(waits) >= threads.MIN_WINDOW_S * 0.9  # the first job had no window yet: it watched for one
    waits.clear()
    sleep(threads.MIN_WINDOW_S * 1.5)  # the previous job's run
    assert threads.busy_elsewhere() >= 0.0 and waits == []
    monkeypatch.setattr(threads, "_last", (threads._last[0] - threads.MAX_WINDOW_S - 1, threads._last[1]))
    threads.busy_elsewhere()
    assert waits  # a window that old says little about now: it watched afresh


def test_a_platform_without_cpu_affinity_watches_every_core(monkeypatch) -> None:
    """macOS's psutil has no cpu_affinity: a server there still sizes its large jobs."""
    import psutil

    from nefl.support import threads

    real = psutil.Process()

    class NoAffinity:
        def __init__(self, *a) -> None:
            self._p = real

        def cpu_times(self):
            return self._p.cpu_times()

    monkeypatch.setattr(psutil, "Process", NoAffinity)
    monkeypatch.setattr(threads, "_last", None)
    assert 0.0 <= threads.busy_elsewhere() <= psutil.cpu_count()
