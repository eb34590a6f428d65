"""The run ledger: every number a run summary or report holds comes from here.

It keeps the logging intervals (metrics, timeline), the energy and carbon accounting (of
the GPUs, and of the node's CPUs and DRAM where this rank measures them), the decisions,
the baselines measured from the end of the profile on, the run summary and the job's
totals. It decides nothing and changes no GPU: the coordinator tells it what happened and
reads the numbers back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from lightning_energy.controller.records import Decision, Profile, RunSummary
from lightning_energy.controller.windows import AFTER_PROFILE, INTERVAL, Readings
from lightning_energy.pacing import utc_now

if TYPE_CHECKING:
    from lightning_energy.device.base import DeviceSet, GPUInfo
    from lightning_energy.errors import DeviceError
    from lightning_energy.measure import Measurement
    from lightning_energy.node_energy import NodeEnergyMeter
    from lightning_energy.pacing import CarbonPacer

__all__ = ["RunLedger", "RunSummary"]

log = logging.getLogger(__name__)


class RunLedger:
    """The numbers of one run (one ``fit``), from setup to teardown.

    Args:
        log_every_n_steps: steps per logging interval.
        clock: the device clock (seconds).
        on_lost: called once when a GPU reading first fails (see :class:`Readings`).
    """

    def __init__(
        self,
        log_every_n_steps: int,
        clock: Callable[[], float],
        on_lost: Callable[[DeviceError], None],
    ) -> None:
        self._log_every_n_steps = log_every_n_steps
        self._clock = clock
        self.readings = Readings(on_lost)
        #: The job's training steps: those of the checkpoint resumed, then this run's.
        self.step = 0
        #: The energy of this run's closed logging intervals.
        self.energy_j = 0.0
        self.resumed_at_step = 0
        self.energy_before_resume_j = 0.0
        self.interval_steps = 0
        self.start_s = 0.0
        self.end_s: float | None = None
        self.job_start = utc_now()
        self.intensity: float | None = None
        self.scale: float | None = None
        self.emissions_g = 0.0
        self.profile_end: tuple[datetime, int, float] | None = None
        self.after_profile: Measurement | None = None
        self.idle_power_w: float | None = None
        self.idle_reading_w: float | None = None
        self.published = 0
        self.metrics: dict[str, float] = {}
        self.timeline: list[dict[str, Any]] = []
        self.decisions: list[Decision] = []
        self.device_info: list[GPUInfo] = []
        self.node: NodeEnergyMeter | None = None
        self.node_info: dict[str, Any] | None = None
        self.node_energy_j = 0.0
        self.node_emissions_g = 0.0
        self.job: dict[str, Any] | None = None
        self.summary: RunSummary | None = None

    @property
    def read_error(self) -> str | None:
        """Why GPU readings failed during the run (None: they never did)."""
        return self.readings.error

    def start(self, devices: DeviceSet, device_info: list[GPUInfo], job_start: datetime) -> None:
        """Start measuring: the run's clock starts now."""
        from lightning_energy.measure import EnergyMeter

        self.device_info = device_info
        self.readings.meter = EnergyMeter(devices)
        self.start_s = self._clock()
        self.job_start = job_start

    def elapsed_s(self) -> float:
        """Device-clock seconds since the run started."""
        return self._clock() - self.start_s

    def now(self, *, running: bool) -> datetime:
        """The job's current time: its start plus the device-clock seconds elapsed."""
        return self.job_start + timedelta(seconds=self.elapsed_s() if running else 0.0)

    def decide(
        self, kind: str, value: float | None, reason: str, purpose: str | None = None
    ) -> None:
        """Record a decision."""
        entry: Decision = {
            "step": self.step,
            "time_s": self.elapsed_s(),
            "kind": kind,
            "purpose": purpose,
            "value": value,
            "reason": reason,
        }
        self.decisions.append(entry)
        log.debug("decision at step %d: %s=%s (%s)", self.step, kind, value, reason)

    def count_step(self) -> None:
        """Count a training step."""
        self.step += 1
        self.interval_steps += 1

    @property
    def interval_complete(self) -> bool:
        """Whether the logging interval has run its steps."""
        return self.interval_steps >= self._log_every_n_steps

    def resume(self, steps: int, energy_j: float) -> None:
        """The job resumes from a checkpoint taken after ``steps`` steps that used
        ``energy_j``: the steps count on from there, this run's own numbers stay its own."""
        self.resumed_at_step = steps - (self.step - self.resumed_at_step)
        self.step = steps
        self.energy_before_resume_j = energy_j

    def job_energy_so_far_j(self) -> float:
        """The job's energy up to now (what a checkpoint holds): the energy of the
        checkpoint resumed, of this run's closed intervals and of the open one so far."""
        m = self.readings.peek(INTERVAL)
        open_j = m.energy_j if m is not None and not m.missing else 0.0
        return self.energy_before_resume_j + self.energy_j + open_j

    def lose_metrics(self) -> None:
        """Readings failed: the last metrics no longer stand."""
        self.metrics = {}

    def abandon(self) -> None:
        """The run's setup failed: nothing is left to measure (no reading at teardown, no
        new NVML session for a job that never started)."""
        self.readings.meter = None
        self.close_node()

    # ------------------------------------------------------------------ carbon inputs
    def set_intensity(self, intensity_g_per_kwh: float | None) -> None:
        """The grid's carbon intensity from now on (None: not known)."""
        self.intensity = intensity_g_per_kwh

    def set_scale(self, scale: float) -> None:
        """The carbon pace's step-time scale from now on."""
        self.scale = scale

    def set_idle_reading(self, power_w: float) -> None:
        """The job-wide board power read before any work (the first idle estimate)."""
        self.idle_reading_w = power_w

    def set_idle_power(self, power_w: float) -> None:
        """The job-wide power a pause was measured to draw."""
        self.idle_power_w = power_w

    # ------------------------------------------------------------------ intervals
    def begin_interval(self) -> None:
        """Open the logging interval."""
        self.readings.begin(INTERVAL)

    def next_interval(
        self, power_limit_w: float | None, locked_clock_mhz: float | None
    ) -> Measurement | None:
        """Close the logging interval and open the next one."""
        m = self.close_interval(power_limit_w, locked_clock_mhz)
        self.begin_interval()
        return m

    def close_interval(
        self, power_limit_w: float | None, locked_clock_mhz: float | None
    ) -> Measurement | None:
        """Close the logging interval: metrics, timeline and carbon accounting.

        Args:
            power_limit_w: the limit in force (None: none applied).
            locked_clock_mhz: the SM clock this job locked, in force (None: none).

        Returns:
            The interval's measurement; None when the readings failed (its numbers are
            missing).
        """
        m = self.readings.end(INTERVAL)
        node = self._close_node_interval()
        steps = self.interval_steps
        if m is None:
            self.interval_steps = 0
            return None
        if not steps and m.duration_s <= 0:
            return m  # an interval in which nothing happened (e.g. closed at teardown)
        if not m.missing:  # a GPU that cannot be read: its energy is missing, not zero
            self.energy_j += m.energy_j
        self.metrics = {
            # A pause has no steps: the energy per step of the last steps still stands.
            "energy/step_j": m.energy_j / steps
            if steps
            else self.metrics.get("energy/step_j", 0.0),
            "energy/power_w": m.average_power_w,
            "energy/power_limit_w": float(power_limit_w or 0.0),
            "energy/locked_clock_mhz": float(locked_clock_mhz or 0.0),
            "energy/total_j": self.energy_before_resume_j + self.energy_j,
        }
        entry: dict[str, Any] = {
            "step": self.step,
            "time_s": self.elapsed_s(),
            "duration_s": m.duration_s,
            "steps": self.interval_steps,
            "energy_j": m.energy_j,
            "power_w": m.average_power_w,
            "power_limit_w": power_limit_w,
            "locked_clock_mhz": locked_clock_mhz,
        }
        if self.intensity is not None:
            entry.update(self._account_carbon(m.energy_j))
        if node is not None:
            node_j, node_g = node
            entry["node_energy_j"] = node_j
            self.metrics["energy/node_power_w"] = node_j / m.duration_s if m.duration_s > 0 else 0.0
            self.metrics["energy/node_total_j"] = self.node_energy_j
            if node_g is not None:
                entry["node_emissions_g"] = node_g
                self.metrics["carbon/node_emissions_g"] = self.node_emissions_g
        self.timeline.append(entry)
        self.interval_steps = 0
        self.published += 1
        return m

    # ------------------------------------------------------------------ node
    def start_node(self, meter: NodeEnergyMeter | None, info: dict[str, Any]) -> None:
        """Measure the node's CPUs and DRAM from now on.

        Args:
            meter: the node's meter (None: this rank does not measure them).
            info: the node and rank, and when there is no meter, why (the summary's base).
        """
        self.node, self.node_info = meter, info
        if meter is not None:
            meter.start()

    def _close_node_interval(self) -> tuple[float, float | None] | None:
        """The node's energy since the last interval and its grams (None: not measured
        here, or this reading failed: the energy is counted at the next one)."""
        if self.node is None:
            return None
        total_j = self.node.read_j()
        if total_j is None:
            return None
        node_j, self.node_energy_j = total_j - self.node_energy_j, total_j
        grams = None
        if self.intensity is not None:
            from carbon.accounting import emissions_g  # only jobs with a carbon: section

            grams = emissions_g(node_j, self.intensity)
            self.node_emissions_g += grams
        return node_j, grams

    def close_node(self) -> None:
        """Stop measuring the node, after a last reading (idempotent)."""
        if self.node is not None:
            self.node.close()

    def node_summary(self) -> dict[str, Any] | None:
        """The node's CPUs and DRAM as measured here, or why not (None: never started)."""
        if self.node_info is None:
            return None
        return {**self.node_info, **(self.node.summary() if self.node is not None else {})}

    # ------------------------------------------------------------------ carbon
    def _account_carbon(self, energy_j: float) -> dict[str, float | None]:
        """Grams emitted during the interval just closed, at the intensity then in force."""
        from carbon.accounting import emissions_g  # only jobs with a carbon: section need it

        assert self.intensity is not None
        grams = emissions_g(energy_j, self.intensity)
        self.emissions_g += grams
        self.metrics["carbon/intensity_g_per_kwh"] = self.intensity
        self.metrics["carbon/emissions_g"] = self.emissions_g
        if self.scale is not None:
            self.metrics["carbon/scale"] = self.scale
        return {
            "intensity_g_per_kwh": self.intensity,
            "emissions_g": grams,
            "scale": self.scale,
        }

    def start_baselines(
        self, power_limit_w: float | None, locked_clock_mhz: float | None, now: datetime
    ) -> None:
        """The profile is complete: measure the steps that run at its choice from here.

        The logging interval closes here, so the grams before the carbon baselines are
        those of whole intervals and the baselines cover exactly the steps after it.

        Args:
            power_limit_w: the limit in force until the choice applies.
            locked_clock_mhz: the lock in force until the choice applies (None: none).
            now: the job's current time.
        """
        if self.readings.is_open(INTERVAL):
            self.next_interval(power_limit_w, locked_clock_mhz)
        self.profile_end = (now, self.step, self.emissions_g)
        self.readings.cancel(AFTER_PROFILE)
        self.readings.begin(AFTER_PROFILE)

    def forget_baselines(self) -> None:
        """A new workload: its own profile starts its own baselines."""
        self.profile_end = None
        self.scale = None  # the carbon pace applies afresh to the new workload's profile
        self.readings.cancel(AFTER_PROFILE)

    def carbon_summary(
        self,
        pacer: CarbonPacer | None,
        profile: Profile,
        static_limit_w: float | None,
        world_size: int,
        now: datetime,
    ) -> dict[str, Any]:
        """Grams emitted; on rank 0 (the pacer's) also the baselines and the deadline.

        Args:
            pacer: rank 0's carbon pacer (None elsewhere).
            profile: the measured profile of the workload.
            static_limit_w: the selector's own choice (carbon-unaware).
            world_size: ranks of the job (the profile is job-wide).
            now: the job's current time.
        """
        carbon: dict[str, Any] = {"emissions_g": self.emissions_g}
        if self.node is not None:
            carbon["node_emissions_g"] = self.node_emissions_g
            carbon["total_emissions_g"] = self.emissions_g + self.node_emissions_g
        if pacer is None:
            return carbon
        carbon.update(pacer.summary(now))
        if self.profile_end is None or static_limit_w not in profile:
            return carbon
        when, step, grams_before = self.profile_end
        steps = max(self.step - step, 0)
        carbon["baselines_from_step"] = step
        carbon["baselines_from_s"] = (when - self.job_start).total_seconds()
        carbon["baselines_steps"] = steps
        carbon["emissions_before_baselines_g"] = grams_before
        baselines = {}
        for name, limit in (("carbon_unaware", static_limit_w), ("full_power", max(profile))):
            t, e = profile[limit]
            series = pacer.emissions_at_pace(when, steps, t, e / world_size)
            kept = series[:: max(steps // 200, 1)]
            if series and kept[-1] != series[-1]:
                kept.append(series[-1])  # the plotted series ends at the total
            baselines[name] = [(s, grams_before + g) for s, g in kept]
            carbon[f"{name}_emissions_g"] = grams_before + (series[-1][1] if series else 0.0)
            if pacer.deadline is not None:
                finish = when + timedelta(seconds=steps * t)
                carbon[f"{name}_meets_deadline"] = finish <= pacer.deadline
        carbon["baselines"] = baselines
        return carbon

    # ------------------------------------------------------------------ end
    def close(
        self, power_limit_w: float | None, locked_clock_mhz: float | None, *, stop_clock: bool
    ) -> None:
        """Close the open windows (what can still be read) and stop the run's clock.

        A failed reading (e.g. a sticky CUDA error) is recorded, not raised: the GPUs are
        restored already and the summary leaves the missing numbers out.

        Args:
            power_limit_w: the limit in force.
            locked_clock_mhz: the lock in force (None: none).
            stop_clock: whether the devices are there to read the end time from.
        """
        self.after_profile = None
        try:
            self.after_profile = self.readings.end(AFTER_PROFILE)
            if self.readings.is_open(INTERVAL):
                self.close_interval(power_limit_w, locked_clock_mhz)
            if stop_clock:
                self.end_s = self._clock()
        except Exception as exc:
            self.fail(exc)

    def fail(self, exc: Exception) -> None:
        """A reading at the end of the run failed: record it, keep what was measured."""
        self.readings.error = self.readings.error or str(exc)
        log.warning("the last GPU reading failed (%s); the summary leaves it out", exc)

    def build_summary(
        self,
        *,
        power_limit_w: float | None,
        pre_job_power_limit_w: float | None,
        observe_only: bool,
        profile: Profile,
        progress: tuple[bool, int, int] | None,
        world_size: int,
        carbon: dict[str, Any] | None,
        knob: str = "power_limit",
        locked_clock_mhz: float | None = None,
    ) -> RunSummary:
        """The run summary (kept in :attr:`summary`).

        Args:
            power_limit_w: the limit chosen and in force at the end (None: none chosen).
            pre_job_power_limit_w: the first GPU's limit before the job.
            observe_only: whether GPU settings could not be changed.
            profile: the measured profile of the workload (job-wide numbers).
            progress: the profile's ``(complete, limits measured, candidates)``; None when
                the run profiled nothing.
            world_size: ranks of the job.
            carbon: the carbon summary (None without a ``carbon:`` section).
            knob: the setting knob the run profiled (``power_limit`` or ``locked_clock``).
            locked_clock_mhz: the clock the choice locked, in force at the end (None: none).
        """
        duration_s = (self.end_s or self.start_s) - self.start_s
        saved_j, slowdown = 0.0, 1.0
        after = self.after_profile
        if profile and after is not None and self.profile_end is not None:
            # Every step after profiling, measured, against the same steps at the highest
            # profiled limit (this process's share of the job-wide profile).
            steps = self.step - self.profile_end[1]
            t_top, e_top = profile[max(profile)]
            if steps > 0:
                saved_j = steps * e_top / world_size - after.energy_j
                slowdown = after.duration_s / (steps * t_top)
        self.summary = RunSummary(
            steps=self.step - self.resumed_at_step,
            energy_j=self.energy_j,
            duration_s=duration_s,
            power_limit_w=power_limit_w,
            pre_job_power_limit_w=pre_job_power_limit_w,
            energy_saved_j=saved_j,
            slowdown=slowdown,
            observe_only=observe_only,
            carbon=carbon,
            read_error=self.read_error,
            profile_complete=None if progress is None else progress[0],
            power_limits_measured=0 if progress is None else progress[1],
            power_limit_candidates=0 if progress is None else progress[2],
            power_limits_applied=len(
                {d["value"] for d in self.decisions if d["kind"] == "power_limit"}
            ),
            knob=knob,
            locked_clock_mhz=locked_clock_mhz,
            resumed_at_step=self.resumed_at_step,
            energy_before_resume_j=self.energy_before_resume_j,
            node_energy=self.node_summary(),
            energy_counted=self._energy_counted(),
        )
        return self.summary

    def _energy_counted(self) -> str | None:
        node = self.node_summary()
        if node is None:
            return None
        if node.get("measured_by") is not None:
            return f"GPUs (this node's CPUs and DRAM: rank {node['measured_by']}'s)"
        from lightning_energy.node_energy import energy_counted

        return energy_counted([node])

    def keep_job_totals(self, job: dict[str, Any], summary: RunSummary) -> None:
        """Keep the job's totals (:func:`~.job_plan.job_totals` of every rank's
        :meth:`own_totals`) in :attr:`job` and in ``summary``, the run's summary from now on."""
        self.job = job
        self.summary = replace(
            summary,
            job_energy_j=job["energy_j"],
            job_node_energy_j=job.get("node_energy_j"),
            energy_counted=job.get("counted", summary.energy_counted),
        )

    def own_totals(self, rank: int, node: str, counted: bool) -> dict[str, Any]:
        """This rank's numbers, as compared with the other ranks' at the end of a run."""
        assert self.summary is not None
        carbon = self.summary.carbon or {}
        return {
            "rank": rank,
            "node": node,
            "counted": counted,
            "observe_only": self.summary.observe_only,
            "gpus": [{"uuid": g.uuid, "name": g.name, "index": g.index} for g in self.device_info],
            "steps": self.summary.steps,
            "energy_j": self.summary.energy_j,
            "energy_saved_j": self.summary.energy_saved_j,
            "emissions_g": carbon.get("emissions_g"),
            "node_energy": self.summary.node_energy,
            "node_emissions_g": carbon.get("node_emissions_g"),
        }
