"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

import pytest

from tests.test_federation import Procs


@pytest.fixture
def procs(tmp_path):
    """Every process a test starts, killed at teardown whatever happened."""
    p = Procs(tmp_path)
    yield p
    p.stop_all()
