"""What adapters tell the controller.

An adapter translates each framework hook into one event and hands it to
:meth:`EnergyController.handle <lightning_energy.controller.EnergyController.handle>`;
the answer is a :class:`~lightning_energy.controller.records.StepResult`. :data:`Event` is
the union the controller dispatches over (a ``match`` the type checker proves complete).

Example:
    >>> from lightning_energy.controller import Interruption
    >>> Interruption("validation")
    Interruption(reason='validation')
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CheckpointLoad",
    "CheckpointSave",
    "End",
    "Event",
    "Interruption",
    "StepEnd",
    "StepStart",
]


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
class CheckpointSave:
    """A checkpoint is being written: the result's ``state`` is what to store. Writing it
    is not training: the profiling window in progress pauses, as at an :class:`Interruption`."""


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


Event = StepStart | StepEnd | Interruption | CheckpointSave | CheckpointLoad | End
