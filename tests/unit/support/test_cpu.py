"""nefl/support/cpu.py: the shares of a window between two CPU readings, against a direct computation."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nefl.support.cpu import MIN_WINDOW_S, CpuReading, window

seconds = st.floats(0, 1e4, allow_nan=False)


@given(st.integers(1, 64), seconds, seconds, seconds, st.floats(0, 1, allow_nan=False))
def test_a_window_splits_the_busy_time_into_the_process_and_everything_else(cores, wall, busy_s, own_s, idle_frac):
    total = wall * cores
    busy = min(busy_s, total) * (1 - idle_frac)
    own = min(own_s, busy)
    got = window(CpuReading(5.0, 7.0, 3.0), CpuReading(5.0 + busy, 7.0 + total, 3.0 + own), cores)
    if wall < MIN_WINDOW_S:
        assert got is None
        return
    assert got.percent == pytest.approx(100 * busy / total)
    assert got.own_cores == pytest.approx(own / wall, abs=1e-9)
    assert got.external_percent == pytest.approx(100 * (busy - own) / total, abs=1e-6)


def test_a_process_whose_times_cannot_be_read_leaves_only_the_total():
    got = window(CpuReading(0.0, 0.0, None), CpuReading(1.0, 4.0, 2.0), 2)
    assert got.percent == 25.0 and got.own_cores is None is got.external_percent
