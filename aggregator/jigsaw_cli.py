"""The FedJigsaw commands: `aggregator jigsaw` runs FedJigsaw, its ablations, local training or the PT baselines in one
process, with a progress bar; `aggregator jigsaw-serve` coordinates real devices over MQTT (nefl/jigsaw/coordinator.py)."""

from __future__ import annotations

import json
import sys
from typing import Optional

import torch
import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from nefl.jigsaw.sim import JigsawConfig, JigsawSimulator
from nefl.support.cli_options import (ThreadsOption, CaCertOption, CertfileOption, KeyDirOption, KeyfileOption, LogFormatOption, LogLevelOption,
                              PasswordOption, UsernameOption)
from nefl.nested.data import DatasetUnavailable
from nefl.jigsaw.methods import METHODS, get_method
from nefl.jigsaw.zoo import ArchError
from nefl.support.logs import console

D = JigsawConfig  # every default below is the config's


def jigsaw_command(
    method: str = typer.Option(D.method, help=" | ".join(f"{m.name} ({m.summary})" for m in METHODS.values()) + "."),
    dataset: str = typer.Option(D.dataset, help="Dataset (cnn-* architectures: 28x28; vgg-*: 32x32, e.g. cifar10)."),
    archs: str = typer.Option(",".join(D.archs), help="Base architectures devices can get (names from profiles/jigsaw or "
                              "TOML paths); each client gets the largest its memory budget fits."),
    clients: int = typer.Option(D.clients, min=2, help="Clients (all active every round, as the paper)."),
    rounds: int = typer.Option(D.rounds, min=1, help="Model-training rounds (every method)."),
    policy_rounds: int = typer.Option(D.policy_rounds, min=0, help="Policy phase before them, on the proxy task "
                                      "(methods with a policy: fedjigsaw, no-coretune, no-symbio)."),
    critic_warmup: int = typer.Option(D.critic_warmup, min=0, help="Policy-phase rounds the server's critic trains "
                                      "before its values drive the clients' advantages."),
    switch_cost: float = typer.Option(D.switch_cost, min=0.0, help="Nats per round the current chain was trained that "
                                      "the policy must prefer a new chain by before a client switches to it in the "
                                      "model-training phase."),
    switch_patience: int = typer.Option(D.switch_patience, min=1, help="Consecutive rounds the policy must prefer the "
                                        "same new chain that much."),
    execution_temperature: float = typer.Option(D.execution_temperature, min=0.0, help="Sampling temperature of the "
                                                "model-training phase (0: greedy)."),
    proxy_samples: int = typer.Option(D.proxy_samples, min=10, help="Proxy images per client (rotation task, set "
                                      "aside from the training images before partitioning)."),
    non_iid: float = typer.Option(D.non_iid, min=1e-6, help="Dirichlet alpha of the label skew (0.1 high, 1.0 low)."),
    local_epochs: int = typer.Option(D.local_epochs, min=1, help="Local epochs."),
    batch_size: int = typer.Option(D.batch_size, min=1, help="Local batch size."),
    lr: float = typer.Option(D.lr, min=0.0, help="SGD learning rate of the local models (constant, as the FedJigsaw paper)."),
    topology: str = typer.Option(D.topology, help="Neighbour topology: full (the paper's), ring or random."),
    neighbours_k: int = typer.Option(D.neighbours_k, min=1, help="Peers per client for --topology random."),
    budget_headroom: float = typer.Option(D.budget_headroom, min=1.0, help="Device memory budgets reach this x the "
                                          "largest base model's share of the training-peak estimate."),
    max_samples_per_client: Optional[int] = typer.Option(D.max_samples_per_client, min=10, help="Cap each client's "
                                                         "task data (faster runs)."),
    test_per_client: int = typer.Option(D.test_per_client, min=10, help="Local test images per client (its own label distribution)."),
    eval_every: int = typer.Option(D.eval_every, min=0, help="Evaluate every N model-training rounds (always after the last)."),
    seed: int = typer.Option(D.seed, help="Seed for init, budgets, partitions, policies and augmentation."),
    data_root: Optional[str] = typer.Option(D.data_root, help="Dataset root (torchvision layout)."),
    out: Optional[str] = typer.Option(D.out, help="Directory for metrics.jsonl, config.json and the final checkpoint."),
    threads: ThreadsOption = None,
) -> None:
    """Simulate FedJigsaw (clients assemble models from shared modules) or a baseline; print local accuracy per client."""
    err = console(stderr=True)
    try:
        chosen = get_method(method)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--method") from None
    if topology not in ("full", "ring", "random"):
        raise typer.BadParameter(f"--topology {topology!r}: use full, ring or random")
    if threads:
        torch.set_num_threads(threads)
    cfg = JigsawConfig(method=method, dataset=dataset, archs=tuple(a.strip() for a in archs.split(",") if a.strip()),
                       clients=clients, rounds=rounds, policy_rounds=policy_rounds, critic_warmup=critic_warmup,
                       switch_cost=switch_cost, switch_patience=switch_patience,
                       execution_temperature=execution_temperature, proxy_samples=proxy_samples,
                       local_epochs=local_epochs, batch_size=batch_size, lr=lr, non_iid=non_iid, seed=seed,
                       max_samples_per_client=max_samples_per_client, test_per_client=test_per_client, topology=topology,
                       neighbours_k=neighbours_k, budget_headroom=budget_headroom, eval_every=eval_every,
                       data_root=data_root, out=out)
    try:
        sim = JigsawSimulator(cfg)
    except (ArchError, DatasetUnavailable, ValueError) as e:
        err.print(f"error: {e}")
        raise typer.Exit(2) from None
    total = sim.policy_rounds + rounds
    err.print(f"{chosen.title} · {clients} clients ({', '.join(b.name for b in sim.bases)} from their budgets) · "
              f"Dirichlet({non_iid}) · {sim.policy_rounds} policy + {rounds} model-training rounds")
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


def jigsaw_serve_command(
    devices: int = typer.Option(..., min=2, help="Devices to wait for (`edge-client jigsaw`); numbered by client id."),
    broker: Optional[str] = typer.Option(None, help="mqtt://HOST:PORT or mqtts://HOST:PORT; omit to start an embedded broker."),
    embedded_port: int = typer.Option(1883, min=0, help="Port of the embedded broker (0: a free one)."),
    embedded_host: str = typer.Option("127.0.0.1", help="Address the embedded broker listens on (0.0.0.0: every "
                                      "interface, for devices on other machines; then secure it: docs/security.md)."),
    federation: str = typer.Option("default", help="Federation name (topic prefix nefl/NAME/; its key lives in KEY_DIR/NAME)."),
    method: str = typer.Option(D.method, help="fedjigsaw, no-coretune, no-symbio or local-only."),
    dataset: str = typer.Option(D.dataset, help="Dataset the devices shard (each holds its own copy)."),
    archs: str = typer.Option(",".join(D.archs), help="Base architectures; each device takes the largest its memory fits."),
    rounds: int = typer.Option(D.rounds, min=1, help="Model-training rounds."),
    policy_rounds: int = typer.Option(D.policy_rounds, min=0, help="Policy phase before them (CoRe-Tune's critic runs "
                                      "here during it)."),
    critic_warmup: int = typer.Option(D.critic_warmup, min=0, help="Policy-phase rounds the critic trains before its values count."),
    non_iid: float = typer.Option(D.non_iid, min=1e-6, help="Dirichlet alpha of the devices' label skew."),
    max_samples_per_client: Optional[int] = typer.Option(D.max_samples_per_client, min=10, help="Cap each device's task data."),
    test_per_client: int = typer.Option(D.test_per_client, min=10, help="Local test images per device."),
    proxy_samples: int = typer.Option(D.proxy_samples, min=10, help="Proxy images per device (policy phase)."),
    local_epochs: int = typer.Option(D.local_epochs, min=1, help="Local epochs."),
    batch_size: int = typer.Option(D.batch_size, min=1, help="Local batch size."),
    lr: float = typer.Option(D.lr, min=0.0, help="SGD learning rate."),
    topology: str = typer.Option(D.topology, help="Neighbour topology: full, ring or random."),
    neighbours_k: int = typer.Option(D.neighbours_k, min=1, help="Peers per device for --topology random."),
    norm_bound: float = typer.Option(D.norm_bound, min=1e-6, help="A returned module may differ from its source's copy by "
                                     "at most this x the copy's norm (else refused and counted)."),
    fetch_timeout: float = typer.Option(D.fetch_timeout_s, min=0.1, help="Seconds a device waits for a peer's module "
                                        "before masking that peer for the round."),
    round_timeout: float = typer.Option(D.round_timeout_s, min=1.0, help="Seconds before a round closes without the "
                                        "devices that have not reported."),
    join_wait: float = typer.Option(600.0, min=1.0, help="Seconds to wait for --devices devices to say hello."),
    seed: int = typer.Option(D.seed, help="Seed of shards, module init, policies and topology."),
    out: Optional[str] = typer.Option(None, help="Directory for metrics.jsonl (one row per round) and final.json."),
    http: Optional[str] = typer.Option(None, help="Serve Prometheus /metrics on HOST:PORT (a bare PORT is 127.0.0.1:PORT)."),
    key_dir: KeyDirOption = None,
    username: UsernameOption = None,
    password: PasswordOption = None,
    ca_cert: CaCertOption = None,
    certfile: CertfileOption = None,
    keyfile: KeyfileOption = None,
    log_level: LogLevelOption = "info",
    log_format: LogFormatOption = "plain",
) -> None:
    """Coordinate FedJigsaw devices over MQTT: rounds, topology, phase and the CoRe-Tune critic; no central model."""
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

    setup_logging(log_level, log_format, context={"federation": federation})
    log = logging.getLogger("aggregator.jigsaw")
    stop_on_sigterm()
    try:
        topics = Topics(federation)
        if topology not in ("full", "ring", "random"):
            raise ValueError(f"--topology {topology!r}: use full, ring or random")
        cfg = JigsawConfig(method=method, dataset=dataset, archs=tuple(a.strip() for a in archs.split(",") if a.strip()),
                           rounds=rounds, policy_rounds=policy_rounds, critic_warmup=critic_warmup, non_iid=non_iid,
                           max_samples_per_client=max_samples_per_client, test_per_client=test_per_client,
                           proxy_samples=proxy_samples, local_epochs=local_epochs, batch_size=batch_size, lr=lr,
                           topology=topology, neighbours_k=neighbours_k, norm_bound=norm_bound,
                           fetch_timeout_s=fetch_timeout, round_timeout_s=round_timeout, seed=seed, out=out)
        listen = parse_listen(http) if http else None
        out_dir = Path(out) if out else None
        metrics = JigsawMetrics() if listen else None
        signer = KeyDir(federation, key_dir).server_signer()
        embedded = embedded_broker("auto", embedded_host, embedded_port) if broker is None else None
        settings = parse_broker(broker or embedded.url, username, password, ca_cert, certfile, keyfile)
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
        final = coordinator.run(join_wait)
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
