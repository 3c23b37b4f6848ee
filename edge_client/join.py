"""`edge-client join`: the thin MQTT shell around the agent's logic (edge_client/agent.py).

The paho network thread only enqueues messages; the main thread feeds them to the agent and ticks
it, so all state has one owner. The shell's own job is what a person at the device needs to see:
connection state, a clear word when no aggregator answers, and a clean exit (code 0, status
"offline" published) on Ctrl-C or SIGTERM from a service manager. Exit codes: 0 the federation ended or the
process was stopped, 2 a configuration error (one line), 4 the server refused this device for good (revoked;
a bad, spent or expired join token; the line before says what to do). The agent and the device (torch)
are imported by the command, not by this module, so `join --help` answers at once.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import sys
import time
from dataclasses import asdict, field
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from edge_client.cache import CALIBRATION_DIR
from edge_client.plan_cli import CacheDirOption, CalibrateOption, CpuBudgetOption, RecalibrateOption
from edge_client.identity import PIN_DIR, device_signer, pin_file_for, run_file_for
from nefl.support.cli_options import (BrokerOption, BrokerOptions, ChunkKibOption, ClientIdOption, DataRootOption, DatasetOption,
                                      DeviceKeyOption, FederationOption, HttpOption,
                                      LogOptions, MaxSubmodelOption, MemoryBudgetOption, SeedOption, ServerKeyOption,
                                      ThreadsOption,
                                      TorchDeviceOption)
from nefl.support.extras import full_install_required
from nefl.support.heap import freeze_startup
from nefl.support.listen import check_bindable, parse_listen
from nefl.support.logs import setup_logging
from nefl.support.option_groups import grouped, option_group
from nefl.protocol.messages import DEFAULT_CHUNK_BYTES
from nefl.protocol.mqtt import BrokerSettings, Connection, parse_broker
from nefl.protocol.signing import status_message
from nefl.protocol.tokens import parse_token
from nefl.support.signals import Stop, stop_on_sigterm, stop_reason
from nefl.protocol.topics import Topics, check_name

if TYPE_CHECKING:
    from edge_client.agent import Agent

NO_SERVER_AFTER_S = 30.0
EXIT_REFUSED = 4  # the server refused this device for good (revoked; a bad, spent or expired token): restarting won't help
log = logging.getLogger(__name__)


def run(agent: Agent, conn: Connection, settings: BrokerSettings) -> int:
    """Feed the agent until the federation ends or the process is asked to stop (0 either way), or until the
    server refuses this device for good (EXIT_REFUSED)."""
    started = time.monotonic()
    warned = False
    conn.start()
    try:
        while not agent.ended and agent.refused is None:
            if conn.just_connected():
                agent.on_connected(conn.stamp)
            try:
                agent.dispatch(*conn.inbox.get(timeout=0.5))
            except queue.Empty:
                pass
            agent.tick()
            if not agent.server_seen and not warned and time.monotonic() - started > NO_SERVER_AFTER_S:
                warned = True
                log.warning(_no_server(agent, conn, settings))
        if agent.refused is not None:
            return EXIT_REFUSED
        log.info("federation ended")
    except (KeyboardInterrupt, Stop) as e:
        log.info(f"stopping ({stop_reason(e)}); the server will not wait for this device")
    finally:
        conn.stop((agent.topics.status(agent.cfg.client_id), status_message(agent.cfg.device_key, "offline", conn.stamp)))
    return 0


def _no_server(agent: Agent, conn: Connection, settings: BrokerSettings) -> str:
    """What to say when no trusted aggregator answered: none at all, or one signing with another key."""
    fed = agent.cfg.federation
    if agent.foreign_key is not None:
        return (f"an aggregator answers on nefl/{fed}/, but signs with key {agent.foreign_key}, not the pinned "
                f"{agent.pin.text} (see the dropped message above for the fix); still waiting for one this device trusts")
    where = "connected, but" if conn.connected else "not even connected to the broker, and"
    return (f"{where} no aggregator on nefl/{fed}/ after {NO_SERVER_AFTER_S:.0f} s: is `aggregator serve --federation "
            f"{fed}` running on {settings.url}? (still waiting)")


@option_group("Federation")
class Membership:
    """Which federation a device takes part in, as whom, over which broker (`join` and `jigsaw`)."""

    broker: BrokerOption()
    client_id: ClientIdOption("Unique id (letters, digits, _ . -; default: edge-HOSTNAME-PID).") = None
    federation: FederationOption("Federation name (topic prefix nefl/NAME/).") = "default"
    chunk_kib: ChunkKibOption = DEFAULT_CHUNK_BYTES // 1024
    mqtt: BrokerOptions = field(default_factory=BrokerOptions)

    @property
    def cid(self) -> str:
        """--client-id, or one made of this host and process."""
        return self.client_id or f"edge-{socket.gethostname()}-{os.getpid()}"


@option_group("Training data")
class DataOptions:
    dataset: DatasetOption("Training dataset (its class names are the labels).") = "fashion-mnist"
    partition: Annotated[str, typer.Option(help="This client's IID shard I/N of the training data.")] = "1/1"
    data_root: DataRootOption = None
    data_dir: Annotated[Optional[str], typer.Option(
        help="Train on this folder of images instead (DIR/CLASS/IMAGE.png, CLASS one of --dataset's class names, "
             "converted to its shape); --partition still shards it.")] = None
    max_samples: Annotated[Optional[int], typer.Option(
        min=1, help="Use at most N samples of the shard (quick tests, demos).")] = None




@option_group("What this device trains")
class DeviceOptions:
    max_submodel: MaxSubmodelOption("Cap on the submodel (1-based) this device trains; below it, each round picks the "
                                    "largest that fits memory and deadline.") = 1000
    memory_budget: MemoryBudgetOption(
        "Select submodels as if only this much memory were free, e.g. 300MB (emulation for selection only: the "
        "process is not limited, and its resident memory includes torch, the data and the model, often 800 MB "
        "or more).") = None
    cpu_budget: CpuBudgetOption = None
    calibrate_costs: CalibrateOption = True
    recalibrate: RecalibrateOption = False
    cache_dir: CacheDirOption = CALIBRATION_DIR
    device: TorchDeviceOption("torch device to train on: cpu, or cuda on a Jetson / GPU machine.") = "cpu"
    task_budget: Annotated[Optional[float], typer.Option(
        min=0.1, help="Buffered mode (`aggregator serve --mode buffered`): seconds one task may take on this device; it "
                      "trains the largest submodel that fits them (default: the server's task bound, --round-timeout).")] = None


@grouped
def join_command(
    fp16: bool = typer.Option(False, help="Upload deltas as fp16 (half the bytes)."),
    threads: ThreadsOption() = None,
    seed: SeedOption("Seed of local shuffling and augmentation.") = 0,
    server_key: ServerKeyOption("The aggregator's public key (`aggregator key` prints it) or a file holding it; "
                                "without it the first key seen is trusted and remembered, with a warning.") = None,
    device_key: DeviceKeyOption() = None,
    join_token: str = typer.Option(None, envvar="NEFL_JOIN_TOKEN", help="The one-time token `aggregator enroll "
                                   "CLIENT_ID` printed: enrols this device's key and tells it the server key."),
    http: HttpOption("Serve Prometheus /metrics on HOST:PORT (a bare PORT is 127.0.0.1:PORT): probe readings, the "
                     "selection and its binding limit, step time, upload bytes.") = None,
    *,
    member: Membership,
    data: DataOptions,
    limits: DeviceOptions,
    logs: LogOptions,
) -> None:
    """Join a federation: announce, train assigned submodels, upload deltas until the federation ends."""
    cid, federation = member.cid, member.federation
    try:  # what a person typed is checked before torch, the dataset or the broker: a typo answers at once
        check_name("client id", cid)
        settings = parse_broker(member.broker, *member.mqtt.credentials)
        if join_token:
            parse_token(join_token)
        listen = parse_listen(http) if http else None
        if listen:
            check_bindable(*listen)
        signer = device_signer(cid, device_key)  # the key directory: readable, or the key made, before the data
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
    with full_install_required("edge-client join"):  # here, not at the top: `join --help` needs no torch
        import torch

        from edge_client.agent import Agent, AgentConfig
        from edge_client.device import DataConfig, DeviceConfig, LocalDevice
        from edge_client.metrics import instrument
        from nefl.nested.data import DatasetUnavailable, parse_partition
    setup_logging(logs.log_level, logs.log_format, context={"client": cid})
    stop_on_sigterm()
    try:
        parse_partition(data.partition)
        if limits.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {limits.device}: torch sees no CUDA device here (on a Jetson, install NVIDIA's torch "
                             "wheel; see docs/deploy.md)")
        if threads:
            torch.set_num_threads(threads)
        log.info(f"loading {data.data_dir or data.dataset} (shard {data.partition})")
        local = LocalDevice(DataConfig(**asdict(data)),  # its fields are DataConfig's, by name
                            DeviceConfig(limits.max_submodel, limits.memory_budget, limits.cpu_budget, limits.calibrate_costs,
                                         seed, limits.device, limits.recalibrate, limits.cache_dir))
        pin = pin_file_for(PIN_DIR, federation, settings.host, settings.port)
        cfg = AgentConfig(cid, federation, limits.max_submodel, fp16, member.chunk_kib * 1024, server_key, pin, signer,
                          join_token, run_file_for(pin), task_budget_s=limits.task_budget)
        conn = Connection(settings, cid, Topics(federation).status(cid), lambda seq: status_message(signer, "offline", seq),
                          log)
        transport, dev = (conn.client, local) if listen is None else \
            instrument(conn.client, local, Topics(federation).update(cid), *listen)
        agent = Agent(cfg, transport, dev)
    except (ValueError, DatasetUnavailable, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
    except (KeyboardInterrupt, Stop):
        raise typer.Exit(0) from None
    log.info(f"client {cid}: {local.samples} training samples; joining federation {federation!r} on {settings.url}"
             + (f"; Prometheus metrics on http://{listen[0]}:{listen[1]}/metrics" if listen else ""))
    freeze_startup()
    raise typer.Exit(run(agent, conn, settings))
