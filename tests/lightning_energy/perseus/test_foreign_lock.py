"""Perseus and the straggler equaliser never replace an administrator's clock lock.

NVML cannot read a lock back and shows one (the applications-clocks clock event reason)
only while work runs under it: on the idle GPU of setup it is invisible. So neither locks
a clock before the first steps of training have run under load and the guard has looked;
a lock found is kept to the end, and the GPU is never locked nor reset.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from lightning_energy.config import PerseusConfig
from lightning_energy.device import DeviceSet, SimulatedGPU, SimulatedSpec, simulated_gpus
from lightning_energy.device.guard import GPUGuard
from lightning_energy.perseus.data_parallel import StragglerRun
from lightning_energy.perseus.planning.schedule import one_f_one_b
from lightning_energy.perseus.runtime.pipeline_run import RankPipeline
from lightning_energy.perseus.runtime.rank_gpu import RankGPU

ADMIN_LOCK = (1005, 1005)
SECTION = PerseusConfig(enabled=True, profile_clocks_mhz=(1410, 1200, 1005))


def _rank(tmp_path: Path, **spec: object) -> tuple[RankGPU, SimulatedGPU]:
    gpu = simulated_gpus(SimulatedSpec(gpu="a100", setting_latency_s=0.0, **spec))[0]  # type: ignore[arg-type]
    guard = GPUGuard([gpu], lease_dir=tmp_path / "leases", install_signal_handlers=False)
    guard.acquire()
    return RankGPU(DeviceSet([gpu], gpu.now_s, "simulated"), guard, owned=True), gpu


def _locks(gpu: SimulatedGPU) -> list[tuple[int, int] | None]:
    """Record every clock lock this job sets on ``gpu``."""
    locks: list[tuple[int, int] | None] = []
    set_lock = gpu.set_locked_clocks_mhz

    def recorded(min_mhz: int, max_mhz: int) -> None:
        locks.append((min_mhz, max_mhz))
        set_lock(min_mhz, max_mhz)

    gpu.set_locked_clocks_mhz = recorded  # type: ignore[method-assign]
    return locks


def test_the_straggler_equaliser_keeps_an_administrators_lock(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rank, gpu = _rank(tmp_path, foreign_clock_lock_mhz=ADMIN_LOCK)
    locks = _locks(gpu)
    run = StragglerRun(rank, SECTION)
    with caplog.at_level(logging.WARNING, logger="lightning_energy"):
        try:
            for _ in range(10):
                run.step_start()
                run.step_end()
        finally:
            run.close()
    assert run.equalizer is not None and not run.equalizer.enabled
    assert locks == []  # never locked, so never reset
    assert gpu.foreign_clock_lock_mhz() == ADMIN_LOCK
    assert any("left alone" in r.getMessage() for r in caplog.records)


def test_the_straggler_equaliser_locks_clocks_once_the_first_steps_show_no_lock(
    tmp_path: Path,
) -> None:
    rank, gpu = _rank(tmp_path)
    locks = _locks(gpu)
    run = StragglerRun(rank, SECTION)
    try:
        for step in range(1, 6):
            run.step_start()
            run.step_end()
            assert bool(locks) == (step >= 3)  # the vote comes after three steps
        assert run.equalizer is not None and run.equalizer.enabled
    finally:
        run.close()
    assert gpu.locked_clocks_mhz() is None


@pytest.mark.parametrize("with_plan", [False, True])
def test_perseus_pipelines_keep_an_administrators_lock(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, with_plan: bool
) -> None:
    rank, gpu = _rank(tmp_path, foreign_clock_lock_mhz=ADMIN_LOCK)
    locks = _locks(gpu)
    schedule = one_f_one_b(1, 4)
    section = SECTION
    if with_plan:
        from lightning_energy.perseus.planning.plan import Plan

        path = tmp_path / "plan.json"
        path.write_text(Plan(schedule, tuple(810 for _ in schedule.nodes)).to_json())
        section = PerseusConfig(enabled=True, plan=str(path))
    pipeline = RankPipeline(rank, section, schedule, global_rank=0)
    with caplog.at_level(logging.WARNING, logger="lightning_energy"):
        try:
            for _ in range(4):
                pipeline.iteration_start()
                for inst in schedule.device_orders[0]:
                    pipeline.before(inst)
                    pipeline.after(inst)
                pipeline.iteration_end()
        finally:
            pipeline.close()
    assert locks == []
    assert gpu.foreign_clock_lock_mhz() == ADMIN_LOCK
    assert any("left alone" in r.getMessage() for r in caplog.records)
