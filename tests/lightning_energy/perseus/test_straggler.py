from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from lightning_energy.device import SimulatedSpec, simulated_gpus
from lightning_energy.device.guard import GPUGuard
from lightning_energy.device.physics import physics_preset
from lightning_energy.errors import ConfigError
from lightning_energy.perseus.runtime import StageWork
from lightning_energy.perseus.straggler import SimulatedDataParallel, StragglerEqualizer
from tests.lightning_energy.perseus.helpers import EXACT_BOARD

from .helpers import TickingCounter
from .test_runtime import free_port, run_ranks


@pytest.mark.slow
def test_two_process_ddp_equalises_the_fast_rank(tmp_path: Path) -> None:
    port = str(free_port())
    run_ranks(
        "tests.lightning_energy.perseus.ddp_worker",
        [[str(r), port, str(tmp_path), str(tmp_path / "leases")] for r in range(2)],
        tmp_path,
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    def last(phase: str, key: str, k: int = 3) -> list[float]:
        """Per step of the last window: the value summed (energy) or of rank 0 (time)."""
        if key == "energy_j":
            return [sum(r["phases"][phase][-i][key] for r in ranks) for i in range(1, k + 1)]
        return [ranks[0]["phases"][phase][-i][key] for i in range(1, k + 1)]

    base_time = last("baseline", "time_s")[0]
    base_energy = last("baseline", "energy_j")[0]
    for phase in ("equalised", "swapped"):
        # The step takes as long as before (the straggler still runs at full clock) ...
        assert last(phase, "time_s") == pytest.approx([base_time] * 3, rel=1e-9)
        # ... and the job uses less energy per step.
        assert max(last(phase, "energy_j")) < base_energy * 0.97
    assert ranks[0]["straggler_before"] == ranks[1]["straggler_before"] == 1
    assert ranks[0]["phases"]["equalised"][-1]["clock"][1] < 1410  # the fast rank slowed
    assert ranks[1]["phases"]["equalised"][-1]["clock"][1] == 1410
    # Re-evaluated when the straggler changed.
    assert ranks[0]["straggler_after"] == ranks[1]["straggler_after"] == 0
    assert ranks[0]["phases"]["swapped"][-1]["clock"][1] == 1410
    assert ranks[1]["phases"]["swapped"][-1]["clock"][1] < 1410
    assert ranks[0]["reset_clock"] is None and ranks[1]["reset_clock"] is None


def test_single_rank_profiles_then_stays_at_full_clock(tmp_path: Path) -> None:
    gpu = simulated_gpus(SimulatedSpec(gpu="a100", **EXACT_BOARD))[0]
    sim = SimulatedDataParallel(gpu, StageWork(0.1, 0.9))
    with GPUGuard([gpu], lease_dir=tmp_path, install_signal_handlers=False) as guard:
        equalizer = StragglerEqualizer(
            guard,
            gpu.supported_sm_clocks_mhz(),
            profile_clocks_mhz=[1410, 1200, 1005],
            steps_per_clock=1,
            window_steps=2,
        )
        clocks = []
        for _ in range(5):
            clocks.append(gpu.locked_clocks_mhz())
            compute = sim.compute()
            equalizer.record_step(*compute, *sim.all_reduce())
            equalizer.on_step_end()
        assert clocks[:3] == [(1410, 1410), (1200, 1200), (1005, 1005)]
        assert not equalizer.profiling
        assert equalizer.straggler_rank == 0
        assert gpu.locked_clocks_mhz() == (1410, 1410)  # alone, it is its own straggler
        assert equalizer.model is not None
        assert equalizer.model.time_s(1410) == pytest.approx(0.1, rel=1e-9)
    assert gpu.locked_clocks_mhz() is None


def test_equalizer_validates_its_arguments(tmp_path: Path) -> None:
    gpu = simulated_gpus(SimulatedSpec(gpu="a100", **EXACT_BOARD))[0]
    with GPUGuard([gpu], lease_dir=tmp_path, install_signal_handlers=False) as guard:
        with pytest.raises(ConfigError) as info:
            StragglerEqualizer(guard, [1410, 1200], steps_per_clock=0, window_steps=0, margin=1)
        assert len(info.value.problems) == 3


def test_without_permission_the_equalizer_does_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gpu = simulated_gpus(SimulatedSpec(gpu="a100", permission_denied=True))[0]
    sim = SimulatedDataParallel(gpu, StageWork(0.1, 0.9))
    with (
        caplog.at_level(logging.INFO),
        GPUGuard([gpu], lease_dir=tmp_path, install_signal_handlers=False) as guard,
    ):
        equalizer = StragglerEqualizer(
            guard, gpu.supported_sm_clocks_mhz(), steps_per_clock=1, window_steps=2
        )
        for _ in range(6):
            equalizer.record_step(*sim.compute(), *sim.all_reduce())
            equalizer.on_step_end()
        assert not equalizer.enabled and not equalizer.profiling
        assert equalizer.model is None and equalizer.straggler_rank is None
        assert guard.observe_only
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "observe-only" in warnings[0].getMessage()


def test_profiling_on_a_counter_that_ticks_every_100_ms(tmp_path: Path) -> None:
    """20 ms steps on a 100 ms counter: most compute windows read 0 J; the mean is the
    compute time at the power averaged over the counter period (compute and wait blended)."""
    gpu = simulated_gpus(SimulatedSpec(gpu="a100"))[0]
    model = physics_preset("a100")
    counter = TickingCounter(0.1)
    zeros = 0
    with GPUGuard([gpu], lease_dir=tmp_path, install_signal_handlers=False) as guard:
        equalizer = StragglerEqualizer(
            guard,
            gpu.supported_sm_clocks_mhz(),
            profile_clocks_mhz=[1410, 1200, 1005],
            steps_per_clock=2000,
            window_steps=10,
        )
        while equalizer.profiling:
            assert equalizer.clock_mhz is not None
            t = model.work_time_s(0.02, 0.85, equalizer.clock_mhz)
            e0 = counter.energy_j()
            counter.run(t, model.work_power_w(0.85, equalizer.clock_mhz))
            e1 = counter.energy_j()
            counter.run(0.005, model.idle_power_w)
            zeros += e1 == e0
            equalizer.record_step(t, e1 - e0, t + 0.005, counter.energy_j() - e0)
            equalizer.on_step_end()
        assert zeros > 3000
        assert equalizer.model is not None
        for f in (1410, 1200, 1005):
            t = model.work_time_s(0.02, 0.85, f)
            blended_w = (t * model.work_power_w(0.85, f) + 0.005 * model.idle_power_w) / (t + 0.005)
            # ~400 ticks per clock: a few % of sampling error.
            assert equalizer.model.energy_j(f) == pytest.approx(t * blended_w, rel=0.08)


def test_a_profile_without_energy_turns_equalisation_off_without_raising(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gpu = simulated_gpus(SimulatedSpec(gpu="a100"))[0]
    with (
        caplog.at_level(logging.WARNING),
        GPUGuard([gpu], lease_dir=tmp_path, install_signal_handlers=False) as guard,
    ):
        equalizer = StragglerEqualizer(guard, [1410, 1200, 1005], steps_per_clock=2, window_steps=2)
        for _ in range(10):  # a counter that never moved during any compute window
            equalizer.record_step(0.02, 0.0, 0.025, 0.0)
            equalizer.on_step_end()
        assert not equalizer.enabled and equalizer.model is None
        assert gpu.locked_clocks_mhz() is None  # back to its pre-job state
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2  # the clocks without energy, then equalisation off
    assert "Straggler equalisation off" in warnings[1]
