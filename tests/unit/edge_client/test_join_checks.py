"""`edge-client join` checks what a person typed before torch, the dataset or the broker."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _join(*args: str) -> tuple[int, str, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("NEFL_JOIN_TOKEN", None)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", "from edge_client.cli import app; app()", "join", *args],
                          capture_output=True, text=True, timeout=30, env=env, cwd=ROOT)
    return done.returncode, done.stderr, time.monotonic() - started


@pytest.mark.parametrize("args, said", [
    (["--join-token", "not-a-token"], "not a join token"),
    (["--client-id", "a/b"], "client id"),
    (["--broker", "ftp://x:1"], "broker"),
])
def test_a_typo_is_one_line_and_exit_2_before_any_loading(args: list[str], said: str) -> None:
    code, err, took = _join("--broker", "mqtt://127.0.0.1:1", "--data-root", "/nonexistent", *args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and said in lines[0].lower(), err
    assert took < 5.0, f"took {took:.1f} s: something loaded before the check"
    assert "loading" not in err


def test_an_unusable_device_key_is_found_before_any_loading(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    code, err, took = _join("--broker", "mqtt://127.0.0.1:1", "--data-root", "/nonexistent",
                            "--device-key", str(tmp_path / "file" / "c1.key"))
    assert code == 2 and err.startswith("error:") and "loading" not in err and took < 5.0, err
