"""The FedJigsaw commands: `aggregator jigsaw` runs FedJigsaw, its ablations, local training or the PT baselines in one
process, with a progress bar; `aggregator jigsaw-serve` coordinates real devices over MQTT (nefl/jigsaw/coordinator.py)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import Annotated, Optional

import torch
import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from nefl.jigsaw.sim import ATTACKS, JigsawConfig, JigsawSimulator
from aggregator.serve_cli import BrokerOrEmbeddedOption, EmbeddedHostOption, EmbeddedPortOption
from nefl.support.cli_options import (BatchSizeOption, BrokerOptions, ClientsOption, DataRootOption, DatasetOption,
                                      DevicesOption, FederationOption, KeyDirOption, EvalEveryOption, HttpOption,
                                      JoinWaitOption, LocalEpochsOption, LogOptions, LrOption, MaxSamplesOption, MethodOption,
                                      NonIidOption, OutOption, RoundsOption, RoundTimeoutOption, SeedOption, ThreadsOption)
from nefl.support.option_groups import grouped, option_group
from nefl.nested.data import DatasetUnavailable
from nefl.jigsaw.methods import METHODS, get_method
from nefl.jigsaw.zoo import ArchError
from nefl.support.logs import console

D = JigsawConfig  # every default below is the config's


def _archs(names: str) -> tuple[str, ...]:
    """--archs: comma-separated names or paths."""
    return tuple(a.strip() for a in names.split(",") if a.strip())


# options of the simulation (`jigsaw`) and the MQTT federation (`jigsaw-serve`) alike: a client of one is a device
# of the other
ArchsOption = Annotated[str, typer.Option(
    "--archs", help="Base architectures (names from profiles/jigsaw or TOML paths, comma-separated); each client takes "
                    "the largest its memory budget fits.")]
ProbeSamplesOption = Annotated[int, typer.Option(
    "--probe-samples", min=1, help="Shared unlabelled images set aside from the training images before partitioning: "
                                   "E_data for CoRe-Tune's Exp.")]
ValSamplesOption = Annotated[int, typer.Option(
    "--val-samples", min=1, help="Held-out validation images per client (the policy's reward), at most half its "
                                 "shard.")]
TestPerClientOption = Annotated[int, typer.Option(
    "--test-per-client", min=10, help="Local test images per client (its own label distribution).")]
PolicyRoundsOption = Annotated[int, typer.Option(
    "--policy-rounds", min=0, help="Policy phase before the model-training rounds, on the task data too (methods "
                                   "with a policy: fedjigsaw, no-coretune, no-symbio; 0: the untrained policy, decoded "
                                   "greedily).")]
CriticWarmupOption = Annotated[int, typer.Option(
    "--critic-warmup", min=0, help="Policy-phase rounds the server's critic trains before its values drive the "
                                   "clients' advantages.")]


@option_group("Local training")
class LocalTraining:
    local_epochs: LocalEpochsOption = D.local_epochs
    batch_size: BatchSizeOption = D.batch_size


@option_group("Data")
class SimData:
    non_iid: NonIidOption() = D.non_iid
    probe_samples: ProbeSamplesOption = D.probe_samples
    max_samples_per_client: MaxSamplesOption() = D.max_samples_per_client
    val_samples: ValSamplesOption = D.val_samples
    test_per_client: TestPerClientOption = D.test_per_client
    data_root: DataRootOption = D.data_root


CommonPriorOption = Annotated[float, typer.Option(
    min=0.0, help="The policies' starting logit bonus (learnable) for each step of the common chain, the smallest base "
                  "model with its head, so clients start out training one chain together; 0: off.")]


@option_group("Policy")
class SimPolicy:
    policy_rounds: PolicyRoundsOption = D.policy_rounds
    critic_warmup: CriticWarmupOption = D.critic_warmup
    policy_lr: Annotated[float, typer.Option(
        min=0.0, help="The policies' learning rate (Adam) in the policy phase; 0: the policy never learns, while the "
                      "policy phase still samples chains and trains modules (the control of a learned policy with "
                      "equal training).")] = D.policy_lr
    common_prior: CommonPriorOption = D.common_prior
    switch_cost: Annotated[float, typer.Option(
        min=0.0, help="Nats per round the current chain was trained that the policy must prefer a new chain by before "
                      "a client switches to it in the model-training phase.")] = D.switch_cost
    switch_patience: Annotated[int, typer.Option(
        min=1, help="Consecutive rounds the policy must prefer the same new chain that much.")] = D.switch_patience
    execution_temperature: Annotated[float, typer.Option(
        min=0.0, help="Sampling temperature of the model-training phase (0: greedy).")] = D.execution_temperature


@option_group("Topology")
class Topology:
    """Who borrows from whom: the simulator's clients and jigsaw-serve's devices alike."""

    topology: Annotated[str, typer.Option(help="Neighbour topology: full (the paper's), ring or random.")] = D.topology
    neighbours_k: Annotated[int, typer.Option(min=1, help="Peers per participant for --topology random.")] = D.neighbours_k


@option_group("Poisoning")
class SimAttack:
    """A poisoning borrower, to measure the sources' screening of returned copies (docs/fedjigsaw.md)."""

    poison: Annotated[Optional[str], typer.Option(
        help="The first --poisoners clients return poisoned copies of borrowed modules: flip (-3.5 x the copy), "
             "scale (change stretched to 4.5 x the module's norm) or layer (largest tensor flipped).")] = D.attack
    poisoners: Annotated[int, typer.Option(min=0, help="Clients that poison under --poison.")] = D.attackers
    screen_returns: Annotated[bool, typer.Option(
        help="Sources judge each module's returns together before averaging (off: the fixed norm bound alone).")] = D.screen_returns


@grouped
def jigsaw_command(
    method: MethodOption(" | ".join(f"{m.name} ({m.summary})" for m in METHODS.values()) + ".") = D.method,
    dataset: DatasetOption("Dataset (cnn-* architectures: 28x28; vgg-*: 32x32, e.g. cifar10).") = D.dataset,
    archs: ArchsOption = ",".join(D.archs),
    clients: ClientsOption("Clients (all active every round, as the paper; at least 2).") = D.clients,
    rounds: RoundsOption("Model-training rounds (every method).") = D.rounds,
    lr: LrOption("SGD learning rate of the local models (constant, as the FedJigsaw paper).") = D.lr,
    budget_headroom: float = typer.Option(D.budget_headroom, min=1.0, help="Device memory budgets reach this x the "
                                          "largest base model's share of the training-peak estimate."),
    eval_every: EvalEveryOption("Evaluate every N model-training rounds (always after the last).") = D.eval_every,
    seed: SeedOption("Seed for init, budgets, partitions, policies and augmentation.") = D.seed,
    out: OutOption = D.out,
    threads: ThreadsOption() = None,
    *,
    data: SimData,
    local: LocalTraining,
    policy: SimPolicy,
    neighbours: Topology,
    poisoning: SimAttack,
) -> None:
    """Simulate FedJigsaw (clients assemble models from shared modules) or a baseline; print local accuracy per client.

    With --out, metrics.jsonl, config.json and the final checkpoint are written there."""
    err = console(stderr=True)
    try:
        chosen = get_method(method)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--method") from None
    if clients < 2:
        raise typer.BadParameter(f"{clients}: FedJigsaw needs at least 2 clients", param_hint="--clients")
    if neighbours.topology not in ("full", "ring", "random"):
        raise typer.BadParameter(f"--topology {neighbours.topology!r}: use full, ring or random")
    if poisoning.poison is not None and poisoning.poison not in ATTACKS:
        raise typer.BadParameter(f"--poison {poisoning.poison!r}: use {', '.join(ATTACKS)}")
    if threads:
        torch.set_num_threads(threads)
    # the groups' fields are JigsawConfig's, by name (the poisoning's apart)
    cfg = JigsawConfig(method=method, dataset=dataset, archs=_archs(archs), clients=clients, rounds=rounds, lr=lr,
                       budget_headroom=budget_headroom, eval_every=eval_every, seed=seed, out=out, **asdict(data),
                       **asdict(local), **asdict(policy), **asdict(neighbours), attack=poisoning.poison,
                       attackers=poisoning.poisoners, screen_returns=poisoning.screen_returns)
    try:
        sim = JigsawSimulator(cfg)
    except (ArchError, DatasetUnavailable, ValueError) as e:
        err.print(f"error: {e}")
        raise typer.Exit(2) from None
    total = sim.policy_rounds + rounds
    err.print(f"{chosen.title} · {clients} clients ({', '.join(b.name for b in sim.bases)} from their budgets) · "
              f"Dirichlet({data.non_iid}) · {sim.policy_rounds} policy + {rounds} model-training rounds")
    columns = (TextColumn("round {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.fields[status]}"),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err) as progress:
        task = progress.add_task("rounds", total=total, status="")

        def on_round(row: dict) -> None:
            status = f"{row['phase']} · loss {row['train_loss']:.3f}"
            if "chain_changes" in row:
                status += f" · chains changed {100 * row['chain_changes']:.0f}%"
            if "mean" in row:
                status += f" · local acc {row['mean']:.3f} ± {row['std']:.3f}"
            progress.update(task, advance=1, status=status)
            if out is None:
                print(json.dumps(row), flush=True)

        try:
            result = sim.run(on_round)
        except ValueError as e:  # e.g. a budget no assembly fits
            err.print(f"error: {e}")
            raise typer.Exit(2) from None
    table = Table(title=f"{chosen.title} · {total} rounds · {result.seconds:.0f} s")
    for col in ("client", "base", "budget MiB", "model", "local top-1"):
        table.add_column(col, justify="right" if col in ("budget MiB", "local top-1") else "left")
    for c, acc in enumerate(result.accuracy):
        table.add_row(str(c), sim.bases[c].name, f"{sim.budgets[c] / 2**20:.1f}", " ".join(result.architectures[c]),
                      f"{100 * acc:.2f}")
    table.add_row("mean ± std", "", "", "", f"{100 * result.mean:.2f} ± {100 * result.std:.2f}")
    console().print(table)


@option_group("Data")
class DeviceData:
    dataset: DatasetOption("Dataset the devices shard (each holds its own copy).") = D.dataset
    non_iid: NonIidOption() = D.non_iid
    max_samples_per_client: MaxSamplesOption() = D.max_samples_per_client
    test_per_client: TestPerClientOption = D.test_per_client
    val_samples: ValSamplesOption = D.val_samples
    probe_samples: ProbeSamplesOption = D.probe_samples


@option_group("Policy")
class DevicePolicy:
    policy_rounds: PolicyRoundsOption = D.policy_rounds
    critic_warmup: CriticWarmupOption = D.critic_warmup
    common_prior: CommonPriorOption = D.common_prior


@option_group("Checks and timeouts")
class Timeouts:
    norm_bound: Annotated[float, typer.Option(
        min=1e-6, help="A returned module may differ from its source's copy by at most this x the copy's norm (else "
                       "refused and counted).")] = D.norm_bound
    fetch_timeout: Annotated[float, typer.Option(
        min=0.1, help="Seconds a device waits for a peer's module before masking that peer for the round.")] = D.fetch_timeout_s
    round_timeout: RoundTimeoutOption = D.round_timeout_s
    join_wait: JoinWaitOption("Seconds to wait for --devices devices to say hello.") = 600.0


@option_group("Embedded broker (without --broker)")
class Embedded:
    embedded_port: EmbeddedPortOption = 1883
    embedded_host: EmbeddedHostOption = "127.0.0.1"


@grouped
def jigsaw_serve_command(
    devices: DevicesOption("Devices to wait for (`edge-client jigsaw`; at least 2); numbered by client id."),
    broker: BrokerOrEmbeddedOption = None,
    federation: FederationOption("Federation name (topic prefix nefl/NAME/; its key lives in KEY_DIR/NAME).") = "default",
    method: MethodOption("fedjigsaw, no-coretune, no-symbio or local-only.") = D.method,
    archs: ArchsOption = ",".join(D.archs),
    rounds: RoundsOption("Model-training rounds.") = D.rounds,
    lr: LrOption() = D.lr,
    seed: SeedOption("Seed of shards, module init, policies and topology.") = D.seed,
    out: OutOption = None,
    http: HttpOption() = None,
    key_dir: KeyDirOption = None,
    *,
    data: DeviceData,
    local: LocalTraining,
    policy: DevicePolicy,
    neighbours: Topology,
    limits: Timeouts,
    local_broker: Embedded,
    mqtt: BrokerOptions,
    logs: LogOptions,
) -> None:
    """Coordinate FedJigsaw devices over MQTT: rounds, topology, phase and the CoRe-Tune critic; no central model.

    With --out, metrics.jsonl (one row per round) and final.json are written there."""
    import logging
    import threading
    from pathlib import Path

    from aggregator.broker import embedded_broker
    from nefl.jigsaw.coordinator import Coordinator
    from aggregator.keys import KeyDir
    from aggregator.metrics import JigsawMetrics
    from nefl.support.fsio import atomic_write_text
    from nefl.support.listen import parse_listen
    from nefl.support.logs import setup_logging
    from nefl.protocol.mqtt import Connection, drain, parse_broker
    from nefl.support.signals import Stop, stop_on_sigterm, stop_reason
    from nefl.protocol.signing import KeyFileError
    from nefl.protocol.topics import Topics

    setup_logging(logs.log_level, logs.log_format, context={"federation": federation})
    log = logging.getLogger("aggregator.jigsaw")
    stop_on_sigterm()
    try:
        topics = Topics(federation)
        if devices < 2:
            raise ValueError(f"--devices {devices}: FedJigsaw needs at least 2 devices")
        if neighbours.topology not in ("full", "ring", "random"):
            raise ValueError(f"--topology {neighbours.topology!r}: use full, ring or random")
        # the groups' fields are JigsawConfig's, by name (the timeouts in seconds apart)
        cfg = JigsawConfig(method=method, archs=_archs(archs), rounds=rounds, lr=lr, seed=seed, out=out,
                           **asdict(data), **asdict(local), **asdict(policy), **asdict(neighbours),
                           norm_bound=limits.norm_bound, fetch_timeout_s=limits.fetch_timeout,
                           round_timeout_s=limits.round_timeout)
        listen = parse_listen(http) if http else None
        out_dir = Path(out) if out else None
        metrics = JigsawMetrics() if listen else None
        signer = KeyDir(federation, key_dir).server_signer()
        embedded = embedded_broker("auto", local_broker.embedded_host, local_broker.embedded_port) if broker is None else None
        settings = parse_broker(broker or embedded.url, *mqtt.credentials)
        conn = Connection(settings, f"jigsaw-coordinator-{federation}", None, b"", log)
        coordinator = Coordinator(cfg, federation, devices, signer, conn.client,
                                  on_row=lambda row: _record(row, out_dir, metrics, log))
    except (ValueError, ArchError, KeyFileError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "metrics.jsonl").unlink(missing_ok=True)
    if embedded is not None:
        embedded.start()
        log.info(f"started embedded MQTT broker on {embedded.url}; devices run `edge-client jigsaw --broker {embedded.url}`")
    web = metrics.serve(*listen) if metrics is not None and listen else None
    log.info(f"coordinator key {signer.public_text} (devices: --server-key); waiting for {devices} devices on {topics.root}/jigsaw/")
    stop = threading.Event()
    conn.start()
    threading.Thread(target=drain, args=(conn, coordinator.handle, lambda: [conn.client.subscribe(t, qos=1) for t in
                                                                             coordinator.subscriptions()], stop),
                     daemon=True).start()
    code = 0
    try:
        final = coordinator.run(limits.join_wait)
        table = Table(title=f"FedJigsaw over MQTT · {len(final)} devices")
        for col in ("device", "client id", "local top-1"):
            table.add_column(col)
        names = {p.index: p.client_id for p in coordinator.plan.participants} if coordinator.plan else {}
        for c in sorted(final):
            table.add_row(str(c), names.get(c, "?"), f"{100 * final[c]:.2f}")
        console().print(table)
        if out_dir:
            atomic_write_text(out_dir / "final.json", json.dumps({"accuracy": {names.get(c, str(c)): a for c, a in final.items()},
                                                                  "plan": coordinator.plan.participants and
                                                                  [p.client_id for p in coordinator.plan.participants]}))
    except TimeoutError as e:
        log.error(str(e))
        code = 1
    except (KeyboardInterrupt, Stop) as e:
        log.info(f"stopping ({stop_reason(e)})")
    finally:
        stop.set()
        conn.stop()
        if web is not None:
            web.shutdown()
        if embedded is not None:
            embedded.stop()
    raise typer.Exit(code)


def _record(row: dict, out_dir, metrics, log) -> None:
    """A closed round: a line of metrics.jsonl, the Prometheus gauges, a log line."""
    from nefl.nested.checkpoint import append_metrics

    if out_dir:
        append_metrics(out_dir, row)
    if metrics is not None:
        metrics.record(row)
    log.info(f"round {row['round']} ({row['phase']}): {row['trained']}/{row['devices']} devices trained, "
             f"{row['modules_borrowed']} modules borrowed and returned, {row['bytes_per_device']:.0f} bytes sent and "
             f"received per device (whole models down and up: {row['whole_model_bytes_per_device']:.0f}), "
             f"rejected {row['rejected']}")
