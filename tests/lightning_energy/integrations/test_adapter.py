"""What every adapter shares: the ranks' collectives over a framework's gather, and the
workload key."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch

from lightning_energy.config import EnergyConfig
from lightning_energy.errors import ConfigError
from lightning_energy.integrations.adapter import (
    EnergyAdapter,
    count_parameters,
    tensor_collective,
    workload_key,
)

OTHER_RANK = torch.tensor([3.0, 5.0], dtype=torch.float64)

# How each framework hands back a gather of two ranks (one for a single process).
GATHERS: dict[str, tuple[int, Callable[[torch.Tensor], torch.Tensor]]] = {
    "stacked rows (Lightning, Fabric)": (2, lambda t: torch.stack([t, OTHER_RANK])),
    "concatenated (Accelerate)": (2, lambda t: torch.cat([t, OTHER_RANK])),
    "a single process": (1, lambda t: t),
}


@pytest.mark.parametrize("name", list(GATHERS))
def test_rows_are_read_back_alike_from_every_gather_shape(name: str) -> None:
    world_size, gather = GATHERS[name]
    collective = tensor_collective(0, world_size, gather, lambda obj, src: obj, torch.device("cpu"))
    sums, maxes = collective.sum_and_max([1.0], [2.0])
    if world_size == 2:
        assert (sums, maxes) == ([4.0], [5.0])
    else:
        assert (sums, maxes) == ([1.0], [2.0])


def test_the_workload_key_keeps_the_form_checkpoints_were_saved_with() -> None:
    model = torch.nn.Linear(8, 2)  # 8 x 2 weights + 2 biases
    assert count_parameters(model) == 18
    assert workload_key(batch_size=8, params=18) == "batch_size=8,params=18"
    assert (
        workload_key(batch_size=4, params=18, gradient_accumulation_steps=2)
        == "batch_size=4,gradient_accumulation_steps=2,params=18"
    )
    assert workload_key(batch_size=None, params=18) == "batch_size=None,params=18"


def _adapters() -> dict[str, type[EnergyAdapter]]:
    from lightning_energy.integrations.accelerate import AcceleratorEnergy
    from lightning_energy.integrations.fabric import EnergyFabricCallback
    from lightning_energy.integrations.lightning import EnergyCallback
    from lightning_energy.integrations.transformers import EnergyTrainerCallback

    return {
        "Lightning": EnergyCallback,
        "Fabric": EnergyFabricCallback,
        "Accelerate": AcceleratorEnergy,
        "Transformers": EnergyTrainerCallback,
    }


@pytest.mark.parametrize("framework", ["Lightning", "Fabric", "Accelerate", "Transformers"])
def test_a_section_the_framework_does_not_apply_is_never_silently_ignored(
    framework: str, caplog: pytest.LogCaptureFixture
) -> None:
    adapter = _adapters()[framework]
    config = {"perseus": {"enabled": True, "mode": "ddp"}}

    def build(strict: bool) -> EnergyAdapter:
        full = EnergyConfig.from_mapping({**config, "strict": strict})
        from lightning_energy.integrations.accelerate import AcceleratorEnergy

        if issubclass(adapter, AcceleratorEnergy):
            from accelerate import Accelerator

            return adapter(Accelerator(cpu=True), full)
        return adapter(full)

    with caplog.at_level(logging.WARNING, logger="lightning_energy"):
        build(strict=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if "perseus" in adapter.applied_sections:
        assert not warnings
        return
    assert len(warnings) == 1 and "perseus: enabled is not applied" in warnings[0]
    with pytest.raises(ConfigError, match="the Lightning Trainer applies these sections"):
        build(strict=True)
