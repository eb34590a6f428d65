"""Perseus for data parallelism: straggler-aware clocks.

* :mod:`.straggler` (:class:`StragglerEqualizer`): profiles each rank's clocks and locks
  each one so all ranks reach the all-reduce together.
* :mod:`.run` (:class:`StragglerRun`): one rank's equaliser over a run, wired to what
  measures its compute; :class:`StragglerClocks`: its knob.
"""

from __future__ import annotations

from lightning_energy.perseus.data_parallel.run import StepWork, StragglerClocks, StragglerRun
from lightning_energy.perseus.data_parallel.straggler import (
    Reading,
    StepReadings,
    StragglerEqualizer,
)

__all__ = [
    "Reading",
    "StepReadings",
    "StepWork",
    "StragglerClocks",
    "StragglerEqualizer",
    "StragglerRun",
]
