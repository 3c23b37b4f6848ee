"""Options several commands share, declared once so their flags, environment variables and help agree.

Each is an Annotated type: a command declares `password: PasswordOption = None` and gets the same
`--password` (env NEFL_MQTT_PASSWORD) as every other command that talks to a broker. This module
imports neither torch nor paho, so the small inference install's commands can use it too.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from nefl.support.logs import LogFormat, LogLevel

ENV_USERNAME, ENV_PASSWORD, ENV_CA_CERT = "NEFL_MQTT_USERNAME", "NEFL_MQTT_PASSWORD", "NEFL_CA_CERT"

# the broker's credentials and TLS files, in nefl.protocol.mqtt.parse_broker's argument order
UsernameOption = Annotated[Optional[str], typer.Option("--username", envvar=ENV_USERNAME, help="Broker user.")]
PasswordOption = Annotated[Optional[str], typer.Option("--password", envvar=ENV_PASSWORD, help="Broker password.")]
CaCertOption = Annotated[Optional[str], typer.Option("--ca-cert", envvar=ENV_CA_CERT,
                                                      help="CA certificate (PEM) to verify an mqtts:// broker.")]
CertfileOption = Annotated[Optional[str], typer.Option("--certfile", help="Client certificate (PEM) for mutual TLS.")]
KeyfileOption = Annotated[Optional[str], typer.Option("--keyfile", help="Key of --certfile.")]

# the aggregator side's private keys (aggregator/keys.py): one directory per federation, outside the run directories
KeyDirOption = Annotated[Optional[str], typer.Option(
    "--key-dir", envvar="NEFL_KEY_DIR", help="Where private keys, enrolment and the run incarnation are kept, one "
                                              "subdirectory per federation [default: ~/.config/nefl/keys].")]

# the learning-rate schedule of a federation (nefl.nested.train.TrainConfig.lr_at); plain strings, so this module needs no torch
ScheduleOption = Annotated[str, typer.Option(
    "--lr-schedule", help="step: lr x0.1 at 1/2 and 3/4 of the rounds (the paper's ResNet protocol); cosine: "
                          "cosine decay to 0 over the rounds (its pretrained-ViT protocol).")]
WarmupOption = Annotated[int, typer.Option("--warmup-rounds", min=0, help="Rounds of linear lr warmup before the schedule.")]

ThreadsOption = Annotated[Optional[int], typer.Option("--threads", min=1, help="torch CPU threads (default: torch's choice).")]
LogLevelOption = Annotated[LogLevel, typer.Option("--log-level", case_sensitive=False, help="Least severe events logged.")]
LogFormatOption = Annotated[LogFormat, typer.Option(
    "--log-format", help="plain: a readable line per event; json: one object per line (time, level, logger, msg, "
                         "and the event's fields such as round, client, submodel, reason).")]
