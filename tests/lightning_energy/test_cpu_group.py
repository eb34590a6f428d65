"""CPU tensors never go to a group that rejects them (NCCL): a gloo side group instead."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_energy import collectives
from lightning_energy.collectives import cpu_collective_group

from .perseus import nccl_like


def test_without_a_process_group_the_group_is_returned_as_is() -> None:
    assert cpu_collective_group() is None


def test_a_gloo_default_group_is_used_as_is(single_process_group: None) -> None:
    assert cpu_collective_group() is None


def test_an_nccl_default_group_gets_a_gloo_side_group(
    single_process_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(collectives, "dist", nccl_like.NcclLikeDistributed())
    with pytest.raises(RuntimeError, match="device type cpu"):
        collectives.dist.all_reduce(torch.zeros(1))  # the fake rejects CPU tensors
    group = cpu_collective_group()
    assert group is not None and dist.get_backend(group) == "gloo"
    value = torch.ones(1)
    collectives.dist.all_reduce(value, group=group)  # accepted on the side group
    assert value.item() == 1.0
