"""Knobs: every setting the controller changes on a GPU, or in the job, behind one protocol.

A :class:`Knob` is a power limit, Perseus' per-instruction clocks, the straggler
equaliser's clocks, the batch size of a recurring job. The controller owns what is common
to all of them: the lease and the guard every change goes through, the ledger every
decision is recorded in, the carbon pace (it moves the knob that can be paced), and the
conflicts between them (a knob that holds the clocks switches power-limit profiling off:
limits measured while clocks move say nothing). A knob owns what is its own: its
candidates, how it measures and decides, and what it applies.

A knob is registered with :meth:`EnergyController.add_knob
<lightning_energy.controller.EnergyController.add_knob>` before training starts, on every
rank alike (the pace is agreed across ranks). The power limit is the controller's built-in
knob (:class:`~lightning_energy.controller.power_limits.PowerLimitKnob`); docs/knobs.md
walks through adding one.

Example:
    >>> class FixedClock:
    ...     name = "fixed_clock"
    ...     holds_clocks = True
    ...     def pace_frontier(self):
    ...         return []  # nothing to pace: the carbon pace leaves it alone
    ...     def apply_pace(self, scale):
    ...         return None
    >>> isinstance(FixedClock(), Knob)
    True
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from lightning_energy.errors import ConfigError, EnergyError

if TYPE_CHECKING:
    from lightning_energy.collectives import Collective
    from lightning_energy.config import EnergyConfig
    from lightning_energy.controller.ledger import RunLedger
    from lightning_energy.controller.locked_clock import LockedClockKnob
    from lightning_energy.controller.power_limits import PowerLimitKnob
    from lightning_energy.device.base import DeviceSet
    from lightning_energy.device.guard import GPUGuard

__all__ = ["ControllerRun", "Knob", "KnobDecision", "RegisteredKnobs"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KnobDecision:
    """What a knob set, for the ledger (reports list it as a decision).

    Attributes:
        kind: what was set (``power_limit``, ``target_time_s``, ...).
        value: its new value (watts, seconds per step...; None: not known on this rank).
        purpose: what for (``choice``, ``pace``, ...: see
            :class:`~lightning_energy.controller.records.Decision`).
    """

    kind: str
    value: float | None
    purpose: str


@runtime_checkable
class Knob(Protocol):
    """A setting of the job that the controller coordinates.

    Attributes:
        name: what reports and log lines call it (``power_limit``, ``perseus_clocks``,
            ``straggler_clocks``, ``batch_size``).
        holds_clocks: it locks the SM clocks: power-limit profiling is off while it is
            registered (limits measured under clocks that move, or are held, say nothing
            of the limits themselves).
    """

    name: str
    holds_clocks: bool

    def pace_frontier(self) -> list[tuple[float, float, str]]:
        """Rank 0: ``(seconds, joules, label)`` of one step of the whole job at each setting
        the knob can run, fastest first; empty when it cannot be paced (now, or ever)."""
        ...

    def apply_pace(self, scale: float) -> KnobDecision | None:
        """Every rank: run at ``scale`` times the fastest step time from now on; what was
        set, for the ledger (None: nothing changed)."""
        ...


class ControllerRun(Protocol):
    """What the controller's collaborators (knobs, carbon pacing) use of the run they belong
    to; each extends it with what it needs besides."""

    config: EnergyConfig

    @property
    def devices(self) -> DeviceSet: ...

    @property
    def collective(self) -> Collective: ...

    @property
    def run_guard(self) -> GPUGuard | None: ...

    @property
    def ledger(self) -> RunLedger: ...

    @property
    def counts_energy(self) -> bool: ...

    @property
    def total_steps(self) -> int | None: ...

    def changes_settings(self) -> bool: ...

    def now(self) -> datetime: ...


class RegisteredKnobs:
    """The knobs registered with a controller, in order, and the conflicts a registration
    settles with the built-in knobs.

    Args:
        power_limit: the controller's power-limit knob.
        locked_clock: the controller's locked-clock knob.
    """

    def __init__(self, power_limit: PowerLimitKnob, locked_clock: LockedClockKnob) -> None:
        self._power_limit = power_limit
        self._locked_clock = locked_clock
        self._knobs: list[Knob] = []

    def __iter__(self) -> Iterator[Knob]:
        return iter(self._knobs)

    def add(self, knob: Knob, *, steps_run: int, rank: int) -> None:
        """Register ``knob``: one holding the clocks switches power-limit profiling off
        (said once at INFO on rank 0) and the locked-clock knob off. One owner of the
        clocks at a time: a knob holding them beside another one that does is refused. A
        knob of the name of one registered (a later fit's, of the same adapter) takes its
        place.

        Args:
            knob: the knob.
            steps_run: training steps the job ran so far (knobs are added before any).
            rank: this process's rank.

        Raises:
            EnergyError: training has started.
            ConfigError: ``knob`` holds the clocks beside another knob that does, naming it.
        """
        if steps_run:
            raise EnergyError(
                f"add_knob({knob.name!r}): add knobs before training starts (step {steps_run} ran)"
            )
        owners = self.clock_owners(except_name=knob.name)
        if knob.holds_clocks and owners:
            raise ConfigError(
                f"add_knob({knob.name!r}): {', '.join(owners)} already holds the clocks (one "
                "owner of the clocks at a time); register one of them"
            )
        same = [i for i, k in enumerate(self._knobs) if k.name == knob.name]
        if same:
            self._knobs[same[0]] = knob
        else:
            self._knobs.append(knob)
        if not knob.holds_clocks:
            return
        limits = self._power_limit
        if limits.enabled and limits.profiling_off is None:
            limits.profiling_off = f"{knob.name} holds the clocks"
            if rank == 0:
                log.info("Power limits are not profiled: %s.", limits.profiling_off)
        self._locked_clock.yield_clocks(knob.name)

    def clock_owners(self, *, except_name: str | None = None) -> list[str]:
        """The names of the registered knobs holding the clocks (but ``except_name``)."""
        return [k.name for k in self._knobs if k.holds_clocks and k.name != except_name]

    def check(self, knob: Knob) -> None:
        """Raises:
        EnergyError: ``knob`` is not registered."""
        if not any(k is knob for k in self._knobs):
            raise EnergyError(f"record({knob.name!r}): register the knob first (add_knob)")

    def holding_clocks(self) -> Knob | None:
        """The knob holding the clocks (None: none does; never more than one)."""
        return next((knob for knob in self._knobs if knob.holds_clocks), None)
