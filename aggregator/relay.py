"""`aggregator relay`: a site's devices on their local broker, one partial per round over the WAN.

To the site's devices the relay's broker looks like the coordinator's: it copies the coordinator's
signed tasks (for the site's clients only), model chunks, control and server status down, and the
devices' announces and statuses up, so the coordinator picks and pins site devices like any other.
Updates stay on the site: the relay checks and sums them as an aggregator worker does (same checks,
same plan; aggregator/worker.py) and sends the coordinator a receipt per update and one partial
aggregate per round. Bytes crossing the WAN per round are then O(model) for updates, plus a few
hundred bytes per device for announces, statuses and tasks, instead of one update per device.
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import typer

from aggregator.worker import Worker, WorkerConfig, own_key, run_until_signalled
from nefl.cli_options import (CaCertOption, CertfileOption, KeyDirOption, KeyfileOption, LogFormatOption, LogLevelOption,
                              PasswordOption, UsernameOption)
from nefl.logs import setup_logging
from nefl.messages import MAX_CONTROL_BYTES
from nefl.signing import Signer
from nefl.mqtt import QOS, BrokerSettings, Connection, parse_broker

log = logging.getLogger("aggregator.worker")


class Relay(Worker):
    role = "relay"

    def __init__(self, cfg: WorkerConfig, upstream: BrokerSettings, site: BrokerSettings, key: Signer) -> None:
        super().__init__(cfg, upstream, key)
        self.site = Connection(site, f"nefl-relay-{cfg.federation}-{self.me}", None, b"", log)
        self.sources = [self.site]
        self.site_clients: set[str] = set()
        self.dropped = 0  # oversized control messages from the site, not copied up

    def subscriptions(self, conn: Connection) -> list[str]:
        t = self.topics
        if conn is self.site:
            return [t.update("+"), t.resend("+"), *t.relay_up()]
        return [t.workers_round, t.workers_close, *t.relay_down(), *(t.task(c) for c in sorted(self.site_clients))]

    def route(self, conn: Connection, topic: str, payload: bytes) -> None:
        t = self.topics
        if conn is self.site and any(t.client_of(topic, kind) for kind in ("announce", "status", "sent")):
            self._up(topic, payload)
        elif conn is self.up and (t.client_of(topic, "task") or t.is_model(topic)
                                  or topic in (t.control, t.server_status)):
            self.site.client.publish(topic, payload, qos=QOS, retain=True)  # all retained at the source
        else:
            super().route(conn, topic, payload)

    def _up(self, topic: str, payload: bytes) -> None:
        """A site device's announce, status or upload notice, copied up unchanged (the coordinator checks it,
        signature included); its task topic is followed from now on."""
        if len(payload) > MAX_CONTROL_BYTES:
            self.dropped += 1
            log.info(f"not relaying a {len(payload)}-byte message on {topic} (limit {MAX_CONTROL_BYTES})")
            return
        client = self.topics.client_of(topic, "announce")
        if client is not None and client not in self.site_clients:
            self.site_clients.add(client)
            self.up.client.subscribe(self.topics.task(client), qos=QOS)
        self.publish_up(topic, payload, retain=self.topics.client_of(topic, "sent") is None)


def relay_command(
    site_broker: str = typer.Option(..., help="mqtt://HOST:PORT of the site's broker, where its devices connect."),
    upstream: str = typer.Option(..., help="mqtt(s)://HOST:PORT of the coordinator's broker (`aggregator serve`); the "
                                 "credential and TLS options below are for this one."),
    federation: str = typer.Option("default", help="Federation name: the MQTT topic prefix nefl/NAME/."),
    relay_id: str = typer.Option(None, help="This relay's id (default: relay-HOSTNAME)."),
    server_key: str = typer.Option(None, envvar="NEFL_SERVER_KEY", help="The coordinator's public key (`aggregator key`): "
                                   "round plans not signed by it are refused."),
    key: Path = typer.Option(None, "--key", help="This relay's signing key (created 0600 if missing) [default: "
                             "KEY_DIR/FEDERATION/workers/ID.key]; authorise it on the coordinator."),
    key_dir: KeyDirOption = None,
    print_key: bool = typer.Option(False, "--print-key", help="Print this relay's public key (for `aggregator enroll "
                                   "ID --worker --key KEY` on the coordinator) and exit."),
    username: UsernameOption = None,
    password: PasswordOption = None,
    ca_cert: CaCertOption = None,
    certfile: CertfileOption = None,
    keyfile: KeyfileOption = None,
    log_level: LogLevelOption = "info",
    log_format: LogFormatOption = "plain",
) -> None:
    """Serve a site's devices on its own broker; send the coordinator one partial per round (docs/scale.md)."""
    setup_logging(log_level, log_format)
    rid = relay_id or f"relay-{socket.gethostname()}"[:64]
    signer = own_key(federation, rid, key, key_dir, print_key)
    run_until_signalled(lambda: Relay(WorkerConfig(federation, rid, shared=False, server_key=server_key),
                                      parse_broker(upstream, username, password, ca_cert, certfile, keyfile),
                                      parse_broker(site_broker), signer))
