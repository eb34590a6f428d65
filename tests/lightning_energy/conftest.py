"""Fixtures shared by the tests of ``lightning_energy``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from lightning_energy.config import EnergyConfig
from lightning_energy.controller import EnergyController
from lightning_energy.device.simulated import SimulatedGPU
from tests.lightning_energy.processes import free_port


@pytest.fixture
def single_process_group() -> Iterator[None]:
    """A gloo process group of one rank (this process), for the duration of the test."""
    port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


#: What the A40 reads in its deepest idle state before a job; paused mid-job (memory held,
#: clocks up) it draws the simulated board's 30 W.
COLD_IDLE_W = 17.0


@pytest.fixture
def a40_pausing_config(tmp_path: Path) -> EnergyConfig:
    """Simulated A40s under a forecast carbon policy that may pause (~37 s steps: 1500 steps
    are ~16 h at full speed, the deadline 40 h)."""
    return EnergyConfig.from_mapping(
        {
            "device": {
                "backend": "simulated",
                "gpu": "a40",
                "start": "2023-09-04T00:00:00Z",
                "steps_per_epoch": 100,
                "lease_dir": str(tmp_path / "leases"),
            },
            "power_limit": {"selector": "energy", "warmup_steps": 2, "settle_steps": 1},
            "carbon": {
                "provider": "trace",
                "region": "DE",
                "policy": "forecast",
                "deadline": "40h",
                "allow_pause": True,
                "poll_interval_s": 3600,
            },
            "log_every_n_steps": 10,
        }
    )


@pytest.fixture
def setup_reading_cold_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> Callable[[EnergyController], float]:
    """Sets a controller up on boards that read their cold idle power at setup (which makes
    the A40 policy pause); returns that reading."""

    def setup(controller: EnergyController) -> float:
        with monkeypatch.context() as patch:
            patch.setattr(SimulatedGPU, "power_w", lambda self: COLD_IDLE_W)
            controller.setup()
        return COLD_IDLE_W

    return setup


@dataclass(frozen=True)
class PaceCall:
    """One decision of the carbon pacer: when, at which idle power, and whether it paused."""

    elapsed_s: float
    idle_w: float
    pause: bool


@pytest.fixture
def record_pace_calls() -> Callable[[EnergyController], list[PaceCall]]:
    """Records every decision of a set-up controller's carbon pacer from now on."""

    def record(controller: EnergyController) -> list[PaceCall]:
        pacer = controller.pacer
        assert pacer is not None
        calls: list[PaceCall] = []
        update = pacer.update

        def spy(*args: Any, **kwargs: Any) -> Any:
            result = update(*args, **kwargs)
            calls.append(PaceCall(pacer._elapsed_s(), args[2], result.pause))
            return result

        pacer.update = spy  # type: ignore[method-assign]
        return calls

    return record
