"""Where a device keeps what it learns between runs: calibrations, pinned server keys, its own keys.

All under $NEFL_CACHE_DIR (default ~/.cache/nefl). A module of its own, without torch, so that the
command lines can show these paths in --help at once.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE = Path(os.environ.get("NEFL_CACHE_DIR", "~/.cache/nefl")).expanduser()
CALIBRATION_DIR = CACHE / "calibration"  # edge_client/costmodel.py, keyed by device fingerprint and profile
PIN_DIR = CACHE / "servers"  # aggregator keys trusted on first use
DEVICE_KEY_DIR = CACHE / "device-keys"  # this machine's device keys, one per client id


def pin_file_for(pin_dir: Path, federation: str, host: str, port: int) -> Path:
    return pin_dir / f"{federation}@{host}_{port}.pub"
