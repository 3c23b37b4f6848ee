"""A MobileNetV2 federation over the embedded broker: `aggregator serve` and two `edge-client join` processes (the
family's in-process tests are tests/unit/nested/test_families.py's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nefl.nested.checkpoint import load_checkpoint
from tests.harness.procs import finish, free_port, metrics, port_open, wait_for


# -- a federation ----------------------------------------------------------------------------------------

@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_mobilenet_federation_over_the_embedded_broker(procs, tmp_path: Path) -> None:
    import sys

    port = free_port()
    procs.start("agg", [sys.executable, "-c", "from aggregator.cli import app; app()", "serve",
                        "--profile", "mobilenetv2-fmnist-wd", "--checkpoint-dir", str(tmp_path / "run"),
                        "--embedded-port", str(port), "--federation", "t", "--rounds", "2", "--clients-per-round", "2",
                        "--min-clients", "1", "--round-timeout", "60", "--join-wait", "3", "--batch-size", "16",
                        "--eval-dataset", "fashion-mnist", "--eval-samples", "100",
                        "--final-eval-samples", "500"])  # the last round too (by default the whole split)
    wait_for(lambda: port_open(port), 60, "the embedded broker")
    for i, sub in enumerate((2, 5), start=1):
        procs.client(f"c{i}", f"mqtt://127.0.0.1:{port}",
                     ["--federation", "t", "--partition", f"{i}/8", "--max-samples", "64", "--max-submodel", str(sub),
                      "--no-calibrate"])
    finish(procs, "agg", 200)
    m = metrics(tmp_path)
    assert sorted(m) == [0, 1, 2]
    assert sum(sum(m[r]["updates_per_submodel"]) for r in (1, 2)) >= 2
    ckpt = load_checkpoint(tmp_path / "run")
    assert ckpt.layout.profile.arch.family == "mobilenetv2" and ckpt.meta["round"] == 2
