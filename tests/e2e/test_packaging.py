"""Packaging: the small install runs inference without torch, commands that need more name the fix,
and a wheel carries the profiles."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import numpy as np
import pytest
import typer
from PIL import Image
from typer.testing import CliRunner

import nefl.nested.profile
from aggregator.cli import COMMANDS as AGGREGATOR_COMMANDS
from edge_client.cli import COMMANDS as EDGE_COMMANDS
from nefl.cli import app as nefl_app
from nefl.support.extras import FULL_INSTALL, FULL_ONLY_MODULES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PIP_NET = ["--timeout", "20", "--retries", "1"]  # the machine's pip waits 180 s per try: bound it
# runs an edge-client command in this process, then reports which full-install modules it imported
IMPORT_CHECK = """
import json, sys
from edge_client.cli import app
code = 0
try:
    app({args!r})
except SystemExit as e:
    code = e.code or 0
print("imported: " + json.dumps(sorted(m for m in {modules!r} if m in sys.modules)))
sys.exit(code)
"""


def _run(cmd: list[str | Path], cwd: Path, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    """Without the caller's PYTHONPATH, so only the install under test (or `env`) provides the package."""
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | env
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=clean, capture_output=True, text=True, timeout=timeout)


def _imported_full_modules(args: list[str], cwd: Path) -> list[str]:
    out = _run([sys.executable, "-c", IMPORT_CHECK.format(args=args, modules=sorted(FULL_ONLY_MODULES))], cwd)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.rsplit("imported: ", 1)[1])


def _copy_sources(dest: Path) -> None:
    """pip builds in the source directory (build/, *.egg-info): build a copy, not the tree others work in."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setup = config["tool"]["setuptools"]
    for name in ("pyproject.toml", config["project"]["readme"]):
        shutil.copy(ROOT / name, dest / name)
    for package in setup["packages"]:
        src = setup.get("package-dir", {}).get(package, package.replace(".", "/"))
        shutil.copytree(ROOT / src, dest / src, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src, dist = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    _copy_sources(src)
    out = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dist, src], src,
               timeout=120)
    assert out.returncode == 0, out.stderr
    return next(dist.glob("nefl_edge-*.whl"))


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(export directory, a 28x28 PNG): the smallest and largest rungs of the tiny ladder keep the export short."""
    from export.onnx_export import export_checkpoint
    from nefl.nested.checkpoint import save_checkpoint
    from nefl.nested.state import GlobalState, Layout

    root = tmp_path_factory.mktemp("exported")
    layout = Layout.build(nefl.nested.profile.load_profile("resnet8-fmnist-w"))
    ckpt = save_checkpoint(root / "ckpt", GlobalState.init(layout, 1), layout, {"round": 0})
    export_checkpoint(ckpt, root / "onnx", submodels=[0, layout.num_submodels - 1])
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (28, 28), dtype=np.uint8)).save(root / "img.png")
    return root / "onnx", root / "img.png"


def _small_venv(wheel: Path, root: Path) -> Path:
    """A venv with the wheel and its base dependencies only; skips when no package index answers."""
    probe = _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PIP_NET, "-d", root / "probe", "psutil"],
                 root, timeout=90)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"package index unreachable (pip download psutil failed: {last})")
    venv.create(root / "venv", with_pip=False)
    python = root / "venv" / "bin" / "python"
    out = _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", *PIP_NET, wheel], root, timeout=240)
    assert out.returncode == 0, out.stderr
    return root / "venv" / "bin"


def test_help_and_probe_import_no_full_install_module(tmp_path: Path) -> None:
    assert _imported_full_modules(["--help"], tmp_path) == []
    assert _imported_full_modules(["probe", "--json", "--interval", "0"], tmp_path) == []


def test_following_a_rollout_needs_no_full_install_module(tmp_path: Path) -> None:
    block = "; ".join(f"sys.modules[{m!r}] = None" for m in sorted(FULL_ONLY_MODULES))
    out = _run([sys.executable, "-c", f"import sys; {block}; import edge_client.follow_cli"], tmp_path, PYTHONPATH=str(ROOT))
    assert out.returncode == 0, out.stderr


def test_listed_help_of_lazy_commands_is_their_docstring() -> None:
    """The command list shows each command's summary, the first paragraph of its help (details follow it)."""
    for module, function, listed in [*EDGE_COMMANDS.values(), *AGGREGATOR_COMMANDS.values()]:
        command = getattr(importlib.import_module(module), function)
        doc = command.info.help if isinstance(command, typer.Typer) else inspect.getdoc(command)
        assert doc.split("\n\n")[0] == listed


@pytest.mark.parametrize("code", [
    "from edge_client.cli import app; app(['plan', '-p', 'resnet8-fmnist-w'])",
    "from edge_client.cli import app; app(['join', '--broker', 'mqtt://localhost:1'])",
    "from export.cli import app; app(['onnx', '--checkpoint', 'ckpt', '--out', 'out'])",
    "from aggregator.cli import app; app(['serve'])",
])
def test_a_command_that_needs_torch_names_the_full_install(code: str, tmp_path: Path) -> None:
    out = _run([sys.executable, "-c", f"import sys; sys.modules['torch'] = None; {code}"], tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and FULL_INSTALL in out.stderr and "Traceback" not in out.stderr


def test_profile_list_fails_when_no_profile_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nefl.nested.profile, "PROFILES_DIR", tmp_path)
    result = CliRunner().invoke(nefl_app, ["profile", "list"])
    assert result.exit_code == 2 and "no profiles found" in result.output


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_small_install_runs_inference_without_torch(wheel: Path, exported: tuple[Path, Path], tmp_path: Path) -> None:
    models, image = exported
    assert _imported_full_modules(["infer", "--models", str(models), "--threads", "1", str(image)], tmp_path) == []
    bin_dir = _small_venv(wheel, tmp_path)
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    where = _run([bin_dir / "python", "-c", "import importlib.util as u, edge_client; print(edge_client.__file__, "
                  "u.find_spec('torch') is None and u.find_spec('torchvision') is None)"], cwd)
    package_file, no_torch = where.stdout.split()
    assert Path(package_file).is_relative_to(bin_dir.parent) and no_torch == "True", where.stdout + where.stderr
    assert _run([bin_dir / "edge-client", "--help"], cwd).returncode == 0
    probe = _run([bin_dir / "edge-client", "probe", "--json", "--interval", "0.05"], cwd)
    assert probe.returncode == 0 and json.loads(probe.stdout)["cpu_count"] >= 1
    infer = _run([bin_dir / "edge-client", "infer", "--models", models, "--threads", "1", image], cwd)
    assert infer.returncode == 0 and "submodel" in infer.stdout, infer.stdout + infer.stderr
    join = _run([bin_dir / "edge-client", "join", "--broker", "mqtt://localhost:1"], cwd)
    assert join.returncode == 2 and FULL_INSTALL in join.stderr and "Traceback" not in join.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_wheel_ships_the_profiles(wheel: Path, tmp_path: Path) -> None:
    target, cwd = tmp_path / "target", tmp_path / "elsewhere"
    cwd.mkdir()
    out = _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target, wheel], tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    found = _run([sys.executable, "-c", "import nefl.nested.profile; print(nefl.nested.profile.PROFILES_DIR)"], cwd, PYTHONPATH=str(target))
    assert found.stdout.strip() == str(target / "nefl" / "profiles")
    listed = _run([sys.executable, target / "bin" / "nefl", "profile", "list"], cwd, PYTHONPATH=str(target))
    assert listed.returncode == 0, listed.stderr
    assert {line.split()[0] for line in listed.stdout.splitlines()} == {p.stem for p in (ROOT / "profiles").glob("*.toml")}
    serve = _run([sys.executable, target / "bin" / "aggregator", "serve", "--help"], cwd, PYTHONPATH=str(target))
    assert serve.returncode == 0 and "--profile" in serve.stdout, serve.stderr
