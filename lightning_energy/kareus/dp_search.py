"""Kareus' data-parallel settings measured online, during training.

DDP fixes its buckets when it wraps the model, but two knobs of a data-parallel setting
(:mod:`.data_parallel`) can still change afterwards:

* the CTAs of the gradient all-reduce: a DDP communication hook
  (:func:`cta_allreduce_hook`) all-reduces each bucket in the group its state
  (:class:`GradientGroups`) points at, one CTA-limited copy of the DDP model's group per
  candidate CTA count, all created together before training (a collective);
* the locked SM clock, through the energy run's guard.

:class:`DataParallelSearch` measures every candidate ``(ctas, clock)`` in windows of
training steps, as the power limits are profiled: a warm-up before the first, settle
steps after each change, then measured steps until the window is long enough for the
GPUs' energy counters (:func:`~lightning_energy.optimize.power_limit.min_window_s`, 1 %).
Each window's time is the slowest rank's and its energy the sum over every GPU of the job
(one collective per measured step, the same on every rank), so every rank decides alike.
Once all are measured, the selector of the ``power_limit`` section
(:mod:`~lightning_energy.optimize.selectors`) chooses, rank 0's choice is broadcast and
applied on every rank, and every candidate measured is in the run's decisions and in
:meth:`DataParallelSearch.profile`. The first candidate (the most CTAs at the highest
clock) is the baseline of the ``max_slowdown`` selector.

The search is a knob of the job (:meth:`~lightning_energy.controller.EnergyController.add_knob`):
searching clocks it holds them (no power limits or locked clocks are profiled beside it);
it cannot be paced.
"""

# Without ``from __future__ import annotations``: DDP checks the hook's annotations as
# objects (``dist.GradBucket``, ``torch.futures.Future[torch.Tensor]``).
import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from lightning_energy.errors import ConfigError
from lightning_energy.kareus.data_parallel import (
    agree,
    lock_refusal,
    refuse_other_clock_owners,
    unsupported_clock,
)
from lightning_energy.kareus.runtime import NCCL_MAX_CTAS, cta_groups
from lightning_energy.optimize.power_limit import min_window_s
from lightning_energy.optimize.selectors import Measurement

if TYPE_CHECKING:
    from lightning_energy.controller import EnergyController

__all__ = [
    "SEARCH_WINDOW",
    "DataParallelCandidate",
    "DataParallelSearch",
    "GradientGroups",
    "cta_allreduce_hook",
    "search_problems",
]

log = logging.getLogger(__name__)

#: The name of the search's measurement window in the run's readings.
SEARCH_WINDOW = "kareus-dp-window"

#: Relative error of a window's energy allowed from the counter period.
_TOLERANCE = 0.01


@dataclass(frozen=True)
class DataParallelCandidate:
    """One setting the online search measures.

    Attributes:
        ctas: the CTAs of the gradient all-reduce.
        clock_mhz: the locked SM clock (None: left as it is).
    """

    ctas: int
    clock_mhz: int | None

    def label(self) -> str:
        """E.g. ``"8 CTAs at 1200 MHz"``."""
        clock = "the clock left as it is" if self.clock_mhz is None else f"{self.clock_mhz} MHz"
        return f"{self.ctas} CTAs at {clock}"


def search_problems(ctas: object, clocks_mhz: object, steps: object) -> list[str]:
    """What is wrong with an online search's candidates, each naming what is allowed.

    Args:
        ctas: the candidate CTA counts.
        clocks_mhz: the candidate clocks (None: the clock is left as it is).
        steps: measured steps per candidate at least.

    Returns:
        One message per bad value (none: the search is good).
    """
    problems = []
    key = "kareus.data_parallel_search_ctas"
    if not isinstance(ctas, Sequence) or not ctas:
        problems.append(f"{key}: {ctas!r} is not allowed; give a list of CTA counts")
    elif not all(_whole(n) and 1 <= n <= NCCL_MAX_CTAS for n in ctas) or len(set(ctas)) < len(ctas):
        problems.append(
            f"{key}: {list(ctas)} is not allowed; use distinct CTA counts, each 1 to "
            f"{NCCL_MAX_CTAS} (NCCL's channel limit)"
        )
    key = "kareus.data_parallel_search_clocks_mhz"
    if clocks_mhz is not None and (
        not isinstance(clocks_mhz, Sequence)
        or not clocks_mhz
        or not all(_whole(c) and c > 0 for c in clocks_mhz)
        or len(set(clocks_mhz)) < len(clocks_mhz)
    ):
        problems.append(
            f"{key}: {clocks_mhz!r} is not allowed; use a list of distinct positive clocks in "
            "MHz, or null (the clock is left as it is)"
        )
    if not (_whole(steps) and steps >= 1):
        problems.append(
            f"kareus.data_parallel_search_steps: {steps!r} is not allowed; use an integer >= 1"
        )
    return problems


def _whole(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


class GradientGroups:
    """The state of :func:`cta_allreduce_hook`: one CTA-limited copy of a data-parallel
    group per CTA count, and the one the gradients are all-reduced in now.

    Creating it is a collective (:func:`~.runtime.cta_groups`): build it on every rank at
    the same point, with the same counts, before training.

    Args:
        group: this rank's data-parallel group (None: the default process group).
        ctas: the CTA counts; the first is used until :meth:`use` picks another.

    Raises:
        ConfigError: no CTA count given.
    """

    def __init__(self, group: Any, ctas: Sequence[int]) -> None:
        if not ctas:
            raise ConfigError("GradientGroups: give at least one CTA count")
        base = group if group is not None else dist.group.WORLD
        self.groups: dict[int, Any] = cta_groups(base, tuple(ctas))
        self.ctas = ctas[0]

    @property
    def group(self) -> Any:
        """The group the gradients are all-reduced in now."""
        return self.groups[self.ctas]

    def use(self, ctas: int) -> None:
        """All-reduce in the copy limited to ``ctas`` from the next bucket on.

        Raises:
            ConfigError: no copy was created for ``ctas``.
        """
        if ctas not in self.groups:
            raise ConfigError(
                f"GradientGroups.use({ctas!r}): no group was created for it; use one of "
                f"{sorted(self.groups)}"
            )
        self.ctas = ctas


def cta_allreduce_hook(
    state: GradientGroups, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: PyTorch's ``allreduce_hook`` in the group ``state`` uses
    now (all-reduced there and divided by its size: the same ranks as DDP's group, so the
    gradients are averaged over the data-parallel group)."""
    return allreduce_hook(state.group, bucket)


class DataParallelSearch:
    """Measures data-parallel settings online and applies the best; a knob of the job.

    Call :meth:`step_start` and :meth:`step_end` on every rank around each training step,
    after the controller's own step events, and :meth:`pause` before anything else runs.
    Build it on every rank alike, after the run is set up and before the first step: it is
    registered with ``controller`` here and, with clocks, checks that every GPU of the job
    may be locked at each of them.

    Args:
        controller: this rank's energy controller, its run set up.
        groups: the hook's state (the CTA counts to search are its groups').
        clocks_mhz: the clocks to search (None: the clock is left as it is).
        steps: measured steps per candidate at least (windows go on until long enough for
            the energy counters).

    Attributes:
        candidates: in the order measured: the clocks from the highest, at each the CTAs
            from the most.
        chosen: the candidate applied once the search is done (None before).

    Raises:
        ConfigError: bad candidates; another knob holds the clocks; without clocks, the
            power limits (or locked clocks) are profiled in this run; on every rank, when a
            clock is not supported by every GPU of the job or the job may not lock clocks
            (observe-only, no permission, no clock locking).
    """

    name = "kareus_data_parallel_search"

    def __init__(
        self,
        controller: "EnergyController",
        groups: GradientGroups,
        clocks_mhz: Sequence[int] | None,
        *,
        steps: int,
    ) -> None:
        problems = search_problems(list(groups.groups), clocks_mhz, steps)
        if problems:
            raise ConfigError(problems, source="kareus data-parallel search")
        self.controller = controller
        self.groups = groups
        self.holds_clocks = clocks_mhz is not None
        clocks: list[int | None] = [None]
        if clocks_mhz is not None:
            clocks = [*sorted(clocks_mhz, reverse=True)]
        self.candidates = [
            DataParallelCandidate(n, c)
            for c, n in itertools.product(clocks, sorted(groups.groups, reverse=True))
        ]
        self.steps = steps
        self.chosen: DataParallelCandidate | None = None
        self._measured: dict[DataParallelCandidate, Measurement] = {}
        self._next = 0  # index of the candidate measured next
        self._current: DataParallelCandidate | None = None
        self._skip = controller.config.power_limit.warmup_steps  # steps left unmeasured
        self._window_steps = 0
        period = max(g.energy_counter_period_s() for g in controller.devices.gpus)
        _, (period,) = controller.collective.sum_and_max([], [period])
        self._min_window_s = min_window_s(period, _TOLERANCE)
        if clocks_mhz is not None:
            self._check_clocks(sorted(clocks_mhz, reverse=True))
        elif controller.setting.profiles():
            raise ConfigError(
                "kareus.data_parallel_search: the power limits (or locked clocks) are profiled "
                "in this run and would change the settings inside the search's windows; set "
                "power_limit.enabled: false, or search the clocks too "
                "(kareus.data_parallel_search_clocks_mhz)"
            )
        controller.add_knob(self)

    def _check_clocks(self, clocks_mhz: list[int]) -> None:
        controller = self.controller
        key = "kareus.data_parallel_search_clocks_mhz"
        refuse_other_clock_owners(controller, key, self.name)
        guard = controller.run_guard
        if guard is None:
            raise ConfigError(f"{key}: the energy run is not set up; search after it starts")
        refusal = next(filter(None, (unsupported_clock(controller, c) for c in clocks_mhz)), None)
        if refusal is None:  # locking the first candidate tells whether locks hold
            refusal = lock_refusal(guard, clocks_mhz[0])
        agree(controller, refusal, key)

    # ------------------------------------------------------------------ steps
    @property
    def done(self) -> bool:
        """Whether every candidate is measured and the choice applied."""
        return self.chosen is not None

    def step_start(self) -> None:
        """Apply the next candidate when one is due; start measuring when its unmeasured
        steps have run."""
        if self.done or not self.controller.changes_settings():
            return
        if self._current is None:
            self._current = self.candidates[self._next]
            self._apply(self._current, "profile", "data-parallel search window")
            self._skip += self.controller.config.power_limit.settle_steps
        readings = self.controller.ledger.readings
        if readings.is_open(SEARCH_WINDOW):
            readings.resume(SEARCH_WINDOW)
        elif self._skip == 0:
            readings.begin(SEARCH_WINDOW)
            self._window_steps = 0

    def pause(self) -> None:
        """Something other than training runs next (evaluation): the window in progress
        leaves it out, until the next :meth:`step_start`."""
        self.controller.ledger.readings.pause(SEARCH_WINDOW)

    def step_end(self) -> None:
        """Count the step; close the window once it has run its steps and is long enough
        (decided on the job-wide time and energy, alike on every rank)."""
        if self.done or self._current is None:
            return
        if self._skip > 0:
            self._skip -= 1
            return
        self._window_steps += 1
        if self._window_steps < self.steps:
            return
        run = self.controller
        m = run.ledger.readings.peek(SEARCH_WINDOW)
        energy_j = math.nan if m is None else (m.energy_j if run.counts_energy else 0.0)
        duration_s = math.nan if m is None else m.duration_s
        (energy_j,), (duration_s,) = run.collective.sum_and_max([energy_j], [duration_s])
        if math.isnan(energy_j) or math.isnan(duration_s):
            run.ledger.readings.cancel(SEARCH_WINDOW)
            self._finish(None, "stopped: a GPU's energy could not be read")
            return
        if duration_s < self._min_window_s:
            return
        run.ledger.readings.cancel(SEARCH_WINDOW)
        steps = self._window_steps
        candidate = self._current
        self._measured[candidate] = Measurement(
            float(len(self.candidates) - self._next),
            time_per_step_s=duration_s / steps,
            energy_per_step_j=energy_j / steps,
            steps=steps,
        )
        run.ledger.decide(
            "kareus_dp_measured_energy_per_step_j",
            energy_j / steps,
            f"{candidate.label()}: {duration_s / steps:.6g} s per step over {steps} steps",
            "profile",
        )
        self._next += 1
        self._current = None
        if self._next == len(self.candidates):
            self._choose()

    def _choose(self) -> None:
        run = self.controller
        section = run.config.power_limit
        selector = section.make_selector()
        top_w = min(g.power_limit_constraints_w()[1] for g in run.devices.gpus)
        _, (top_w,) = run.collective.sum_and_max([], [-top_w])
        best = selector.select(
            list(self._measured.values()),
            max_power_limit_w=-top_w,
            num_gpus=len(run.devices) * run.collective.world_size,
        )
        index = run.collective.broadcast(len(self.candidates) - int(best.power_limit_w))
        self._finish(self.candidates[index], f"search complete; selector {selector.describe()}")

    def _finish(self, chosen: DataParallelCandidate | None, reason: str) -> None:
        """Apply ``chosen`` (None: the first candidate, the baseline) and stop searching."""
        choice = chosen if chosen is not None else self.candidates[0]
        self._apply(choice, "choice", reason)
        self.chosen = choice
        self._current = None
        if self.controller.collective.rank == 0:
            log.info("Kareus data-parallel search: %s (%s)", choice.label(), reason)

    def _apply(self, candidate: DataParallelCandidate, purpose: str, reason: str) -> None:
        self.groups.use(candidate.ctas)
        ledger = self.controller.ledger
        ledger.decide("kareus_dp_ctas", float(candidate.ctas), reason, purpose)
        if candidate.clock_mhz is None:
            return
        guard = self.controller.run_guard
        assert guard is not None  # checked when built
        if guard.lock_clocks_mhz(candidate.clock_mhz, candidate.clock_mhz) is not None:
            ledger.decide("kareus_dp_clock_mhz", float(candidate.clock_mhz), reason, purpose)

    # ------------------------------------------------------------------ results
    def profile(self) -> list[dict[str, Any]]:
        """Every candidate measured so far: its CTAs, clock, job-wide time and energy per
        step and the steps measured, in the order measured."""
        return [
            {
                "ctas": c.ctas,
                "clock_mhz": c.clock_mhz,
                "time_per_step_s": m.time_per_step_s,
                "energy_per_step_j": m.energy_per_step_j,
                "steps": m.steps,
            }
            for c, m in self._measured.items()
        ]

    # ------------------------------------------------------------------ knob
    def pace_frontier(self) -> list[tuple[float, float, str]]:
        """None to pace: the search's choice holds for the run."""
        return []

    def apply_pace(self, scale: float) -> None:
        """Nothing: the search's choice holds for the run."""
        return None
