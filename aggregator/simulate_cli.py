"""`aggregator simulate`: the paper's experiments in one process, with a progress bar (the simulator's
modules, which need torch, are imported when the command runs, not for its --help)."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Annotated, Optional, get_args

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from aggregator.fleet_cli import FleetOptions, fleet_robustness, fleet_simulator, report_fleet
from aggregator.run_options import AssignmentOption, RunSpec
from nefl.nested.profile import ProfileError
from nefl.support.cli_options import (BatchSizeOption, ClientsOption, DataRootOption, DatasetOption, EvalEveryOption,
                                      EvalSamplesOption, FinalEvalSamplesOption, InitFromOption, LocalEpochsOption, LrOption,
                                      MaxSamplesOption, MethodOption, NonIidOption, OutOption, ProfileOption, RoundsOption,
                                      SeedOption, ThreadsOption, TorchDeviceOption)
from nefl.support.extras import full_install_required
from nefl.support.option_groups import grouped, option_group
from nefl.support.settings import (ATTACK_SCALES, DEFAULT_ATTACK_SCALE, Attack, AttackName, Direction, TrainConfig,
                                   Weighting)

console = Console(stderr=True)


@option_group("Data")
class SimData:
    dataset: DatasetOption("Dataset (default: the profile's), e.g. fashion-mnist.") = None
    non_iid: NonIidOption("Dirichlet alpha of the clients' label skew (0.1 high, 1.0 low; omit for IID).") = None
    max_samples_per_client: MaxSamplesOption() = None
    data_root: DataRootOption = None


@option_group("Local training")
class SimTraining:
    local_epochs: LocalEpochsOption = TrainConfig.local_epochs
    batch_size: BatchSizeOption = TrainConfig.batch_size
    lr: LrOption("SGD learning rate (its schedule: --lr-schedule).") = TrainConfig.lr
    weighting: Annotated[Weighting, typer.Option(help="uniform (as the paper) or samples.")] = "uniform"


@option_group("Evaluation")
class SimEval:
    eval_every: EvalEveryOption() = 5
    eval_samples: EvalSamplesOption("Test images for intermediate evaluations.") = 2000
    final_eval_samples: FinalEvalSamplesOption() = None


@option_group("Speed")
class SimSpeed:
    batch_clients: Annotated[bool, typer.Option(
        help="Train the clients of one submodel and sample count together (torch.func.vmap): for GPUs; the same "
             "results up to float order; on a CPU no faster (`make bench-sim`).")] = False
    bf16: Annotated[bool, typer.Option(help="bfloat16 autocast for local training (GPUs with bfloat16).")] = False


@option_group("Attack (docs/security.md)")
class AttackOptions:
    attack: Annotated[Optional[str], typer.Option(
        help="What the hostile clients do: " + ", ".join(get_args(AttackName)) + " (docs/security.md).")] = None
    attackers: Annotated[float, typer.Option(min=0, max=1, help="With --attack: the share of clients that are hostile.")] = 0.2
    attack_scale: Annotated[Optional[float], typer.Option(
        min=0, help="scaled-flip: -SCALE x the honest delta; neg-weights: -SCALE x the weights; noise: SCALE x the "
                    "honest norm; bias-push: the upload's norm, SCALE x the honest; bn-poison: per-submodel tensors "
                    "moved by -SCALE x themselves; boosted-, durable-backdoor: SCALE x its delta; layer-local: the "
                    f"poison's norm, SCALE x the honest. Default: "
                    f"{', '.join(f'{k} {v}' for k, v in ATTACK_SCALES.items())}, else "
                    f"{DEFAULT_ATTACK_SCALE}.")] = None
    attack_direction: Annotated[str, typer.Option(
        help="min-max, min-sum, adaptive: the perturbation's direction, " + ", ".join(get_args(Direction)) + ".")
    ] = Attack.direction


@grouped
def simulate_command(
    profile: ProfileOption(),
    method: MethodOption("nefl | nefl-nl | fjord | heterofl | depthfl (default: the profile's).") = None,
    clients: ClientsOption("Clients in the federation (split into equal tiers).") = 20,
    per_round: int = typer.Option(5, min=1, help="Clients sampled per round."),
    rounds: RoundsOption("Communication rounds.") = 30,
    seed: SeedOption("Seed for init, partitions, sampling and augmentation.") = 0,
    out: OutOption = None,
    threads: ThreadsOption() = None,
    device: TorchDeviceOption("torch device for training and evaluation: cpu, cuda, cuda:N or mps.") = "cpu",
    assignment: AssignmentOption() = "paper",
    init_from: InitFromOption() = None,
    *,
    data: SimData,
    training: SimTraining,
    run: RunSpec,
    evaluation: SimEval,
    hostile: AttackOptions,
    fleet: FleetOptions,
    speed: SimSpeed,
) -> None:
    """Simulate a NeFL federation (or a baseline) on a real dataset and print per-submodel accuracy.

    With --out, metrics.jsonl, config.json and the final checkpoint are written there."""
    with full_install_required("aggregator simulate"):  # here, not at the top: `simulate --help` needs no torch
        import torch

        from aggregator.simulate import SimConfig, Simulator
        from nefl.nested.data import DatasetUnavailable
        from nefl.nested.state import GlobalState
    if per_round > clients:
        raise typer.BadParameter(f"--per-round {per_round} exceeds --clients {clients}")
    if fleet.mode and (speed.batch_clients or speed.bf16):
        raise typer.BadParameter("--batch-clients and --bf16 apply to the round simulator, not to --mode")
    if threads:
        torch.set_num_threads(threads)
    try:
        attack = (Attack(hostile.attack, hostile.attack_scale, direction=hostile.attack_direction)
                  if hostile.attack else None)
        # the groups' fields are SimConfig's, by name
        cfg = SimConfig(profile, method, clients=clients, per_round=per_round, rounds=rounds, seed=seed, out=out,
                        device=device, assignment=assignment, **asdict(data), **asdict(training), **asdict(evaluation),
                        **asdict(speed),
                        lr_schedule=run.lr_schedule, warmup_rounds=run.warmup_rounds,
                        robustness=fleet_robustness(run.robust) if fleet.mode else run.robust.robustness(),
                        root_samples=run.robust.root_samples, attack=attack, attackers=hostile.attackers if attack else 0.0)
        if fleet.mode:
            fleet_sim = fleet_simulator(cfg, fleet, init_from)
        else:
            sim = Simulator(cfg)
        if init_from:  # before the first round, so round 1 trains from the pretrained weights
            sim.fed.state = GlobalState.pretrained(sim.layout, init_from, seed)
    except (ProfileError, DatasetUnavailable, ValueError, ImportError) as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
    if fleet.mode:
        return report_fleet(fleet_sim, console)
    ladder = sim.layout.profile
    console.print(f"{ladder.name} · method {sim.layout.method.name} · {len(sim.train)} training images over "
                  f"{clients} clients ({'IID' if data.non_iid is None else f'Dirichlet({data.non_iid})'})")
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
