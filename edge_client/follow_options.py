"""The options of `edge-client serve --follow`, apart from the follower itself (edge_client/follow_cli.py), which
imports the MQTT client: `serve --help` and a server that does not follow never load it."""

from __future__ import annotations

from dataclasses import field
from typing import Annotated, Optional

import typer

from nefl.support.cli_options import BrokerOptions, ClientIdOption, DeviceKeyOption, FederationOption, ServerKeyOption
from nefl.support.option_groups import option_group


@option_group("Following a federation (--follow)")
class FollowOptions:
    follow: Annotated[Optional[str], typer.Option(
        help="mqtt://HOST:PORT of a federation's broker: take the models its aggregator rolls out (`aggregator "
             "publish`), swapping them in while serving. docs/deploy.md")] = None
    federation: FederationOption("With --follow: the federation (topics nefl/NAME/).") = "default"
    server_key: ServerKeyOption("With --follow: the aggregator's public key (`aggregator key` prints it) or a file "
                                "holding it; default: the key `edge-client join` pinned for this broker.") = None
    client_id: ClientIdOption("With --follow: this device's id in rollout reports and canary lists (default: "
                              "edge-HOSTNAME).") = None
    device_key: DeviceKeyOption("With --follow: the key reports are signed with (default: the one `edge-client join` "
                                "uses for --client-id).") = None
    keep_free: Annotated[str, typer.Option(help="With --follow: disk space a download must leave free.")] = "64MiB"
    mqtt: BrokerOptions = field(default_factory=BrokerOptions)
