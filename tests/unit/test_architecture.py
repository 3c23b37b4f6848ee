"""The import rules of docs/architecture.md, read from the code: floors only import downward, peers on a
floor stay apart, apps never import each other, no module circle, and the torch-free floors load without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("nefl", "aggregator", "edge_client", "export")
# (package prefix, floor): a module may import its own floor's package and any lower floor, never a higher or a peer
FLOORS = (("nefl.support", 1), ("nefl.nested", 2), ("nefl.aggregation", 3), ("nefl.protocol", 3), ("nefl.jigsaw", 4),
          ("nefl.cli", 4), ("nefl", 0), ("aggregator", 5), ("edge_client", 5), ("export", 5))
# what the small install (numpy, onnxruntime, paho-mqtt: no torch) imports: docs/architecture.md
TORCH_FREE = ("nefl.support", "nefl.protocol.messages", "nefl.protocol.merkle", "nefl.protocol.wire", "nefl.protocol.signing",
              "nefl.protocol.topics", "nefl.protocol.tokens", "nefl.protocol.manifest", "nefl.protocol.mqtt", "nefl.protocol.paho_fast",
              "nefl.nested.arch", "nefl.nested.profile", "nefl.nested.cost", "nefl.nested.tensorfile",
              "nefl.nested.families.costs", "nefl.cli")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports(path: Path, known: set[str]) -> set[str]:
    """Every project module `path` imports, at the top, in a function or under TYPE_CHECKING."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found.update(n for n in names if n in known)
    return found


def floor_of(module: str) -> tuple[str, int]:
    return next((p, f) for p, f in FLOORS if module == p or module.startswith(p + "."))


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports(p, set(mods)) - {m} for m, p in mods.items()}


def test_floors_import_only_downward_and_peers_stay_apart() -> None:
    wrong = []
    for m, deps in graph().items():
        pkg, floor = floor_of(m)
        for d in deps:
            dpkg, dfloor = floor_of(d)
            if dpkg != pkg and dfloor >= floor and dpkg != "nefl":
                wrong.append(f"{m} (floor {floor}) imports {d} (floor {dfloor})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_module_circle() -> None:
    g = graph()
    state: dict[str, int] = {}
    circles: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(g[m]):
            if state.get(d) == 1:
                circles.append(path[path.index(d):] + [d] if d in path else [m, d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert not circles, circles


def test_the_rules_see_every_module() -> None:
    """A new top-level package or floor gets a rule here before it gets code."""
    for m in modules():
        floor_of(m)
    assert {"nefl.nested.state", "nefl.aggregation.aggregate", "nefl.protocol.wire", "aggregator.server"} <= set(modules())


@pytest.mark.parametrize("prefix", TORCH_FREE)
def test_the_small_install_floors_load_without_torch(prefix: str) -> None:
    inside = sorted(m for m in modules() if m == prefix or m.startswith(prefix + "."))
    assert inside, prefix
    code = "import sys; sys.modules['torch'] = None; sys.modules['torchvision'] = None\n" + "\n".join(f"import {m}" for m in inside)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
