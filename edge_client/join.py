"""`edge-client join`: the thin MQTT shell around the agent's logic (edge_client/agent.py).

The paho network thread only enqueues messages; the main thread feeds them to the agent and ticks
it, so all state has one owner. The shell's own job is what a person at the device needs to see:
connection state, a clear word when no aggregator answers, and a clean exit (code 0, status
"offline" published) on Ctrl-C or SIGTERM from a service manager.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import sys
import time
from pathlib import Path
from types import FrameType

import torch
import typer

from edge_client.agent import Agent, AgentConfig, status_message
from edge_client.costmodel import CACHE_DIR
from edge_client.device import DataConfig, DeviceConfig, LocalDevice
from edge_client.identity import PIN_DIR, device_signer, pin_file_for, run_file_for
from edge_client.metrics import instrument
from nefl.cli_options import (CaCertOption, CertfileOption, KeyfileOption, LogFormatOption, LogLevelOption, PasswordOption,
                              UsernameOption)
from nefl.data import DatasetUnavailable, parse_partition
from nefl.listen import parse_listen
from nefl.logs import setup_logging
from nefl.mqtt import BrokerSettings, Connection, parse_broker
from nefl.topics import Topics, check_name
from nefl.wire import DEFAULT_CHUNK_BYTES

NO_SERVER_AFTER_S = 30.0
log = logging.getLogger(__name__)


class Stop(Exception):
    """SIGTERM: leave like Ctrl-C does, cleanly."""


def _stop(signum: int, frame: FrameType | None) -> None:
    raise Stop(signal.Signals(signum).name)


def run(agent: Agent, conn: Connection, settings: BrokerSettings) -> int:
    """Feed the agent until the federation ends or the process is asked to stop; 0 either way."""
    started = time.monotonic()
    warned = False
    conn.start()
    try:
        while not agent.ended:
            if conn.just_connected():
                agent.on_connected(conn.stamp)
            try:
                agent.dispatch(*conn.inbox.get(timeout=0.5))
            except queue.Empty:
                pass
            agent.tick()
            if not agent.server_seen and not warned and time.monotonic() - started > NO_SERVER_AFTER_S:
                warned = True
                where = "connected, but" if conn.connected else "not even connected to the broker, and"
                log.warning(f"{where} no aggregator on nefl/{agent.cfg.federation}/ after {NO_SERVER_AFTER_S:.0f} s: "
                            f"is `aggregator serve --federation {agent.cfg.federation}` running on {settings.url}? "
                            "(still waiting)")
        log.info("federation ended")
    except (KeyboardInterrupt, Stop) as e:
        log.info(f"stopping ({e or 'interrupted'}); the server will not wait for this device")
    finally:
        conn.stop((agent.topics.status(agent.cfg.client_id), status_message(agent.cfg.device_key, "offline", conn.stamp)))
    return 0


def join_command(
    broker: str = typer.Option(..., help="mqtt://HOST:PORT or mqtts://HOST:PORT of the federation's broker."),
    client_id: str = typer.Option(None, help="Unique id (letters, digits, _ . -; default: edge-HOSTNAME-PID)."),
    federation: str = typer.Option("default", help="Federation name (topic prefix nefl/NAME/)."),
    dataset: str = typer.Option("fashion-mnist", help="Training dataset (its class names are the labels)."),
    partition: str = typer.Option("1/1", help="This client's IID shard I/N of the training data."),
    data_root: str = typer.Option(None, help="Dataset directory (default $NEFL_DATA_ROOT or ~/.cache/nefl/data)."),
    data_dir: str = typer.Option(None, help="Train on this folder of images instead (DIR/CLASS/IMAGE.png, CLASS one of "
                                 "--dataset's class names, converted to its shape); --partition still shards it."),
    max_samples: int = typer.Option(None, min=1, help="Use at most N samples of the shard (quick tests, demos)."),
    max_submodel: int = typer.Option(1000, min=1, help="Cap on the submodel (1-based) this device trains; "
                                     "below it, each round picks the largest that fits memory and deadline."),
    memory_budget: str = typer.Option(None, help="Emulate a device with this much free memory, e.g. 300MB."),
    cpu_budget: float = typer.Option(None, help="Emulate a device this fraction as fast, e.g. 0.5."),
    calibrate_costs: bool = typer.Option(True, "--calibrate/--no-calibrate",
                                         help="Measure one training step per submodel (cached) or use the analytic estimate."),
    recalibrate: bool = typer.Option(False, help="Ignore the cached calibration and measure again."),
    cache_dir: Path = typer.Option(CACHE_DIR, help="Where calibrations are cached."),
    device: str = typer.Option("cpu", help="torch device to train on: cpu, or cuda on a Jetson / GPU machine."),
    fp16: bool = typer.Option(False, help="Upload deltas as fp16 (half the bytes)."),
    chunk_kib: int = typer.Option(DEFAULT_CHUNK_BYTES // 1024, min=8, help="Largest MQTT message this client sends, KiB."),
    username: UsernameOption = None,
    password: PasswordOption = None,
    ca_cert: CaCertOption = None,
    certfile: CertfileOption = None,
    keyfile: KeyfileOption = None,
    threads: int = typer.Option(None, min=1, help="torch CPU threads (default: torch's choice)."),
    seed: int = typer.Option(0, help="Seed of local shuffling and augmentation."),
    server_key: str = typer.Option(None, envvar="NEFL_SERVER_KEY",
                                   help="The aggregator's public key (`aggregator key` prints it) or a file holding it; "
                                        "without it the first key seen is trusted and remembered, with a warning."),
    device_key: Path = typer.Option(None, help="This device's signing key (created 0600 if missing) "
                                    "[default: $NEFL_CACHE_DIR/device-keys/CLIENT_ID.key]; the aggregator pins it."),
    join_token: str = typer.Option(None, envvar="NEFL_JOIN_TOKEN", help="The one-time token `aggregator enroll "
                                   "CLIENT_ID` printed: enrols this device's key and tells it the server key."),
    http: str = typer.Option(None, help="Serve Prometheus /metrics on HOST:PORT (a bare PORT is 127.0.0.1:PORT): probe "
                             "readings, the selection and its binding limit, step time, upload bytes."),
    log_level: LogLevelOption = "info",
    log_format: LogFormatOption = "plain",
) -> None:
    """Join a federation: announce, train assigned submodels, upload deltas until the federation ends."""
    cid = client_id or f"edge-{socket.gethostname()}-{os.getpid()}"
    setup_logging(log_level, log_format, context={"client": cid})
    signal.signal(signal.SIGTERM, _stop)
    try:
        check_name("client id", cid)
        settings = parse_broker(broker, username, password, ca_cert, certfile, keyfile)
        parse_partition(partition)
        listen = parse_listen(http) if http else None
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {device}: torch sees no CUDA device here (on a Jetson, install NVIDIA's torch "
                             "wheel; see docs/deploy.md)")
        if threads:
            torch.set_num_threads(threads)
        log.info(f"loading {data_dir or dataset} (shard {partition})")
        local = LocalDevice(DataConfig(dataset, partition, data_root, data_dir, max_samples),
                            DeviceConfig(max_submodel, memory_budget, cpu_budget, calibrate_costs, seed, device, recalibrate,
                                         cache_dir))
        signer = device_signer(cid, device_key)
        pin = pin_file_for(PIN_DIR, federation, settings.host, settings.port)
        cfg = AgentConfig(cid, federation, max_submodel, fp16, chunk_kib * 1024, server_key, pin, signer, join_token,
                          run_file_for(pin))
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
    raise typer.Exit(run(agent, conn, settings))
