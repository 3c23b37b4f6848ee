"""nefl/support/heap.py: an aggregator's process keeps freed memory for the next message's buffer instead of handing
it back to the kernel and faulting it in again page by page."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

# buffers of 1..16 MiB, as updates of different submodels come in, each written (a receive) and freed
BUFFERS = """
import resource, sys
from nefl.support.heap import keep_freed_memory
if sys.argv[1] == "kept":
    assert keep_freed_memory()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    for mib in range(1, 17):
        b = bytearray(mib << 20)
        del b
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults(mode: str) -> int:
    return int(subprocess.run([sys.executable, "-c", BUFFERS, mode], env={**os.environ, "PYTHONPATH": str(ROOT)},
                              capture_output=True, text=True, check=True, timeout=60).stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a setting of glibc's malloc")
def test_freed_buffers_are_reused_without_page_faults() -> None:
    default, kept = page_faults("default"), page_faults("kept")
    # 3 x (1 + ... + 16) MiB of 4 KiB pages is about 35,000 faults when every buffer is fresh memory; kept, the
    # heap grows to the largest buffer once
    assert default > 20_000
    assert kept < default / 4
