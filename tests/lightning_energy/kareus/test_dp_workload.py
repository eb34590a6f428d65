"""The simulated data-parallel backward: buckets, their overlap, and the search over
(CTAs, bucket size, clock)."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_energy.errors import ConfigError
from lightning_energy.kareus.data_parallel import DDP_DEFAULT_BUCKET_CAP_MB
from lightning_energy.kareus.dp_workload import DP_KEY, SimulatedDataParallel, least_energy_within
from lightning_energy.kareus.model import OverlapModel, shipped_physics
from lightning_energy.kareus.partition import SEQUENTIAL, PartitionSetting
from lightning_energy.kareus.search import MeasuredPoint, SearchSpace, search_partition
from lightning_energy.kareus.workload import LLAMA_3_2_3B

CAPS_MB = (1.0, 5.0, DDP_DEFAULT_BUCKET_CAP_MB, 100.0, 400.0, 4000.0)
DP_SIZE = 4
#: NCCL's own choice as the Kareus benchmark takes it: the most CTAs of the search.
DEFAULT_CTAS = 20


def group(*, noise: bool = True) -> SimulatedDataParallel:
    physics = shipped_physics()
    if not noise:
        physics = dataclasses.replace(physics, time_noise=0.0, energy_noise=0.0)
    return SimulatedDataParallel(
        OverlapModel(physics), LLAMA_3_2_3B, dp_size=DP_SIZE, bucket_caps_mb=CAPS_MB
    )


def test_buckets_hold_every_gradient_once_in_backward_order() -> None:
    dp = group()
    one = dp.buckets(CAPS_MB[-1])
    assert len(one) == 1
    all_ops, all_bytes = one[0]
    for cap in CAPS_MB[:-1]:
        buckets = dp.buckets(cap)
        assert len(buckets) > 1
        assert sum((ops for ops, _ in buckets), ()) == all_ops
        assert sum(size for _, size in buckets) == pytest.approx(all_bytes)
        # Every bucket but the last is closed once it reaches the cap.
        assert all(size >= cap * 2**20 for _, size in buckets[:-1])
    assert [len(dp.buckets(cap)) for cap in CAPS_MB] == sorted(
        (len(dp.buckets(cap)) for cap in CAPS_MB), reverse=True
    )


def test_one_bucket_is_the_backward_then_the_all_reduce_alone() -> None:
    dp = group()
    [(partition, slot)] = dp.partitions(CAPS_MB[-1])
    assert slot == SEQUENTIAL and partition.tp_size == DP_SIZE
    ops, size = dp.buckets(CAPS_MB[-1])[0]
    assert partition.ops == ops
    assert partition.comm_bytes == pytest.approx(2 * (DP_SIZE - 1) / DP_SIZE * size)


def test_each_bucket_reduces_beside_the_compute_of_the_next() -> None:
    dp = group()
    buckets = dp.buckets(DDP_DEFAULT_BUCKET_CAP_MB)
    parts = dp.partitions(DDP_DEFAULT_BUCKET_CAP_MB)
    assert len(parts) == len(buckets)
    first, *overlapped = parts
    assert first[0].ops == buckets[0][0] and first[1] == SEQUENTIAL
    for j, (partition, slot) in enumerate(overlapped):
        assert slot == 0 and partition.ops == buckets[j + 1][0]
        assert partition.comm_bytes == pytest.approx(2 * (DP_SIZE - 1) / DP_SIZE * buckets[j][1])


def test_buckets_hide_communication_that_one_bucket_exposes() -> None:
    dp = group(noise=False)
    slot_25mb, one_bucket = CAPS_MB.index(DDP_DEFAULT_BUCKET_CAP_MB), len(CAPS_MB) - 1
    [(overlapped_s, _), (alone_s, _)] = dp.exact(
        DP_KEY, [PartitionSetting(1410, 8, slot_25mb), PartitionSetting(1410, 8, one_bucket)]
    )
    assert overlapped_s < alone_s
    assert dp.measure(DP_KEY, [PartitionSetting(1410, 8, one_bucket)]) == [
        tuple(dp.exact(DP_KEY, [PartitionSetting(1410, 8, one_bucket)])[0])
    ]


def test_the_searchs_choice_under_the_default_time_saves_energy() -> None:
    dp = group(noise=False)
    static_power_w = dp.model.physics.static_power_w * DP_SIZE
    space = SearchSpace(range(1410, 899, -30), (1, 2, 4, 8, 12, 16, 20), dp.slots)
    result = search_partition(
        dp,
        DP_KEY,
        space,
        budget=space.size,
        static_power_w=static_power_w,
        sampler="exhaustive",
        batch_size=space.size,
    )
    assert result.measured == space.size and len(result.front) > 1
    default_setting = PartitionSetting(1410, DEFAULT_CTAS, CAPS_MB.index(DDP_DEFAULT_BUCKET_CAP_MB))
    [(time_s, energy_j)] = dp.exact(DP_KEY, [default_setting])
    default = MeasuredPoint(default_setting, time_s, energy_j)
    choice = least_energy_within(result.front, default.time_s, static_power_w)
    assert choice is not None and choice.time_s <= default.time_s
    assert choice.effective_energy_j(static_power_w) < default.effective_energy_j(static_power_w)
    assert choice.energy_j < default.energy_j
    setting = dp.setting(choice.setting)
    assert setting.bucket_cap_mb in CAPS_MB and setting.ctas == choice.setting.ctas


def test_nothing_fits_a_time_shorter_than_every_point() -> None:
    point = MeasuredPoint(PartitionSetting(1410, 1, 0), 1.0, 10.0)
    assert least_energy_within([point], 0.5, 0.0) is None


def test_bad_groups_and_settings_are_refused_naming_what_is_allowed() -> None:
    with pytest.raises(ConfigError) as info:
        SimulatedDataParallel(
            OverlapModel(shipped_physics()), LLAMA_3_2_3B, dp_size=1, bucket_caps_mb=(0.0,)
        )
    assert "dp_size: 1 is not allowed; use >= 2" in str(info.value)
    assert "bucket_cap_mb: 0.0 is not allowed" in str(info.value)
    dp = group()
    with pytest.raises(ConfigError, match=r"slot 6 is not allowed; use the index of a bucket"):
        dp.exact(DP_KEY, [PartitionSetting(1410, 8, len(CAPS_MB))])
    with pytest.raises(ConfigError, match="measures 'dp_backward'"):
        dp.exact("bwd_mlp", [PartitionSetting(1410, 8, 0)])
