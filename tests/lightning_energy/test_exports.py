"""The packages' public names: each resolves to what its module defines, and importing a
package imports no framework or database library its names do not need yet."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import lightning_energy.integrations
import lightning_energy.optimize

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = [lightning_energy.integrations, lightning_energy.optimize]


@pytest.mark.parametrize(
    ("package", "name"),
    [(package, name) for package in PACKAGES for name in package.__all__],
    ids=lambda value: value.__name__ if isinstance(value, ModuleType) else value,
)
def test_every_public_name_resolves_to_its_definition(package: ModuleType, name: str) -> None:
    try:
        value = getattr(package, name)
    except ModuleNotFoundError as missing:
        if (missing.name or "").startswith("lightning_energy"):
            raise
        pytest.skip(f"{missing.name} is not installed")
    assert value.__name__ == name
    assert value.__module__.startswith(package.__name__ + ".")


@pytest.mark.parametrize("package", PACKAGES, ids=lambda package: package.__name__)
def test_unknown_names_are_attribute_errors(package: ModuleType) -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = package.no_such_name


@pytest.mark.parametrize(
    ("module", "not_loaded"),
    [
        (
            "lightning_energy.integrations",
            [
                "lightning",
                "pytorch_lightning",
                "accelerate",
                "transformers",
                "deepspeed",
                "megatron",
            ],
        ),
        ("lightning_energy.optimize", ["sqlalchemy"]),
    ],
)
def test_importing_the_package_loads_none_of(module: str, not_loaded: list[str]) -> None:
    prefixes = [arg for prefix in not_loaded for arg in ("--prefix", prefix)]
    out = subprocess.run(
        [sys.executable, "-m", "tests.import_probe", *prefixes, module],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []
