"""A physical GPU that several ranks open, itself or as MIG instances (every instance reports
the whole GPU's power and energy), is counted once: for the lowest of them."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest

from lightning_energy.collectives import GatherCollective
from lightning_energy.config import EnergyConfig
from lightning_energy.controller import EnergyController
from lightning_energy.device import NVMLGPU, DeviceSet
from lightning_energy.device.simulated import TRACE_GPUS
from tests.lightning_energy.conftest import PaceCall
from tests.lightning_energy.device.fake_pynvml import FakeDevice, a100, make_module

T = TypeVar("T")

WAIT_S = 60  # a hang guard: nothing here waits for long


def _collectives(world_size: int) -> list[GatherCollective]:
    """Ranks in threads of one process, meeting at a barrier for each collective."""
    meet = threading.Barrier(world_size, timeout=WAIT_S)
    slots: list[Any] = [None] * world_size

    def make(rank: int) -> GatherCollective:
        def exchange(value: Any) -> list[Any]:
            slots[rank] = value
            meet.wait()
            seen = list(slots)
            meet.wait()
            return seen

        return GatherCollective(rank, world_size, exchange, lambda obj, src: exchange(obj)[src])

    return [make(rank) for rank in range(world_size)]


def test_ranks_on_mig_instances_of_one_gpu_count_its_energy_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    parent = a100(0, mig_mode=1, draw_mw=200_000.0)
    for slot in range(2):
        parent.mig_instances.append(
            FakeDevice(
                name="NVIDIA A100-SXM4-40GB MIG 3g.20gb",
                uuid=f"MIG-{slot}bbbbbbb-0000-0000-0000-00000000000{slot}",
                parent=parent,
                energy_mj=None,
            )
        )
    fake = make_module([parent])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    config = EnergyConfig.from_mapping(
        {
            "device": {"backend": "nvml", "lease_dir": str(tmp_path / "leases")},
            "power_limit": {"enabled": False},
        }
    )
    gpus = [NVMLGPU(instance, 0) for instance in parent.mig_instances]
    collectives = _collectives(2)
    ran = threading.Barrier(3, timeout=WAIT_S)  # the two ranks and the GPU's time
    jobs: list[dict[str, Any]] = [{}, {}]

    def rank(r: int) -> None:
        devices = DeviceSet(gpus=[gpus[r]], clock=fake.clock, backend="nvml")
        controller = EnergyController(
            config, devices=devices, collective=collectives[r], install_signal_handlers=False
        )
        controller.setup()
        ran.wait()
        ran.wait()  # the GPU ran for a second meanwhile
        for _ in range(3):
            controller.on_step_start()
            controller.on_step_end()
        jobs[r] = controller.gather_job_totals()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    try:
        for thread in threads:
            thread.start()
        ran.wait()
        fake.advance(1.0)  # 200 W for 1 s on the physical GPU both instances report
        ran.wait()
        for thread in threads:
            thread.join(timeout=WAIT_S)
    finally:
        for gpu in gpus:
            gpu.close()
    assert jobs[0] == jobs[1]
    assert jobs[0]["energy_j"] == pytest.approx(200.0)  # not 400 J
    assert [r["counted"] for r in jobs[0]["per_rank"]] == [True, False]
    assert [g["uuid"] for g in jobs[0]["gpus"]] == [parent.mig_instances[0].uuid]
    assert fake.init_calls == fake.shutdown_calls


class _PeerOnTheSameGpu:
    """Rank 0 of two whose peer, rank 1, opened the same GPU: the peer sends what such a
    rank sends (its GPUs, that it only observes, none of the GPU's energy, the same time)
    and follows rank 0's decisions."""

    rank = 0
    world_size = 2

    def sum_and_max(
        self, to_sum: Sequence[float], to_max: Sequence[float]
    ) -> tuple[list[float], list[float]]:
        return list(to_sum), list(to_max)

    def broadcast(self, obj: T, src: int = 0) -> T:
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        peer = {**obj, "rank": 1}
        if "can_change" in obj:
            peer.update(can_change=False, reason="rank 0 drives its GPU")
        return [obj, peer]


def test_a_pause_weighs_each_physical_gpu_idle_once(
    a40_pausing_config: EnergyConfig,
    setup_reading_cold_idle: Callable[[EnergyController], float],
    record_pace_calls: Callable[[EnergyController], list[PaceCall]],
) -> None:
    """The first polling period of a pause measures what the paused GPU draws; the job's
    idle power is that of its one physical GPU, not once per rank."""
    controller = EnergyController(
        a40_pausing_config, collective=_PeerOnTheSameGpu(), install_signal_handlers=False
    )
    setup_reading_cold_idle(controller)
    calls = record_pace_calls(controller)
    controller.set_total_steps(1500)
    for _ in range(1500):
        controller.on_step_start()
        controller.on_step_end()
    controller.teardown()
    first_pause = next(i for i, call in enumerate(calls) if call.pause)
    idle_w = TRACE_GPUS["a40"][2]  # what the simulated A40 draws idle
    assert calls[first_pause + 1].idle_w == pytest.approx(idle_w, rel=0.1)  # not twice that
