"""Physics-driven GPU model: time and power of a piece of work as functions of the SM clock.

A piece of work is described by ``t0`` (its duration at the maximum SM clock ``f_max``) and
its compute-bound share ``beta`` (the fraction of ``t0`` that scales with the clock; the
rest is memory-bound and does not). At SM clock ``f``:

* time: ``t(f) = beta * t0 * f_max / f + (1 - beta) * t0``;
* relative switching power: ``s(f) = (f / f_max) * V(f)**2``, the voltage ``V`` rising
  linearly from ``v_low`` at ``f_v_low_mhz`` to ``v_high`` at ``f_max`` (flat below
  ``f_v_low_mhz``: lower clocks no longer lower the voltage, which is why the lowest clocks
  are slower *and* costlier, as on real GPUs);
* energy: ``E(f) = P_static * t(f) + t_c(f) * P_compute * s(f)
  + t_m * (P_memory + P_memory_sm * s(f))`` with ``t_c(f) = beta * t0 * f_max / f`` the
  compute-bound time and ``t_m = (1 - beta) * t0`` the memory-bound time; the average power
  of the work is ``E(f) / t(f)``.

A GPU that is idle (nothing queued: a carbon pause, data loading) draws ``idle_power_w``.
A GPU *blocked in a collective* (a P2P receive in a pipeline bubble, an all-reduce waiting
for a straggler) is not idle: NCCL's kernels spin on flags in memory until the peer
arrives, at whatever clock is locked. It draws
``P_blocked(f) = idle_power_w + spin_power_w * s(f)``: more than idle, rising with the
clock as switching power does. The assumption behind ``spin_power_w`` (not a
measurement): NCCL runs one thread block per channel (up to 32 channels, so up to a
quarter to a third of the SMs), each polling memory without doing math, taken as 10 % of
the switching power of compute-bound work.

The power limit caps the clock through the board's governor (:mod:`.governor`): every
control period it moves the clock towards the power limit, bounded by the upper bound of
a clock lock, so the clock follows a piece of work's phases (:class:`Phase`: stretches of
one compute-bound share). :meth:`PhysicsModel.clock_for` is the static answer for steady
single-phase work: the highest supported clock (at most the lock's upper bound) whose
average power fits under the limit, or the lowest clock when none does; the governor
dithers around it. A power limit therefore wins over a clock lock, as it does on NVIDIA
GPUs.

The ``"a100"`` preset reproduces the model behind the pipeline profiles in the project's
reference data (``perseus_profiles/README.md``): A100 SXM4 40GB, power limit 100-400 W
(default 400 W), SM clocks 1410 MHz down to 210 MHz in 15 MHz steps, 80 W static, 300 W
compute-bound switching power at 1410 MHz, 50 W + 90 W x s(f) while memory-bound, voltage
0.70 to 1.00 between 900 and 1410 MHz, 70 W idle (the profiles' blocked power, which
ignores NCCL's spin; the preset adds 30 W x s(f) while blocked in a collective: 100 W at
1410 MHz). The ``"h100"`` (H100 SXM5) and
``"h200"`` (H200 SXM, more HBM: more memory power) presets, 200-700 W (default 700 W),
1980 down to 345 MHz, have the same shape scaled to the larger parts, so that a
full-clock training step (85 % compute-bound, a bf16 training load) draws close to the
700 W limit (about 665 W and 675 W) and purely compute-bound work is held back by it, as on
those boards; their constants are illustrative, not measurements.

The ``"a100_sxm"`` (A100 SXM4 80GB, 500 W), ``"a100_pcie"`` (A100 80GB PCIe, 150-300 W) and
``"a40_physics"`` (A40, 100-300 W; ``"a40"`` is the A40 power trace) presets are fitted on
measured runs (``lightning_energy/data/perseus_sosp24/``) by
``benchmarks/calibrate_governor.py``: their clock response on locked-clock stage profiles
(A100 SXM, A40), their governor's ``cap_margin`` and board powers on jobs under power caps
(A100 PCIe, A40). ``benchmarks/README.md`` gives the fit's errors.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from lightning_energy.device.simulated.clocked_model import ClockedModel
from lightning_energy.errors import ConfigError

__all__ = [
    "PHYSICS_PRESETS",
    "GovernorConstants",
    "Phase",
    "PhysicsModel",
    "ThermalModel",
    "mean_compute_bound_share",
    "phase_problems",
    "physics_preset",
]


def _clock_table(max_mhz: int, min_mhz: int, step_mhz: int = 15) -> tuple[int, ...]:
    return tuple(range(max_mhz, min_mhz - 1, -step_mhz))


@dataclass(frozen=True)
class Phase:
    """One phase of a piece of work: a stretch with one compute/memory intensity.

    Attributes:
        share: the phase's share of the work's duration at ``f_max`` (the shares of a
            piece of work add up to 1).
        compute_bound_share: the phase's ``beta`` (0: memory-bound, 1: compute-bound).
        blocked: the GPU waits in a collective for this share of the duration instead
            of working (a P2P receive, a pipeline bubble): it lasts as long whatever the
            clock and draws :meth:`PhysicsModel.blocked_power_w`; ``compute_bound_share``
            must then be 0.
    """

    share: float
    compute_bound_share: float = 1.0
    blocked: bool = False


def phase_problems(phases: Sequence[Phase]) -> list[str]:
    """What is wrong with a piece of work's phases, one line each (empty when valid)."""
    if not phases:
        return ["phases: () is not allowed; use one or more Phase(share, compute_bound_share)"]
    problems = []
    for i, phase in enumerate(phases):
        if not 0.0 < phase.share <= 1.0:
            problems.append(f"phases[{i}].share: {phase.share!r} is not allowed; use (0, 1]")
        if not 0.0 <= phase.compute_bound_share <= 1.0:
            problems.append(
                f"phases[{i}].compute_bound_share: {phase.compute_bound_share!r} is not "
                "allowed; use a number in [0, 1]"
            )
        elif phase.blocked and phase.compute_bound_share != 0.0:
            problems.append(
                f"phases[{i}].compute_bound_share: {phase.compute_bound_share!r} is not "
                "allowed for a blocked phase; use 0 (a wait does not scale with the clock)"
            )
    total = math.fsum(phase.share for phase in phases)
    if not problems and abs(total - 1.0) > 1e-6:
        problems.append(f"phases: the shares add up to {total!r}; they must add up to 1")
    return problems


def mean_compute_bound_share(phases: Sequence[Phase]) -> float:
    """The share of the work's duration at ``f_max`` that scales with the clock: a locked
    clock runs the phases in ``t0 * (beta f_max / f + 1 - beta)`` with this ``beta``."""
    return math.fsum(phase.share * phase.compute_bound_share for phase in phases)


@dataclass(frozen=True)
class GovernorConstants:
    """How the board's firmware moves the SM clock under a power limit (:mod:`.governor`).

    NVIDIA documents neither the loop nor its constants. What boards are seen to do: the
    clock reacts to a power step within tens of milliseconds, the loop acts on power
    averaged over a window (a single kernel does not move the clock), and a capped board
    holds its average power at or a little under the limit. The defaults are chosen in
    that range and kept for every preset, so that fits to measured data adjust the work
    and the board, not the loop (``benchmarks/calibrate_governor.py --loop-sensitivity``
    shows how little the fitted presets' results move with a loop twice as fast or slow).

    Attributes:
        control_period_s: the clock is re-decided every this many seconds, from the
            power averaged over the period (20 ms).
        response_s: integral action: each period the clock target moves by
            ``control_period_s / response_s`` of the step that would close the power
            error on compute-bound work at the current clock (its power rise per MHz
            there; 40 ms: half the error per period, a step to a far lower limit settles
            within about ten periods).
        cap_margin: the setpoint is ``power_limit_w * (1 - cap_margin)``: how far under
            the limit a capped board holds its power (fitted per preset; 0 by default).
    """

    control_period_s: float = 0.02
    response_s: float = 0.04
    cap_margin: float = 0.0

    def problems(self) -> list[str]:
        """What is out of range, one line each (empty when valid)."""
        problems = []
        for key in ("control_period_s", "response_s"):
            value = getattr(self, key)
            if not 0.0 < value < math.inf:
                problems.append(f"governor.{key}: {value!r} is not allowed; use a finite > 0")
        if not 0.0 <= self.cap_margin < 0.5:
            problems.append(
                f"governor.cap_margin: {self.cap_margin!r} is not allowed; use [0, 0.5)"
            )
        return problems


@dataclass(frozen=True)
class ThermalModel:
    """A first-order thermal model of the GPU and its slowdown threshold.

    The temperature relaxes towards ``ambient_c + resistance_c_per_w * power`` with time
    constant ``time_constant_s``. At or above ``slowdown_c`` the governor lowers the clock
    ceiling by one supported clock per control period (and reports the thermal clock
    event reason while the GPU works); below ``slowdown_c - hysteresis_c`` it raises it
    again, one clock per period.

    Attributes:
        ambient_c: inlet temperature, degrees Celsius.
        resistance_c_per_w: steady-state temperature rise per watt drawn.
        time_constant_s: how fast the temperature follows the power.
        slowdown_c: the temperature at which the clock is lowered.
        hysteresis_c: how far under ``slowdown_c`` the clock may rise again.
    """

    ambient_c: float
    resistance_c_per_w: float
    time_constant_s: float
    slowdown_c: float
    hysteresis_c: float = 2.0

    def problems(self) -> list[str]:
        """What is out of range, one line each (empty when valid)."""
        problems = []
        for key in ("resistance_c_per_w", "time_constant_s"):
            value = getattr(self, key)
            if not 0.0 < value < math.inf:
                problems.append(f"thermal.{key}: {value!r} is not allowed; use a finite > 0")
        if not self.ambient_c < self.slowdown_c:
            problems.append(
                f"thermal (ambient_c, slowdown_c)=({self.ambient_c}, {self.slowdown_c}): "
                "need ambient < slowdown"
            )
        if not self.hysteresis_c >= 0.0:
            problems.append(f"thermal.hysteresis_c: {self.hysteresis_c!r} is not allowed; use >= 0")
        return problems

    def steady_c(self, power_w: float) -> float:
        """The temperature the GPU settles at while drawing ``power_w``."""
        return self.ambient_c + self.resistance_c_per_w * power_w


@dataclass(frozen=True)
class PhysicsModel(ClockedModel):
    """Frequency-dependent time and power of a GPU class, plus its simulated training step.

    Attributes:
        name: the GPU's marketing name (``" (simulated)"`` is appended by the simulator).
        sm_clocks_mhz: supported SM clocks, descending; the first is ``f_max``.
        min_power_limit_w: lowest power limit the GPU accepts.
        max_power_limit_w: highest power limit the GPU accepts.
        default_power_limit_w: the vendor default power limit.
        static_power_w: power drawn while working regardless of the clock (leakage, fans,
            board).
        idle_power_w: power drawn while idle (nothing queued on the GPU).
        compute_power_w: switching power of compute-bound work at ``f_max`` and ``v_high``.
        spin_power_w: switching power, at ``f_max`` and ``v_high``, of NCCL's kernels
            spinning while the GPU is blocked in a collective (on top of the idle power).
        memory_power_w: clock-independent power of memory-bound work (the memory system).
        memory_sm_power_w: switching power of the SMs during memory-bound work at ``f_max``.
        v_low: relative voltage at and below ``f_v_low_mhz``.
        v_high: relative voltage at ``f_max``.
        f_v_low_mhz: clock below which the voltage stops falling.
        step_time_s: duration of one simulated training step at ``f_max``.
        step_compute_bound_share: compute-bound share ``beta`` of that step (with
            ``step_phases``, their :func:`mean_compute_bound_share`).
        step_phases: the step's phases, in order (empty: one phase of
            ``step_compute_bound_share``).
        governor: the power-limit governor's constants.
        thermal: the thermal model, or None for a GPU that never runs hot enough to slow
            down (every shipped preset).
    """

    name: str
    sm_clocks_mhz: tuple[int, ...]
    min_power_limit_w: float
    max_power_limit_w: float
    default_power_limit_w: float
    static_power_w: float
    idle_power_w: float
    compute_power_w: float
    memory_power_w: float
    memory_sm_power_w: float
    v_low: float
    v_high: float
    f_v_low_mhz: int
    spin_power_w: float = 0.0
    step_time_s: float = 0.25
    step_compute_bound_share: float = 0.85
    step_phases: tuple[Phase, ...] = ()
    governor: GovernorConstants = GovernorConstants()
    thermal: ThermalModel | None = None

    def __post_init__(self) -> None:
        problems: list[str] = []
        clocks = self.sm_clocks_mhz
        if not clocks or any(a <= b for a, b in itertools.pairwise(clocks)):
            problems.append(
                f"sm_clocks_mhz: {clocks!r} is not allowed; use a non-empty, descending list"
            )
        if not 0 < self.min_power_limit_w <= self.default_power_limit_w <= self.max_power_limit_w:
            problems.append(
                "power limits (min, default, max)="
                f"({self.min_power_limit_w}, {self.default_power_limit_w}, "
                f"{self.max_power_limit_w}): must satisfy 0 < min <= default <= max"
            )
        for key in (
            "static_power_w",
            "idle_power_w",
            "compute_power_w",
            "memory_power_w",
            "spin_power_w",
        ):
            if getattr(self, key) < 0:
                problems.append(f"{key}: {getattr(self, key)!r} is not allowed; use >= 0")
        if not 0 < self.v_low <= self.v_high:
            problems.append(f"(v_low, v_high)=({self.v_low}, {self.v_high}): need 0 < low <= high")
        if clocks and not clocks[-1] <= self.f_v_low_mhz < clocks[0]:
            problems.append(
                f"f_v_low_mhz: {self.f_v_low_mhz!r} is not allowed; "
                f"use a number in [{clocks[-1]}, {clocks[0]})"
            )
        problems += self.step_problems()
        if self.step_phases:
            phase_issues = phase_problems(self.step_phases)
            problems.extend(f"step_{issue}" for issue in phase_issues)
            mean = mean_compute_bound_share(self.step_phases)
            if not phase_issues and abs(mean - self.step_compute_bound_share) > 1e-6:
                problems.append(
                    f"step_compute_bound_share: {self.step_compute_bound_share!r} is not "
                    f"allowed with these step_phases; use their mean, {mean!r}"
                )
        problems.extend(self.governor.problems())
        if self.thermal is not None:
            problems.extend(self.thermal.problems())
        if problems:
            raise ConfigError(problems, source=f"physics model {self.name!r}")

    def voltage(self, freq_mhz: float) -> float:
        """Relative core voltage at ``freq_mhz`` (linear above ``f_v_low_mhz``, flat below)."""
        if freq_mhz <= self.f_v_low_mhz:
            return self.v_low
        span = self.max_clock_mhz - self.f_v_low_mhz
        return self.v_low + (self.v_high - self.v_low) * (freq_mhz - self.f_v_low_mhz) / span

    def switching_scale(self, freq_mhz: float) -> float:
        """``s(f) = (f / f_max) * V(f)**2``: switching power relative to ``f_max``."""
        return freq_mhz / self.max_clock_mhz * (self.voltage(freq_mhz) / self.v_high) ** 2

    def work_power_w(self, compute_bound_share: float, freq_mhz: float) -> float:
        """Average power of work with compute-bound share ``beta`` run at ``freq_mhz``.

        Independent of ``t0`` (energy and time both scale with it).
        """
        beta = compute_bound_share
        s = self.switching_scale(freq_mhz)
        compute_s = beta * self.max_clock_mhz / freq_mhz
        memory_s = 1.0 - beta
        dynamic_j = compute_s * self.compute_power_w * s + memory_s * (
            self.memory_power_w + self.memory_sm_power_w * s
        )
        return self.static_power_w + dynamic_j / (compute_s + memory_s)

    def phase_power_w(self, phase: Phase, freq_mhz: float) -> float:
        """Power of ``phase`` at ``freq_mhz``: :meth:`blocked_power_w` for a blocked phase,
        else :meth:`work_power_w` of its compute-bound share."""
        if phase.blocked:
            return self.blocked_power_w(freq_mhz)
        return self.work_power_w(phase.compute_bound_share, freq_mhz)

    def blocked_power_w(self, freq_mhz: float) -> float:
        """Power of the GPU blocked in a collective at ``freq_mhz`` (NCCL spinning):
        ``idle_power_w + spin_power_w * s(f)``."""
        return self.idle_power_w + self.spin_power_w * self.switching_scale(freq_mhz)

    def step_shape(self) -> tuple[Phase, ...]:
        """The phases of one simulated training step."""
        return self.step_phases or (Phase(1.0, self.step_compute_bound_share),)


PHYSICS_PRESETS: dict[str, PhysicsModel] = {
    "a100": PhysicsModel(
        name="NVIDIA A100-SXM4-40GB",
        sm_clocks_mhz=_clock_table(1410, 210),
        min_power_limit_w=100.0,
        max_power_limit_w=400.0,
        default_power_limit_w=400.0,
        static_power_w=80.0,
        idle_power_w=70.0,
        compute_power_w=300.0,
        memory_power_w=50.0,
        memory_sm_power_w=90.0,
        v_low=0.70,
        v_high=1.00,
        f_v_low_mhz=900,
        spin_power_w=30.0,
    ),
    "h100": PhysicsModel(
        name="NVIDIA H100 80GB HBM3",
        sm_clocks_mhz=_clock_table(1980, 345),
        min_power_limit_w=200.0,
        max_power_limit_w=700.0,
        default_power_limit_w=700.0,
        static_power_w=120.0,
        idle_power_w=100.0,
        compute_power_w=600.0,
        memory_power_w=90.0,
        memory_sm_power_w=150.0,
        v_low=0.70,
        v_high=1.00,
        f_v_low_mhz=1200,
        spin_power_w=60.0,
    ),
    "h200": PhysicsModel(
        name="NVIDIA H200",
        sm_clocks_mhz=_clock_table(1980, 345),
        min_power_limit_w=200.0,
        max_power_limit_w=700.0,
        default_power_limit_w=700.0,
        static_power_w=125.0,
        idle_power_w=110.0,
        compute_power_w=600.0,
        memory_power_w=110.0,
        memory_sm_power_w=150.0,
        v_low=0.70,
        v_high=1.00,
        f_v_low_mhz=1200,
        spin_power_w=60.0,
    ),
    # Fitted on measured runs: benchmarks/calibrate_governor.py (errors in its README).
    "a100_sxm": PhysicsModel(
        name="NVIDIA A100-SXM4-80GB",
        sm_clocks_mhz=_clock_table(1410, 210),
        min_power_limit_w=100.0,
        max_power_limit_w=500.0,
        default_power_limit_w=500.0,
        static_power_w=49.851,
        idle_power_w=70.0,
        compute_power_w=452.812,
        memory_power_w=106.77,
        memory_sm_power_w=294.18,
        v_low=0.804,
        v_high=1.00,
        f_v_low_mhz=1111,
        spin_power_w=30.0,
    ),
    "a100_pcie": PhysicsModel(
        name="NVIDIA A100 80GB PCIe",
        sm_clocks_mhz=_clock_table(1410, 210),
        min_power_limit_w=150.0,
        max_power_limit_w=300.0,
        default_power_limit_w=300.0,
        static_power_w=115.262,
        idle_power_w=60.0,
        compute_power_w=301.107,
        memory_power_w=70.999,
        memory_sm_power_w=195.622,
        v_low=0.804,
        v_high=1.00,
        f_v_low_mhz=1111,
        spin_power_w=30.0,
        governor=GovernorConstants(cap_margin=0.0408),
    ),
    "a40_physics": PhysicsModel(
        name="NVIDIA A40",
        sm_clocks_mhz=_clock_table(1740, 210),
        min_power_limit_w=100.0,
        max_power_limit_w=300.0,
        default_power_limit_w=300.0,
        static_power_w=80.068,
        idle_power_w=30.0,
        compute_power_w=387.01,
        memory_power_w=67.475,
        memory_sm_power_w=168.485,
        v_low=0.694,
        v_high=1.00,
        f_v_low_mhz=1081,
        spin_power_w=30.0,
        governor=GovernorConstants(cap_margin=0.0401),
    ),
}


def physics_preset(
    name: str,
    *,
    step_time_s: float | None = None,
    compute_bound_share: float | None = None,
    step_phases: Sequence[Phase] | None = None,
) -> PhysicsModel:
    """A physics preset, optionally with a different simulated training step.

    Args:
        name: a key of :data:`PHYSICS_PRESETS` (``"a100"``, ``"h100"``, ``"h200"``,
            ``"a100_sxm"``, ``"a100_pcie"``, ``"a40_physics"``).
        step_time_s: duration of one training step at ``f_max`` (default 0.25 s).
        compute_bound_share: compute-bound share of a step (default: the preset's); a
            step of one phase of this share replaces the preset's phases.
        step_phases: the phases of a step, replacing the preset's (its compute-bound share
            becomes their mean); not with ``compute_bound_share``.

    Returns:
        The preset's model.

    Raises:
        ConfigError: ``name`` is not a preset, a step parameter is out of range, or both
            ``compute_bound_share`` and ``step_phases`` are given.
    """
    try:
        model = PHYSICS_PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"gpu={name!r}: not a physics preset; allowed: {sorted(PHYSICS_PRESETS)}"
        ) from None
    if compute_bound_share is not None and step_phases is not None:
        raise ConfigError(
            "compute_bound_share and step_phases: give one of them (the share of phased "
            "steps is their mean)",
            source=f"physics preset {name!r}",
        )
    if compute_bound_share is not None:  # one phase of that share replaces the preset's
        model = replace(model, step_phases=(), step_compute_bound_share=compute_bound_share)
    if step_phases is not None:
        problems = [f"step_{issue}" for issue in phase_problems(step_phases)]
        if problems:
            raise ConfigError(problems, source=f"physics preset {name!r}")
        model = replace(
            model,
            step_phases=tuple(step_phases),
            step_compute_bound_share=mean_compute_bound_share(step_phases),
        )
    return replace(model, step_time_s=model.step_time_s if step_time_s is None else step_time_s)
