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


def _simulated_backend_comparisons(path: Path) -> list[str]:
    """``<x>.backend == "simulated"`` (or ``!=``, ``in``): code asking whether the GPUs are
    simulated instead of asking the device set what it needs to know."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        asks_backend = any(isinstance(o, ast.Attribute) and o.attr == "backend" for o in operands)
        constants = {n.value for o in operands for n in ast.walk(o) if isinstance(n, ast.Constant)}
        if asks_backend and "simulated" in constants:
            found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    return found


def _outside_the_device_layer() -> list[Path]:
    return [p for p in PACKAGE.rglob("*.py") if PACKAGE / "device" not in p.parents]


def test_no_code_outside_the_device_layer_asks_whether_the_backend_is_simulated() -> None:
    assert [
        hit for path in _outside_the_device_layer() for hit in _simulated_backend_comparisons(path)
    ] == []
    # The device layer answers it (DeviceSet.virtual_time): the check sees it there.
    assert _simulated_backend_comparisons(PACKAGE / "device" / "base.py")


def test_no_isinstance_check_on_a_backend_outside_the_device_layer() -> None:
    outside = _outside_the_device_layer()
    assert outside
    assert [hit for path in outside for hit in _backend_isinstance_calls(path)] == []


def test_the_check_finds_one() -> None:
    # The device layer itself may ask which backend a GPU is: the check sees it there.
    assert _backend_isinstance_calls(PACKAGE / "device" / "simulated" / "gpu.py")
