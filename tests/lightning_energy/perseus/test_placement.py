"""The pipeline strategy puts only this rank's stages on its device."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.plugins.environments import LightningEnvironment

from lightning_energy.integrations.perseus_lightning import PerseusPipelineStrategy


class TwoStages(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stages = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

    def pipeline_stages(self) -> list[torch.nn.Module]:
        return list(self.stages)

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(output, target)


def devices_of(module: TwoStages) -> list[str]:
    return [next(stage.parameters()).device.type for stage in module.stages]


@pytest.mark.parametrize(("local_rank", "expected"), [(0, ["meta", "cpu"]), (1, ["cpu", "meta"])])
def test_each_rank_places_only_its_stage(
    monkeypatch: pytest.MonkeyPatch, local_rank: int, expected: list[str]
) -> None:
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    strategy = PerseusPipelineStrategy(
        parallel_devices=[torch.device("meta"), torch.device("meta")],
        cluster_environment=LightningEnvironment(),
    )
    strategy.set_world_ranks()
    module = TwoStages()
    strategy._lightning_module = module  # type: ignore[assignment]
    strategy.model_to_device()
    assert devices_of(module) == expected
