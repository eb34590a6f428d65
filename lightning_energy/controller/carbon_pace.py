"""Carbon pacing of a run: the pace agreed across ranks, applied to a knob, and pauses.

:class:`CarbonPacing` is the controller's collaborator for the ``carbon:`` section. Rank 0
polls the grid (a :class:`~lightning_energy.pacing.CarbonPacer`); at every logging
boundary the ranks agree on rank 0's pace (one broadcast) and the knob that can be paced
runs at it: Perseus' target iteration time when Perseus plans the clocks, else the power
limit. A pause waits at the lowest power limit until the policy resumes training, each
polling period an interval of its own in the ledger, and ends at once when a signal
restores the GPUs. The first pause is weighed at the idle power the GPUs read at setup,
then at what pauses measure.
"""

from __future__ import annotations

import contextlib
import logging
import math
import select
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from lightning_energy.controller.job_plan import measuring_ranks
from lightning_energy.controller.knobs import ControllerRun
from lightning_energy.errors import ConfigError, DeviceError
from lightning_energy.pacing import CarbonPacer, PaceUpdate

if TYPE_CHECKING:
    from carbon.config import CarbonConfig
    from lightning_energy.controller.job_plan import RankInfo
    from lightning_energy.controller.knobs import Knob
    from lightning_energy.controller.power_limits import PowerLimitKnob
    from lightning_energy.measure import Measurement

__all__ = ["CarbonPacing", "PacedRun"]

log = logging.getLogger(__name__)

# Assumed power of an idle GPU, as a share of the least-power measured point, when no
# reading at setup gave it and until a pause measures it (used only to weigh pausing
# against slow running).
_IDLE_SHARE = 0.15
# A pause decided before any pause measured idle power first idles this long only (at most
# one polling period): long enough for the energy counter to measure idle power, then the
# pause is decided again at the measured power.
_IDLE_PROBE_S = 60.0


class PacedRun(ControllerRun, Protocol):
    """What carbon pacing uses of the run it belongs to (the controller)."""

    @property
    def ranks(self) -> Sequence[RankInfo]: ...

    @property
    def power_limit(self) -> PowerLimitKnob: ...

    def paced_knob(self) -> Knob: ...

    def current_locked_clock_mhz(self) -> float | None: ...


class CarbonPacing:
    """The carbon pace and pauses of one run (every rank; rank 0 polls the grid).

    Args:
        run: the controller running the job.
        config: the ``carbon:`` section.
    """

    def __init__(self, run: PacedRun, config: CarbonConfig) -> None:
        self.run = run
        self.config = config
        self.pacer: CarbonPacer | None = None
        # The knob the current scale was applied to (rank 0's is the one that counts).
        self._paced: Knob | None = None
        self._wake: socket.socket | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self, *, simulated: bool) -> None:
        """Rank 0 starts polling; every rank learns the first intensity, or rank 0's
        configuration problem (so no rank is left waiting in a collective); with pauses
        allowed, the GPUs' idle power is read before any work.

        Raises:
            ConfigError: rank 0's ``carbon:`` section cannot be used (every rank).
        """
        run = self.run
        first: float | list[str] | None = None
        if run.collective.rank == 0:
            first = self._start_pacer(simulated)
        first = run.collective.broadcast(first)
        if isinstance(first, list):
            raise ConfigError(first, run.config.source)
        run.ledger.set_intensity(first)
        if self.config.allow_pause:
            self._read_idle_power()

    def _start_pacer(self, simulated: bool) -> float | list[str]:
        """Rank 0: start polling; the first intensity, or the configuration problems."""
        from carbon.errors import CarbonConfigError

        try:
            pacer = CarbonPacer(self.config, now=self.run.now, virtual_clock=simulated)
        except CarbonConfigError as exc:
            return [f"carbon.{p}" for p in exc.problems]
        self.pacer = pacer
        pacer.start()
        return pacer.intensity_g_per_kwh()

    def _read_idle_power(self) -> None:
        """Before any work: the job-wide board power the GPUs read now, each GPU counted
        once. It is what they draw idle (more if something else runs on them), the first
        estimate a pause is weighed at: a pause then measures what it really draws. A
        failed reading leaves the estimate to the profile."""
        run = self.run
        try:
            gpus = run.devices.gpus
            mine = sum(gpu.power_w() for gpu in gpus) if run.counts_energy else 0.0
        except DeviceError as exc:
            log.debug("no idle power reading at setup: %s", exc)
            mine = math.nan
        (total,), _ = run.collective.sum_and_max([mine], [])
        if math.isfinite(total) and total > 0:
            run.ledger.set_idle_reading(total)

    def stop(self) -> None:
        """Stop polling (without waiting for a poll in flight)."""
        if self.pacer is not None:
            self.pacer.stop()

    def wake(self) -> None:
        """In a signal handler, after the restore: end a pause at once."""
        wake = self._wake
        if wake is not None:
            with contextlib.suppress(OSError):
                wake.send(b"\0")

    # ------------------------------------------------------------------ pacing
    def _update(self, *, paused: bool = False) -> PaceUpdate | None:
        """Rank 0: the pacing decision until the next boundary (while ``paused``, one being
        made in the background is waited for: no step is held up)."""
        pacer = self.pacer
        if pacer is None:
            return None
        run = self.run
        ledger = run.ledger
        frontier = run.paced_knob().pace_frontier()
        total = run.total_steps
        if frontier and total is not None:
            pacer.fix_deadline(total, min(t for t, _, _ in frontier))
        remaining = None
        if total is not None and pacer.pacing:
            remaining = max(total - ledger.step, 0)
        idle_w = ledger.idle_power_w if ledger.idle_power_w is not None else ledger.idle_reading_w
        if idle_w is None:
            idle_w = _IDLE_SHARE * min((e / t for t, e, _ in frontier), default=0.0)
        return pacer.update(remaining, frontier, idle_w, emitted_g=ledger.emissions_g, wait=paused)

    def pace(self) -> None:
        """At a logging boundary: agree on the carbon pace and apply it (every rank)."""
        run = self.run
        # A scale comes with rank 0's frontier of the knob. It is applied again where
        # another knob took the pace since (a lock refused: power limits, once profiled),
        # as rank 0 saw it: every rank applies alike.
        update, moved = run.collective.broadcast(
            (self._update(), run.paced_knob() is not self._paced)
        )
        if update is None:
            return
        ledger = run.ledger
        ledger.set_intensity(update.intensity_g_per_kwh)
        if update.scale is None or not run.changes_settings():
            return
        if update.scale != ledger.scale or moved:
            ledger.set_scale(update.scale)
            decision = run.paced_knob().apply_pace(update.scale)
            if decision is not None:
                self._paced = run.paced_knob()
                reason = f"carbon pace x{update.scale:.3f}: {update.reason}"
                ledger.decide(decision.kind, decision.value, reason, decision.purpose)
        if update.pause:
            self._pause(update)

    def _pause(self, first: PaceUpdate) -> None:
        """Wait at the lowest power limit until rank 0's policy resumes training.

        Each polling period ends with a decision. A pause decided before idle power was
        ever measured first idles a short probe only (``_IDLE_PROBE_S``), so that the
        policy decides again at once at the measured power. The wait ends at once when a
        signal restores the GPUs (the job is being stopped).
        """
        run = self.run
        guard = run.run_guard
        assert guard is not None
        ledger = run.ledger
        limits = run.power_limit
        before = limits.pause(first.reason)
        wait_s = self.config.poll_interval_s
        if ledger.idle_power_w is None:  # weighed at an estimate: measure before committing
            wait_s = min(wait_s, _IDLE_PROBE_S)
        update: PaceUpdate | None = first
        idle_j = idle_s = 0.0
        measuring = measuring_ranks(run.ranks)  # each physical GPU counted once
        waiter, self._wake = socket.socketpair()
        waiter.setblocking(False)
        self._wake.setblocking(False)
        try:
            while update is not None and update.pause and not guard.restored:
                if run.devices.run_step is not None:
                    for gpu in run.devices.gpus:
                        gpu.idle(wait_s)
                else:
                    select.select([waiter], [], [], wait_s)
                # Each polling period of the pause is an interval of its own (no steps), so
                # its idle energy is counted at the intensity of that period.
                m: Measurement | None = ledger.next_interval(
                    limits.power_limit_w, run.current_locked_clock_mhz()
                )
                if m is not None:
                    idle_j, idle_s = idle_j + m.energy_j, idle_s + m.duration_s
                if idle_s > 0:  # job-wide idle power, as every measuring rank idles alike
                    # Measured from the first period on: the next decision weighs the pause
                    # at the power it really draws, not at the guess it was started with.
                    ledger.set_idle_power(idle_j / idle_s * measuring)
                update = run.collective.broadcast(self._update(paused=True))
                if update is not None:
                    ledger.set_intensity(update.intensity_g_per_kwh)
                wait_s = self.config.poll_interval_s
        finally:
            wake, self._wake = self._wake, None
            wake.close()
            waiter.close()
        limits.resume(before)
