"""`aggregator simulate`: the paper's experiments in one process, with a progress bar (the simulator's
modules, which need torch, are imported when the command runs, not for its --help)."""

from __future__ import annotations

import json
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from aggregator import robust_options as ro
from aggregator.assignment import Assignment
from nefl.nested.profile import ProfileError
from nefl.support.cli_options import ScheduleOption, ThreadsOption, WarmupOption
from nefl.support.extras import full_install_required
from nefl.support.settings import Attack, TrainConfig, Weighting

console = Console(stderr=True)


def simulate_command(
    profile: str = typer.Option(..., help="Profile name (see `nefl profile list`) or path to a TOML ladder."),
    dataset: Optional[str] = typer.Option(None, help="Dataset (default: the profile's), e.g. fashion-mnist."),
    method: Optional[str] = typer.Option(None, help="nefl | nefl-nl | fjord | heterofl | depthfl (default: the profile's)."),
    clients: int = typer.Option(20, min=1, help="Clients in the federation (split into equal tiers)."),
    per_round: int = typer.Option(5, min=1, help="Clients sampled per round."),
    rounds: int = typer.Option(30, min=1, help="Communication rounds."),
    local_epochs: int = typer.Option(TrainConfig.local_epochs, min=1, help="Local epochs E."),
    non_iid: Optional[float] = typer.Option(None, help="Dirichlet alpha for label skew (omit for IID)."),
    seed: int = typer.Option(0, help="Seed for init, partitions, sampling and augmentation."),
    batch_size: int = typer.Option(TrainConfig.batch_size, min=1, help="Local batch size."),
    lr: float = typer.Option(TrainConfig.lr, help="SGD learning rate (its schedule: --lr-schedule)."),
    lr_schedule: ScheduleOption = TrainConfig.schedule,
    warmup_rounds: WarmupOption = TrainConfig.warmup_rounds,
    weighting: Weighting = typer.Option("uniform", help="uniform (as the paper) or samples."),
    eval_every: int = typer.Option(5, min=0, help="Evaluate every N rounds (always after the last)."),
    eval_samples: int = typer.Option(2000, min=1, help="Test images for intermediate evaluations."),
    final_eval_samples: Optional[int] = typer.Option(None, min=1, help="Test images for the last evaluation (default: all)."),
    max_samples_per_client: Optional[int] = typer.Option(None, min=1, help="Cap each client's data (faster runs)."),
    data_root: Optional[str] = typer.Option(None, help="Dataset root (torchvision layout)."),
    out: Optional[str] = typer.Option(None, help="Directory for metrics.jsonl, config.json and the final checkpoint."),
    threads: ThreadsOption = None,
    device: str = typer.Option("cpu", help="torch device for training and evaluation: cpu, cuda, cuda:N or mps."),
    assignment: Assignment = typer.Option("paper", help="paper (tier t picks among submodels t-2..t+2), coverage "
                                          "(every submodel trained each round when the pool allows) or largest."),
    init_from: Optional[str] = typer.Option(None, help="Start from pretrained weights: a torchvision state dict (.pth, "
                                            "loaded with weights_only=True, or .safetensors) of the profile's "
                                            "architecture (docs/architectures.md)."),
    max_update_norm: ro.MaxUpdateNorm = None,
    update_norm_relative: ro.UpdateNormRelative = ro.D.relative,
    update_norm_k: ro.UpdateNormK = ro.D.adaptive_k,
    clip: ro.Clip = False,
    max_weight_abs: ro.MaxWeightAbs = ro.D.max_weight_abs,
    dp_noise_multiplier: ro.DPNoise = 0.0,
    aggregator: ro.Rule = ro.D.rule,
    trim: ro.Trim = ro.D.trim,
    centre_check: ro.CentreCheck = None,
    min_agree: ro.MinAgree = ro.D.min_agree,
    max_norm_ratio: ro.MaxNormRatio = ro.D.max_norm_ratio,
    root_samples: ro.RootSamples = ro.D.root_samples,
    attack: Optional[str] = typer.Option(None, help="What the hostile clients do: sign-flip, scaled-flip, neg-weights, "
                                         "noise, label-flip, backdoor or alie (docs/security.md)."),
    attackers: float = typer.Option(0.2, min=0, max=1, help="With --attack: the share of clients that are hostile."),
    attack_scale: float = typer.Option(Attack.scale, min=0, help="scaled-flip: -SCALE x the honest delta; neg-weights: "
                                       "-SCALE x the weights; noise: SCALE x the honest norm."),
) -> None:
    """Simulate a NeFL federation (or a baseline) on a real dataset and print per-submodel accuracy."""
    with full_install_required("aggregator simulate"):  # here, not at the top: `simulate --help` needs no torch
        import torch

        from aggregator.simulate import SimConfig, Simulator
        from nefl.nested.data import DatasetUnavailable
        from nefl.nested.state import GlobalState
    if per_round > clients:
        raise typer.BadParameter(f"--per-round {per_round} exceeds --clients {clients}")
    if threads:
        torch.set_num_threads(threads)
    try:
        robust = ro.robustness(max_update_norm, update_norm_relative, update_norm_k, clip, max_weight_abs,
                               dp_noise_multiplier, aggregator, trim, centre_check, min_agree, max_norm_ratio)
        hostile = Attack(attack, attack_scale) if attack else None
        cfg = SimConfig(profile, method, dataset, clients, per_round, rounds, local_epochs, non_iid, seed, batch_size,
                        lr, weighting, eval_every, eval_samples, final_eval_samples,
                        max_samples_per_client=max_samples_per_client, data_root=data_root, out=out, device=device,
                        assignment=assignment, lr_schedule=lr_schedule, warmup_rounds=warmup_rounds, robustness=robust,
                        root_samples=root_samples, attack=hostile, attackers=attackers if hostile else 0.0)
        sim = Simulator(cfg)
        if init_from:  # before the first round, so round 1 trains from the pretrained weights
            sim.fed.state = GlobalState.pretrained(sim.layout, init_from, seed)
    except (ProfileError, DatasetUnavailable, ValueError, ImportError) as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
    ladder = sim.layout.profile
    console.print(f"{ladder.name} · method {sim.layout.method.name} · {len(sim.train)} training images over "
                  f"{clients} clients ({'IID' if non_iid is None else f'Dirichlet({non_iid})'})")
    columns = (TextColumn("round {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.fields[status]}"),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("rounds", total=rounds, status="")

        def on_round(row: dict) -> None:
            status = f"loss {row['train_loss']:.3f}"
            if "accuracy" in row:
                status += f" · worst {row['worst']:.3f} avg {row['avg']:.3f}"
            progress.update(task, advance=1, status=status)
            if out is None:
                print(json.dumps(row), flush=True)

        result = sim.run(on_round)
    table = Table(title=f"{ladder.name} · {sim.layout.method.name} · {rounds} rounds · {result.seconds:.0f} s")
    table.add_column("submodel")
    table.add_column("gamma")
    table.add_column("gamma_w")
    table.add_column("depth")
    table.add_column("top-1", justify="right")
    for s, acc in zip(ladder.submodels, result.accuracy):
        table.add_row(str(s.index + 1), f"{s.gamma:g}", f"{s.gamma_w:g}", f"{s.depth_ratio:.2f}", f"{100 * acc:.2f}")
    table.add_row("worst", "", "", "", f"{100 * result.worst:.2f}")
    table.add_row("avg", "", "", "", f"{100 * result.avg:.2f}")
    Console().print(table)
    if result.backdoor is not None:
        Console().print("backdoor success per submodel (triggered test images classified as the target): "
                        + ", ".join(f"{100 * b:.1f}%" for b in result.backdoor))
