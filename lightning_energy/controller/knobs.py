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

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from lightning_energy.collectives import Collective
    from lightning_energy.config import EnergyConfig
    from lightning_energy.controller.ledger import RunLedger
    from lightning_energy.device.base import DeviceSet
    from lightning_energy.device.guard import GPUGuard

__all__ = ["ControllerRun", "Knob", "KnobDecision"]


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
