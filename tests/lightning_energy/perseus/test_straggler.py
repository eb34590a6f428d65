from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from lightning_energy.device import SimulatedSpec, StageWork, simulated_gpus
from lightning_energy.device.guard import GPUGuard
from lightning_energy.device.simulated import physics_preset
from lightning_energy.device.simulated.work import DataParallelSimulation
from lightning_energy.errors import ConfigError
from lightning_energy.perseus.data_parallel.straggler import (
    StragglerEqualizer,
)

from ..processes import free_port, run_module_ranks
from . import ddp_worker
from .helpers import TickingCounter


@pytest.mark.slow
def test_two_process_ddp_equalises_the_fast_rank(tmp_path: Path) -> None:
    port = str(free_port())
    run_module_ranks(
        "tests.lightning_energy.perseus.ddp_worker",
        [[str(r), port, str(tmp_path), str(tmp_path / "leases")] for r in range(2)],
        tmp_path,
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    def per_step(phase: str) -> tuple[float, float]:
        """Rank 0's step time and both GPUs' energy per step over the phase's last
        ``WINDOW_STEPS`` steps (read from the counters at both ends)."""
        k = ddp_worker.WINDOW_STEPS
        steps = [r["phases"][phase] for r in ranks]
        time_s = (steps[0][-1]["end_s"] - steps[0][-1 - k]["end_s"]) / k
        return time_s, sum(s[-1]["end_j"] - s[-1 - k]["end_j"] for s in steps) / k

    base_time, base_energy = per_step("baseline")
    for phase in ("equalised", "swapped"):
        time_s, energy_j = per_step(phase)
        # The step takes as long as before (the straggler still runs at full clock) ...
        assert time_s == pytest.approx(base_time, rel=1e-9)
        # ... and the job uses less energy per step.
        assert energy_j < base_energy * 0.97
    assert ranks[0]["straggler_before"] == ranks[1]["straggler_before"] == 1
    assert ranks[0]["phases"]["equalised"][-1]["clock"][1] < 1410  # the fast rank slowed
    assert ranks[1]["phases"]["equalised"][-1]["clock"][1] == 1410
    # Re-evaluated when the straggler changed.
    assert ranks[0]["straggler_after"] == ranks[1]["straggler_after"] == 0
    assert ranks[0]["phases"]["swapped"][-1]["clock"][1] == 1410
    assert ranks[1]["phases"]["swapped"][-1]["clock"][1] < 1410
    assert ranks[0]["reset_clock"] is None and ranks[1]["reset_clock"] is None


def test_single_rank_profiles_then_stays_at_full_clock(tmp_path: Path) -> None:
    """Default board (100 ms counter, 50 ms set latency): each clock gets one step for the
    change to land, then 200 counter periods (20 s) of 0.1-0.13 s steps."""
    gpu = simulated_gpus(SimulatedSpec(gpu="a100"))[0]
    sim = DataParallelSimulation(gpu, StageWork(0.1, 0.9))
    with GPUGuard([gpu], lease_dir=tmp_path, install_signal_handlers=False) as guard:
        equalizer = StragglerEqualizer(
            guard,
            gpu.supported_sm_clocks_mhz(),
            profile_clocks_mhz=[1410, 1200, 1005],
            steps_per_clock=1,
            window_steps=2,
            counter_period_s=gpu.energy_counter_period_s(),
        )
        clocks = []
        while equalizer.profiling:
            clocks.append(gpu.locked_clocks_mhz())
            compute_s = sim.compute()
            equalizer.record_step(compute_s, sim.all_reduce())
            equalizer.on_step_end()
        model = physics_preset("a100")
        for f in (1410, 1200, 1005):
            step_s = model.work_time_s(0.1, 0.9, f)
            measured = clocks.count((f, f)) - 1
            assert measured * step_s >= 20.0 > (measured - 1) * step_s
        for _ in range(2):
            compute_s = sim.compute()
            equalizer.record_step(compute_s, sim.all_reduce())
            equalizer.on_step_end()
        assert equalizer.straggler_rank == 0
        assert gpu.locked_clocks_mhz() == (1410, 1410)  # alone, it is its own straggler
        assert equalizer.model is not None
        assert equalizer.model.time_s(1410) == pytest.approx(0.1, rel=1e-6)
        for f in (1410, 1200, 1005):
            truth_j = model.work_time_s(0.1, 0.9, f) * model.work_power_w(0.9, f)
            assert equalizer.model.energy_j(f) == pytest.approx(truth_j, rel=0.02)
    assert gpu.locked_clocks_mhz() is None


def test_long_steps_with_work_between_them_still_fit(tmp_path: Path) -> None:
    """Steps of 2 s on a 100 ms counter, with 0.3 s of other work between steps (data
    loading, the framework's own work), as on a real GPU: the counter's updates between
    steps keep their stretch, so three readings a step are enough to fit every clock."""
    gpu = simulated_gpus(SimulatedSpec(gpu="a100"))[0]
    sim = DataParallelSimulation(gpu, StageWork(2.0, 0.9))
    with GPUGuard([gpu], lease_dir=tmp_path, install_signal_handlers=False) as guard:
        equalizer = StragglerEqualizer(
            guard,
            gpu.supported_sm_clocks_mhz(),
            profile_clocks_mhz=[1410, 1200, 1005],
            steps_per_clock=2,
            window_steps=2,
            counter_period_s=gpu.energy_counter_period_s(),
            vote_after_steps=1,
        )
        equalizer.on_step_end()  # a first step, unmeasured: the ranks agree on clock control
        while equalizer.profiling:
            compute_s = sim.compute()
            equalizer.record_step(compute_s, sim.all_reduce())
            equalizer.on_step_end()
            gpu.idle(0.3)
            assert equalizer.enabled, "the step model could not be fitted"
        model = physics_preset("a100")
        assert equalizer.model is not None
        for f in (1410, 1200, 1005):
            truth_j = model.work_time_s(2.0, 0.9, f) * model.work_power_w(0.9, f)
            assert equalizer.model.energy_j(f) == pytest.approx(truth_j, rel=0.02)
    assert gpu.locked_clocks_mhz() is None


def test_equalizer_validates_its_arguments(tmp_path: Path) -> None:
    gpu = simulated_gpus(SimulatedSpec(gpu="a100"))[0]
    with GPUGuard([gpu], lease_dir=tmp_path, install_signal_handlers=False) as guard:
        with pytest.raises(ConfigError) as info:
            StragglerEqualizer(guard, [1410, 1200], steps_per_clock=0, window_steps=0, margin=1)
        assert len(info.value.problems) == 3


def test_without_permission_the_equalizer_does_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gpu = simulated_gpus(SimulatedSpec(gpu="a100", permission_denied=True))[0]
    sim = DataParallelSimulation(gpu, StageWork(0.1, 0.9))
    with (
        caplog.at_level(logging.INFO),
        GPUGuard([gpu], lease_dir=tmp_path, install_signal_handlers=False) as guard,
    ):
        equalizer = StragglerEqualizer(
            guard, gpu.supported_sm_clocks_mhz(), steps_per_clock=1, window_steps=2
        )
        for _ in range(6):
            compute_s = sim.compute()
            equalizer.record_step(compute_s, sim.all_reduce())
            equalizer.on_step_end()
        assert not equalizer.enabled and not equalizer.profiling
        assert equalizer.model is None and equalizer.straggler_rank is None
        assert guard.observe_only
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "observe-only" in warnings[0].getMessage()


def test_profiling_on_a_counter_that_ticks_every_100_ms(tmp_path: Path) -> None:
    """20 ms of compute then 5-30 ms of waiting (the all-reduce, spinning at the locked
    clock) on a jittery 100 ms counter, which fits no phase: most compute windows read 0 J,
    and their mean would blend compute and wait; the timeline's split of the counter's
    updates (bracket middles, ~800 per clock) gives the compute energy itself within 3 %
    and the wait's power at each clock within 2 %."""
    gpu = simulated_gpus(SimulatedSpec(gpu="a100"))[0]
    model = physics_preset("a100")
    counter = TickingCounter(0.1)
    waits = np.random.default_rng(1)
    zeros = 0
    with GPUGuard([gpu], lease_dir=tmp_path, install_signal_handlers=False) as guard:
        equalizer = StragglerEqualizer(
            guard,
            gpu.supported_sm_clocks_mhz(),
            profile_clocks_mhz=[1410, 1200, 1005],
            steps_per_clock=3000,
            window_steps=10,
            counter_period_s=0.1,
            vote_after_steps=1,
        )
        equalizer.on_step_end()  # a first step, unmeasured: the ranks agree on clock control
        while equalizer.profiling:
            assert equalizer.clock_mhz is not None
            t = model.work_time_s(0.02, 0.85, equalizer.clock_mhz)
            start = (counter.now_s, counter.energy_j())
            counter.run(t, model.work_power_w(0.85, equalizer.clock_mhz))
            compute_end = (counter.now_s, counter.energy_j())
            # Blocked in the all-reduce: NCCL spins at the locked clock.
            counter.run(
                float(waits.uniform(0.005, 0.03)), model.blocked_power_w(equalizer.clock_mhz)
            )
            zeros += compute_end[1] == start[1]
            equalizer.record_step(t, (start, compute_end, (counter.now_s, counter.energy_j())))
            equalizer.on_step_end()
        assert zeros > 1500
        assert equalizer.model is not None
        for f in (1410, 1200, 1005):
            t = model.work_time_s(0.02, 0.85, f)
            assert equalizer.model.energy_j(f) == pytest.approx(
                t * model.work_power_w(0.85, f), rel=0.03
            )
        for f in (1410, 1200, 1005):  # 100, 90 and 82 W: one value would miss by 10 %
            assert equalizer.blocked_power.power_w(f) == pytest.approx(
                model.blocked_power_w(f), rel=0.02
            )


def test_a_profile_without_energy_turns_equalisation_off_without_raising(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gpu = simulated_gpus(SimulatedSpec(gpu="a100"))[0]
    with (
        caplog.at_level(logging.WARNING),
        GPUGuard([gpu], lease_dir=tmp_path, install_signal_handlers=False) as guard,
    ):
        equalizer = StragglerEqualizer(
            guard, [1410, 1200, 1005], steps_per_clock=2, window_steps=2, counter_period_s=0.1
        )
        for k in range(12):  # 0.3 s of steps: a 100 ms counter that never moved
            equalizer.record_step(
                0.02, ((0.025 * k, 5.0), (0.025 * k + 0.02, 5.0), (0.025 * (k + 1), 5.0))
            )
            equalizer.on_step_end()
        assert equalizer.profiling  # 20 s per clock on a 100 ms counter
        for k in range(12, 3000):
            if not equalizer.profiling:
                break
            equalizer.record_step(
                0.02, ((0.025 * k, 5.0), (0.025 * k + 0.02, 5.0), (0.025 * (k + 1), 5.0))
            )
            equalizer.on_step_end()
        assert not equalizer.enabled and equalizer.model is None
        assert gpu.locked_clocks_mhz() is None  # back to its pre-job state
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "Straggler equalisation off" in warnings[0] and "moved 0 time(s)" in warnings[0]
