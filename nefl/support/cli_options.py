"""Options several commands share, declared once so their flags, environment variables and help agree.

Each is an Annotated type (a command declares `key_dir: KeyDirOption = None`) or an option group
(nefl/support/option_groups.py: a command declares `mqtt: BrokerOptions` and gets the same `--password`,
env NEFL_MQTT_PASSWORD, as every other command that talks to a broker). This module imports neither
torch nor paho, so the small inference install's commands can use it too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from nefl.support.logs import LogFormat, LogLevel
from nefl.support.option_groups import SharedOption, option_group

ENV_USERNAME, ENV_PASSWORD, ENV_CA_CERT = "NEFL_MQTT_USERNAME", "NEFL_MQTT_PASSWORD", "NEFL_CA_CERT"


@option_group("Broker credentials and TLS")
class BrokerOptions:
    """The broker's credentials and TLS files; its URL is each command's own option (required, or not where
    the command can start an embedded broker)."""

    username: Annotated[Optional[str], typer.Option(envvar=ENV_USERNAME, help="Broker user.")] = None
    password: Annotated[Optional[str], typer.Option(envvar=ENV_PASSWORD, help="Broker password.")] = None
    ca_cert: Annotated[Optional[str], typer.Option(envvar=ENV_CA_CERT,
                                                   help="CA certificate (PEM) to verify an mqtts:// broker.")] = None
    certfile: Annotated[Optional[str], typer.Option(help="Client certificate (PEM) for mutual TLS.")] = None
    keyfile: Annotated[Optional[str], typer.Option(help="Key of --certfile.")] = None

    @property
    def credentials(self) -> tuple[Optional[str], ...]:
        """In nefl.protocol.mqtt.parse_broker's argument order, after the URL."""
        return self.username, self.password, self.ca_cert, self.certfile, self.keyfile


# options of the same meaning in several commands (each command gives its own default)
FederationOption = SharedOption(str, "--federation", help="Federation name: the MQTT topic prefix nefl/NAME/.")
# required where a command gives no default
BrokerOption = SharedOption(Optional[str], "--broker", help="mqtt://HOST:PORT or mqtts://HOST:PORT of the federation's broker.")
SeedOption = SharedOption(int, "--seed", help="Seed of this command's random draws.")
# required where a command gives no default
ProfileOption = SharedOption(str, "--profile", "-p", help="Profile name (see `nefl profile list`) or TOML path: the submodel ladder.")
# none given: no cap (each command says what it then does)
MaxSubmodelOption = SharedOption(Optional[int], "--max-submodel", min=1, help="Largest submodel (1-based) a device trains.")
ClientsOption = SharedOption(int, "--clients", min=1, help="Clients in the federation.")
DevicesOption = SharedOption(int, "--devices", min=1, help="Devices in the federation.")
JoinWaitOption = SharedOption(float, "--join-wait", min=0, help="Seconds to wait for devices to join before starting.")
LrOption = SharedOption(float, "--lr", min=0.0, help="SGD learning rate.")
ServerKeyOption = SharedOption(Optional[str], "--server-key", envvar="NEFL_SERVER_KEY",
                               help="The aggregator's public key (`aggregator key` prints it) or a file holding it.")
NonIidOption = SharedOption(Optional[float], "--non-iid", min=1e-6,
                            help="Dirichlet alpha of the clients' label skew (0.1 high, 1.0 low).")
MaxSamplesOption = SharedOption(Optional[int], "--max-samples-per-client", min=1,
                                help="Cap each client's training images (faster runs, or a small-data setting).")
DataRootOption = Annotated[Optional[str], typer.Option(
    "--data-root", help="Dataset directory, torchvision's layout (default $NEFL_DATA_ROOT or ~/.cache/nefl/data).")]
RoundsOption = SharedOption(int, "--rounds", min=1, help="Rounds to run.")
EvalEveryOption = SharedOption(int, "--eval-every", min=0, help="Evaluate every N rounds (always after the last).")
EvalSamplesOption = SharedOption(int, "--eval-samples", min=1, help="Test images of each evaluation.")
FinalEvalSamplesOption = SharedOption(Optional[int], "--final-eval-samples", min=1,
                                      help="Test images of the last evaluation (default: all).")
InitFromOption = SharedOption(Optional[str], "--init-from", help=(
    "Start from pretrained weights: a torchvision state dict (.pth, loaded with weights_only=True, or .safetensors) of "
    "the profile's architecture (docs/architectures.md)."))
TorchDeviceOption = SharedOption(str, "--device", help="torch device: cpu, cuda, cuda:N or mps.")
MemoryBudgetOption = SharedOption(Optional[str], "--memory-budget",
                                  help="Emulate a device with this much free memory, e.g. 300MB.")
HttpOption = SharedOption(Optional[str], "--http", help="Serve Prometheus /metrics on HOST:PORT (a bare PORT is 127.0.0.1:PORT).")
IncludeUntrainedOption = SharedOption(bool, "--include-untrained", help=(
    "Also use submodels the export records as never trained or no better than chance (skipped by default)."))
CheckpointDirOption = SharedOption(Optional[str], "--checkpoint-dir",
                                   help="The federation's run directory (default: runs/FEDERATION).")
DatasetOption = SharedOption(Optional[str], "--dataset", help="Dataset, e.g. fashion-mnist or cifar10.")
MethodOption = SharedOption(Optional[str], "--method", help="Method preset (default: the profile's).")
ClientIdOption = SharedOption(Optional[str], "--client-id", help="This device's id (letters, digits, _ . -).")
DeviceKeyOption = SharedOption(Optional[Path], "--device-key", help=(
    "This device's signing key (created 0600 if missing) [default: $NEFL_CACHE_DIR/device-keys/CLIENT_ID.key]; the "
    "aggregator (or, in FedJigsaw, each peer) checks what it sends against it."))
# what a command writes there, and what it prints, its own description says
OutOption = Annotated[Optional[str], typer.Option("--out", help="Directory this command writes its results into.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print the output as JSON instead of text.")]
BatchSizeOption = Annotated[int, typer.Option("--batch-size", min=1, help="Local batch size.")]
LocalEpochsOption = Annotated[int, typer.Option("--local-epochs", min=1, help="Local epochs per round.")]
RoundTimeoutOption = Annotated[float, typer.Option(
    "--round-timeout", min=1, help="Seconds before a round closes without the clients that have not reported.")]
ChunkKibOption = Annotated[int, typer.Option("--chunk-kib", min=8, help="Largest MQTT message this command publishes, KiB.")]

# the aggregator side's private keys (aggregator/keys.py): one directory per federation, outside the run directories
KeyDirOption = Annotated[Optional[str], typer.Option(
    "--key-dir", envvar="NEFL_KEY_DIR", help="Where private keys, enrolment and the run incarnation are kept, one "
                                              "subdirectory per federation [default: ~/.config/nefl/keys].")]


@option_group("Keys")
class KeyOptions:
    """Where a federation's keys and enrolment journal are: KEY_DIR/FEDERATION."""

    federation: FederationOption("Federation name (its keys live in KEY_DIR/FEDERATION).") = "default"
    key_dir: KeyDirOption = None


# the learning-rate schedule of a federation (nefl.nested.train.TrainConfig.lr_at); plain strings, so this module needs no torch
ScheduleOption = Annotated[str, typer.Option(
    "--lr-schedule", help="step: lr x0.1 at 1/2 and 3/4 of the rounds (the paper's ResNet protocol); cosine: "
                          "cosine decay to 0 over the rounds (its pretrained-ViT protocol).")]
WarmupOption = Annotated[int, typer.Option("--warmup-rounds", min=0, help="Rounds of linear lr warmup before the schedule.")]

ThreadsOption = SharedOption(Optional[int], "--threads", min=1, help="torch CPU threads (default: torch's choice).")
LogLevelOption = Annotated[LogLevel, typer.Option("--log-level", case_sensitive=False, help="Least severe events logged.")]
LogFormatOption = Annotated[LogFormat, typer.Option(
    "--log-format", help="plain: a readable line per event; json: one object per line (time, level, logger, msg, "
                         "and the event's fields such as round, client, submodel, reason).")]


@option_group("Logging")
class LogOptions:
    log_level: LogLevelOption = "info"
    log_format: LogFormatOption = "plain"
