"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

import pytest

from tests.harness.procs import Procs


@pytest.fixture(autouse=True, scope="session")
def private_key_dir(tmp_path_factory):
    """Commands a test runs outside `Procs` keep their aggregator keys in a directory of the session, never
    in the user's ~/.config/nefl/keys."""
    mp = pytest.MonkeyPatch()
    mp.setenv("NEFL_KEY_DIR", str(tmp_path_factory.mktemp("keys")))
    yield
    mp.undo()


@pytest.fixture
def procs(tmp_path):
    """Every process a test starts, killed at teardown whatever happened."""
    p = Procs(tmp_path)
    yield p
    p.stop_all()
