"""Kareus' data-parallel setting applied by the energy DDP strategy of both Lightning
namespaces when it wraps the model."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_energy.errors import ConfigError
from lightning_energy.integrations import lightning, pytorch_lightning
from lightning_energy.kareus.data_parallel import DataParallelSetting

NAMESPACES = [lightning.EnergyDDPStrategy, pytorch_lightning.EnergyDDPStrategy]


def wrap(strategy_class: Any, **kwargs: Any) -> Any:
    """A model wrapped as the strategy wraps it on a CPU rank."""
    strategy = strategy_class(**kwargs)
    strategy.parallel_devices = [torch.device("cpu")]
    return strategy._setup_model(torch.nn.Linear(4, 4))


@pytest.mark.usefixtures("single_process_group")
@pytest.mark.parametrize("strategy_class", NAMESPACES)
def test_the_setting_decides_the_buckets_and_the_gradient_group(strategy_class: Any) -> None:
    setting = DataParallelSetting(ctas=4, bucket_cap_mb=3)
    ddp = wrap(strategy_class, data_parallel=setting, find_unused_parameters=True)
    assert ddp.bucket_bytes_cap == 3 * 1024 * 1024
    assert ddp.process_group is not dist.group.WORLD  # the CTA-limited copy (plain on gloo)
    assert dist.get_process_group_ranks(ddp.process_group) == [0]
    assert ddp.find_unused_parameters  # the strategy's own DDP arguments stay


@pytest.mark.usefixtures("single_process_group")
@pytest.mark.parametrize("strategy_class", NAMESPACES)
def test_without_a_setting_ddp_keeps_its_own(strategy_class: Any) -> None:
    ddp = wrap(strategy_class, bucket_cap_mb=7)
    assert ddp.bucket_bytes_cap == 7 * 1024 * 1024
    assert ddp.process_group is dist.group.WORLD


@pytest.mark.usefixtures("single_process_group")
@pytest.mark.parametrize("strategy_class", NAMESPACES)
def test_the_kareus_section_gives_the_setting(strategy_class: Any) -> None:
    section = {"data_parallel_ctas": 2, "data_parallel_bucket_cap_mb": 5.0}
    ddp = wrap(strategy_class, energy={"kareus": section})
    assert ddp.bucket_bytes_cap == 5 * 1024 * 1024
    assert ddp.process_group is not dist.group.WORLD
    # An argument wins over the section.
    ddp = wrap(
        strategy_class,
        energy={"kareus": section},
        data_parallel=DataParallelSetting(bucket_cap_mb=9),
    )
    assert ddp.bucket_bytes_cap == 9 * 1024 * 1024
    assert ddp.process_group is dist.group.WORLD


@pytest.mark.parametrize("strategy_class", NAMESPACES)
def test_a_setting_with_ddps_bucket_size_is_refused(strategy_class: Any) -> None:
    with pytest.raises(ConfigError, match="bucket_cap_mb come from the data-parallel setting"):
        strategy_class(data_parallel=DataParallelSetting(), bucket_cap_mb=5)
    with pytest.raises(ConfigError, match="process_group come from the data-parallel setting"):
        strategy_class(energy={"kareus": {"data_parallel_ctas": 4}}, process_group=None)
