"""Load the benchmark scripts (not a package) as modules."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


@pytest.fixture
def load_benchmark(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], ModuleType]:
    """Import ``benchmarks/<name>.py``; it is registered in ``sys.modules`` for the test
    only (dataclasses and pickling look their module up)."""

    def load(name: str) -> ModuleType:
        spec = importlib.util.spec_from_file_location(
            f"{name}_benchmark", BENCHMARKS / f"{name}.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, module)
        spec.loader.exec_module(module)
        return module

    return load
