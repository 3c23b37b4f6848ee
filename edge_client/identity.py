"""Where a device keeps who it is: its signing key per client id, and the aggregator keys it trusts.

`edge-client join` (training) and `edge-client serve --follow` (model rollout) sign with the same
device key, so the aggregator sees one identity per client id whatever the device does. Stdlib and
nefl/protocol/signing.py only: the small inference install imports this.
"""

from __future__ import annotations

from pathlib import Path

from edge_client.cache import CACHE
from nefl.protocol.signing import Signer

PIN_DIR = CACHE / "servers"  # aggregator keys trusted on first use
DEVICE_KEY_DIR = CACHE / "device-keys"  # this machine's device keys, one per client id


def device_signer(client_id: str, path: Path | None = None) -> Signer:
    """The device key of `client_id` (created 0600 on first use), at `path` or in DEVICE_KEY_DIR."""
    key_path = path or DEVICE_KEY_DIR / f"{client_id}.key"
    return Signer.load_or_create(key_path.parent, key_path.name)


def pin_file_for(pin_dir: Path, federation: str, host: str, port: int) -> Path:
    """Where the aggregator key of `federation` on that broker is remembered once trusted."""
    return pin_dir / f"{federation}@{host}_{port}.pub"


def run_file_for(pin_file: Path) -> Path:
    """Beside the pin: the newest run incarnation seen under that key (a device refuses older runs)."""
    return pin_file.with_suffix(".run")
