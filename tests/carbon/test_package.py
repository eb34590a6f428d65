"""The ``carbon`` package stands alone: it imports nothing from ``lightning_energy``."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import carbon

PACKAGE_DIR = Path(carbon.__file__).parent


def test_no_source_file_imports_lightning_energy() -> None:
    offenders = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.startswith("lightning_energy")]
    assert offenders == []


def test_importing_carbon_loads_no_lightning_energy_module() -> None:
    probe = ["tests.import_probe", "--prefix", "lightning_energy"]
    modules = ["carbon", "carbon.monitor", "carbon.config", "carbon.providers"]
    result = subprocess.run(
        [sys.executable, "-m", *probe, *modules],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert json.loads(result.stdout) == []


def test_public_names_resolve() -> None:
    for name in carbon.__all__:
        assert getattr(carbon, name) is not None
