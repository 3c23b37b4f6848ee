"""`edge-client serve --follow`: the options turned into a running follower (edge_client/follow.py).

Imported only when --follow is given: it brings in paho-mqtt. Every user error (broker URL, key,
client id, sizes) exits 2 with one line naming the fix, before anything listens.
"""

from __future__ import annotations

import logging
import socket
import threading
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console

from edge_client.follow import FollowConfig, Follower, RuntimeFactory, offline_report, run
from edge_client.cache import CACHE
from edge_client.identity import PIN_DIR, device_signer, pin_file_for
from edge_client.runtime import ExternalLoadProbe, Probe
from edge_client.serving import Serving
from edge_client.store import Store, StoreError
from nefl.protocol.mqtt import Connection, parse_broker
from nefl.protocol.signing import KeyFileError, public_key_arg
from nefl.protocol.topics import Topics, check_name
from nefl.support.units import parse_size

if TYPE_CHECKING:
    from edge_client.follow_options import FollowOptions

log = logging.getLogger("edge_client.follow")
console = Console(stderr=True)


def start_following(
    stop: threading.Event, following: FollowOptions, models: Path | None, include_untrained: bool, probe: Probe | None,
    build: RuntimeFactory, precision: str,
) -> tuple[Serving, threading.Thread, str]:
    """Load what the directory holds, connect, and follow in a daemon thread until `stop` is set.
    Returns the Serving the HTTP server answers from, the thread, and a line saying what serves."""
    federation, server_key = following.federation, following.server_key
    cid = following.client_id or f"edge-{socket.gethostname()}"
    try:
        if precision != "fp32":
            raise ValueError("--follow rolls out fp32 submodels only: drop --precision int8")
        check_name("client id", cid)
        topics = Topics(federation)
        settings = parse_broker(following.follow, *following.mqtt.credentials)
        pin = pin_file_for(PIN_DIR, federation, settings.host, settings.port)
        if server_key is None and not pin.is_file():
            raise ValueError("--follow needs the aggregator's public key to check what it rolls out: pass --server-key "
                             "KEY (`aggregator key --checkpoint-dir DIR` prints it)")
        cfg = FollowConfig(cid, federation, public_key_arg(server_key or str(pin)), device_signer(cid, following.device_key),
                           include_untrained=include_untrained, keep_free_bytes=parse_size(following.keep_free))
        store = Store(models or CACHE / "deploy" / federation)
    except (ValueError, KeyFileError, StoreError, OSError) as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
    memory_probe = probe or ExternalLoadProbe()
    conn = Connection(settings, f"{cid}-serve", topics.deploy_status(cid), partial(offline_report, cfg), log)
    serving = Serving()
    follower = Follower(cfg, conn.client, store, serving, build, lambda: memory_probe()[1])
    with console.status("loading and calibrating the current version..."):
        follower.load_current()
    thread = threading.Thread(target=run, args=(follower, conn, stop), name="edge-follow", daemon=True)
    thread.start()
    what = (f"v{follower.version}" if follower.version is not None else "nothing yet") + \
        f" of federation {federation!r} as {cid}, following {settings.url} (models in {store.root})"
    return serving, thread, what
