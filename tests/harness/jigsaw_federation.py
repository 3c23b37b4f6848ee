"""FedJigsaw as real processes: `aggregator jigsaw-serve` and one `edge-client jigsaw` per device on a mosquitto
(tests/e2e/test_jigsaw_mqtt.py, benchmarks/bench_jigsaw_poisoning.py --transport mqtt). Device dN is the
simulator's client N: the same budget, so the same base, shard and seeds."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from nefl.jigsaw.shards import device_budgets
from nefl.jigsaw.sim import JigsawConfig
from nefl.jigsaw.zoo import load_base
from nefl.nested.checkpoint import read_metrics
from tests.harness.procs import Procs, free_port

ROOT = Path(__file__).resolve().parents[2]
FEDERATION = "jig"
POISONER = ROOT / "tests" / "harness" / "jigsaw_poisoner.py"


def budgets(cfg: JigsawConfig) -> list[int]:
    """The simulator's device budgets: given to the devices, they pick the bases their twins get."""
    return [int(b) for b in device_budgets([load_base(a) for a in cfg.archs], cfg.clients, cfg.batch_size,
                                           cfg.budget_headroom, cfg.seed)]


def start_federation(procs: Procs, tmp: Path, cfg: JigsawConfig, fetch_timeout: float = 20, round_timeout: float = 120,
                     poisoner: int | None = None, poison: str = "x1000") -> str:
    """Start the broker, the coordinator and cfg.clients devices; device `poisoner` runs tests/harness/jigsaw_poisoner.py
    with `poison` (x1000, or one of the simulator's attacks from the model-training phase on)."""
    port = free_port()
    procs.mosquitto(port)
    broker = f"mqtt://127.0.0.1:{port}"
    procs.start("coordinator", [sys.executable, "-c", "from aggregator.cli import app; app()", "jigsaw-serve",
                                "--devices", str(cfg.clients), "--broker", broker, "--federation", FEDERATION,
                                "--archs", ",".join(cfg.archs), "--rounds", str(cfg.rounds), "--non-iid", str(cfg.non_iid),
                                "--policy-rounds", str(cfg.policy_rounds), "--critic-warmup", str(cfg.critic_warmup),
                                "--max-samples-per-client", str(cfg.max_samples_per_client),
                                "--test-per-client", str(cfg.test_per_client), "--val-samples", str(cfg.val_samples),
                                "--probe-samples", str(cfg.probe_samples),
                                "--seed", str(cfg.seed), "--fetch-timeout", str(fetch_timeout),
                                "--round-timeout", str(round_timeout), "--join-wait", "120", "--out", str(tmp / "run")])
    for i, b in enumerate(budgets(cfg)):
        entry = [str(POISONER), poison, str(cfg.policy_rounds)] if i == poisoner else \
            ["-c", "from edge_client.cli import app; app()"]
        procs.start(f"d{i}", [sys.executable, *entry, "jigsaw", "--broker", broker, "--federation", FEDERATION,
                              "--client-id", f"d{i}", "--memory-budget", str(b), "--threads", "1", "--out", str(tmp / f"d{i}")])
    return broker


def rows(tmp: Path) -> list[dict]:
    """The coordinator's metrics, one row per round closed (a line torn mid-append is skipped)."""
    return read_metrics(tmp / "run")


def final_accuracy(tmp: Path) -> dict[str, float]:
    """Each device's final local test accuracy, as the coordinator collected it."""
    return json.loads((tmp / "run" / "final.json").read_text())["accuracy"]
