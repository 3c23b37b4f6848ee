"""FedJigsaw end to end: `aggregator jigsaw` on real Fashion-MNIST, 4 clients, a few rounds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _jigsaw(out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", "from aggregator.cli import app; app()", "jigsaw", "--clients", "4", "--non-iid", "1.0",
           "--max-samples-per-client", "240", "--test-per-client", "100", "--threads", "1", "--out", str(out), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


@pytest.mark.extended
@pytest.mark.slow
def test_fedjigsaw_gets_every_client_above_chance_on_fashion_mnist(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _jigsaw(out, "--rounds", "3", "--policy-rounds", "2", "--critic-warmup", "1", "--val-samples", "40",
                   "--eval-every", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["round"], r["phase"]) for r in rows] == [(0, "policy"), (1, "policy"), (2, "train"), (3, "train"), (4, "train")]
    assert [r.get("critic_warm") for r in rows] == [False, True, None, None, None]  # the server only in the policy phase
    assert all(r["modules_returned"] > 0 and 0 <= r["chain_changes"] <= 1 for r in rows)
    final = rows[-1]
    assert len(final["accuracy"]) == 4 and min(final["accuracy"]) > 0.1 + 0.05, final["accuracy"]  # chance: 1 in 10
    meta = json.loads((out / "checkpoint" / "meta.json").read_text())
    assert meta["accuracy"] == final["accuracy"] and (out / "checkpoint" / "state.safetensors").stat().st_size > 0
    assert "local top-1" in proc.stdout and "mean ± std" in proc.stdout


def test_jigsaw_command_refuses_bad_options_with_one_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from aggregator.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["jigsaw", "--method", "fedavg"])
    assert res.exit_code == 2 and "use one of fedjigsaw" in res.output
    res = runner.invoke(app, ["jigsaw", "--method", "heterofl"])  # the NeFL preset's name: pointed at its command
    said = " ".join(res.output.replace("│", " ").split())  # the message as one line, however the panel wraps it
    assert res.exit_code == 2 and "pt-heterofl" in said and "aggregator simulate" in said
    res = runner.invoke(app, ["jigsaw", "--archs", "vgg-11", "--clients", "2", "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "use cnn-* for 28x28" in res.output
