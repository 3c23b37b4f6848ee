"""`aggregator jigsaw`: FedJigsaw (or its ablations, HeteroFL, FedRolex) in one process, with a progress bar."""

from __future__ import annotations

import json
from typing import Optional

import torch
import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from aggregator.jigsaw_sim import METHOD_TITLES, METHODS, JigsawConfig, JigsawSimulator
from nefl.data import DatasetUnavailable
from nefl.jigsaw.zoo import ArchError
from nefl.logs import console


def jigsaw_command(
    method: str = typer.Option("fedjigsaw", help=f"{' | '.join(METHODS)}."),
    dataset: str = typer.Option("fashion-mnist", help="Dataset (cnn-* architectures: 28x28; vgg-*: 32x32, e.g. cifar10)."),
    archs: str = typer.Option("cnn-2,cnn-3,cnn-4,cnn-6", help="Base architectures, assigned to clients round-robin "
                              "(names from profiles/jigsaw or TOML paths)."),
    clients: int = typer.Option(10, min=2, help="Clients (all active every round, as the paper)."),
    rounds: int = typer.Option(20, min=1, help="Communication rounds."),
    policy_rounds: Optional[int] = typer.Option(None, min=0, help="CoRe-Tune phase: rounds with the server's critic "
                                                "(fedjigsaw only; default: half the rounds)."),
    non_iid: float = typer.Option(0.1, min=1e-6, help="Dirichlet alpha of the label skew (0.1 high, 1.0 low)."),
    local_epochs: int = typer.Option(1, min=1, help="Local epochs."),
    batch_size: int = typer.Option(32, min=1, help="Local batch size."),
    lr: float = typer.Option(0.05, min=0.0, help="SGD learning rate of the local models (constant, as the FedJigsaw paper)."),
    topology: str = typer.Option("full", help="Neighbour topology: full (the paper's), ring or random."),
    neighbours_k: int = typer.Option(2, min=1, help="Peers per client for --topology random."),
    budget_scale: float = typer.Option(1.5, min=0.1, help="Memory budget: the base model's share of the training-peak "
                                       "estimate times this (plus the fixed part)."),
    max_samples_per_client: Optional[int] = typer.Option(None, min=10, help="Cap each client's data (faster runs)."),
    test_per_client: int = typer.Option(500, min=10, help="Local test images per client (its own label distribution)."),
    eval_every: int = typer.Option(5, min=0, help="Evaluate every N rounds (always after the last)."),
    seed: int = typer.Option(0, help="Seed for init, partitions, policies and augmentation."),
    data_root: Optional[str] = typer.Option(None, help="Dataset root (torchvision layout)."),
    out: Optional[str] = typer.Option(None, help="Directory for metrics.jsonl, config.json and the final checkpoint."),
    threads: Optional[int] = typer.Option(None, min=1, help="torch CPU threads (default: torch's choice)."),
) -> None:
    """Simulate FedJigsaw (clients assemble models from shared modules) or a baseline; print local accuracy per client."""
    err = console(stderr=True)
    if method not in METHODS:
        raise typer.BadParameter(f"--method {method!r}: use one of {', '.join(METHODS)}")
    if topology not in ("full", "ring", "random"):
        raise typer.BadParameter(f"--topology {topology!r}: use full, ring or random")
    if threads:
        torch.set_num_threads(threads)
    cfg = JigsawConfig(method=method, dataset=dataset, archs=tuple(a.strip() for a in archs.split(",") if a.strip()),
                       clients=clients, rounds=rounds, policy_rounds=policy_rounds, local_epochs=local_epochs,
                       batch_size=batch_size, lr=lr, non_iid=non_iid, seed=seed, max_samples_per_client=max_samples_per_client,
                       test_per_client=test_per_client, topology=topology, neighbours_k=neighbours_k,
                       budget_scale=budget_scale, eval_every=eval_every, data_root=data_root, out=out)
    try:
        sim = JigsawSimulator(cfg)
    except (ArchError, DatasetUnavailable, ValueError) as e:
        err.print(f"error: {e}")
        raise typer.Exit(2) from None
    err.print(f"{METHOD_TITLES[method]} · {clients} clients ({', '.join(cfg.archs)} round-robin) · "
              f"Dirichlet({non_iid}) · {rounds} rounds")
    columns = (TextColumn("round {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.fields[status]}"),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err) as progress:
        task = progress.add_task("rounds", total=rounds, status="")

        def on_round(row: dict) -> None:
            status = f"loss {row['train_loss']:.3f}"
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
    table = Table(title=f"{METHOD_TITLES[method]} · {rounds} rounds · {result.seconds:.0f} s")
    for col in ("client", "base", "budget MiB", "model", "local top-1"):
        table.add_column(col, justify="right" if col in ("budget MiB", "local top-1") else "left")
    for c, acc in enumerate(result.accuracy):
        table.add_row(str(c), sim.bases[c].name, f"{sim.budgets[c] / 2**20:.1f}", " ".join(result.architectures[c]), f"{100 * acc:.2f}")
    table.add_row("mean ± std", "", "", "", f"{100 * result.mean:.2f} ± {100 * result.std:.2f}")
    console().print(table)
