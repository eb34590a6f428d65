"""EnergyController: the coordinator every framework adapter talks to.

It owns the run's lifecycle: it opens the GPUs and takes their lease (setup, a new run
after teardown), agrees with the other ranks on who optimises, applies settings through
the guard, runs the carbon pause loop, saves and resumes checkpoints, and restores every
GPU first at teardown. What to measure next is the :class:`ProfilingSession`'s decision;
every number is the :class:`RunLedger`'s.

Every rank makes the same calls at the same steps, so collectives never mismatch.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import socket
from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime
from typing import TYPE_CHECKING, Any

from lightning_energy.collectives import Collective, default_collective
from lightning_energy.config import EnergyConfig
from lightning_energy.controller.events import (
    CheckpointLoad,
    CheckpointSave,
    Decision,
    End,
    Event,
    Interruption,
    PaceTarget,
    Pause,
    StepEnd,
    StepResult,
    StepStart,
)
from lightning_energy.controller.ledger import RunLedger, RunSummary
from lightning_energy.controller.readings import WINDOW
from lightning_energy.controller.session import ProfilingSession, WindowProgress
from lightning_energy.device.base import DeviceSet, gpu_info
from lightning_energy.errors import (
    CheckpointMismatchError,
    ConfigError,
    DeviceError,
    EnergyError,
    JobSetupError,
    LeaseConflictError,
)
from lightning_energy.job import (
    Capability,
    JobPlan,
    RankInfo,
    agree,
    describe_shared,
    job_totals,
    measuring_ranks,
    node_meters,
    node_name,
)
from lightning_energy.node_energy import NotMeasured
from lightning_energy.pacing import CarbonPacer, PaceUpdate, utc_now

if TYPE_CHECKING:
    import torch

    from carbon.config import CarbonConfig
    from lightning_energy.device.base import GPUInfo
    from lightning_energy.device.guard import GPUGuard
    from lightning_energy.device.rapl import RaplCounters
    from lightning_energy.measure import Measurement
    from lightning_energy.optimize.power_limit import PowerLimitOptimizer

__all__ = ["EnergyController"]

log = logging.getLogger(__name__)

_STATE_VERSION = 1
# Assumed power of an idle GPU, as a share of the least-power measured point, when no
# reading at setup gave it and until a pause measures it (used only to weigh pausing
# against slow running).
_IDLE_SHARE = 0.15
# A pause decided before any pause measured idle power first idles this long only (at most
# one polling period): long enough for the energy counter to measure idle power, then the
# pause is decided again at the measured power.
_IDLE_PROBE_S = 60.0
# At the end of this many first steps of a run the guard looks for a clock lock the job did
# not make: NVML shows one only while work runs under it, never on the idle GPU of setup.
_FOREIGN_CLOCK_CHECK_STEPS = 3


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
        self._devices = devices
        self._owns_devices = False
        self._collective = collective
        self._local_rank = local_rank
        self._node_rank = node_rank
        self._node = node_name(node_rank)
        self._device = device
        self._install_signal_handlers = install_signal_handlers
        self._session = ProfilingSession(
            self.config.power_limit.make_selector(),
            self._new_optimizer,
            settle_s=self.config.power_limit.settle_s,
        )
        self._devices_closed = False
        self._is_setup = False
        self._torn_down = False
        self._total_steps: int | None = None
        self._pace_target: PaceTarget | None = None
        self._new_run()

    def _new_run(self) -> None:
        """Forget the previous run (fit): its guard, windows, numbers and decisions.

        What was learnt about the workloads (their profiles) is kept, so a later fit of a
        known workload applies its choice without profiling again.
        """
        self._guard: GPUGuard | None = None
        self._ranks: list[RankInfo] = []
        self._node_counters: RaplCounters | NotMeasured | None = None
        self._plan = JobPlan(True, (), None)
        self._counts_energy = True
        self._clock_checks_left = _FOREIGN_CLOCK_CHECK_STEPS
        self._wake: socket.socket | None = None
        self._power_limit_w: float | None = None
        self._static_limit_w: float | None = None
        self._enforced_limit_w: float | None = None
        self._pacer: CarbonPacer | None = None
        self._session.new_run()
        self._ledger = RunLedger(self.config.log_every_n_steps, self._clock, self._readings_lost)

    # ------------------------------------------------------------------ events
    def handle(self, event: Event) -> StepResult:
        """Handle one event of the training loop (every rank, at the same point).

        Args:
            event: what happened (see :mod:`lightning_energy.controller.events`).

        Returns:
            The metrics to log when a logging interval closed (None otherwise), the
            decisions made, and the state (:class:`CheckpointSave`) or the run summary
            (:class:`End`).

        Raises:
            CheckpointMismatchError: a :class:`CheckpointLoad` of a state measured on
                another GPU model or written by an incompatible version.
        """
        ledger = self._ledger
        published, decided = ledger.published, len(ledger.decisions)
        state: dict[str, Any] | None = None
        summary: RunSummary | None = None
        if isinstance(event, StepStart):
            self._step_start()
        elif isinstance(event, StepEnd):
            self._step_end()
        elif isinstance(event, Interruption):
            self._interrupt(event.reason)
        elif isinstance(event, Pause):
            self._pause(event.update)
        elif isinstance(event, CheckpointSave):
            state = self.state_dict()
        elif isinstance(event, CheckpointLoad):
            self.load_state_dict(event.state)
        elif isinstance(event, End):
            summary = self.teardown()
        if self._ledger is not ledger:  # a new run started during the event
            ledger, published, decided = self._ledger, -1, 0
        fresh = ledger.published != published and bool(ledger.metrics)
        return StepResult(
            metrics=dict(ledger.metrics) if fresh else None,
            decisions=tuple(ledger.decisions[decided:]),
            state=state,
            summary=summary,
        )

    def on_step_start(self) -> StepResult:
        """Call before every training (optimizer) step: ``handle(StepStart())``.

        After :meth:`teardown` it is ignored until :meth:`setup` starts another run.
        """
        return self.handle(StepStart())

    def on_step_end(self) -> StepResult:
        """Call after every training (optimizer) step: ``handle(StepEnd())``."""
        return self.handle(StepEnd())

    def interrupt(self, reason: str) -> StepResult:
        """Something other than training runs next (validation, epoch end): the profiling
        window in progress pauses until the next step starts: ``handle(Interruption(reason))``.

        Every rank must call it at the same point (framework hooks guarantee this).
        """
        return self.handle(Interruption(reason))

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

    @property
    def guard(self) -> GPUGuard | None:
        """The guard of the run in progress (None outside a run): every other part of the
        job (Perseus clocks) changes the GPUs through it, under the same lease."""
        return self._guard if self._is_setup else None

    def _clock(self) -> float:
        return self.devices.clock()

    def setup(self, *, collective: Collective | None = None, observe: str | None = None) -> None:
        """Open the GPUs, take their lease and start measuring a run. Idempotent.

        After :meth:`teardown`, ``setup`` starts a new run (a second ``fit``): a new lease
        and fresh numbers; a workload profiled by an earlier run gets its chosen limit
        at once, without profiling again.

        Args:
            collective: how ranks agree from this run on (a new trainer's); None: keep.
            observe: why this run may not change its GPUs although it could (another run
                of this process drives them): it takes no lease and only observes, with
                one warning saying so (strict mode: a ``LeaseConflictError``).

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
        guard = self._guard = GPUGuard(
            devices.gpus,
            lease_dir=self.config.device.lease_dir,
            strict=self.config.strict,
            install_signal_handlers=self._install_signal_handlers,
        )
        try:
            self._agree(devices, guard, observe)
            guard.add_signal_listener(self._on_signal)
            self._start(devices, guard)
        except BaseException:
            guard.restore()  # nothing may stay changed, nor leased, after a failed setup
            if self._pacer is not None:
                self._pacer.stop()
            # Teardown has nothing left to measure or restore: no second lease, no new
            # NVML session for a job that never started.
            self._guard = None
            self._ledger.readings.meter = None
            self._ledger.close_node()
            if self._owns_devices and self._devices is not None:
                self._devices.close()
                self._devices = None
            raise
        self._is_setup = True
        if guard.observe_only:
            self._ledger.decide("observe-only", None, guard.observe_only_reason or "")
            return
        chosen = self._session.known_choice()
        if chosen is not None:
            self._use_profile(chosen, f"reuse profile of workload {self._session.workload}")

    def _agree(self, devices: DeviceSet, guard: GPUGuard, observe: str | None) -> None:
        """Take the lease and find out, with every rank, who optimises (one job, one plan).

        Two collectives: which GPUs each rank opened (a physical GPU opened by two ranks,
        itself or as MIG instances, is driven and measured by the lower one only), then
        whether each rank can change its GPUs (not when ``observe`` says why). In strict
        mode a rank that cannot makes every rank raise the same error, so no rank is left
        waiting in a collective.
        """
        from lightning_energy.job import shared_gpus

        collective = self.collective
        single = collective.world_size == 1
        counters = self._node_counters = self._open_node_counters(devices)
        me = RankInfo(
            collective.rank,
            self._node,
            tuple(g.uuid for g in devices.gpus),
            node_meter=None if isinstance(counters, NotMeasured) else counters.key,
            physical=tuple(g.physical_uuid for g in devices.gpus),
        )
        self._ranks = (
            [me]
            if single
            else [RankInfo.from_dict(r) for r in collective.all_gather_object(me.to_dict())]
        )
        shared = shared_gpus(self._ranks, collective.rank)
        if shared:
            self._counts_energy = False
            guard.observe(describe_shared(shared, self._ranks))
        failure: str | None = None
        try:
            if observe is not None and self.config.strict:
                raise LeaseConflictError(observe, owner_pid=os.getpid())
            if observe is not None:
                guard.observe(observe)
            guard.acquire()
            self._probe_permission(devices, guard)
        except EnergyError as exc:
            if single:
                raise
            failure = str(exc)
        if single:
            return
        reason = failure or guard.observe_only_reason
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

    def _probe_permission(self, devices: DeviceSet, guard: GPUGuard) -> None:
        """Find out now, before training, whether settings may be changed.

        Setting each GPU, on its own, to its pre-job limit changes nothing but fails without
        permission (observe-only, or an error in strict mode). One limit for all GPUs would
        not do: the guard keeps a request for several GPUs equal across them, lowering
        those whose pre-job limits are higher.
        """
        if self.config.power_limit.enabled and not guard.observe_only:
            for i in range(len(devices)):  # after a refusal the guard changes nothing more
                guard.set_power_limit_w(guard.pre_job_power_limit_w(i), gpus=[i])

    def _start(self, devices: DeviceSet, guard: GPUGuard) -> None:
        simulated = devices.backend == "simulated"
        job_start = (simulated and self.config.device.start_time()) or utc_now()
        self._ledger.start(devices, [gpu_info(g) for g in devices.gpus], job_start)
        if self.config.power_limit.enabled and not guard.observe_only:
            self._enforced_limit_w = self._board_limiter_w(guard)
        if self.config.carbon is not None:
            # Rank 0 polls the grid; every rank learns the first intensity, or rank 0's
            # configuration problem, so no rank is left waiting in a collective.
            first: float | list[str] | None = None
            if self.collective.rank == 0:
                first = self._start_pacer(self.config.carbon, simulated)
            first = self.collective.broadcast(first)
            if isinstance(first, list):
                raise ConfigError(first, self.config.source)
            self._ledger.intensity = first
            if self.config.carbon.allow_pause:
                self._read_idle_power(devices)
        self._start_node()
        self._ledger.begin_interval()

    def _open_node_counters(self, devices: DeviceSet) -> RaplCounters | NotMeasured:
        """This node's CPU and DRAM energy counters, or why there are none."""
        from lightning_energy.node_energy import open_counters

        return open_counters(self.config.node_energy, simulated=devices.backend == "simulated")

    def _start_node(self) -> None:
        """Measure the node's CPUs and DRAM when this rank is the lowest of the ranks that
        read the same counters (each node once); otherwise say who does, or why nobody."""
        from lightning_energy.node_energy import NodeEnergyMeter

        rank = self.collective.rank
        info: dict[str, Any] = {"node": self._node, "rank": rank}
        found = self._node_counters
        assert found is not None  # opened in _agree
        if isinstance(found, NotMeasured):
            self._ledger.start_node(None, {**info, **found.summary()})
            return
        measurer = node_meters(self._ranks).get(found.key, rank)
        if measurer != rank:
            why = NotMeasured(f"measured by rank {measurer}", f"rank {measurer} reads them")
            self._ledger.start_node(None, {**info, **why.summary(), "measured_by": measurer})
            return
        self._ledger.start_node(NodeEnergyMeter(found), info)

    def _read_idle_power(self, devices: DeviceSet) -> None:
        """Before any work: the job-wide board power the GPUs read now, each GPU counted
        once. It is what they draw idle (more if something else runs on them), the first
        estimate a pause is weighed at: a pause then measures what it really draws. A
        failed reading leaves the estimate to the profile."""
        try:
            mine = sum(gpu.power_w() for gpu in devices.gpus) if self._counts_energy else 0.0
        except DeviceError as exc:
            log.debug("no idle power reading at setup: %s", exc)
            mine = math.nan
        (total,), _ = self.collective.sum_and_max([mine], [])
        if math.isfinite(total) and total > 0:
            self._ledger.idle_reading_w = total

    def _start_pacer(self, config: CarbonConfig, simulated: bool) -> float | list[str]:
        """Rank 0: start polling; the first intensity, or the configuration problems."""
        from carbon.errors import CarbonConfigError

        try:
            pacer = CarbonPacer(config, now=self.now, virtual_clock=simulated)
        except CarbonConfigError as exc:
            return [f"carbon.{p}" for p in exc.problems]
        self._pacer = pacer
        pacer.start()
        return pacer.intensity_g_per_kwh()

    def _board_limiter_w(self, guard: GPUGuard) -> float | None:
        """The limit a board or rack limiter enforces below the pre-job limits, or None.

        Read at setup, while every GPU still has its pre-job limit: later the enforced
        limit also follows the limits this job sets.
        """
        pre = min(guard.pre_job_power_limit_w(i) for i in range(len(self.devices)))
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
        self._ledger.decide("enforced_power_limit", enforced, reason)
        return enforced

    def _open_devices(self) -> DeviceSet:
        """This process's GPUs from the ``device:`` section, as the framework's device says:
        a CUDA device is its GPU; the CPU is a simulated GPU under ``backend: auto`` and the
        local rank's GPU under ``nvml`` (see :func:`~lightning_energy.device.open_devices`)."""
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
        ledger = self._ledger
        if ledger.summary is not None and self._torn_down:
            return ledger.summary
        self._torn_down = True
        try:
            if self._guard is not None:
                self._guard.restore()
        finally:
            if self._pacer is not None:
                self._pacer.stop()
            summary = self._final_summary()
            if self._owns_devices and self._devices is not None:
                self._devices.close()
                self._devices_closed = True
            self._is_setup = False
        return summary

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
        ledger = self._ledger
        ledger.after_profile = None
        try:
            self._discard_window("end of the run")  # a window cut short is measured later
        except Exception as exc:  # e.g. a sticky CUDA error: the GPUs are restored already
            ledger.fail(exc)
        else:
            ledger.close(self._power_limit_w, stop_clock=self._devices is not None)
        ledger.close_node()
        profile = self._session.profile_by_limit()
        world_size = self.collective.world_size
        carbon = None
        if self.config.carbon is not None:
            carbon = ledger.carbon_summary(
                self._pacer, profile, self._static_limit_w, world_size, self.now()
            )
        guard = self._guard
        progress = self._session.progress() if self._job_profiles() else None
        return ledger.build_summary(
            power_limit_w=self._power_limit_w if progress is None or progress[0] else None,
            pre_job_power_limit_w=guard.pre_job_power_limit_w(0) if guard is not None else None,
            observe_only=self.observe_only,
            profile=profile,
            progress=progress,
            world_size=world_size,
            carbon=carbon,
        )

    def _job_profiles(self) -> bool:
        """Whether this run profiles power limits (decided alike on every rank)."""
        if not self.config.power_limit.enabled or self._pace_target is not None:
            return False
        if self._guard is None:
            return False
        return self._plan.optimises if self.collective.world_size > 1 else not self.observe_only

    def _readings_lost(self, exc: DeviceError) -> None:
        """A GPU reading failed mid-run: restore, change nothing more, keep training
        (observe-only; strict mode raises)."""
        self._ledger.lose_metrics()
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
        Adapters build the key with
        :func:`~lightning_energy.integrations._common.workload_key`.
        """
        if key == self._session.workload:
            return
        self._discard_window("workload change")
        self._session.workload = key
        self._ledger.forget_baselines()
        chosen = self._session.known_choice()
        if chosen is not None:
            self._use_profile(chosen, f"reuse profile of workload {key}")

    def _new_optimizer(self) -> PowerLimitOptimizer:
        from lightning_energy.optimize.power_limit import PowerLimitOptimizer

        section = self.config.power_limit
        lo, hi = self._power_limit_range()
        # The Zeus cost weighs time by the highest power limit of the GPUs (x every
        # GPU of the job), not the highest candidate.
        top_w = min(g.power_limit_constraints_w()[1] for g in self.devices.gpus)
        # Every rank sizes its windows alike: by the slowest energy counter of the job.
        period = max(g.energy_counter_period_s() for g in self.devices.gpus)
        _, (period,) = self.collective.sum_and_max([], [period])
        self._session.counter_period_s = period
        # What the guard would apply: above the pre-job limit (or an enforced one below
        # it) limits do not differ, so the profile is labelled with the limits applied.
        requested = section.candidates_w(lo, hi)
        candidates = [min(max(c, lo), hi) for c in requested]
        clamped = sorted({c for c in requested if c > hi}, reverse=True)
        if clamped and self.collective.rank == 0:
            log.info(
                "Power limits %s W are above %g W, the highest limit this job may set (the "
                "GPUs' pre-job or enforced limit): they are measured, and reported, as %g W.",
                ", ".join(f"{c:g}" for c in clamped),
                hi,
                hi,
            )
        return PowerLimitOptimizer(
            candidates,
            self._session.selector,
            max_power_limit_w=top_w,
            num_gpus=len(self.devices) * self.collective.world_size,
            warmup_steps=section.warmup_steps,
            settle_steps=section.settle_steps,
            seed=self.config.device.seed,
            counter_period_s=period,
        )

    def _power_limit_range(self) -> tuple[float, float]:
        """The range every local GPU accepts, capped at the lowest pre-job limit and at a
        board or rack limiter below it."""
        assert self._guard is not None
        guard = self._guard
        los, his = zip(*(g.power_limit_constraints_w() for g in self.devices.gpus), strict=True)
        pre = [guard.pre_job_power_limit_w(i) for i in range(len(self.devices))]
        enforced = [] if self._enforced_limit_w is None else [self._enforced_limit_w]
        return max(los), min(*his, *pre, *enforced)

    # ------------------------------------------------------------------ steps
    def _step_start(self) -> None:
        if not self._is_setup:
            if self._torn_down:
                return
            self.setup()
        session = self._session
        if session.window is None and self._optimizing():
            window = session.open_window(self._clock())
            if window is None:
                self._finish_profile()
            else:
                self._apply(window.power_limit_w, f"{window.purpose} window", purpose="profile")
        now_s = self._clock()
        if session.resume(now_s):
            self._ledger.readings.resume(WINDOW)
        elif session.start_measuring(now_s):
            self._ledger.readings.begin(WINDOW)

    def _step_end(self) -> None:
        if not self._is_setup:
            return
        run_step = self.devices.run_step
        if run_step is not None:
            run_step()
        self._check_foreign_clocks()
        self._ledger.count_step()
        if self._session.count_step():
            self._close_window()
        if self._ledger.interval_complete:  # closing the profile may have closed it
            self._ledger.next_interval(self._power_limit_w)
            if self.config.carbon is not None:
                self._pace()

    def _check_foreign_clocks(self) -> None:
        """During the first steps, while the step's work keeps the GPUs busy: let the guard
        look for an administrator's clock lock (one NVML reading per GPU)."""
        if self._clock_checks_left > 0:
            self._clock_checks_left -= 1
            assert self._guard is not None
            self._guard.check_foreign_clocks()

    def _interrupt(self, reason: str) -> None:
        """Something other than training runs next: a measuring window pauses (what runs
        until the next step start is left out of it)."""
        if self._session.pause():
            self._ledger.readings.pause(WINDOW)
            log.debug("profiling window paused: %s", reason)

    def _discard_window(self, reason: str) -> None:
        """Discard the window in progress; its limit is measured again later."""
        if self._session.window is None:
            return
        self._ledger.readings.cancel(WINDOW)
        window = self._session.discard()
        assert window is not None
        log.debug("profiling window at %.0f W discarded: %s", window.power_limit_w, reason)

    def _optimizing(self) -> bool:
        if not self.config.power_limit.enabled or not self._job_changes_settings():
            return False
        return self._session.wants_window()

    def _job_changes_settings(self) -> bool:
        """Whether the job profiles and paces: one decision for all ranks, since every rank
        makes the same collective calls (an observing rank takes part, changing nothing);
        a single process decides by its own guard."""
        if self.collective.world_size > 1:
            return self._plan.optimises
        assert self._guard is not None
        return not (self._guard.observe_only or self._guard.restored)

    def _close_window(self) -> None:
        """Report the window once it is long enough; it goes on while it is too short for
        the energy counter (or read no energy yet). Every rank decides on the job-wide sums:
        a rank whose readings failed sends NaN, so every rank learns it in this collective;
        a rank observing a GPU that a lower rank measures sends 0 (each GPU counted once)."""
        readings = self._ledger.readings
        m = readings.peek(WINDOW)
        if m is None:
            energy_j, duration_s = math.nan, math.nan
        else:
            energy_j = m.energy_j if self._counts_energy else 0.0
            duration_s = m.duration_s
        (energy_j,), (duration_s,) = self.collective.sum_and_max([energy_j], [duration_s])
        if math.isnan(energy_j):
            self._device_fault()
            return
        steps = self._session.window_steps
        progress = self._session.report(energy_j, duration_s)
        if progress is WindowProgress.MEASURING:
            return
        readings.cancel(WINDOW)
        if progress is WindowProgress.COMPLETE:
            self._finish_profile()
        else:
            self._check_profile_fits(duration_s / steps)

    def _check_profile_fits(self, time_per_step_s: float) -> None:
        """Say once, at INFO, when the job is too short for its profile to finish, and what
        it would need (every rank decides alike; rank 0 says it)."""
        total = self._total_steps
        if total is None or self._session.fit_warned:
            return
        left = total - self._ledger.step
        needed = self._session.optimizer().min_steps_left(time_per_step_s)
        if needed <= left:
            return
        self._session.fit_warned = True
        if self.collective.rank == 0:
            log.info(
                "The power-limit profile cannot finish in this run: %d steps are left and the "
                "limits not measured yet need at least %d more (at %.3f s per step, each "
                "window measures %.0f s or more so that the energy counter, which moves every "
                "%.2f s, tells limits apart within 1 %%). The GPUs are put back to their "
                "pre-job limits at the end; a run of at least %d steps profiles fully (a "
                "checkpoint carries the profile so far to a resumed run).",
                left,
                needed,
                time_per_step_s,
                self._session.optimizer().min_window_duration_s,
                self._session.counter_period_s,
                self._ledger.step + needed,
            )

    def _device_fault(self) -> None:
        """A GPU stopped answering in a profiling window (every rank sees the job-wide NaN):
        restore what can be restored now and only observe for the rest of the run; the
        window is measured again by a later run."""
        assert self._guard is not None
        readings = self._ledger.readings
        self._session.stop()
        readings.cancel(WINDOW)
        error = readings.last_error or DeviceError(readings.error or "a GPU stopped answering")
        self._guard.stop_changes(f"a GPU failed mid-run ({error})", error)
        self._ledger.decide("observe-only", None, self._guard.observe_only_reason or str(error))

    def _finish_profile(self) -> None:
        session = self._session
        chosen = self.collective.broadcast(session.optimizer().chosen_power_limit_w)
        selector = session.selector.describe()
        profile = session.profile_by_limit()
        if chosen in profile:
            top_w = max(profile)
            (t, e), (t_top, e_top) = profile[chosen], profile[top_w]
            log.info(
                "power-limit profile complete after %d steps: %.0f W chosen by the %s "
                "selector (%.1f %% less energy and %+.1f %% time per step than %.0f W)",
                self._ledger.step,
                chosen,
                selector,
                100.0 * (1.0 - e / e_top),
                100.0 * (t / t_top - 1.0),
                top_w,
            )
        self._use_profile(chosen, f"profile complete; selector {selector}")

    def _use_profile(self, chosen: float | None, reason: str) -> None:
        """Apply the profile's choice and start measuring the steps that run at it."""
        self._static_limit_w = chosen
        self._ledger.start_baselines(self._power_limit_w, self.now())
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
        assert self._guard is not None
        applied = self._power_limit_w
        if power_limit_w != applied:
            applied = self._guard.set_power_limit_w(power_limit_w)
        if self._guard.observe_only or self._guard.restored:
            return
        self._power_limit_w = applied
        self._ledger.decide("power_limit", applied, reason, purpose)

    # ------------------------------------------------------------------ carbon
    def now(self) -> datetime:
        """The job's current time: its start plus the device-clock seconds elapsed.

        On a real GPU this is the wall clock; on a simulated GPU it follows the virtual
        clock, so carbon traces replay at the simulated job's speed.
        """
        return self._ledger.now(running=self._is_setup)

    def set_total_steps(self, total_steps: int | None) -> None:
        """Declare how many training steps the job will run (carbon pacing needs it)."""
        self._total_steps = total_steps

    def pace_with(self, target: PaceTarget | None) -> None:
        """Let the carbon pace move ``target`` (Perseus' iteration time) instead of the
        power limit; every rank registers the same kind of target (None: the power limit
        again). Call it before training starts."""
        self._pace_target = target

    def _pace_update(self, *, paused: bool = False) -> PaceUpdate | None:
        """Rank 0: the pacing decision until the next boundary (while ``paused``, one being
        made in the background is waited for: no step is held up)."""
        if self._pacer is None:
            return None
        ledger = self._ledger
        if self._pace_target is not None:
            frontier = self._pace_target.pace_frontier()
        else:
            profile = self._session.profile_by_limit()
            frontier = [(t, e, f"{p:g} W") for p, (t, e) in sorted(profile.items(), reverse=True)]
        if frontier and self._total_steps is not None:
            self._pacer.fix_deadline(self._total_steps, min(t for t, _, _ in frontier))
        remaining = None
        if self._total_steps is not None and self._pacer.pacing:
            remaining = max(self._total_steps - ledger.step, 0)
        idle_w = ledger.idle_power_w if ledger.idle_power_w is not None else ledger.idle_reading_w
        if idle_w is None:
            idle_w = _IDLE_SHARE * min((e / t for t, e, _ in frontier), default=0.0)
        return self._pacer.update(
            remaining, frontier, idle_w, emitted_g=ledger.emissions_g, wait=paused
        )

    def _pace(self) -> None:
        """At a logging boundary: agree on the carbon pace and apply it (every rank)."""
        update: PaceUpdate | None = self.collective.broadcast(self._pace_update())
        if update is None:
            return
        ledger = self._ledger
        ledger.intensity = update.intensity_g_per_kwh
        if update.scale is None or not self._job_changes_settings():
            return
        if self._pace_target is not None:
            if update.scale != ledger.scale:
                ledger.scale = update.scale
                target_s = self._pace_target.apply_pace(update.scale)
                reason = f"carbon pace x{update.scale:.3f}: {update.reason}"
                ledger.decide("target_time_s", target_s, reason, purpose="pace")
            if update.pause:
                self._pause(update)
            return
        profile = self._session.profile_by_limit()
        if not profile:
            return
        if update.scale != ledger.scale:
            ledger.scale = update.scale
            from lightning_energy.optimize.selectors import make_selector

            target_s = update.scale * min(t for t, _ in profile.values())
            limit = self._session.optimizer().reselect(
                make_selector("target_time", target_time_s=target_s)
            )
            self._apply(limit, f"carbon pace x{update.scale:.3f}: {update.reason}")
        if update.pause:
            self._pause(update)

    def _pause(self, first: PaceUpdate) -> None:
        """Wait at the lowest power limit until rank 0's policy resumes training.

        Each polling period ends with a decision. A pause decided before idle power was
        ever measured first idles a short probe only (``_IDLE_PROBE_S``), so that the
        policy decides again at once at the measured power. The wait ends at once when a
        signal restores the GPUs (the job is being stopped).
        """
        assert self._guard is not None and self.config.carbon is not None
        ledger = self._ledger
        lo, hi = self._power_limit_range()
        # A job that never set a limit (Perseus plans clocks instead) resumes at the cap.
        before = self._power_limit_w if self._power_limit_w is not None else hi
        self._apply(lo, f"paused: {first.reason}", purpose="pause")
        wait_s = self.config.carbon.poll_interval_s
        if ledger.idle_power_w is None:  # weighed at an estimate: measure before committing
            wait_s = min(wait_s, _IDLE_PROBE_S)
        update: PaceUpdate | None = first
        idle_j = idle_s = 0.0
        measuring = measuring_ranks(self._ranks)  # each physical GPU counted once
        waiter, self._wake = socket.socketpair()
        waiter.setblocking(False)
        self._wake.setblocking(False)
        try:
            while update is not None and update.pause and not self._guard.restored:
                if self.devices.run_step is not None:
                    for gpu in self.devices.gpus:
                        gpu.idle(wait_s)
                else:
                    select.select([waiter], [], [], wait_s)
                # Each polling period of the pause is an interval of its own (no steps), so
                # its idle energy is counted at the intensity of that period.
                m: Measurement | None = ledger.next_interval(self._power_limit_w)
                if m is not None:
                    idle_j, idle_s = idle_j + m.energy_j, idle_s + m.duration_s
                if idle_s > 0:  # job-wide idle power, as every measuring rank idles alike
                    # Measured from the first period on: the next decision weighs the pause
                    # at the power it really draws, not at the guess it was started with.
                    ledger.idle_power_w = idle_j / idle_s * measuring
                update = self.collective.broadcast(self._pace_update(paused=True))
                if update is not None:
                    ledger.intensity = update.intensity_g_per_kwh
                wait_s = self.config.carbon.poll_interval_s
        finally:
            wake, self._wake = self._wake, None
            wake.close()
            waiter.close()
        self._apply(before, "resumed", purpose="resume")

    # ------------------------------------------------------------------ queries
    def current_power_limit_w(self) -> float | None:
        """The limit this controller applied last (None: none applied yet)."""
        return self._power_limit_w

    @property
    def profile_done(self) -> bool:
        """Whether the current workload's profile is complete."""
        return self._session.done

    @property
    def steps(self) -> int:
        """The job's training steps so far (a resumed run counts on from its checkpoint's)."""
        return self._ledger.step

    @property
    def observe_only(self) -> bool:
        """True when this process may not change GPU settings."""
        return bool(self._guard is not None and self._guard.observe_only)

    @property
    def metrics(self) -> dict[str, float]:
        """The ``energy/*`` (and ``carbon/*``) values of the last logging interval."""
        return self._ledger.metrics

    @property
    def timeline(self) -> list[dict[str, Any]]:
        """One entry per logging interval of the run (and per polling period of a pause)."""
        return self._ledger.timeline

    @property
    def decisions(self) -> list[Decision]:
        """Every setting chosen in the run, and why."""
        return self._ledger.decisions

    @property
    def device_info(self) -> list[GPUInfo]:
        """Identity and limits of every GPU, as recorded at setup."""
        return self._ledger.device_info

    @property
    def job(self) -> dict[str, Any] | None:
        """The job's totals once :meth:`gather_job_totals` ran (None before)."""
        return self._ledger.job

    def profile(self) -> list[dict[str, float]]:
        """The measured power-limit profile of the current workload (job-wide numbers)."""
        return self._session.profile()

    def gather_job_totals(self) -> dict[str, Any]:
        """Every rank: compare numbers with the others; the job's totals (a collective).

        Call it on every rank after :meth:`teardown` on a normal end (never on an exception
        path, where another rank may not be there to answer). The totals count each GPU
        once; they are kept in :attr:`job` and the summary's ``job_energy_j``.
        """
        summary = self.teardown()
        ledger = self._ledger
        mine = ledger.own_totals(self.collective.rank, self._node, self._counts_energy)
        job = ledger.job = job_totals(self.collective.all_gather_object(mine))
        ledger.summary = replace(
            summary,
            job_energy_j=job["energy_j"],
            job_node_energy_j=job.get("node_energy_j"),
            energy_counted=job.get("counted", summary.energy_counted),
        )
        return job

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume without profiling again (JSON-serialisable), and the
        job's totals at this step: its steps and the energy they used, up to this step."""
        gpus = [gpu_info(g) for g in self.devices.gpus]
        return {
            "version": _STATE_VERSION,
            "gpu_models": sorted({g.name for g in gpus}),
            "workload": self._session.workload,
            "optimizers": self._session.state_dict(),
            "steps": self._ledger.step,
            "energy_j": self._ledger.job_energy_so_far_j(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the profiles and choice, and the job's steps
        and energy so far (this run's summary stays its own and says where it resumed).

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
        self._discard_window("checkpoint restore")
        self._session.load_state_dict(
            state.get("optimizers", {}), str(state.get("workload", "default"))
        )
        self._ledger.resume(int(state.get("steps", 0)), float(state.get("energy_j", 0.0)))
        if self._is_setup:
            self._session.optimizer()
            chosen = self._session.known_choice()
            if chosen is not None:
                self._use_profile(chosen, "resumed from checkpoint")
