"""EnergyController: the one object every framework adapter talks to.

Adapters translate their framework's hooks into a handful of calls::

    controller = EnergyController(config)
    controller.setup()                       # opens GPUs, takes the guard's lease
    for step in training:
        controller.on_step_start()
        ...                                  # the user's training step
        controller.on_step_end()
    controller.interrupt("validation")       # a window must not span validation
    controller.teardown()                    # restores every GPU first, then summarises
    controller.setup()                       # another run (a second fit), profiles kept

What happens in between: the power-limit optimizer (``optimize.power_limit``) hands out
profiling windows (a power limit, steps to settle, steps to measure); the controller applies
the limit through the guard, measures the window with ``measure.EnergyMeter``, aggregates it
over ranks (energy summed over every GPU of the job, time of the slowest rank) and reports
it back. Once the profile is complete the chosen limit stays applied. With a ``carbon:``
section, rank 0 polls the grid in the background and the pacing policy turns intensity into
a target time per step; the decision is broadcast at fixed step boundaries and the optimizer
re-selects the least-energy limit meeting it, without profiling again.

Every rank makes the same calls at the same steps, so collectives never mismatch.
"""

from __future__ import annotations

import contextlib
import logging
import math
import select
import socket
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from carbon.accounting import emissions_g
from lightning_energy.collectives import Collective, default_collective
from lightning_energy.config import EnergyConfig
from lightning_energy.device.base import DeviceSet, GPUInfo, gpu_info
from lightning_energy.errors import (
    CheckpointMismatchError,
    ConfigError,
    DeviceError,
    EnergyError,
    JobSetupError,
)
from lightning_energy.job import (
    Capability,
    JobPlan,
    RankInfo,
    agree,
    describe_shared,
    job_totals,
    node_name,
    shared_gpus,
)
from lightning_energy.measure import EnergyMeter, Measurement
from lightning_energy.pacing import CarbonPacer, PaceUpdate, utc_now

if TYPE_CHECKING:
    import torch

__all__ = ["EnergyController", "RunSummary"]

log = logging.getLogger(__name__)

_WINDOW = "profile-window"
_INTERVAL = "log-interval"
_AFTER_PROFILE = "after-profile"
_STATE_VERSION = 1
# Assumed power of an idle GPU, as a share of the least-power measured point, until a
# pause measures it (used only to weigh pausing against slow running).
_IDLE_SHARE = 0.15


@dataclass(frozen=True)
class RunSummary:
    """What a run used and saved.

    Attributes:
        steps: training steps seen.
        energy_j: energy used by this process's GPUs.
        duration_s: device-clock time from setup to teardown.
        power_limit_w: the power limit in force at the end (None: never changed).
        pre_job_power_limit_w: the limit each GPU had before the job.
        energy_saved_j: energy measured over the steps after profiling, subtracted from
            the same steps at the highest profiled limit (per the measured profile; 0
            before the profile completes).
        slowdown: the time those steps took over their time at the highest profiled
            limit (pauses included).
        observe_only: True when GPU settings could not be changed.
        read_error: why GPU readings failed during the run (None: they never did); the
            energy from then on is missing and the settings were restored at that point.
        carbon: with a ``carbon:`` section: grams emitted by this process's GPUs; on rank 0
            also the same job run carbon-unaware (the selector's limit, no pacing) and at
            full power, from the end of profiling on the intensities observed (cumulative
            series in ``baselines``), and the deadline and whether it was met.
        job_energy_j: energy used by every GPU of the job, each counted once (None until
            the ranks have compared numbers at the end of a run; ``energy_j`` is this
            process's own share).
    """

    steps: int
    energy_j: float
    duration_s: float
    power_limit_w: float | None
    pre_job_power_limit_w: float | None
    energy_saved_j: float
    slowdown: float
    observe_only: bool
    carbon: dict[str, Any] | None = None
    job_energy_j: float | None = None
    read_error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain data for logs and reports."""
        return asdict(self)


class EnergyController:
    """Drives power-limit optimisation (and carbon-aware pacing) from step events.

    Args:
        config: the configuration (default: all defaults, simulated GPU when none).
        devices: the GPUs to drive (default: opened from ``config.device`` in ``setup``).
        collective: how ranks agree (default: ``torch.distributed`` when initialised).
        local_rank: which local GPU this process drives when opening devices, when
            ``device`` is not a CUDA device.
        node_rank: the framework's node rank (None: from the launcher's environment); it
            names this process's node in reports and sets simulated GPUs apart per node.
        device: the framework's root device; a CUDA device is matched to its GPU by UUID
            (see :mod:`lightning_energy.device.mapping`).
        install_signal_handlers: restore GPUs on SIGTERM/SIGINT too (main thread only).
    """

    def __init__(
        self,
        config: EnergyConfig | None = None,
        *,
        devices: DeviceSet | None = None,
        collective: Collective | None = None,
        local_rank: int = 0,
        node_rank: int | None = None,
        device: torch.device | None = None,
        install_signal_handlers: bool = True,
    ) -> None:
        self.config = config or EnergyConfig()
        self._selector = self.config.power_limit.make_selector()
        self._devices = devices
        self._owns_devices = False
        self._collective = collective
        self._local_rank = local_rank
        self._node_rank = node_rank
        self._node = node_name(node_rank)
        self._device = device
        self._install_signal_handlers = install_signal_handlers
        self._optimizers: dict[str, Any] = {}
        self._workload = "default"
        self._restored_states: dict[str, Any] = {}
        self._devices_closed = False
        self._is_setup = False
        self._torn_down = False
        self._total_steps: int | None = None
        self._new_run()

    def _new_run(self) -> None:
        """Forget the previous run (fit): its guard, windows, numbers and decisions.

        What was learnt about the workloads (their profiles) is kept, so a later fit of a
        known workload applies its choice without profiling again.
        """
        self._guard: Any = None
        self._meter: EnergyMeter | None = None
        self._read_error: str | None = None
        self._ranks: list[RankInfo] = []
        self._plan = JobPlan(True, (), None)
        self._counts_energy = True
        self.job: dict[str, Any] | None = None
        self._wake: socket.socket | None = None
        self._stopped_profiling = False
        self._window: Any = None
        self._window_steps = 0
        self._window_steps_run = 0
        self._measuring = False
        self._interval_steps = 0
        self._power_limit_w: float | None = None
        self._step = 0
        self._energy_j = 0.0
        self._start_s = 0.0
        self._end_s: float | None = None
        self._summary: RunSummary | None = None
        self._pacer: CarbonPacer | None = None
        self._job_start = utc_now()
        self._static_limit_w: float | None = None
        self._intensity: float | None = None
        self._scale: float | None = None
        self._emissions_g = 0.0
        self._profile_end: tuple[datetime, int, float] | None = None
        self._after_profile: Measurement | None = None
        self._zero_energy_warned = False
        self._enforced_limit_w: float | None = None
        self._idle_power_w: float | None = None
        self.metrics: dict[str, float] = {}
        self.timeline: list[dict[str, Any]] = []
        self.device_info: list[GPUInfo] = []
        self.decisions: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ lifecycle
    @property
    def devices(self) -> DeviceSet:
        """The GPUs driven by this process (opened on first use)."""
        if self._devices is None:
            self._devices = self._open_devices()
        return self._devices

    @property
    def collective(self) -> Collective:
        """How ranks agree (resolved on first use, once the process group exists)."""
        if self._collective is None:
            self._collective = default_collective()
        return self._collective

    def setup(self, *, collective: Collective | None = None) -> None:
        """Open the GPUs, take their lease and start measuring a run. Idempotent.

        After :meth:`teardown`, ``setup`` starts a new run (a second ``fit``): a new lease
        and fresh numbers; a workload profiled by an earlier run gets its chosen limit
        at once, without profiling again.

        Args:
            collective: how ranks agree from this run on (a new trainer's); None: keep.

        Raises:
            ConfigError: candidate power limits outside every GPU's allowed range.
            EnergyError: in strict mode, when the GPUs cannot be controlled.
        """
        if self._is_setup:
            return
        from lightning_energy.device.guard import GPUGuard

        if self._torn_down:
            self._new_run()
            self._torn_down = False
            if self._owns_devices and self._devices_closed:
                self._devices = None  # reopened below: closing released them
        if collective is not None:
            self._collective = collective
        devices = self.devices
        self._devices_closed = False
        self._check_candidates()
        self._guard = GPUGuard(
            devices.gpus,
            lease_dir=self.config.device.lease_dir,
            strict=self.config.strict,
            install_signal_handlers=self._install_signal_handlers,
        )
        try:
            self._agree(devices)
            self._guard.add_signal_listener(self._on_signal)
            self._start(devices)
        except BaseException:
            self._guard.restore()  # nothing may stay changed, nor leased, after a failed setup
            if self._pacer is not None:
                self._pacer.stop()
            # Teardown has nothing left to measure or restore: no second lease, no new
            # NVML session for a job that never started.
            self._guard = self._meter = None
            if self._owns_devices and self._devices is not None:
                self._devices.close()
                self._devices = None
            raise
        self._is_setup = True
        if self._guard.observe_only:
            self._decide("observe-only", None, self._guard.observe_only_reason or "")
            return
        optimizer = self._optimizers.get(self._workload)
        if optimizer is not None and optimizer.done:
            self._use_profile(
                optimizer.chosen_power_limit_w, f"reuse profile of workload {self._workload}"
            )

    def _agree(self, devices: DeviceSet) -> None:
        """Take the lease and find out, with every rank, who optimises (one job, one plan).

        Two collectives: which GPUs each rank opened (a GPU opened by two ranks is driven
        and measured by the lower one only), then whether each rank can change its GPUs.
        In strict mode a rank that cannot makes every rank raise the same error, so no rank
        is left waiting in a collective.
        """
        collective = self.collective
        single = collective.world_size == 1
        me = RankInfo(collective.rank, self._node, tuple(g.uuid for g in devices.gpus))
        self._ranks = (
            [me]
            if single
            else [RankInfo.from_dict(r) for r in collective.all_gather_object(me.to_dict())]
        )
        shared = shared_gpus(self._ranks, collective.rank)
        if shared:
            self._counts_energy = False
            self._guard.observe(describe_shared(shared, self._ranks))
        failure: str | None = None
        try:
            self._guard.acquire()
            self._probe_permission(devices)
        except EnergyError as exc:
            if single:
                raise
            failure = str(exc)
        if single:
            return
        reason = failure or self._guard.observe_only_reason
        mine = Capability(collective.rank, reason is None, reason)
        self._plan = agree(
            [Capability.from_dict(c) for c in collective.all_gather_object(mine.to_dict())]
        )
        if self._plan.message is None:
            return
        if self.config.strict:
            raise JobSetupError(self._plan.message)
        if collective.rank == 0:
            log.warning("%s.", self._plan.message)

    def _probe_permission(self, devices: DeviceSet) -> None:
        """Find out now, before training, whether settings may be changed.

        Setting every GPU to its own pre-job limit changes nothing (the guard clamps to it)
        but fails without permission (observe-only, or an error in strict mode).
        """
        if self.config.power_limit.enabled and not self._guard.observe_only:
            pre = [self._guard.pre_job_power_limit_w(i) for i in range(len(devices))]
            self._guard.set_power_limit_w(max(pre))

    def _start(self, devices: DeviceSet) -> None:
        self.device_info = [gpu_info(g) for g in devices.gpus]
        self._meter = EnergyMeter(devices)
        self._start_s = devices.clock()
        if self.config.power_limit.enabled and not self._guard.observe_only:
            self._enforced_limit_w = self._board_limiter_w()
        simulated = devices.backend == "simulated"
        self._job_start = (simulated and self.config.device.start_time()) or utc_now()
        if self.config.carbon is not None:
            # Rank 0 polls the grid; every rank learns the first intensity, or rank 0's
            # configuration problem, so no rank is left waiting in a collective.
            first: float | list[str] | None = None
            if self.collective.rank == 0:
                first = self._start_pacer(self.config.carbon, simulated)
            first = self.collective.broadcast(first)
            if isinstance(first, list):
                raise ConfigError(first, self.config.source)
            self._intensity = first
        self._begin(_INTERVAL)

    def _start_pacer(self, config: Any, simulated: bool) -> float | list[str]:
        """Rank 0: start polling; the first intensity, or the configuration problems."""
        from carbon.errors import CarbonConfigError

        try:
            pacer = CarbonPacer(config, now=self.now, virtual_clock=simulated)
        except CarbonConfigError as exc:
            return [f"carbon.{p}" for p in exc.problems]
        self._pacer = pacer
        pacer.start()
        return pacer.intensity_g_per_kwh()

    def _board_limiter_w(self) -> float | None:
        """The limit a board or rack limiter enforces below the pre-job limits, or None.

        Read at setup, while every GPU still has its pre-job limit: later the enforced
        limit also follows the limits this job sets.
        """
        pre = min(self._guard.pre_job_power_limit_w(i) for i in range(len(self.devices)))
        try:
            enforced = min(g.enforced_power_limit_w() for g in self.devices.gpus)
        except DeviceError:
            return None
        if not enforced < pre:
            return None
        reason = (
            f"the GPU enforces {enforced:g} W, below its {pre:g} W limit (a board or rack "
            "power limiter): candidate limits above it are capped at it"
        )
        log.warning("Power limits: %s.", reason)
        self._decide("enforced_power_limit", enforced, reason)
        return enforced

    def _open_devices(self) -> DeviceSet:
        from lightning_energy.device import open_devices

        dev = self.config.device
        spec = dev.simulated_spec()
        node = self._node_rank or 0
        if node:
            # Simulated GPUs of different nodes are different GPUs, as real ones are.
            spec = replace(
                spec, seed=spec.seed + 1000 * node, uuid_prefix=f"GPU-sim-{spec.label}-n{node}"
            )
        self._owns_devices = True
        return open_devices(
            dev.backend,
            simulated=replace(spec, seed=spec.seed + self._local_rank),
            local_rank=self._local_rank,
            device=self._device,
        )

    def _check_candidates(self) -> None:
        section = self.config.power_limit
        if section.power_limits_w is None:
            return
        problems = []
        for gpu in self.devices.gpus:
            try:
                lo, hi = gpu.power_limit_constraints_w()
            except DeviceError:
                continue  # no power management, or lost: the guard runs observe-only
            bad = [p for p in section.power_limits_w if not lo <= p <= hi]
            if bad:
                problems.append(
                    f"power_limit.power_limits_w: {bad} outside the allowed range "
                    f"{lo:g}-{hi:g} W of GPU {gpu.index} ({gpu.name})"
                )
        if problems:
            raise ConfigError(problems, self.config.source)

    def teardown(self) -> RunSummary:
        """Restore every GPU, then stop measuring and return the run summary. Idempotent.

        The GPUs are restored first, whatever happens next: a failed energy reading, a
        sticky device error or a carbon API that does not answer cannot delay or skip it.
        The carbon poller is stopped without waiting for a poll in flight.
        """
        if self._summary is not None and self._torn_down:
            return self._summary
        self._torn_down = True
        try:
            if self._guard is not None:
                self._guard.restore()
        finally:
            if self._pacer is not None:
                self._pacer.stop()
            self._summary = self._final_summary()
            if self._owns_devices and self._devices is not None:
                self._devices.close()
                self._devices_closed = True
            self._is_setup = False
        return self._summary

    def handle_signals(self) -> None:
        """Restore on SIGTERM/SIGINT from now on, then hand the signal to the handler found.

        For adapters whose framework installs its own handler once training starts (a
        controller built with ``install_signal_handlers=False``): called after that, the
        GPUs are restored the moment the signal arrives, mid-step or mid-pause, and the
        framework still handles the signal its own way.
        """
        if self._guard is not None:
            self._guard.handle_signals()

    def _on_signal(self, signum: int) -> None:
        """In the signal handler, after the restore: end a carbon pause at once."""
        wake = self._wake
        if wake is not None:
            with contextlib.suppress(OSError):
                wake.send(b"\0")

    def _final_summary(self) -> RunSummary:
        """Close the open windows (what can still be read) and build the summary."""
        self._after_profile = None
        try:
            self.interrupt("end of the run")  # a window cut short is measured by a later run
            if self._meter is not None:
                self._after_profile = self._end(_AFTER_PROFILE)
                if self._meter.is_open(_INTERVAL):
                    self._close_interval()
            if self._devices is not None:
                self._end_s = self._devices.clock()
        except Exception as exc:  # e.g. a sticky CUDA error: the GPUs are restored already
            self._read_error = self._read_error or str(exc)
            log.warning("the last GPU reading failed (%s); the summary leaves it out", exc)
        return self._build_summary()

    def _begin(self, name: str) -> None:
        """Open a measurement window, unless readings were lost."""
        if self._meter is None or self._read_error is not None:
            return
        try:
            self._meter.begin(name)
        except DeviceError as exc:
            self._lose_readings(exc)
            return
        self._check_readings()

    def _end(self, name: str) -> Measurement | None:
        """Close a measurement window; None when it is not open or the reading failed."""
        if self._meter is None or not self._meter.is_open(name):
            return None
        try:
            m = self._meter.end(name)
        except DeviceError as exc:
            self._lose_readings(exc)
            return None
        return None if self._check_readings() else m

    def _peek(self, name: str) -> Measurement | None:
        """What a window measured so far; None when it is not open or the reading failed."""
        if self._meter is None or not self._meter.is_open(name):
            return None
        try:
            m = self._meter.peek(name)
        except DeviceError as exc:
            self._lose_readings(exc)
            return None
        return None if self._check_readings() else m

    def _check_readings(self) -> bool:
        """Whether readings are lost: a GPU the meter could not read (its energy is NaN)
        or synchronise counts as a failed reading, as a raised error does."""
        assert self._meter is not None
        error = self._meter.last_error
        if error is not None and self._read_error is None:
            self._lose_readings(error)
        return self._read_error is not None

    def _lose_readings(self, exc: DeviceError) -> None:
        """A GPU reading failed mid-run: restore, change nothing more, keep training
        (observe-only; strict mode raises)."""
        self._read_error = str(exc)
        assert self._meter is not None
        for name in (_WINDOW, _INTERVAL, _AFTER_PROFILE):
            self._meter.cancel(name)
        self.metrics = {}
        log.warning(
            "reading the GPUs failed (%s): energy metrics are missing for the rest of this "
            "run, GPU settings were restored and are left alone; training continues",
            exc,
        )
        if self._guard is not None:
            self._guard.stop_changes(f"a GPU failed mid-run ({exc})", exc)

    # ------------------------------------------------------------------ workloads
    def set_workload(self, key: str) -> None:
        """Declare what is being trained (e.g. batch size and model size).

        A new key starts a new profile (or resumes the one saved for it), so a change of
        batch size or model is profiled again; returning to a known key reuses its profile.
        """
        if key == self._workload:
            return
        self.interrupt("workload change")
        self._workload = key
        self._profile_end = None
        self._scale = None  # the carbon pace applies afresh to the new workload's profile
        if self._meter is not None:
            self._meter.cancel(_AFTER_PROFILE)
        optimizer = self._optimizers.get(key)
        if optimizer is not None and optimizer.done:
            self._use_profile(optimizer.chosen_power_limit_w, f"reuse profile of workload {key}")

    def _optimizer(self) -> Any:
        optimizer = self._optimizers.get(self._workload)
        if optimizer is None:
            from lightning_energy.optimize.power_limit import PowerLimitOptimizer

            section = self.config.power_limit
            lo, hi = self._power_limit_range()
            # The Zeus cost weighs time by the highest power limit of the GPUs (x every
            # GPU of the job), not the highest candidate.
            top_w = min(g.power_limit_constraints_w()[1] for g in self.devices.gpus)
            # Every rank sizes its windows alike: by the slowest energy counter of the job.
            period = max(g.energy_counter_period_s() for g in self.devices.gpus)
            _, (period,) = self.collective.sum_and_max([], [period])
            candidates = section.candidates_w(lo, hi)
            if self._enforced_limit_w is not None:  # above it, limits do not differ
                candidates = [min(c, self._enforced_limit_w) for c in candidates]
            optimizer = PowerLimitOptimizer(
                candidates,
                self._selector,
                max_power_limit_w=top_w,
                num_gpus=len(self.devices) * self.collective.world_size,
                warmup_steps=section.warmup_steps,
                settle_steps=section.settle_steps,
                seed=self.config.device.seed,
                counter_period_s=period,
            )
            saved = self._restored_states.pop(self._workload, None)
            if saved is not None:
                optimizer.load_state_dict(saved)
            self._optimizers[self._workload] = optimizer
        return optimizer

    def _power_limit_range(self) -> tuple[float, float]:
        """The range every local GPU accepts, capped at the lowest pre-job limit and at a
        board or rack limiter below it."""
        los, his = zip(*(g.power_limit_constraints_w() for g in self.devices.gpus), strict=True)
        pre = [self._guard.pre_job_power_limit_w(i) for i in range(len(self.devices))]
        enforced = [] if self._enforced_limit_w is None else [self._enforced_limit_w]
        return max(los), min(*his, *pre, *enforced)

    # ------------------------------------------------------------------ steps
    def on_step_start(self) -> None:
        """Call before every training (optimizer) step (after :meth:`teardown`: ignored
        until :meth:`setup` starts another run)."""
        if not self._is_setup:
            if self._torn_down:
                return
            self.setup()
        if self._window is None and self._optimizing():
            self._open_window()
        window = self._window
        if (
            window is not None
            and not self._measuring
            and window.measure_steps
            and self._window_steps >= window.settle_steps
        ):
            self._begin(_WINDOW)
            self._measuring = True
            self._window_steps = 0

    def on_step_end(self) -> None:
        """Call after every training (optimizer) step."""
        if not self._is_setup:
            return
        run_step = self.devices.run_step
        if run_step is not None:
            run_step()
        self._step += 1
        self._interval_steps += 1
        if self._window is not None:
            self._window_steps += 1
            self._window_steps_run += 1
            if self._measuring and self._window_steps >= self._window.measure_steps:
                self._close_window()
            elif (
                not self._measuring
                and not self._window.measure_steps
                and self._window_steps >= self._window.settle_steps
            ):
                self._optimizer().report(self._window, time_per_step_s=0.0, energy_per_step_j=0.0)
                self._window = None
        if self._interval_steps >= self.config.log_every_n_steps:
            self._next_interval()
            if self.config.carbon is not None:
                self._pace()

    def interrupt(self, reason: str) -> None:
        """Discard the profiling window in progress (validation, epoch end, workload change).

        The optimizer retries that power limit afterwards. Every rank must call it at the
        same point (framework hooks guarantee this).
        """
        if self._window is None:
            return
        if self._meter is not None:
            self._meter.cancel(_WINDOW)
        self._optimizer().report_interrupted(self._window, steps_run=self._window_steps_run)
        log.debug("profiling window at %.0f W discarded: %s", self._window.power_limit_w, reason)
        self._window = None
        self._measuring = False
        self._window_steps = 0

    def _optimizing(self) -> bool:
        if not self.config.power_limit.enabled or not self._job_changes_settings():
            return False
        if self._stopped_profiling:
            return False
        return not self._optimizer().done

    def _job_changes_settings(self) -> bool:
        """Whether the job profiles and paces: one decision for all ranks, since every rank
        makes the same collective calls (an observing rank takes part, changing nothing);
        a single process decides by its own guard."""
        if self.collective.world_size > 1:
            return self._plan.optimises
        return not (self._guard.observe_only or self._guard.restored)

    def _open_window(self) -> None:
        optimizer = self._optimizer()
        window = optimizer.next_window()
        if window is None:
            self._finish_profile(optimizer)
            return
        self._window = window
        self._window_steps = 0
        self._window_steps_run = 0
        self._measuring = False
        self._apply(window.power_limit_w, f"{window.purpose} window", purpose="profile")

    def _close_window(self) -> None:
        """Report the window once it is long enough; it goes on while it is too short for
        the energy counter (or read no energy yet). Every rank decides on the job-wide sums:
        a rank whose readings failed sends NaN, so every rank learns it in this collective;
        a rank observing a GPU that a lower rank measures sends 0 (each GPU counted once)."""
        assert self._window is not None
        m = self._peek(_WINDOW)
        if m is None:
            energy_j, duration_s = math.nan, math.nan
        else:
            energy_j = m.energy_j if self._counts_energy else 0.0
            duration_s = m.duration_s
        (energy_j,), (duration_s,) = self.collective.sum_and_max([energy_j], [duration_s])
        if math.isnan(energy_j):
            self._device_fault()
            return
        if duration_s < self._window.min_duration_s:
            return
        if energy_j <= 0:
            if not self._zero_energy_warned:
                self._zero_energy_warned = True
                log.warning(
                    "A %.3f s profiling window read no energy (the GPU energy counter has not "
                    "moved yet): measuring on until it does.",
                    duration_s,
                )
            return
        assert self._meter is not None
        self._meter.cancel(_WINDOW)
        steps = self._window_steps
        optimizer = self._optimizer()
        optimizer.report(
            self._window,
            time_per_step_s=duration_s / steps,
            energy_per_step_j=energy_j / steps,
            steps=steps,
        )
        self._window = None
        self._measuring = False
        if optimizer.done:
            self._finish_profile(optimizer)

    def _device_fault(self) -> None:
        """A GPU stopped answering in a profiling window (every rank sees the job-wide NaN):
        restore what can be restored now and only observe for the rest of the run; the
        window is measured again by a later run."""
        assert self._window is not None
        self._optimizer().report_interrupted(self._window, steps_run=self._window_steps_run)
        if self._meter is not None:
            self._meter.cancel(_WINDOW)
        self._window = None
        self._measuring = False
        self._stopped_profiling = True
        error = (self._meter.last_error if self._meter else None) or DeviceError(
            self._read_error or "a GPU stopped answering"
        )
        self._guard.stop_changes(f"a GPU failed mid-run ({error})", error)
        self._decide("observe-only", None, self._guard.observe_only_reason or str(error))

    def _finish_profile(self, optimizer: Any) -> None:
        chosen = self.collective.broadcast(optimizer.chosen_power_limit_w)
        reason = f"profile complete; selector {self._selector.describe()}"
        profile = self._profile_by_limit()
        if chosen in profile:
            top_w = max(profile)
            (t, e), (t_top, e_top) = profile[chosen], profile[top_w]
            log.info(
                "power-limit profile complete after %d steps: %.0f W chosen by the %s "
                "selector (%.1f %% less energy and %+.1f %% time per step than %.0f W)",
                self._step,
                chosen,
                self._selector.describe(),
                100.0 * (1.0 - e / e_top),
                100.0 * (t / t_top - 1.0),
                top_w,
            )
        self._use_profile(chosen, reason)

    def _use_profile(self, chosen: float | None, reason: str) -> None:
        """Apply the profile's choice and start measuring the steps that run at it.

        The logging interval closes here, so the grams before the carbon baselines are
        those of whole intervals and the baselines cover exactly the steps after it.
        """
        self._static_limit_w = chosen
        if self._meter is not None and self._meter.is_open(_INTERVAL):
            self._next_interval()
        self._profile_end = (self.now(), self._step, self._emissions_g)
        if self._meter is not None:
            self._meter.cancel(_AFTER_PROFILE)
        self._begin(_AFTER_PROFILE)
        self._apply(chosen, reason)

    def _apply(self, power_limit_w: float | None, reason: str, purpose: str = "choice") -> None:
        """Set the power limit on every local GPU and record why.

        ``purpose`` tells reports what the change was for: ``profile`` (a profiling
        window), ``choice`` (the optimizer's or the carbon pace's limit), ``pause`` or
        ``resume``. Every decision is recorded, also one that keeps the limit already
        set (the GPU is then left alone).
        """
        if power_limit_w is None:
            return
        applied = self._power_limit_w
        if power_limit_w != applied:
            applied = self._guard.set_power_limit_w(power_limit_w)
        if self._guard.observe_only or self._guard.restored:
            return
        self._power_limit_w = applied
        self._decide("power_limit", applied, reason, purpose)

    def _decide(
        self, kind: str, value: float | None, reason: str, purpose: str | None = None
    ) -> None:
        entry = {
            "step": self._step,
            "time_s": self.devices.clock() - self._start_s,
            "kind": kind,
            "purpose": purpose,
            "value": value,
            "reason": reason,
        }
        self.decisions.append(entry)
        log.debug("decision at step %d: %s=%s (%s)", self._step, kind, value, reason)

    def _next_interval(self) -> Measurement | None:
        """Close the logging interval and open the next one."""
        m = self._close_interval()
        self._begin(_INTERVAL)
        return m

    def _close_interval(self) -> Measurement | None:
        """Close the logging interval: metrics, timeline and carbon accounting.

        Returns None when the readings failed (the interval's numbers are missing).
        """
        m = self._end(_INTERVAL)
        steps = self._interval_steps
        if m is None:
            self._interval_steps = 0
            return None
        if not steps and m.duration_s <= 0:
            return m  # an interval in which nothing happened (e.g. closed at teardown)
        if not m.missing:  # a GPU that cannot be read: its energy is missing, not zero
            self._energy_j += m.energy_j
        self.metrics = {
            # A pause has no steps: the energy per step of the last steps still stands.
            "energy/step_j": m.energy_j / steps
            if steps
            else self.metrics.get("energy/step_j", 0.0),
            "energy/power_w": m.average_power_w,
            "energy/power_limit_w": float(self.current_power_limit_w() or 0.0),
            "energy/total_j": self._energy_j,
        }
        entry: dict[str, Any] = {
            "step": self._step,
            "time_s": self.devices.clock() - self._start_s,
            "duration_s": m.duration_s,
            "steps": self._interval_steps,
            "energy_j": m.energy_j,
            "power_w": m.average_power_w,
            "power_limit_w": self.current_power_limit_w(),
        }
        if self._intensity is not None:
            entry.update(self._account_carbon(m.energy_j))
        self.timeline.append(entry)
        self._interval_steps = 0
        return m

    # ------------------------------------------------------------------ carbon
    def now(self) -> datetime:
        """The job's current time: its start plus the device-clock seconds elapsed.

        On a real GPU this is the wall clock; on a simulated GPU it follows the virtual
        clock, so carbon traces replay at the simulated job's speed.
        """
        elapsed_s = self.devices.clock() - self._start_s if self._is_setup else 0.0
        return self._job_start + timedelta(seconds=elapsed_s)

    def set_total_steps(self, total_steps: int | None) -> None:
        """Declare how many training steps the job will run (carbon pacing needs it)."""
        self._total_steps = total_steps

    def _account_carbon(self, energy_j: float) -> dict[str, float | None]:
        """Grams emitted during the interval just closed, at the intensity then in force."""
        assert self._intensity is not None
        grams = emissions_g(energy_j, self._intensity)
        self._emissions_g += grams
        self.metrics["carbon/intensity_g_per_kwh"] = self._intensity
        self.metrics["carbon/emissions_g"] = self._emissions_g
        if self._scale is not None:
            self.metrics["carbon/scale"] = self._scale
        return {
            "intensity_g_per_kwh": self._intensity,
            "emissions_g": grams,
            "scale": self._scale,
        }

    def _carbon_summary(self) -> dict[str, Any]:
        carbon: dict[str, Any] = {"emissions_g": self._emissions_g}
        pacer = self._pacer
        if pacer is None:
            return carbon
        carbon.update(pacer.summary(self.now()))
        profile = self._profile_by_limit()
        if self._profile_end is None or self._static_limit_w not in profile:
            return carbon
        when, step, grams_before = self._profile_end
        steps = max(self._step - step, 0)
        ranks = self.collective.world_size
        carbon["baselines_from_step"] = step
        carbon["baselines_from_s"] = (when - self._job_start).total_seconds()
        carbon["baselines_steps"] = steps
        carbon["emissions_before_baselines_g"] = grams_before
        baselines = {}
        for name, limit in (("carbon_unaware", self._static_limit_w), ("full_power", max(profile))):
            t, e = profile[limit]
            series = pacer.emissions_at_pace(when, steps, t, e / ranks)
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

    def _profile_by_limit(self) -> dict[float, tuple[float, float]]:
        """Measured (time, energy) per step by power limit, once the profile is complete."""
        optimizer = self._optimizers.get(self._workload)
        if optimizer is None or not optimizer.done:
            return {}
        return {
            m.power_limit_w: (m.time_per_step_s, m.energy_per_step_j) for m in optimizer.profile()
        }

    def _pace_update(self) -> PaceUpdate | None:
        """Rank 0: the pacing decision until the next boundary."""
        if self._pacer is None:
            return None
        profile = self._profile_by_limit()
        frontier = [(t, e, f"{p:g} W") for p, (t, e) in sorted(profile.items(), reverse=True)]
        if frontier and self._total_steps is not None:
            self._pacer.fix_deadline(self._total_steps, min(t for t, _, _ in frontier))
        remaining = None
        if self._total_steps is not None and self._pacer.pacing:
            remaining = max(self._total_steps - self._step, 0)
        idle_w = self._idle_power_w
        if idle_w is None:
            idle_w = _IDLE_SHARE * min((e / t for t, e, _ in frontier), default=0.0)
        return self._pacer.update(remaining, frontier, idle_w, emitted_g=self._emissions_g)

    def _pace(self) -> None:
        """At a logging boundary: agree on the carbon pace and apply it (every rank)."""
        update: PaceUpdate | None = self.collective.broadcast(self._pace_update())
        if update is None:
            return
        self._intensity = update.intensity_g_per_kwh
        profile = self._profile_by_limit()
        if update.scale is None or not profile or not self._job_changes_settings():
            return
        if update.scale != self._scale:
            self._scale = update.scale
            from lightning_energy.optimize.selectors import make_selector

            target_s = update.scale * min(t for t, _ in profile.values())
            limit = self._optimizer().reselect(make_selector("target_time", target_time_s=target_s))
            self._apply(limit, f"carbon pace x{update.scale:.3f}: {update.reason}")
        if update.pause:
            self._pause(update)

    def _pause(self, first: PaceUpdate) -> None:
        """Wait at the lowest power limit until rank 0's policy resumes training.

        The wait ends at once when a signal restores the GPUs (the job is being stopped).
        """
        lo, _ = self._power_limit_range()
        before = self._power_limit_w
        self._apply(lo, f"paused: {first.reason}", purpose="pause")
        assert self.config.carbon is not None
        wait_s = self.config.carbon.poll_interval_s
        update: PaceUpdate | None = first
        idle_j = idle_s = 0.0
        waiter, self._wake = socket.socketpair()
        waiter.setblocking(False)
        self._wake.setblocking(False)
        try:
            while update is not None and update.pause and not self._guard.restored:
                if self.devices.run_step is not None:
                    for gpu in self.devices.gpus:
                        gpu.idle(wait_s)  # type: ignore[attr-defined]
                else:
                    select.select([waiter], [], [], wait_s)
                # Each polling period of the pause is an interval of its own (no steps), so
                # its idle energy is counted at the intensity of that period.
                m = self._next_interval()
                if m is not None:
                    idle_j, idle_s = idle_j + m.energy_j, idle_s + m.duration_s
                update = self.collective.broadcast(self._pace_update())
                if update is not None:
                    self._intensity = update.intensity_g_per_kwh
        finally:
            wake, self._wake = self._wake, None
            wake.close()
            waiter.close()
        if idle_s > 0:  # job-wide idle power, as every rank idles alike
            self._idle_power_w = idle_j / idle_s * self.collective.world_size
        self._apply(before, "resumed", purpose="resume")

    # ------------------------------------------------------------------ queries
    def current_power_limit_w(self) -> float | None:
        """The limit this controller applied last (None: none applied yet)."""
        return self._power_limit_w

    @property
    def profile_done(self) -> bool:
        """Whether the current workload's profile is complete."""
        return bool(self._optimizers.get(self._workload)) and self._optimizer().done

    @property
    def steps(self) -> int:
        """Training steps seen."""
        return self._step

    @property
    def observe_only(self) -> bool:
        """True when this process may not change GPU settings."""
        return bool(self._guard is not None and self._guard.observe_only)

    def profile(self) -> list[dict[str, float]]:
        """The measured power-limit profile of the current workload (job-wide numbers)."""
        optimizer = self._optimizers.get(self._workload)
        if optimizer is None:
            return []
        return [asdict(m) for m in optimizer.profile()]

    def _build_summary(self) -> RunSummary:
        duration_s = (self._end_s or self._start_s) - self._start_s
        pre = self._guard.pre_job_power_limit_w(0) if self._guard is not None else None
        saved_j, slowdown = 0.0, 1.0
        profile = self._profile_by_limit()
        after = self._after_profile
        if profile and after is not None and self._profile_end is not None:
            # Every step after profiling, measured, against the same steps at the highest
            # profiled limit (this process's share of the job-wide profile).
            steps = self._step - self._profile_end[1]
            t_top, e_top = profile[max(profile)]
            if steps > 0:
                saved_j = steps * e_top / self.collective.world_size - after.energy_j
                slowdown = after.duration_s / (steps * t_top)
        return RunSummary(
            steps=self._step,
            energy_j=self._energy_j,
            duration_s=duration_s,
            power_limit_w=self._power_limit_w,
            pre_job_power_limit_w=pre,
            energy_saved_j=saved_j,
            slowdown=slowdown,
            observe_only=self.observe_only,
            carbon=self._carbon_summary() if self.config.carbon is not None else None,
            read_error=self._read_error,
        )

    def gather_job_totals(self) -> dict[str, Any]:
        """Every rank: compare numbers with the others; the job's totals (a collective).

        Call it on every rank after :meth:`teardown` on a normal end (never on an exception
        path, where another rank may not be there to answer). The totals count each GPU
        once; they are kept in :attr:`job` and the summary's ``job_energy_j``.
        """
        summary = self.teardown()
        carbon = summary.carbon or {}
        mine = {
            "rank": self.collective.rank,
            "node": self._node,
            "counted": self._counts_energy,
            "observe_only": summary.observe_only,
            "gpus": [{"uuid": g.uuid, "name": g.name, "index": g.index} for g in self.device_info],
            "steps": summary.steps,
            "energy_j": summary.energy_j,
            "energy_saved_j": summary.energy_saved_j,
            "emissions_g": carbon.get("emissions_g"),
        }
        self.job = job_totals(self.collective.all_gather_object(mine))
        self._summary = replace(summary, job_energy_j=self.job["energy_j"])
        return self.job

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume without profiling again (JSON-serialisable)."""
        gpus = [gpu_info(g) for g in self.devices.gpus]
        states = dict(self._restored_states)
        states.update({k: o.state_dict() for k, o in self._optimizers.items()})
        return {
            "version": _STATE_VERSION,
            "gpu_models": sorted({g.name for g in gpus}),
            "workload": self._workload,
            "optimizers": states,
            "steps": self._step,
            "energy_j": self._energy_j,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`.

        Raises:
            CheckpointMismatchError: the state was saved on another GPU model or by an
                incompatible version.
        """
        if state.get("version") != _STATE_VERSION:
            raise CheckpointMismatchError(
                f"energy state version {state.get('version')!r} cannot be resumed; "
                f"this version reads {_STATE_VERSION}"
            )
        models = sorted({g.name for g in self.devices.gpus})
        if state.get("gpu_models") != models:
            raise CheckpointMismatchError(
                f"the checkpoint's energy profile was measured on {state.get('gpu_models')} "
                f"but this job runs on {models}; profiles do not transfer between GPU models "
                "(drop the energy state from the checkpoint to profile again)"
            )
        self.interrupt("checkpoint restore")
        self._optimizers.clear()
        self._restored_states = dict(state.get("optimizers", {}))
        self._workload = str(state.get("workload", "default"))
        self._step = int(state.get("steps", 0))
        self._energy_j = float(state.get("energy_j", 0.0))
        if self._is_setup:
            optimizer = self._optimizer()
            if optimizer.done:
                self._use_profile(optimizer.chosen_power_limit_w, "resumed from checkpoint")
