"""Fixtures of the Transformers ``Trainer`` tests (``pytest.importorskip`` in the modules
that use them keeps the rest collectable without the ``hf`` extra)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from lightning_energy.config import CONFIG_ENV_VAR
from tests.lightning_energy.integrations._hf import load_example, reset_accelerate


@pytest.fixture
def hf_isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Keep the Trainer's process-wide side effects inside the test."""
    # torch sets this variable when the Trainer first asks for its compile cache.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("LIGHTNING_ENERGY_LEASE_DIR", str(tmp_path / "leases"))
    monkeypatch.delenv(CONFIG_ENV_VAR, raising=False)
    yield
    reset_accelerate()


@pytest.fixture(scope="module")
def example() -> ModuleType:
    """examples/transformers/train.py, imported (its model and dataset are reused)."""
    return load_example()
