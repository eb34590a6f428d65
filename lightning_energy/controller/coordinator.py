"""EnergyController: the coordinator every framework adapter talks to.

It only sequences a run: it opens the GPUs (:mod:`.rank_devices`), agrees with the other
ranks on who drives what (:mod:`.agreement`) under one guard and lease, hands each event to
the knobs that act on it (the built-in power limit and its sibling the locked SM clock,
:mod:`.built_in_knobs`, and those registered with :meth:`EnergyController.add_knob`: see
:mod:`.knobs`), paces the paced knob to the grid (:mod:`.carbon_pace`), saves and resumes
checkpoints (:mod:`.checkpoint`), and restores every GPU first at teardown, then ends the
run (:mod:`.summary`). Every number is the :class:`~.ledger.RunLedger`'s; what the run can
be asked is in :mod:`.queries`.

Every rank makes the same calls at the same steps, so collectives never mismatch.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from typing_extensions import assert_never

from lightning_energy.collectives import Collective, default_collective
from lightning_energy.config import EnergyConfig
from lightning_energy.controller.agreement import RunAgreement, agree_on_run
from lightning_energy.controller.built_in_knobs import BuiltInKnobs
from lightning_energy.controller.carbon_pace import CarbonPacing
from lightning_energy.controller.checkpoint import check_resumable, energy_state
from lightning_energy.controller.events import (
    CheckpointLoad,
    CheckpointSave,
    End,
    Event,
    Interruption,
    StepEnd,
    StepStart,
)
from lightning_energy.controller.job_plan import launcher_node_rank, node_name
from lightning_energy.controller.knobs import Knob, KnobDecision, RegisteredKnobs
from lightning_energy.controller.ledger import RunLedger
from lightning_energy.controller.locked_clock import FOREIGN_CLOCK_CHECK_STEPS
from lightning_energy.controller.queries import ControllerQueries
from lightning_energy.controller.rank_devices import RankDevices
from lightning_energy.controller.records import RunSummary, StepResult
from lightning_energy.controller.summary import final_summary, gather_job_totals
from lightning_energy.device.base import DeviceSet, gpu_info
from lightning_energy.errors import DeviceError
from lightning_energy.node_energy import open_counters
from lightning_energy.pacing import utc_now

if TYPE_CHECKING:
    import torch

    from lightning_energy.device.guard import GPUGuard

__all__ = ["EnergyController"]

log = logging.getLogger(__name__)


class EnergyController(ControllerQueries):
    """Drives a job's knobs (the power limit, and any registered) from step events, with
    carbon-aware pacing.

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

    Attributes:
        power_limit: the built-in power-limit knob.
        locked_clock: the built-in locked-clock knob (profiled instead of power limits
            where ``power_limit.knob`` asks for it and the job may lock clocks).
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
        if node_rank is None:  # simulated GPUs of two nodes must differ as real ones do
            node_rank = launcher_node_rank()
        self._devices = RankDevices(
            self.config.device,
            devices,
            node_rank=node_rank or 0,
            local_rank=local_rank,
            device=device,
        )
        self._collective = collective
        self._node = node_name(node_rank)
        self._install_signal_handlers = install_signal_handlers
        self._built_in = BuiltInKnobs(self)
        self.power_limit = self._built_in.power_limit
        self.locked_clock = self._built_in.locked_clock
        self._registered = RegisteredKnobs(self.power_limit, self.locked_clock)
        self._is_setup = False
        self._torn_down = False
        self._total_steps: int | None = None
        self._new_run()

    def _new_run(self) -> None:
        """Forget the previous run (fit): its guard, windows, numbers and decisions.

        What was learnt about the workloads (their profiles) is kept, so a later fit of a
        known workload applies its choice without profiling again.
        """
        self._guard: GPUGuard | None = None
        self._agreement = RunAgreement()
        self._clock_checks_left = FOREIGN_CLOCK_CHECK_STEPS
        self._pacing: CarbonPacing | None = None
        self._built_in.new_run()
        self._ledger = RunLedger(self.config.log_every_n_steps, self.clock, self._readings_lost)

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
        match event:
            case StepStart():
                self._step_start()
            case StepEnd():
                self._step_end()
            case Interruption(reason=reason):
                self.setting.pause_window(reason)
            case CheckpointSave():
                state = self.state_dict()
                self.setting.pause_window("checkpoint")
            case CheckpointLoad(state=saved):
                self.load_state_dict(saved)
            case End():
                summary = self.teardown()
            case _:
                assert_never(event)
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

    # ------------------------------------------------------------------ knobs
    def add_knob(self, knob: Knob) -> None:
        """Coordinate ``knob`` in this job from now on (every rank alike, before training).

        The carbon pace moves the knob holding the clocks (the setting knob when none
        does); a knob that holds the clocks switches power-limit profiling off (limits
        measured while clocks move say nothing), saying so once at INFO, and switches the
        locked-clock knob off (one owner of the clocks at a time: its lock is released). A
        knob that leaves the clocks alone (the batch size) changes neither. Knobs stay
        registered for this controller's later runs; a knob of the name of one registered
        (the same adapter's next fit) takes its place.

        Raises:
            EnergyError: training has started (its steps were profiled or paced already).
            ConfigError: ``knob`` holds the clocks beside another registered knob that does.
        """
        self._registered.add(knob, steps_run=self._ledger.step, rank=self.collective.rank)

    def record(self, knob: Knob, decision: KnobDecision, reason: str) -> None:
        """Record what ``knob`` set outside the carbon pace (the batch size a run chose) as a
        decision of the run: reports list it with the others.

        Raises:
            EnergyError: ``knob`` is not registered (:meth:`add_knob`).
        """
        self._registered.check(knob)
        self._ledger.decide(decision.kind, decision.value, reason, decision.purpose)

    # ------------------------------------------------------------------ the run
    @property
    def devices(self) -> DeviceSet:
        """The GPUs driven by this process (opened on first use)."""
        return self._devices.get()

    @property
    def collective(self) -> Collective:
        """How ranks agree (resolved on first use, once the process group exists)."""
        if self._collective is None:
            self._collective = default_collective()
        return self._collective

    def changes_settings(self) -> bool:
        """Whether the job profiles and paces now (one decision for all ranks: see
        :meth:`.RunAgreement.changes_settings`)."""
        assert self._guard is not None
        return self._agreement.changes_settings(self.collective.world_size, self._guard)

    def optimises(self) -> bool:
        """Whether this run was set up to change settings (as the summary reports it)."""
        return self._agreement.optimises(self.collective.world_size, self._guard)

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
        if collective is not None:
            self._collective = collective
        devices = self._devices.for_new_run()
        self.power_limit.check_candidates()
        guard = self._guard = GPUGuard(
            devices.gpus,
            lease_dir=self.config.device.lease_dir,
            strict=self.config.strict,
            install_signal_handlers=self._install_signal_handlers,
        )
        try:
            counters = open_counters(self.config.node_energy, simulated=devices.virtual_time)
            self._agreement = agree_on_run(
                collective=self.collective,
                node=self._node,
                devices=devices,
                guard=guard,
                node_counters=counters,
                probe_permission=self.power_limit.probe_permission,
                observe=observe,
                strict=self.config.strict,
            )
            guard.add_signal_listener(self._on_signal)
            self._start(devices, guard)
        except BaseException:
            guard.restore()  # nothing may stay changed, nor leased, after a failed setup
            if self._pacing is not None:
                self._pacing.stop()
            # Teardown has nothing left to measure or restore: no second lease, no new
            # NVML session for a job that never started.
            self._guard = None
            self._ledger.abandon()
            self._devices.close(forget=True)
            raise
        self._is_setup = True
        if guard.observe_only:
            self._ledger.decide("observe-only", None, guard.observe_only_reason or "")
            return
        self.setting.reuse_known_choice()

    def _start(self, devices: DeviceSet, guard: GPUGuard) -> None:
        virtual = devices.virtual_time
        job_start = (virtual and self.config.device.start_time()) or utc_now()
        self._ledger.start(devices, [gpu_info(g) for g in devices.gpus], job_start)
        self._built_in.start(guard)
        if self.config.carbon is not None:
            self._pacing = CarbonPacing(self, self.config.carbon)
            self._pacing.start(simulated=virtual)
        self._ledger.start_node(*self._agreement.node_meter(self.collective.rank, self._node))
        self._ledger.begin_interval()

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
            if self._pacing is not None:
                self._pacing.stop()
            summary = final_summary(self, stop_clock=self._devices.opened)
            self._devices.close()
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
        if self._pacing is not None:
            self._pacing.wake()

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

    # ------------------------------------------------------------------ steps
    def set_workload(self, key: str) -> None:
        """Declare what is being trained (e.g. batch size and model size).

        A new key starts a new profile (or resumes the one saved for it), so a change of
        batch size or model is profiled again; returning to a known key reuses its profile.
        Adapters build the key with
        :func:`~lightning_energy.integrations.adapter.workload_key`.
        """
        self._built_in.set_workload(key)

    def _step_start(self) -> None:
        if not self._is_setup:
            if self._torn_down:
                return
            self.setup()
        self.locked_clock.hand_over()
        self.setting.step_start()

    def _step_end(self) -> None:
        if not self._is_setup:
            return
        run_step = self.devices.run_step
        if run_step is not None:
            run_step()
        self._check_foreign_clocks()
        self._ledger.count_step()
        self.setting.step_end()
        if self._ledger.interval_complete:  # closing the profile may have closed it
            self._ledger.next_interval(
                self.power_limit.power_limit_w, self.current_locked_clock_mhz()
            )
            if self._pacing is not None:
                self._pacing.pace()

    def _check_foreign_clocks(self) -> None:
        """During the first steps, while the step's work keeps the GPUs busy: let the guard
        look for an administrator's clock lock (one NVML reading per GPU)."""
        if self._clock_checks_left > 0:
            self._clock_checks_left -= 1
            assert self._guard is not None
            self._guard.check_foreign_clocks()

    def set_total_steps(self, total_steps: int | None) -> None:
        """Declare how many training steps the job will run (carbon pacing needs it)."""
        self._total_steps = total_steps

    # ------------------------------------------------------------------ the job
    def gather_job_totals(self) -> dict[str, Any]:
        """Every rank: compare numbers with the others; the job's totals (a collective).

        Call it on every rank after :meth:`teardown` on a normal end (never on an exception
        path, where another rank may not be there to answer). The totals count each GPU
        once; they are kept in :attr:`job` and the summary's ``job_energy_j``.
        """
        return gather_job_totals(self, self.teardown(), self._node)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume without profiling again (JSON-serialisable), and the
        job's totals at this step: its steps and the energy they used, up to this step."""
        ledger = self._ledger
        knobs = self._built_in.state_dict()
        return energy_state(self.devices.gpus, knobs, ledger.step, ledger.job_energy_so_far_j())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the profiles and choice, and the job's steps
        and energy so far (this run's summary stays its own and says where it resumed).

        Raises:
            CheckpointMismatchError: the state was saved on another GPU model or by an
                incompatible version.
        """
        check_resumable(state, self.devices.gpus)
        self._ledger.resume(int(state.get("steps", 0)), float(state.get("energy_j", 0.0)))
        self._built_in.load_state_dict(state, running=self._is_setup)
