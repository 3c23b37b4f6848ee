"""`aggregator worker`, `relay` and `loadtest`: the command lines of the scale-out tools (docs/scale.md).

Kept apart from the worker, relay and fleet themselves (aggregator/worker.py, relay.py, loadtest.py),
which need torch: these modules are imported when a command runs, not for its `--help`.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from aggregator.keys import KeyDir
from nefl.support.cli_options import (BrokerOption, BrokerOptions, ChunkKibOption, DevicesOption, FederationOption,
                                      KeyDirOption, LogOptions, MaxSubmodelOption, ProfileOption, SeedOption,
                                      ServerKeyOption)
from nefl.support.option_groups import grouped, option_group
from nefl.support.heap import freeze_startup
from nefl.support.logs import setup_logging
from nefl.support.settings import DEFAULT_PROFILE
from nefl.protocol.messages import DEFAULT_CHUNK_BYTES
from nefl.protocol.mqtt import parse_broker
from nefl.nested.profile import ProfileError, load_profile
from nefl.support.signals import Stop, stop_children, stop_on_sigterm
from nefl.protocol.signing import Signer
from nefl.support.threads import one_per_process
from nefl.protocol.topics import WORKER_GROUP, check_name

log = logging.getLogger("aggregator.worker")

@option_group("Keys")
class WorkerKeys:
    """The coordinator's key a worker or relay checks, and its own."""

    server_key: ServerKeyOption("The coordinator's public key (`aggregator key`): round plans not signed by it are "
                                "refused.") = None
    key: Annotated[Optional[Path], typer.Option(
        help="This worker's or relay's signing key (created 0600 if missing) [default: "
             "KEY_DIR/FEDERATION/workers/ID.key]; authorise it on the coordinator.")] = None
    key_dir: KeyDirOption = None
    print_key: Annotated[bool, typer.Option(
        "--print-key", help="Print this worker's or relay's public key (for `aggregator enroll ID --worker --public-key KEY` on "
                            "the coordinator) and exit.")] = False


def own_key(federation: str, me: str, keys: WorkerKeys) -> Signer:
    """A worker's or relay's key (exit 2 with the fix when unusable); --print-key prints it and exits 0."""
    try:
        signer = KeyDir(check_name("federation name", federation), keys.key_dir).worker_signer(check_name("id", me), keys.key)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
    if keys.print_key:
        print(signer.public_text)
        raise typer.Exit(0)
    log.info(f"{me}: signing with key {signer.public_text} (authorise it: aggregator enroll {me} --worker --public-key "
             f"{signer.public_text})")
    return signer


@grouped
def worker_command(
    broker: BrokerOption("mqtt://HOST:PORT of the coordinator's broker (it must support shared subscriptions: "
                         "mosquitto 2.x, EMQX, HiveMQ, VerneMQ)."),
    federation: FederationOption() = "default",
    worker_id: str = typer.Option(None, help="This worker's id (default: worker-HOSTNAME-PID)."),
    group: str = typer.Option(WORKER_GROUP, help="Shared-subscription group: the broker spreads updates over its members. On "
                              "a broker that devices reach, make it a secret (a device in the group takes away its "
                              "share of the updates, even under an ACL)."),
    shared: bool = typer.Option(True, "--shared/--no-shared", help="--no-shared: take every update (a lone worker, or a "
                                "broker without shared subscriptions)."),
    *,
    keys: WorkerKeys,
    mqtt: BrokerOptions,
    logs: LogOptions,
) -> None:
    """Check and sum a share of a federation's updates for `aggregator serve` (docs/scale.md)."""
    setup_logging(logs.log_level, logs.log_format)
    wid = worker_id or f"worker-{socket.gethostname()}-{os.getpid()}"[:64]
    signer = own_key(federation, wid, keys)
    from aggregator.worker import Worker, WorkerConfig, run_until_signalled  # torch: not for --help or --print-key

    run_until_signalled(lambda: Worker(WorkerConfig(federation, wid, group, shared, keys.server_key),
                                       parse_broker(broker, *mqtt.credentials), signer))


@grouped
def relay_command(
    site_broker: str = typer.Option(..., help="mqtt://HOST:PORT of the site's broker, where its devices connect."),
    upstream: str = typer.Option(..., help="mqtt(s)://HOST:PORT of the coordinator's broker (`aggregator serve`); the "
                                 "credential and TLS options below are for this one."),
    federation: FederationOption() = "default",
    relay_id: str = typer.Option(None, help="This relay's id (default: relay-HOSTNAME)."),
    *,
    keys: WorkerKeys,
    mqtt: BrokerOptions,
    logs: LogOptions,
) -> None:
    """Serve a site's devices on its own broker; send the coordinator one partial per round (docs/scale.md)."""
    setup_logging(logs.log_level, logs.log_format)
    rid = relay_id or f"relay-{socket.gethostname()}"[:64]
    signer = own_key(federation, rid, keys)
    from aggregator.relay import Relay  # torch: not for --help or --print-key
    from aggregator.worker import WorkerConfig, run_until_signalled

    run_until_signalled(lambda: Relay(WorkerConfig(federation, rid, shared=False, server_key=keys.server_key),
                                      parse_broker(upstream, *mqtt.credentials),
                                      parse_broker(site_broker), signer))


def _run_shards(argvs: list[list[str]]) -> int:
    """Run loadtest's shards to their end, the worst exit code; stopped (SIGTERM, Ctrl-C) or failing, the parent
    takes them down with it: a benchmark's or an operator's stop of the parent left them sending until --duration."""
    stop_on_sigterm()
    children: list[subprocess.Popen] = []
    try:
        children = [subprocess.Popen([sys.executable, "-c", "from aggregator.cli import app; app()", "loadtest", *argv])
                    for argv in argvs]
        return max(p.wait() for p in children)
    except (KeyboardInterrupt, Stop):
        return 0
    finally:
        stop_children(children)


@grouped
def loadtest_command(
    broker: BrokerOption("mqtt://HOST:PORT the aggregator (and its workers) use."),
    federation: FederationOption() = "default",
    profile: ProfileOption("The coordinator's profile (deltas must fit its submodels).") = DEFAULT_PROFILE,
    devices: DevicesOption("Simulated devices, one MQTT connection each.") = 100,
    procs: int = typer.Option(1, min=1, help="Processes to spread the devices over."),
    rate: float = typer.Option(0.0, min=0, help="Updates per second, all processes together; 0 = as fast as possible."),
    max_submodel: MaxSubmodelOption("Largest submodel (1-based) every device announces; none given: device i announces "
                                    "(i mod K) + 1, a mixed fleet.") = None,
    chunk_kib: ChunkKibOption = DEFAULT_CHUNK_BYTES // 1024,
    scale: float = typer.Option(1e-3, min=0, help="Standard deviation of the random deltas."),
    pool: int = typer.Option(0, min=0, help="Draw deltas from this many cached variants per submodel (0: a fresh "
                             "delta per device and round, costlier to generate)."),
    prefix: str = typer.Option("sim", help="Device ids are PREFIX00000, PREFIX00001, ..."),
    seed: SeedOption("Seed of the deltas (with client id and round).") = 0,
    duration: float = typer.Option(600.0, min=1, help="Stop after this many seconds even if the federation goes on."),
    shard: str = typer.Option(None, hidden=True, help="I/P: run only devices i with i mod P == I (set for child processes)."),
    enroll: bool = typer.Option(False, "--enroll", help="Enrol the devices' keys (derived from --seed and their ids, so "
                                "anyone can derive them: a load test's federation only) in the federation's journal in "
                                "KEY_DIR, for a closed federation's load test, and exit."),
    key_dir: KeyDirOption = None,
    *,
    logs: LogOptions,
) -> None:
    """Play a fleet of simulated devices sending valid random deltas (docs/scale.md, `make bench-scale`)."""
    from aggregator.loadtest import DeviceFleet, FleetConfig, device_grants, log
    from nefl.nested.state import Layout

    setup_logging(logs.log_level, logs.log_format)
    if enroll:
        from aggregator.enrolment import append

        grants = device_grants(FleetConfig(federation=federation, prefix=prefix, devices=devices, seed=seed))
        journal = KeyDir(check_name("federation name", federation), key_dir).journal
        append(journal, *grants)
        print(f"{len(grants)} simulated devices enrolled in {journal}", file=sys.stderr)
        return
    try:
        settings = parse_broker(broker)
        layout = Layout.build(load_profile(profile))
        first, stride = (int(x) for x in shard.split("/")) if shard else (0, 1)
    except (ValueError, ProfileError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
    if procs > 1 and shard is None:
        argv = ["--broker", broker, "--federation", federation, "--profile", profile, "--devices", str(devices),
                "--rate", str(rate / procs), *(["--max-submodel", str(max_submodel)] if max_submodel else []),
                "--chunk-kib", str(chunk_kib),
                "--scale", str(scale), "--pool", str(pool), "--prefix", prefix, "--seed", str(seed),
                "--duration", str(duration), "--log-level", logs.log_level, "--log-format", logs.log_format]
        raise typer.Exit(_run_shards([[*argv, "--shard", f"{i}/{procs}"] for i in range(procs)]))
    cfg = FleetConfig(federation=federation, prefix=prefix, first=first, stride=stride, devices=devices,
                      max_submodel=max_submodel, rate=rate, chunk_bytes=chunk_kib * 1024, scale=scale, seed=seed,
                      pool=pool, duration_s=duration)
    fleet = DeviceFleet(cfg, settings, layout)
    fleet.start()
    log.info(f"{len(fleet.names)} simulated devices connecting to {settings.url}")
    t0 = time.monotonic()
    one_per_process()
    freeze_startup()
    try:
        fleet.send_loop()
    except KeyboardInterrupt:
        pass
    fleet.stop()
    log.info(f"sent {fleet.sent} updates, {fleet.bytes} bytes in {time.monotonic() - t0:.1f}s"
             + ("" if fleet.ended.is_set() else " (no end from the coordinator)"))
