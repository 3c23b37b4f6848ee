"""`aggregator status`: the live state of a federation, from the broker or from the run directory.

The server keeps its state retained on nefl/{federation}/server/status and mirrored in
{checkpoint-dir}/status.json, so a status query never talks to the server process itself.
"""

from __future__ import annotations

import json
import queue
import secrets
import sys
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import typer
from rich.console import Console
from rich.table import Table

from aggregator.server import METRICS_FILE, STATUS_FILE
from nefl.mqtt import QOS, parse_broker
from nefl.topics import Topics


def read_retained(url: str, federation: str, username: str | None, password: str | None, ca_cert: str | None,
                  timeout_s: float) -> dict[str, Any] | None:
    settings = parse_broker(url, username, password, ca_cert)
    topic = Topics(federation).server_status
    got: queue.Queue[bytes] = queue.Queue()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"nefl-status-{secrets.token_hex(4)}",
                         protocol=mqtt.MQTTv311)
    if settings.username:
        client.username_pw_set(settings.username, settings.password)
    if settings.tls:
        client.tls_set(ca_certs=settings.ca_cert)
    client.on_connect = lambda c, u, f, rc, p: c.subscribe(topic, QOS)
    client.on_message = lambda c, u, m: m.topic == topic and got.put(bytes(m.payload))
    client.connect(settings.host, settings.port, keepalive=10)
    client.loop_start()
    try:
        return json.loads(got.get(timeout=timeout_s))
    except (queue.Empty, json.JSONDecodeError, UnicodeDecodeError):
        return None
    finally:
        client.disconnect()
        client.loop_stop()


def show(status: dict[str, Any], metrics: list[dict[str, Any]]) -> None:
    console = Console()
    console.print(f"federation [bold]{status.get('federation')}[/]: {status.get('state')}, "
                  f"round {status.get('round')}/{status.get('rounds')}, profile {status.get('profile', {}).get('name')}")
    console.print(f"online clients: {', '.join(status.get('clients_online') or []) or '-'}")
    if status.get("participants"):
        console.print(f"this round: {len(status.get('reported') or [])}/{len(status['participants'])} reported")
    if status.get("rejected_total"):
        console.print(f"rejected messages: {status['rejected_total']}")
    rows = [m for m in metrics if m.get("accuracy")]
    if rows:
        table = Table("round", *[f"sub {i + 1}" for i in range(len(rows[0]["accuracy"]))], "wall s")
        for m in rows[-10:]:
            table.add_row(str(m["round"]), *[f"{a:.4f}" for a in m["accuracy"]], str(m.get("wall_s", "")))
        console.print(table)


def status_command(
    broker: str = typer.Option(None, help="Read the retained status from this broker (mqtt://HOST:PORT)."),
    federation: str = typer.Option("default", help="Federation name."),
    checkpoint_dir: str = typer.Option(None, help="Read status.json and metrics.jsonl here [default: runs/FEDERATION]."),
    username: str = typer.Option(None, envvar="NEFL_MQTT_USERNAME", help="Broker user."),
    password: str = typer.Option(None, envvar="NEFL_MQTT_PASSWORD", help="Broker password."),
    ca_cert: str = typer.Option(None, help="CA certificate for mqtts://."),
    timeout: float = typer.Option(5.0, help="Seconds to wait for the retained status."),
    as_json: bool = typer.Option(False, "--json", help="Print the raw status JSON."),
) -> None:
    """Show a federation's live state (round, clients, rejections, accuracy)."""
    run_dir = Path(checkpoint_dir or f"runs/{federation}")
    try:
        if broker:
            status = read_retained(broker, federation, username, password, ca_cert, timeout)
        else:
            status = json.loads((run_dir / STATUS_FILE).read_text()) if (run_dir / STATUS_FILE).exists() else None
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
    if status is None:
        print(f"error: no status for federation {federation!r} (is `aggregator serve` running? right --broker/--checkpoint-dir?)",
              file=sys.stderr)
        raise typer.Exit(1)
    metrics_path = run_dir / METRICS_FILE
    metrics = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()] if metrics_path.exists() else []
    if as_json:
        print(json.dumps(status, indent=1))
    else:
        show(status, metrics)
