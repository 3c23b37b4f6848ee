"""`aggregator serve` and `aggregator key`: the command lines around the server (aggregator/server.py).

Parses and checks the options, loads or refuses a checkpoint, opens the federation's key directory
(its server key, enrolment journal and run incarnation: aggregator/keys.py), starts the embedded broker
when no `--broker` is given (mosquitto as a child process where installed, else amqtt: aggregator/broker.py),
and turns Ctrl-C / SIGTERM into a clean stop (exit code 0, a word on whether there is anything to resume).
The server's modules (torch) are imported by the command, not by this module, so `aggregator serve --help`
answers at once.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import asdict, field
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from aggregator.broker import BrokerKind, embedded_broker
from aggregator import robust_options as ro
from aggregator.enrolment import EnrolmentPolicy
from aggregator.fleet_cli import fleet_robustness
from aggregator.keys import KeyDir
from aggregator.resends import Resends
from aggregator.run_options import AssignmentOption, RunSpec
from aggregator.staleness_options import BufferSizeOption, MaxStalenessOption, ModeOption, StalenessExponentOption
from nefl.aggregation.staleness import StalenessConfig
from nefl.support.cli_options import (BatchSizeOption, BrokerOption, BrokerOptions, CheckpointDirOption, ChunkKibOption, DataRootOption,
                                      EvalSamplesOption, FederationOption, FinalEvalSamplesOption, HttpOption,
                                      InitFromOption, JoinWaitOption, KeyDirOption, KeyOptions, LocalEpochsOption,
                                      LogOptions, LrOption, ProfileOption, RoundsOption, RoundTimeoutOption, SeedOption)
from nefl.support.option_groups import grouped, option_group
from nefl.support.extras import full_install_required
from nefl.support.listen import check_bindable, is_loopback, parse_listen
from nefl.support.logs import setup_logging
from nefl.protocol.messages import DEFAULT_CHUNK_BYTES
from nefl.protocol.mqtt import parse_broker
from nefl.nested.profile import ProfileError
from nefl.support.settings import DEFAULT_EVAL_SAMPLES, DEFAULT_PROFILE, TrainConfig
from nefl.support.heap import freeze_startup, keep_freed_memory
from nefl.support.signals import Stop, stop_children, stop_on_sigterm, stop_reason
from nefl.protocol.signing import KeyFileError
from nefl.support.threads import one_per_process
from nefl.protocol.tokens import fingerprint
from nefl.protocol.topics import Topics

if TYPE_CHECKING:
    from aggregator.web import DashboardServer

log = logging.getLogger("aggregator.server")  # one logger for the server's story, CLI or not


EmbeddedPortOption = Annotated[int, typer.Option(min=0, help="Port of the embedded broker (0: a free one).")]
EmbeddedHostOption = Annotated[str, typer.Option(
    "--embedded-host", help="Address the embedded broker listens on (0.0.0.0: every interface, so devices on other "
                            "machines can join; then secure it: docs/security.md).")]
BrokerOrEmbeddedOption = BrokerOption("mqtt://HOST:PORT or mqtts://HOST:PORT; omit to start an embedded broker.")


_S = StalenessConfig()


@option_group("Buffered mode (docs/operations.md)")
class VersionOptions:
    mode: ModeOption("sync: rounds that wait for their participants or the deadline; buffered: every device trains whenever it "
             "can on the newest version, and a version is committed whenever K updates arrived (--rounds counts "
             "versions, --round-timeout bounds one task, --min-clients devices are waited for at the start).") = "sync"
    buffer_size: BufferSizeOption = _S.buffer_size
    staleness_exponent: StalenessExponentOption = _S.exponent
    max_staleness: MaxStalenessOption = _S.max_staleness
    commit_after: Annotated[Optional[float], typer.Option(
        min=0.1, help="buffered: commit a partial buffer once its oldest update waited this many seconds.")] = None

    def staleness(self) -> StalenessConfig:
        return StalenessConfig(buffer_size=self.buffer_size, exponent=self.staleness_exponent,
                               max_staleness=self.max_staleness, commit_after_s=self.commit_after)


@option_group("Rounds")
class RoundOptions:
    rounds: RoundsOption("Rounds to run (in total, counting resumed ones).") = 10
    clients_per_round: Annotated[int, typer.Option(min=1, help="Participants per round, among connected clients.")] = 10
    min_clients: Annotated[int, typer.Option(min=1, help="Quorum: updates needed for a round to change the model.")] = 1
    round_timeout: RoundTimeoutOption = 120.0
    join_wait: JoinWaitOption("Once a first client is ready, seconds to wait for --clients-per-round before starting "
                              "with --min-clients.") = 10.0
    versions: VersionOptions = field(default_factory=VersionOptions)

    def serve_fields(self) -> dict:
        """ServeConfig's fields of this group, by name."""
        fields = {k: v for k, v in asdict(self).items() if k != "versions"}
        return {**fields, "mode": self.versions.mode, "staleness": self.versions.staleness()}


@option_group("Local training")
class ServeTraining:
    local_epochs: LocalEpochsOption = TrainConfig.local_epochs
    lr: LrOption("Base learning rate (its schedule: --lr-schedule).") = TrainConfig.lr
    batch_size: BatchSizeOption = TrainConfig.batch_size


@option_group("Evaluation")
class ServeEval:
    eval_dataset: Annotated[Optional[str], typer.Option(
        help="Evaluate every submodel on this dataset's test split after each round.")] = None
    eval_samples: EvalSamplesOption("Score each round on the first N test images (beside the next round; the last "
                                    "round: see --final-eval-samples).") = DEFAULT_EVAL_SAMPLES
    final_eval_samples: FinalEvalSamplesOption("Score the last round on the first N test images (default: the whole "
                                               "test split); the run ends when it is scored.") = None
    data_root: DataRootOption = None
    root_data: ro.RootData = None


@option_group("Embedded broker (without --broker)")
class EmbeddedOptions:
    embedded_port: EmbeddedPortOption = 1883
    embedded_host: EmbeddedHostOption = "127.0.0.1"
    embedded_broker_kind: Annotated[BrokerKind, typer.Option(
        "--embedded-broker", help="auto: mosquitto as a child process when installed, else amqtt (about a tenth of "
                                  "the throughput).")] = "auto"


@option_group("Devices and enrolment")
class EnrolmentOptions:
    require_device_keys: Annotated[bool, typer.Option(
        help="Under open enrolment: refuse devices that do not sign their announces and updates (every edge-client "
             "signs; keys are pinned per client id).")] = False
    open_enrolment: Annotated[Optional[bool], typer.Option(
        "--open-enrolment/--no-open-enrolment", help="Pin a device's key on its first signed announce (trust on first "
                                                     "use). Default: on until `aggregator enroll` grants a device, then "
                                                     "only enrolled devices take part.")] = None
    key_dir: KeyDirOption = None
    resend_after: Annotated[float, typer.Option(
        min=0.1, help="Seconds after a device's notice that its update is out before a missing update counts as lost "
                      "and the device is asked to resend.")] = Resends.after_s


@option_group("Dashboard and metrics")
class HttpOptions:
    http: HttpOption("Serve the dashboard (/), /api/state and Prometheus /metrics on HOST:PORT (a bare PORT is "
                     "127.0.0.1:PORT); off by default. docs/operations.md") = None
    http_token: Annotated[Optional[str], typer.Option(
        envvar="NEFL_HTTP_TOKEN", help="Token the --http data needs (Bearer header or ?token=); required when --http is "
                                       "not a loopback address.")] = None
    http_linger: Annotated[float, typer.Option(
        min=0, help="Seconds --http stays up after the last round, so a scraper sees the final values (e.g. your "
                    "scrape interval).")] = 0.0


@option_group("Workers (docs/scale.md)")
class WorkerOptions:
    workers: Annotated[int, typer.Option(
        min=0, help="Aggregator worker processes on this host that share the update stream (MQTT shared "
                    "subscriptions, --broker of mosquitto 2.x / EMQX / HiveMQ); docs/scale.md.")] = 0
    remote_workers: Annotated[bool, typer.Option(
        help="Updates are taken by `aggregator worker` processes started elsewhere; this process only merges their "
             "partials.")] = False
    worker_timeout: Annotated[float, typer.Option(min=1, help="Seconds a round close waits for the workers' partials.")] = 30.0


@grouped
def serve_command(
    profile: ProfileOption() = DEFAULT_PROFILE,
    broker: BrokerOrEmbeddedOption = None,
    federation: FederationOption() = "default",
    checkpoint_dir: CheckpointDirOption("Checkpoint + metrics.jsonl directory (default: runs/FEDERATION).") = None,
    resume: bool = typer.Option(False, help="Continue from the checkpoint in --checkpoint-dir."),
    chunk_kib: ChunkKibOption = DEFAULT_CHUNK_BYTES // 1024,
    seed: SeedOption("Seed of the initial weights and of participant sampling.") = 0,
    dp_delta: float = typer.Option(1e-5, min=0, max=1, help="The delta of the reported (epsilon, delta)-DP."),
    assignment: AssignmentOption() = "coverage",
    init_from: InitFromOption(InitFromOption.help + " Ignored with --resume.") = None,
    *,
    plan: RoundOptions,
    training: ServeTraining,
    run: RunSpec,
    evaluation: ServeEval,
    trust: EnrolmentOptions,
    mqtt: BrokerOptions,
    local_broker: EmbeddedOptions,
    dashboard: HttpOptions,
    scale: WorkerOptions,
    logs: LogOptions,
) -> None:
    """Run a federation: rounds over MQTT, NeFedAvg, checkpoints after every round."""
    with full_install_required("aggregator serve"):  # here, not at the top: `serve --help` needs none of them
        from aggregator.enrolment import Enrolment
        from aggregator.rollout import RolloutWatcher
        from aggregator.buffered_serve import BufferedServer, buffered_refusal_line
        from aggregator.server import ServeConfig, Server, load_start
        from nefl.aggregation.version_buffer import buffered_refusal
        from aggregator.web import TokenRequired, start_http
        from aggregator.worker import local_worker_ids, start_local_workers
        from nefl.nested.checkpoint import CheckpointError
        from nefl.nested.data import DatasetUnavailable
        from nefl.aggregation.robust import DPAccountant
    setup_logging(logs.log_level, logs.log_format, context={"federation": federation})
    stop_on_sigterm()
    http, rule, dp_noise = dashboard.http, run.robust.aggregator, run.robust.dp_noise_multiplier
    try:
        # buffered: the centre check is off unless asked for (then refused below: it votes among a round's updates)
        robust = fleet_robustness(run.robust) if plan.versions.mode == "buffered" else run.robust.robustness()
        if (scale.workers or scale.remote_workers) and not robust.aggregation.mergeable:
            raise ValueError(f"--aggregator {rule} needs every update of a round in this process, and workers "
                             "split them: drop --workers/--remote-workers, or use nefedavg (its centre check runs in each worker)")
        if robust.aggregation.spec.root_data and not (evaluation.root_data or evaluation.eval_dataset):
            raise ValueError(f"--aggregator {rule} needs the server's root set: give --root-data DATASET or --eval-dataset")
        run.check()  # a bad schedule fails here, in one line
        if plan.versions.mode == "buffered":
            refused = buffered_refusal(robust) or buffered_refusal_line(scale.workers, scale.remote_workers, assignment)
            if refused:
                raise ValueError(f"--mode buffered refuses this: {refused}")
            plan.versions.staleness()  # a bad buffer setting fails here
        if dp_noise > 0:
            DPAccountant(dp_noise, 1.0, dp_delta).epsilon(1)  # fails now, not after round 1, without dp-accounting
        listen = parse_listen(http) if http else None
        embedded = embedded_broker(local_broker.embedded_broker_kind, local_broker.embedded_host,
                                   local_broker.embedded_port) if broker is None else None
        if scale.workers > 1 and embedded is not None and embedded.name == "amqtt":
            raise ValueError("--workers > 1 needs MQTT shared subscriptions, which the embedded broker (amqtt) lacks: "
                             "install mosquitto, or give --broker mqtt://HOST:PORT of mosquitto 2.x, EMQX, HiveMQ or VerneMQ")
        if listen and not is_loopback(listen[0]) and not dashboard.http_token:
            raise TokenRequired(f"--http {http} would show the fleet to anyone who can reach it: give --http-token "
                                "(or $NEFL_HTTP_TOKEN), or bind 127.0.0.1")
        if listen:
            check_bindable(*listen)  # a taken port is found now, before the key directory, the checkpoint or the data
    except (ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
    # the groups' fields are ServeConfig's, by name
    cfg = ServeConfig(profile=profile, federation=federation, checkpoint_dir=checkpoint_dir or f"runs/{federation}",
                      resume=resume, chunk_bytes=chunk_kib * 1024, seed=seed, dp_delta=dp_delta, assignment=assignment,
                      init_from=init_from, **plan.serve_fields(), **asdict(training), **asdict(evaluation), **asdict(scale),
                      lr_schedule=run.lr_schedule, warmup_rounds=run.warmup_rounds, robustness=robust,
                      root_samples=run.robust.root_samples, resend_after=trust.resend_after,
                      enrolment=EnrolmentPolicy(open=trust.open_enrolment, require_device_keys=trust.require_device_keys))
    try:
        Topics(federation)
        start = load_start(cfg)
        if cfg.resume and start.meta.get("mode", "sync") != cfg.mode:
            raise ValueError(f"the checkpoint in {cfg.checkpoint_dir} is of --mode {start.meta.get('mode', 'sync')}, "
                             f"this is --mode {cfg.mode}: resume it in its own mode")
        keys = KeyDir(federation, trust.key_dir)
        signer = keys.server_signer(cfg.checkpoint_dir)
        if start.next_round > cfg.rounds:
            log.info(f"checkpoint is already at round {start.next_round - 1} of {cfg.rounds}: nothing to do (raise --rounds)")
            return
        enrolment = Enrolment(federation, cfg.enrolment, keys.journal)
        enrolment.local_workers = {w: keys.worker_signer(w).public_text for w in local_worker_ids(cfg.workers, federation)}
        incarnation = keys.next_incarnation()
        settings = parse_broker(broker or embedded.url, *mqtt.credentials)
        server = (BufferedServer if cfg.mode == "buffered" else Server)(cfg, settings, start, signer, enrolment,
                                                                        incarnation, keys.rule_secret())  # a missing --eval-dataset fails here, first
        if embedded is not None:
            embedded.start()
            log.info(f"started embedded MQTT broker on {embedded.url} ({embedded.name}); clients join with "
                     f"--broker {embedded.url}")
    except (CheckpointError, ProfileError, KeyFileError, DatasetUnavailable, ValueError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
    if start.next_round > 1:
        log.info(f"resuming federation {federation!r} at round {start.next_round} from {cfg.checkpoint_dir}")
    log.info(f"server key {signer.public_text}, fingerprint {fingerprint(signer.public_text)} (devices: --server-key or a "
             f"join token; `aggregator key` prints it); keys in {keys.path}; run incarnation {incarnation}")
    log.info("enrolment " + ("open: a device's first signed announce pins its key" if enrolment.open else
                             "closed: only devices enrolled with `aggregator enroll` take part"))
    watcher = RolloutWatcher(settings, federation, signer.public_text, keys).start() if listen else None
    try:
        web = start_http(server.observer, *listen, dashboard.http_token, watcher.snapshot) if watcher is not None else None
    except OSError as e:
        watcher.close()  # only --http fails to bind, and then there is a watcher
        if embedded is not None:
            embedded.stop()
        print(f"error: --http {http}: {e.strerror or e} (is another process on that port? pick another)", file=sys.stderr)
        raise typer.Exit(2) from None
    if web is not None:
        log.info(f"dashboard on {web.url}, Prometheus metrics on {web.url}metrics")
    local = (start_local_workers(cfg.workers, settings, federation, signer.public_text, keys, logs.log_level)
             if cfg.workers else [])
    one_per_process()
    keep_freed_memory()
    freeze_startup()
    try:
        server.run()
        _linger(web, dashboard.http_linger)
    except (KeyboardInterrupt, Stop) as e:
        done = server.driver.checkpointed
        log.info(f"stopping ({stop_reason(e)}); "
                 + (f"round {done} is the last checkpointed one: continue with --resume" if done >= 1
                    else "no round completed yet, so there is nothing to resume"))
        server.link.conn.stop()
    finally:
        server.driver.stop_evaluating()
        stop_children(local)
        if web is not None:
            web.close()
        if watcher is not None:
            watcher.close()
        if embedded is not None:
            embedded.stop()


def _linger(web: DashboardServer | None, seconds: float) -> None:
    """After the last round: keep --http up so the final round's values get scraped (Ctrl-C ends it)."""
    if web is None or seconds <= 0:
        return
    log.info(f"federation finished; {web.url} stays up {seconds:g} s more (--http-linger)")
    try:
        time.sleep(seconds)
    except (KeyboardInterrupt, Stop):
        log.info("stopping the HTTP server")


@grouped
def key_command(
    checkpoint_dir: CheckpointDirOption("A run directory where an older version kept server.key: the key is moved "
                                        "into the key directory first.") = None,
    *,
    keys: KeyOptions,
) -> None:
    """Print the aggregator's public key (created if missing), for devices' --server-key and workers."""
    try:
        signer = KeyDir(Topics(keys.federation).federation, keys.key_dir).server_signer(checkpoint_dir)
    except (KeyFileError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
    print(signer.public_text)
    print(f"fingerprint {fingerprint(signer.public_text)}", file=sys.stderr)
