"""Where a device keeps what it learns between runs: the cache root and its calibrations (who the
device is and which servers it trusts: edge_client/identity.py, under the same root).

All under $NEFL_CACHE_DIR (default ~/.cache/nefl). A module of its own, without torch, so that the
command lines can show these paths in --help at once.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE = Path(os.environ.get("NEFL_CACHE_DIR", "~/.cache/nefl")).expanduser()
CALIBRATION_DIR = CACHE / "calibration"  # edge_client/costmodel.py, keyed by device fingerprint and profile
