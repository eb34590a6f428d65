"""What adapters tell the controller, and what it answers.

An adapter translates each framework hook into one event and hands it to
:meth:`EnergyController.handle <lightning_energy.controller.EnergyController.handle>`;
the answer is a :class:`StepResult`: the metrics to log when a logging interval closed
(None otherwise) and the decisions the event led to.

Example:
    >>> from lightning_energy.controller import Interruption, StepEnd, StepResult
    >>> Interruption("validation")
    Interruption(reason='validation')
    >>> StepResult().metrics is None
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

if TYPE_CHECKING:
    from lightning_energy.controller.ledger import RunSummary
    from lightning_energy.pacing import PaceUpdate

__all__ = [
    "CheckpointLoad",
    "CheckpointSave",
    "Decision",
    "End",
    "Event",
    "Interruption",
    "PaceTarget",
    "Pause",
    "StepEnd",
    "StepResult",
    "StepStart",
]


class Decision(TypedDict):
    """One setting the controller chose, and why (as written to reports).

    Keys: ``step`` (training steps seen), ``time_s`` (device-clock seconds since setup),
    ``kind`` (``power_limit``, ``observe-only``, ``enforced_power_limit``,
    ``target_time_s``), ``purpose`` (``profile``, ``choice``, ``pause``, ``resume``,
    ``pace`` or None), ``value`` (watts; seconds per step for ``target_time_s``; or None)
    and ``reason``.
    """

    step: int
    time_s: float
    kind: str
    purpose: str | None
    value: float | None
    reason: str


class PaceTarget(Protocol):
    """What the carbon pace moves instead of the power limit (Perseus' iteration time).

    A job that plans its own clocks registers one with
    :meth:`EnergyController.pace_with <lightning_energy.controller.EnergyController.pace_with>`;
    the pacing policy then weighs the target's time-energy frontier, and every rank hands
    it the agreed scale.
    """

    def pace_frontier(self) -> list[tuple[float, float, str]]:
        """Rank 0: ``(seconds, joules, label)`` of one step of the whole job at each
        setting it can run, fastest first (empty while unknown)."""
        ...

    def apply_pace(self, scale: float) -> float | None:
        """Run at ``scale`` times the fastest step time from now on (every rank); the
        target time per step in seconds, when this rank knows it."""
        ...


@dataclass(frozen=True)
class StepStart:
    """A training (optimizer) step is about to run."""


@dataclass(frozen=True)
class StepEnd:
    """A training (optimizer) step has run."""


@dataclass(frozen=True)
class Interruption:
    """Something that is not training runs next (validation, epoch end, evaluation): the
    profiling window in progress pauses, and measures the training steps on either side
    (what runs until the next :class:`StepStart` is left out).

    Attributes:
        reason: why, for the debug log.
    """

    reason: str


@dataclass(frozen=True)
class Pause:
    """Wait at the lowest power limit until the carbon policy resumes training.

    The controller raises this itself at a logging boundary when rank 0's policy says so;
    every rank handles it at the same step.

    Attributes:
        update: the pacing decision that asked for the pause.
    """

    update: PaceUpdate


@dataclass(frozen=True)
class CheckpointSave:
    """A checkpoint is being written: the result's ``state`` is what to store."""


@dataclass(frozen=True)
class CheckpointLoad:
    """A checkpoint is being read: resume its profile and choice.

    Attributes:
        state: what :class:`CheckpointSave` returned when it was written.
    """

    state: Mapping[str, Any]


@dataclass(frozen=True)
class End:
    """The run ends: restore every GPU first, then summarise (the result's ``summary``)."""


Event = StepStart | StepEnd | Interruption | Pause | CheckpointSave | CheckpointLoad | End


@dataclass(frozen=True)
class StepResult:
    """What the controller answers to an event.

    Attributes:
        metrics: the ``energy/*`` (and ``carbon/*``) values to log, when a logging interval
            closed during the event; None when there is nothing new to log.
        decisions: the settings chosen while handling the event, in order.
        state: for :class:`CheckpointSave`, the state to store (JSON-serialisable).
        summary: for :class:`End`, the run summary.
    """

    metrics: Mapping[str, float] | None = None
    decisions: tuple[Decision, ...] = field(default_factory=tuple)
    state: dict[str, Any] | None = None
    summary: RunSummary | None = None
