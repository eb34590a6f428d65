"""Code above the device layer talks to the GPU protocol, never to a backend class."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_energy

PACKAGE = Path(lightning_energy.__file__).parent
BACKEND_CLASSES = {"SimulatedGPU", "NVMLGPU"}


def _backend_isinstance_calls(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance"):
            continue
        if len(node.args) != 2:
            continue
        names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
        found += [f"{path.relative_to(PACKAGE)}:{node.lineno}" for _ in names & BACKEND_CLASSES]
    return found


def test_no_isinstance_check_on_a_backend_outside_the_device_layer() -> None:
    outside = [p for p in PACKAGE.rglob("*.py") if PACKAGE / "device" not in p.parents]
    assert outside
    assert [hit for path in outside for hit in _backend_isinstance_calls(path)] == []


def test_the_check_finds_one() -> None:
    # The device layer itself may ask which backend a GPU is: the check sees it there.
    assert _backend_isinstance_calls(PACKAGE / "device" / "simulated" / "gpu.py")
