"""`aggregator status`: the live state of a federation, from the broker or from the run directory.

The server keeps its state retained on nefl/{federation}/server/status and mirrored in
{checkpoint-dir}/status.json, so a status query never talks to the server process itself.
"""

from __future__ import annotations

import json
import logging
import queue
import secrets
import time
from pathlib import Path
from typing import Any

import msgspec
import paho.mqtt.client as mqtt
import typer
from rich.table import Table

from nefl.support.cli_options import BrokerOption, BrokerOptions, CheckpointDirOption, FederationOption, JsonOption, LogOptions
from nefl.support.option_groups import grouped
from nefl.support.logs import console, setup_logging
from nefl.protocol.messages import MAX_STATUS_BYTES, MessageError, ServerStatus
from nefl.protocol.mqtt import QOS, BrokerSettings, parse_broker
from nefl.protocol.topics import Topics

log = logging.getLogger(__name__)


def read_retained(settings: BrokerSettings, federation: str, timeout_s: float) -> dict[str, Any] | None:
    topic = Topics(federation).server_status
    got: queue.Queue[bytes] = queue.Queue()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"nefl-status-{secrets.token_hex(4)}",
                         protocol=mqtt.MQTTv311)
    if settings.username:
        client.username_pw_set(settings.username, settings.password)
    if settings.tls:
        client.tls_set(ca_certs=settings.ca_cert, certfile=settings.certfile, keyfile=settings.keyfile)
    client.on_connect = lambda c, u, f, rc, p: c.subscribe(topic, QOS)
    client.on_message = lambda c, u, m: m.topic == topic and got.put(bytes(m.payload))
    client.connect(settings.host, settings.port, keepalive=10)
    client.loop_start()
    try:  # whatever sits on the topic is parsed by the strict loader: a hostile retained message is just "no status"
        return msgspec.to_builtins(ServerStatus.from_json(got.get(timeout=timeout_s), MAX_STATUS_BYTES))
    except (queue.Empty, MessageError):
        return None
    finally:
        client.disconnect()
        client.loop_stop()


def show(status: dict[str, Any], metrics: list[dict[str, Any]]) -> None:
    out = console()
    out.print(f"federation [bold]{status.get('federation')}[/]: {status.get('state')}, "
                  f"round {status.get('round')}/{status.get('rounds')}, profile {status.get('profile', {}).get('name')}")
    online = status.get("clients_online") or []
    more = (status.get("clients_online_count") or len(online)) - len(online)
    # a finished (or dead) server no longer hears devices leave: its last list is history, and says so
    live = status.get("state") not in ("finished", "offline")
    said = time.time() - status["time"] if status.get("time") else None
    label = "online clients" if live else "clients online when it stopped"
    out.print(f"{label} ({len(online) + more}): {', '.join(online) or '-'}" + (f" and {more} more" if more > 0 else "")
              + ("" if said is None else f" (as of {said:.0f} s ago)"))
    if status.get("participants"):
        out.print(f"this round: {len(status.get('reported') or [])}/{len(status['participants'])} reported")
    if status.get("rejected_total"):
        out.print(f"rejected messages: {status['rejected_total']}")
    rows = [m for m in metrics if m.get("accuracy")]
    if rows:
        table = Table("round", *[f"sub {i + 1}" for i in range(len(rows[0]["accuracy"]))], "wall s")
        for m in rows[-10:]:
            table.add_row(str(m["round"]), *[f"{a:.4f}" for a in m["accuracy"]], str(m.get("wall_s", "")))
        out.print(table)


@grouped
def status_command(
    broker: BrokerOption("Read the retained status from this broker (mqtt://HOST:PORT).") = None,
    federation: FederationOption() = "default",
    checkpoint_dir: CheckpointDirOption("Read status.json and metrics.jsonl here (default runs/FEDERATION).") = None,
    timeout: float = typer.Option(5.0, help="Seconds to wait for the retained status."),
    as_json: JsonOption = False,
    *,
    access: BrokerOptions,
    logs: LogOptions,
) -> None:
    """Show a federation's live state (round, clients, rejections, accuracy).

    With --json, the raw status JSON is printed."""
    from aggregator.control_plane import STATUS_FILE  # here, not at the top: `status --help` needs no torch
    from nefl.nested.checkpoint import read_metrics

    setup_logging(logs.log_level, logs.log_format)
    run_dir = Path(checkpoint_dir or f"runs/{federation}")
    try:
        if broker:
            status = read_retained(parse_broker(broker, *access.credentials), federation, timeout)
        else:
            status = json.loads((run_dir / STATUS_FILE).read_text()) if (run_dir / STATUS_FILE).exists() else None
    except (OSError, ValueError) as e:
        log.error(f"{broker or run_dir}: {e}")
        raise typer.Exit(2) from None
    if status is None:
        log.error(f"no status for federation {federation!r} (is `aggregator serve` running? right --broker/--checkpoint-dir?)")
        raise typer.Exit(1)
    metrics = read_metrics(run_dir)
    if as_json:
        print(json.dumps(status, indent=1))
    else:
        show(status, metrics)
