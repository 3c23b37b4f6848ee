"""`aggregator jigsaw`: FedJigsaw, its ablations, local training or the PT baselines in one process, with a progress bar."""

from __future__ import annotations

import json
from typing import Optional

import torch
import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from aggregator.jigsaw_sim import JigsawConfig, JigsawSimulator
from nefl.data import DatasetUnavailable
from nefl.jigsaw.methods import METHODS, get_method
from nefl.jigsaw.zoo import ArchError
from nefl.logs import console

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
    threads: Optional[int] = typer.Option(None, min=1, help="torch CPU threads (default: torch's choice)."),
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
