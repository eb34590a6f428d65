"""Online profiling: plan without an offline step.

During the first iterations every pipeline rank runs all its instructions at a few clocks,
one clock at a time, and measures each instruction's time and energy (and the power its
GPU draws while blocked, at each clock: a GPU blocked in NCCL spins at the locked clock).
The first iteration at each clock only lets the change land (a clock set takes tens of ms
to govern the work); the following ones are measured, for
``iterations_per_clock`` iterations and at least :func:`~.attribution.min_profile_s` seconds
(many periods of the GPU's energy counter). Energy is not read per instruction: the
counter marks at every instruction's start and end go to an
:class:`~.attribution.EnergyTimeline`, which splits the counter's updates between the
instructions and the waits. Then every rank fits, per ``(stage, instruction)``, a model of
time and power against the clock, rank 0 gathers the fits, predicts the profile at every
supported clock in the profiled range, plans, and broadcasts the plan; all ranks switch to
it at the same iteration. When the target iteration time changes (the carbon policy's),
rank 0 re-plans from the same profile and the new plan is broadcast the same way; ranks
check for such a change every ``replan_every_iterations`` iterations (one small collective
over a gloo group, so the GPU is never synchronised for it).

Models (per instruction; the simulated GPU's physics follows the same shape):

* time: ``t(f) = a / f + b`` (the compute-bound part scales with 1/f, the memory-bound
  part does not), least squares over the profiled clocks;
* power: ``P(f) = c0 + c1 f + c2 f^2`` (linear with two clocks), least squares; energy is
  ``P(f) t(f)``; the blocked power has the same shape (:class:`PowerCurve`), measured on
  the waits of every rank at each clock.

Example (every rank, after building its :class:`~.runtime.PipelineRuntime`)::

    online = OnlinePerseus(runtime, gpu, supported_clocks_mhz=gpu.supported_sm_clocks_mhz())
    for batch in data:
        online.on_iteration_start()
        pipeline.step(batch)
        online.on_iteration_end()
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch.distributed as dist
from numpy.typing import NDArray

from lightning_energy.collectives import cpu_collective_group
from lightning_energy.device.base import GPU
from lightning_energy.errors import ConfigError, ProfileError
from lightning_energy.perseus.planning.plan import Plan
from lightning_energy.perseus.planning.planner import PerseusPlanner
from lightning_energy.perseus.planning.profile import BlockedPower, PipelineProfile
from lightning_energy.perseus.planning.schedule import Instruction
from lightning_energy.perseus.runtime.attribution import EnergyTimeline, min_profile_s
from lightning_energy.perseus.runtime.clock import agree_on_clock_control
from lightning_energy.perseus.runtime.hooks import BLOCKED_LABEL, InstructionMeter, PipelineRuntime

__all__ = [
    "ClockModel",
    "OnlinePerseus",
    "PowerCurve",
    "Sample",
    "default_profile_clocks",
    "fit_profile",
    "profile_clocks",
]

log = logging.getLogger(__name__)

#: How many clocks :func:`default_profile_clocks` picks unless told.
_DEFAULT_PROFILE_CLOCKS = 4

#: One measurement: ``(freq_mhz, time_s, energy_j)``.
Sample = tuple[int, float, float]


@dataclass(frozen=True)
class ClockModel:
    """Fitted time and power of one piece of work against the SM clock.

    Attributes:
        time_coef: ``(a, b)`` of ``t(f) = a / f + b``.
        power_coef: ``(c0, c1, c2)`` of ``P(f) = c0 + c1 f + c2 f^2``.
        min_mhz: lowest clock profiled.
        max_mhz: highest clock profiled.
    """

    time_coef: tuple[float, float]
    power_coef: tuple[float, float, float]
    min_mhz: int
    max_mhz: int

    @classmethod
    def fit(cls, samples: Sequence[Sample], *, warn: bool = True) -> ClockModel:
        """Least-squares fit from measurements at two clocks or more.

        Measurements are first averaged per clock (see :func:`mean_per_clock`). A clock
        whose mean time or energy is not positive (nothing measured there) is left out.

        Args:
            samples: the measurements.
            warn: log one warning naming the clocks left out.

        Raises:
            ProfileError: fewer than two clocks with positive mean time and energy.
        """
        means, unusable = mean_per_clock(samples)
        if unusable and warn:
            _warn_unusable(unusable)
        usable = sorted(means)
        if len(usable) < 2:
            raise ProfileError(
                f"fitting needs two clocks or more with positive time and energy, got {usable}"
                + (f" (no energy measured at {unusable} MHz)" if unusable else "")
            )
        freqs = np.asarray(usable, dtype=np.float64)
        times = np.asarray([means[f][0] for f in usable], dtype=np.float64)
        energies = np.asarray([means[f][1] for f in usable], dtype=np.float64)
        a, b = np.linalg.lstsq(np.column_stack([1.0 / freqs, np.ones_like(freqs)]), times)[0]
        power = _power_coef(freqs, energies / times)
        return cls((float(a), float(b)), power, usable[0], usable[-1])

    def time_s(self, freq_mhz: float) -> float:
        """Predicted time at ``freq_mhz``."""
        a, b = self.time_coef
        return a / freq_mhz + b

    def power_w(self, freq_mhz: float) -> float:
        """Predicted average power at ``freq_mhz``."""
        c0, c1, c2 = self.power_coef
        return c0 + c1 * freq_mhz + c2 * freq_mhz**2

    def energy_j(self, freq_mhz: float) -> float:
        """Predicted energy at ``freq_mhz``."""
        return self.power_w(freq_mhz) * self.time_s(freq_mhz)


@dataclass(frozen=True)
class PowerCurve:
    """A power against the SM clock: ``P(f) = c0 + c1 f + c2 f^2`` within the clocks it
    was measured at, held at its value at the nearest end beyond them, never negative.

    The power of a GPU blocked in a collective is one: NCCL's kernels spin at the locked
    clock, so it rises with the clock.

    Attributes:
        coef: ``(c0, c1, c2)``.
        min_mhz: lowest clock measured.
        max_mhz: highest clock measured.
    """

    coef: tuple[float, float, float]
    min_mhz: int
    max_mhz: int

    @classmethod
    def fit(cls, powers_w: Mapping[int, float]) -> PowerCurve:
        """Least squares through the power measured at each clock (quadratic from three
        clocks, linear from two, constant from one).

        Raises:
            ProfileError: no clock measured.
        """
        if not powers_w:
            raise ProfileError("no power measured at any clock")
        clocks = sorted(powers_w)
        freqs = np.asarray(clocks, dtype=np.float64)
        coef = _power_coef(freqs, np.asarray([powers_w[f] for f in clocks], dtype=np.float64))
        return cls(coef, clocks[0], clocks[-1])

    @classmethod
    def constant(cls, power_w: float) -> PowerCurve:
        """The same power at every clock."""
        return cls((float(power_w), 0.0, 0.0), 0, 0)

    def power_w(self, freq_mhz: float) -> float:
        """The power at ``freq_mhz`` (at the nearest measured clock outside the range)."""
        f = min(max(freq_mhz, self.min_mhz), self.max_mhz)
        c0, c1, c2 = self.coef
        return max(c0 + c1 * f + c2 * f**2, 0.0)


def _power_coef(
    freqs: NDArray[np.float64], powers_w: NDArray[np.float64]
) -> tuple[float, float, float]:
    """``(c0, c1, c2)`` of the least-squares polynomial through ``powers_w`` at ``freqs``:
    of degree 2 from three clocks, 1 from two, 0 from one."""
    degree = min(len(freqs) - 1, 2)
    basis = np.column_stack([freqs**k for k in range(degree + 1)])
    coef = [*(float(c) for c in np.linalg.lstsq(basis, powers_w)[0]), 0.0, 0.0]
    return coef[0], coef[1], coef[2]


def mean_per_clock(
    samples: Sequence[Sample],
) -> tuple[dict[int, tuple[float, float]], list[int]]:
    """Mean time and energy per clock over every sample at that clock.

    Returns:
        ``({freq_mhz: (mean time_s, mean energy_j)}`` for the clocks where both are
        positive, and the sorted clocks where they are not).
    """
    totals: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for freq, time_s, energy_j in samples:
        total = totals[int(freq)]
        total[0] += time_s
        total[1] += energy_j
        total[2] += 1
    means = {f: (t / n, e / n) for f, (t, e, n) in totals.items()}
    unusable = sorted(f for f, (t, e) in means.items() if t <= 0 or e <= 0)
    return {f: m for f, m in means.items() if f not in unusable}, unusable


def _warn_unusable(clocks_mhz: Sequence[int]) -> None:
    log.warning(
        "Perseus: no energy measured at %s MHz: the GPU's energy counter moved too rarely "
        "during these measurements; profile longer at each clock. Fitting without these "
        "clocks.",
        list(clocks_mhz),
    )


def default_profile_clocks(
    supported_mhz: Sequence[int], count: int = _DEFAULT_PROFILE_CLOCKS
) -> list[int]:
    """``count`` clocks from the maximum down to 60 % of it, evenly spaced, snapped to
    supported clocks (lower clocks are rarely worth it: slower and often costlier).

    Raises:
        ConfigError: no supported clock, or ``count < 2``.
    """
    if not supported_mhz or count < 2:
        raise ConfigError(
            f"supported_mhz={list(supported_mhz)[:3]}..., count={count}: need clocks and count >= 2"
        )
    clocks = sorted(set(supported_mhz), reverse=True)
    top = clocks[0]
    picks: list[int] = []
    for target in np.linspace(top, 0.6 * top, count):
        best = min(clocks, key=lambda f: abs(f - target))
        if best not in picks:
            picks.append(best)
    return picks


def profile_clocks(
    supported_mhz: Sequence[int],
    given_mhz: Sequence[int] | None,
    problems: list[str],
    count: int = _DEFAULT_PROFILE_CLOCKS,
) -> list[int]:
    """The clocks to profile: ``given_mhz``, else ``count`` of :func:`default_profile_clocks`;
    none when no clock is supported (the rank then votes against clock control).

    Args:
        supported_mhz: the GPU's supported clocks (empty when it cannot list them).
        given_mhz: the clocks the configuration names (None or empty: the default ones).
        problems: where fewer than two distinct clocks is reported.
        count: how many default clocks.

    Returns:
        The clocks, in the order given.
    """
    if not supported_mhz:
        return []
    clocks = list(given_mhz or default_profile_clocks(supported_mhz, count))
    if len(set(clocks)) < 2:
        problems.append(f"profile_clocks_mhz={clocks}: need two distinct clocks or more")
    return clocks


def fit_profile(
    samples: Mapping[tuple[int, str], Sequence[Sample]],
    clocks_mhz: Sequence[int],
    *,
    blocked_power_w: BlockedPower,
) -> PipelineProfile:
    """Predict a profile at ``clocks_mhz`` (within each entry's profiled range).

    Args:
        samples: measurements per ``(stage, instruction)``.
        clocks_mhz: the clocks to predict (the GPU's supported ones).
        blocked_power_w: measured power while blocked: one value, or the power measured
            at each profiled clock, predicted at every clock by a :class:`PowerCurve`
            (no clock measured: 0 W).

    Raises:
        ProfileError: an entry cannot be fitted, or no clock lies in the profiled range.
    """
    unusable = sorted({f for values in samples.values() for f in mean_per_clock(values)[1]})
    if unusable:
        _warn_unusable(unusable)
    models = {key: ClockModel.fit(values, warn=False) for key, values in samples.items()}
    low = max(m.min_mhz for m in models.values())
    high = min(m.max_mhz for m in models.values())
    keep = sorted({f for f in clocks_mhz if low <= f <= high}, reverse=True)
    if not keep:
        raise ProfileError(f"no clock in the profiled range {low}-{high} MHz")
    rows = []
    for (stage, kind), model in sorted(models.items()):
        for f in keep:
            time_s, energy_j = model.time_s(f), model.energy_j(f)
            if time_s <= 0 or energy_j <= 0:
                raise ProfileError(f"stage {stage} {kind} at {f} MHz: the fit is not positive")
            rows.append((stage, kind, f, time_s, energy_j))
    blocked: BlockedPower = blocked_power_w
    if isinstance(blocked_power_w, Mapping):
        curve = PowerCurve.fit(blocked_power_w) if blocked_power_w else PowerCurve.constant(0.0)
        blocked = {f: curve.power_w(f) for f in keep}
    return PipelineProfile.from_rows(rows, blocked_power_w=blocked, source="(online)")


class OnlinePerseus:
    """Profiles a pipeline online, plans, switches to the plan, re-plans on new targets.

    Every rank of the pipeline creates one and calls :meth:`on_iteration_start` /
    :meth:`on_iteration_end` around every iteration, at the same iterations (they hold
    collectives over ``group``).

    Args:
        runtime: this rank's runtime (applies clocks, measures instructions).
        gpu: this rank's GPU (energy counter, synchronisation).
        supported_clocks_mhz: clocks the plan may use (empty: this rank's clocks are
            unknown; it votes against clock control, and every rank runs unchanged).
        profile_clocks_mhz: clocks to profile (default :func:`default_profile_clocks`).
        warmup_iterations: iterations at the maximum clock before profiling (allocation,
            compilation and caches make the first ones unrepresentative).
        iterations_per_clock: measured iterations per clock, at least (each clock also
            gets one unmeasured iteration for the change to land, and is measured for at
            least :func:`~.attribution.min_profile_s` of the GPU's counter period).
        target_time_s: iteration time to plan for (None: no slowdown).
        replan_every_iterations: after planning, how often (in iterations) the ranks
            check whether rank 0's target time changed; a new target takes effect at the
            next check.
        group: the process group of the pipeline ranks (None: the default group). Its
            exchanges run over a gloo group (see
            :func:`~lightning_energy.collectives.cpu_collective_group`).
        clock: seconds in the GPU's time base (simulated GPUs: their virtual clock).
        planner_options: keyword arguments for :class:`PerseusPlanner`.

    Raises:
        ConfigError: bad counts or clocks.
    """

    def __init__(
        self,
        runtime: PipelineRuntime,
        gpu: GPU,
        *,
        supported_clocks_mhz: Sequence[int],
        profile_clocks_mhz: Sequence[int] | None = None,
        warmup_iterations: int = 1,
        iterations_per_clock: int = 1,
        target_time_s: float | None = None,
        replan_every_iterations: int = 10,
        group: Any = None,
        clock: Callable[[], float] = time.perf_counter,
        planner_options: Mapping[str, Any] | None = None,
    ) -> None:
        problems = []
        if warmup_iterations < 0:
            problems.append(f"warmup_iterations: {warmup_iterations} is not allowed; use >= 0")
        if iterations_per_clock < 1:
            problems.append(
                f"iterations_per_clock: {iterations_per_clock} is not allowed; use >= 1"
            )
        if replan_every_iterations < 1:
            problems.append(
                f"replan_every_iterations: {replan_every_iterations} is not allowed; use >= 1"
            )
        clocks = profile_clocks(supported_clocks_mhz, profile_clocks_mhz, problems)
        if problems:
            raise ConfigError(problems, source="OnlinePerseus")
        self.runtime = runtime
        self.gpu = gpu
        self.supported_clocks_mhz = list(supported_clocks_mhz)
        self.profile_clocks_mhz = clocks
        self.warmup_iterations = warmup_iterations
        self.iterations_per_clock = iterations_per_clock
        self.replan_every_iterations = replan_every_iterations
        self.group = cpu_collective_group(group)
        self.clock = clock
        self.planner_options = dict(planner_options or {})
        self.iteration = 0
        #: The fitted profile and its planner (rank 0 only; it plans for every rank).
        self.profile: PipelineProfile | None = None
        self.planner: PerseusPlanner | None = None
        self._planned = False
        self._planned_at = 0
        self._target_s = target_time_s
        self._pending_target: tuple[float | None] | None = None
        self._counter_period_s = gpu.energy_counter_period_s()
        self._min_profile_s = min_profile_s(self._counter_period_s)
        self._stream = runtime.stream  # instructions are timed on the stage's stream
        # One timeline per profiled clock: the waits of each are labelled apart, as the
        # power of a GPU blocked in NCCL depends on the clock.
        self._meters: dict[int, InstructionMeter] = {}
        self._clock_index = 0
        self._clock_iterations = 0  # at the current profiling clock, the landing one included
        self._clock_seconds = 0.0  # measured at the current profiling clock
        self._iteration_start_s: float | None = None
        #: False until :meth:`start` (the ranks agreed to control clocks), and for good when
        #: clocks cannot be changed on some rank: nothing is profiled or planned.
        self.enabled = False
        self._started = False

    def start(self) -> None:
        """Agree with the other ranks on clock control and lock the maximum clock
        (collective; every rank). Called after the first iteration: an administrator's
        clock lock shows only under load, and is looked for during it."""
        controller = self.runtime.controller
        self._started = True
        self.enabled = agree_on_clock_control(
            controller.guard,
            max(self.supported_clocks_mhz, default=None),
            controller.gpu_position,
            self.group,
        )

    @property
    def phase(self) -> str:
        """``"starting"`` (before :meth:`start`), ``"disabled"`` (clocks cannot be
        changed), ``"warmup"``, ``"profiling"`` or ``"planned"``."""
        if not self._started:
            return "starting"
        if not self.enabled:
            return "disabled"
        if self._planned:
            return "planned"
        if self.iteration < self.warmup_iterations:
            return "warmup"
        return "profiling"

    @property
    def target_time_s(self) -> float | None:
        """The iteration time planned for (None: no slowdown)."""
        return self._target_s

    def set_target_time(self, target_s: float | None) -> None:
        """Plan for ``target_s`` from the next iteration boundary (rank 0's value counts)."""
        self._pending_target = (target_s,)

    def _label(self, inst: Instruction) -> tuple[int, str, int] | None:
        # The clock read back once the change was applied (a pre-job lock may cap it).
        freq = self.runtime.controller.current_mhz
        return None if freq is None else (inst.stage, inst.kind, freq)

    def on_iteration_start(self) -> None:
        """Set this iteration's clocks (profiling) and start measuring."""
        if self.phase in ("starting", "planned", "disabled"):
            return
        if self.phase == "warmup":
            self.runtime.set_fixed_clock(max(self.supported_clocks_mhz))
            return
        self.runtime.set_fixed_clock(self.profile_clocks_mhz[self._clock_index])
        measured = self._clock_iterations > 0  # the first iteration lets the change land
        meter = self._meter()
        self.runtime.measure_with(meter if measured else None)
        meter.mark(BLOCKED_LABEL if measured else None)
        self._iteration_start_s = self.clock() if measured else None

    def _meter(self) -> InstructionMeter:
        """The meter (and timeline) of the clock being profiled."""
        freq = self.profile_clocks_mhz[self._clock_index]
        if freq not in self._meters:
            timeline = EnergyTimeline(self._counter_period_s)
            self._meters[freq] = InstructionMeter(
                self.gpu, timeline, self._label, self.clock, stream=self._stream
            )
        return self._meters[freq]

    def on_iteration_end(self) -> None:
        """Close the iteration; after the last profiled one, plan and switch (collective).

        Raises:
            ProfileError: the measurements cannot be fitted.
        """
        self.runtime.end_iteration()
        if not self.enabled:
            self.iteration += 1
            return
        profiling = self.phase == "profiling"
        self.iteration += 1
        if profiling:
            # Until the next iteration starts: work outside the pipeline (optimizer step).
            self._meter().mark(None)
            if self._iteration_start_s is not None:
                self._clock_seconds += self.clock() - self._iteration_start_s
            self._clock_iterations += 1
            done = (
                self._clock_iterations > self.iterations_per_clock
                and self._clock_seconds >= self._min_profile_s
            )
            if self._broadcast(done):  # rank 0's view: every rank moves on together
                self._clock_index += 1
                self._clock_iterations, self._clock_seconds = 0, 0.0
        if not self._planned and profiling and self._clock_index >= len(self.profile_clocks_mhz):
            self.runtime.measure_with(None)
            self.runtime.set_fixed_clock(None)
            self._plan_from_samples()
        elif (
            self._planned
            and (self.iteration - self._planned_at) % self.replan_every_iterations == 0
        ):
            self._maybe_replan()

    # ------------------------------------------------------------ collectives
    def _rank(self) -> int:
        return dist.get_rank(self.group) if dist.is_initialized() else 0

    def _gather(self, obj: Any) -> list[Any]:
        if not dist.is_initialized():
            return [obj]
        out: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _broadcast(self, obj: Any) -> Any:
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=_src(self.group), group=self.group)
        return box[0]

    def _measurements(
        self,
    ) -> tuple[dict[tuple[int, str], list[Sample]], dict[int, tuple[float, float]], str | None]:
        """This rank's ``({(stage, kind): [(clock, time_s, energy_j)]}, {clock: (blocked J,
        blocked s)}, problem)`` from its timelines; the problem says why nothing was
        measured."""
        samples: dict[tuple[int, str], list[Sample]] = defaultdict(list)
        blocked: dict[int, tuple[float, float]] = {}
        meters, self._meters = self._meters, {}
        for requested, meter in meters.items():
            try:
                fitted = meter.timeline.fit()
            except ProfileError as exc:
                return {}, {}, f"rank {self._rank()}: {exc}"
            ran = set()
            for label, measured in fitted.items():
                if label != BLOCKED_LABEL:
                    stage, kind, freq = cast(tuple[int, str, int], label)
                    samples[(stage, kind)].append(
                        (freq, measured.segment_s, measured.segment_energy_j)
                    )
                    ran.add(freq)
            if BLOCKED_LABEL in fitted:
                # At the clock the instructions ran at (a pre-job lock may cap the request).
                freq = ran.pop() if len(ran) == 1 else requested
                waited = fitted[BLOCKED_LABEL]
                blocked[freq] = (waited.power_w * waited.seconds, waited.seconds)
        return dict(samples), blocked, None

    def _plan_from_samples(self) -> None:
        gathered = self._gather(self._measurements())
        text = None
        if self._rank() == 0:
            samples: dict[tuple[int, str], list[Sample]] = {}
            waits: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
            problems = []
            for rank_samples, rank_waits, problem in gathered:
                samples.update(rank_samples)
                for freq, (blocked_j, blocked_s) in rank_waits.items():
                    waits[freq][0] += blocked_j
                    waits[freq][1] += blocked_s
                if problem is not None:
                    problems.append(problem)
            blocked_power_w = {f: max(j / s, 0.0) for f, (j, s) in waits.items() if s > 0}
            try:
                if problems:
                    raise ProfileError("; ".join(problems))
                self.profile = fit_profile(
                    samples, self.supported_clocks_mhz, blocked_power_w=blocked_power_w
                )
            except ProfileError as exc:
                log.warning(
                    "Perseus: cannot plan from the profile (%s); GPU clocks are left as "
                    "they were before the job.",
                    exc,
                )
                text = ""
            else:
                self.planner = PerseusPlanner(
                    self.profile, self.runtime.schedule, **self.planner_options
                )
                text = self._plan_text()
                log.info(
                    "Perseus: profiled %d instruction kinds at %s MHz (blocked power %s W); "
                    "switching to the plan.",
                    len(samples),
                    self.profile_clocks_mhz,
                    {f: round(p, 1) for f, p in sorted(blocked_power_w.items(), reverse=True)},
                )
        text = self._broadcast(text)
        if not text:
            self.enabled = False
            self.runtime.controller.reset()
            return
        self.runtime.set_plan(Plan.from_json(text, schedule=self.runtime.schedule))
        self._planned = True
        self._planned_at = self.iteration

    def _plan_text(self) -> str:
        assert self.planner is not None
        if self._target_s is None:
            point = self.planner.plan_no_slowdown()
        else:
            point = self.planner.plan_for_time(self._target_s)
        return point.plan.to_json()

    def _maybe_replan(self) -> None:
        change = self._broadcast(self._pending_target if self._rank() == 0 else None)
        self._pending_target = None
        if change is None or change[0] == self._target_s:
            return
        self._target_s = change[0]
        text = self._plan_text() if self._rank() == 0 else None
        self.runtime.set_plan(Plan.from_json(self._broadcast(text), schedule=self.runtime.schedule))
        log.info("Perseus: re-planned for target iteration time %s s.", self._target_s)


def _src(group: Any) -> int:
    """Global rank of the group's rank 0."""
    if group is None:
        return 0
    return int(dist.get_global_rank(group, 0))
