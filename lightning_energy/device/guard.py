"""Change GPU settings safely: remember what was there, put exactly that back, once.

:class:`GPUGuard` is the only way the rest of the package changes a GPU. Before the first
change it records each GPU's pre-job power limit and clock lock in a per-GPU lease
(:mod:`.lease`), and it restores exactly those values (not the vendor default, not the
maximum) exactly once: at the end of the ``with`` block, on an exception, on
KeyboardInterrupt and on SIGTERM. A job killed with SIGKILL leaves its lease behind; the
next job on that GPU, or ``lightning-energy recover`` (:func:`recover`), restores the GPU
from it first.

It never raises a power limit above the pre-job limit (the operator's cap) or outside the
driver's range: requests are clamped, with a log line. Without permission to change
settings (not root, no ``CAP_SYS_ADMIN``, a container; through zeusd, a token without the
``gpu-control`` scope or a daemon that does not answer), on a MIG instance, or on a GPU
leased by another live job, it runs *observe-only*: nothing is changed, energy is still
measured, one warning says why. ``strict=True`` raises instead.

Example:
    >>> from lightning_energy.device import SimulatedSpec, simulated_gpus
    >>> gpus = simulated_gpus(SimulatedSpec(gpu="a40", count=2))
    >>> with GPUGuard(gpus, install_signal_handlers=False) as guard:
    ...     applied_w = guard.set_power_limit_w(200.0)
    >>> gpus[0].power_limit_w() == guard.pre_job_power_limit_w(0)
    True
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import math
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from lightning_energy.device.base import GPU
from lightning_energy.device.lease import (
    Lease,
    LeaseLock,
    LeaseStore,
    ProcessIdentity,
    apply_saved_settings,
    owner_status,
    restore_stale_lease,
)
from lightning_energy.device.recovery import RecoveryResult, recover
from lightning_energy.errors import (
    ConfigError,
    DaemonUnreachableError,
    DeviceError,
    LeaseConflictError,
    NoPermissionError,
    NotSupportedError,
)

__all__ = ["PERMISSION_HELP", "GPUGuard", "RecoveryResult", "recover"]

log = logging.getLogger(__name__)

_SIGNALS = (signal.SIGTERM, signal.SIGINT)

#: How to grant the permission to change GPU settings (shown in the observe-only warning).
PERMISSION_HELP = (
    "changing GPU power limits and clocks needs root or the CAP_SYS_ADMIN capability: run "
    "the job as root (or grant CAP_SYS_ADMIN); in Docker add `--cap-add SYS_ADMIN` (with the "
    "NVIDIA Container Toolkit, `--gpus all`); in Kubernetes add SYS_ADMIN to the container's "
    "securityContext.capabilities.add; and enable persistence mode once per boot with "
    "`sudo nvidia-smi -pm 1` so the driver keeps settings between processes; or, without "
    "root, let the Zeus daemon zeusd change them (set ZEUSD_SOCK_PATH and ZEUSD_TOKEN). See "
    "docs/permissions.md"
)

_SignalHandler = Callable[[int, FrameType | None], Any] | int | None


def _describe(gpu: GPU) -> str:
    return f"GPU {gpu.index} ({gpu.uuid})"


def _maybe_applied(exc: DeviceError) -> bool:
    """Whether a change that failed may have been applied all the same (a daemon that
    did not answer in time): it is then restored as if it had been."""
    return isinstance(exc, DaemonUnreachableError) and exc.maybe_applied


def _live_handler(handler: _SignalHandler, signum: int) -> _SignalHandler:
    """``handler``, or, when it is the handler of a guard that has restored since (it
    restored while a later guard's handler sat on top of its own, so it stayed in the
    chain), the first handler down that guard's chain that is not such a leftover."""
    guard = getattr(handler, "__self__", None)
    while isinstance(guard, GPUGuard) and guard.restored and handler == guard._handler:
        handler = guard._previous_handlers.get(signum, signal.SIG_DFL)
        guard = getattr(handler, "__self__", None)
    return handler


class GPUGuard:
    """Saves the pre-job settings of some GPUs, changes them safely and restores them.

    Indices passed to the methods (``gpus=[0, 2]``, ``pre_job_power_limit_w(i)``) are
    positions in the ``gpus`` sequence given here. A guard is used once: after
    :meth:`restore` it changes nothing more.

    Args:
        gpus: the GPUs this process controls (distinct UUIDs).
        lease_dir: where leases live; default ``$LIGHTNING_ENERGY_LEASE_DIR``, else the
            machine-wide ``/run/lightning-energy`` (see :func:`~.lease.resolve_lease_dir`).
        strict: raise instead of falling back to observe-only (no permission, MIG or
            unsupported GPU, GPU leased by another live process, a failed change).
        install_signal_handlers: restore on SIGTERM and SIGINT, then hand the signal to
            the handler installed before (main thread only; elsewhere the ``with`` block,
            :meth:`restore` and an ``atexit`` safety net remain).

    Raises:
        ConfigError: no GPU, or the same GPU twice.
    """

    def __init__(
        self,
        gpus: Sequence[GPU],
        *,
        lease_dir: str | Path | None = None,
        strict: bool = False,
        install_signal_handlers: bool = True,
    ) -> None:
        self._gpus = list(gpus)
        uuids = [gpu.uuid for gpu in self._gpus]
        if not uuids:
            raise ConfigError("gpus: at least one GPU is needed", source="GPUGuard")
        if len(set(uuids)) != len(uuids):
            raise ConfigError(f"gpus: the same GPU is listed twice in {uuids}", source="GPUGuard")
        self._store = LeaseStore(lease_dir)
        self._strict = strict
        self._install_handlers = install_signal_handlers
        n = len(self._gpus)
        # The pre-job record of each GPU; written as a lease file when ``_persisted``.
        self._leases: list[Lease | None] = [None] * n
        self._persisted = [False] * n
        self._locks: list[LeaseLock | None] = [None] * n
        self._pre_power_w: list[float] = [math.nan] * n
        self._pre_clocks: list[tuple[int, int] | None] = [None] * n
        self._power_applied = [False] * n
        self._clocks_applied = [False] * n
        self._observe_reason: str | None = None
        self._clocks_unsupported: str | None = None
        self._acquired = False
        self._restored = False
        self._owner_pid: int | None = None
        # Reentrant: a signal handler runs in the main thread, possibly inside a method.
        self._lock = threading.RLock()
        self._depth = 0
        self._pending_signals: list[int] = []
        self._handler = self._on_signal  # one bound method, so getsignal() can be compared
        self._previous_handlers: dict[int, _SignalHandler] = {}
        self._signal_listeners: list[Callable[[int], None]] = []
        self._atexit_registered = False

    # ------------------------------------------------------------------ state
    @property
    def observe_only(self) -> bool:
        """True when this job does not change GPU settings (see observe_only_reason)."""
        return self._observe_reason is not None

    @property
    def observe_only_reason(self) -> str | None:
        """Why the job only observes, or None."""
        return self._observe_reason

    @property
    def restored(self) -> bool:
        """True once :meth:`restore` has run."""
        return self._restored

    @property
    def lease_dir(self) -> Path:
        """The lease directory in use."""
        return self._store.directory

    def pre_job_power_limit_w(self, i: int) -> float:
        """The power limit GPU ``i`` had before this job (NaN if the GPU cannot report it).

        Raises:
            ConfigError: ``i`` is not a GPU position of this guard.
        """
        self._ensure_acquired()
        (i,) = self._targets([i])
        return self._pre_power_w[i]

    def pre_job_locked_clocks_mhz(self, i: int) -> tuple[int, int] | None:
        """The SM clock lock GPU ``i`` had before this job (None: not locked).

        Raises:
            ConfigError: ``i`` is not a GPU position of this guard.
        """
        self._ensure_acquired()
        (i,) = self._targets([i])
        return self._pre_clocks[i]

    # ----------------------------------------------------------- critical section
    @contextlib.contextmanager
    def _critical(self) -> Iterator[None]:
        """Hold the guard's lock; a signal arriving meanwhile is handled at the end."""
        pending: list[int] = []
        try:
            with self._lock:
                self._depth += 1
                try:
                    yield
                finally:
                    self._depth -= 1
                    if self._depth == 0:
                        pending, self._pending_signals = self._pending_signals, []
        finally:
            for signum in pending:
                self._on_signal(signum, None)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """SIGTERM/SIGINT: restore, then behave as the previously installed handler."""
        with self._lock:
            if self._depth > 0 and os.getpid() == self._owner_pid:
                # The main thread was interrupted inside one of our methods: finish it first.
                self._pending_signals.append(signum)
                return
        self.restore()
        for listener in self._signal_listeners:
            listener(signum)
        self._chain(signum, frame)

    def _chain(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous_handlers.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            # The default disposition: die of the signal, so the exit status says so.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def observe(self, reason: str) -> None:
        """Observe only, from now on, because another process drives these GPUs.

        Called before :meth:`acquire` (which then takes no lease): the process that drives
        the GPUs owns their lease and restores them. Logs one warning; never raises, not
        even in strict mode (the caller decides what strictness means for its job).
        """
        with self._critical():
            if self._observe_reason is None:
                self._observe_reason = reason
                log.warning("%s. Running observe-only on this process.", reason)

    # ------------------------------------------------------------------ acquire
    def _ensure_acquired(self) -> None:
        if not self._acquired:
            self.acquire()

    def acquire(self) -> None:
        """Take the GPUs' leases: restore what crashed jobs left, detect live owners.

        Idempotent. A stale lease (its process died, or the machine rebooted) of one of
        these GPUs is restored first. A GPU leased by a live process makes this job
        observe-only. Then the pre-job settings are recorded and leases written.

        Raises:
            LeaseConflictError: strict mode, a GPU is leased by a live process.
            NotSupportedError: strict mode, a MIG instance or a GPU without power limits.
            DeviceError: strict mode, a lease cannot be written or a stale one restored;
                any mode, the GPU's settings cannot be read.
        """
        with self._critical():
            if self._acquired:
                return
            self._acquired = True
            self._owner_pid = os.getpid()
            me = ProcessIdentity.current()
            try:
                self._check_mig()
                if self._observe_reason is None:
                    self._take_locks(me)
                self._record_pre_job()
                if self._observe_reason is None:
                    self._write_leases(me)
                    self._check_foreign_clocks(range(len(self._gpus)))
            except BaseException:
                self._drop_leases()
                self._acquired = False  # strict mode: nothing may change; retry on next use
                raise
            if self._observe_reason is None:
                self._install_signal_handlers()
                atexit.register(self._restore_at_exit)
                self._atexit_registered = True

    def _check_mig(self) -> None:
        for gpu in self._gpus:
            if gpu.is_mig:
                reason = (
                    f"{_describe(gpu)} is a MIG instance: power limits and clocks belong to "
                    "the whole physical GPU, shared with other instances"
                )
                self._observe(reason, NotSupportedError(reason, operation="acquire_lease"))
                return

    def _take_locks(self, me: ProcessIdentity) -> None:
        """Lock every lease, restore stale ones; stop at a live owner (observe-only)."""
        for i, gpu in enumerate(self._gpus):
            if not gpu.lease_source().persistent:
                continue
            try:
                lock = self._store.try_lock(gpu.uuid)
                if lock is None:
                    lease = self._store.read(gpu.uuid)
                    owner = lease.owner.describe() if lease else "another process"
                    self._conflict(gpu, lease, f"{owner} holds its lock")
                    return
                self._locks[i] = lock
                lease = self._store.read(gpu.uuid)
                if lease is None:
                    continue
                alive, why = owner_status(lease.owner, me)
                if alive:
                    self._conflict(gpu, lease, why)
                    return
                self._restore_stale(gpu, lease, why)
            except DeviceError as exc:
                self._drop_leases()
                self._observe(f"cannot use the lease of {_describe(gpu)}: {exc}", exc)
                return

    def _conflict(self, gpu: GPU, lease: Lease | None, why: str) -> None:
        self._drop_leases()
        since = f" since {lease.created_at}" if lease else ""
        reason = f"{_describe(gpu)} is leased{since} by another job ({why})"
        error = LeaseConflictError(
            reason, owner_pid=lease.owner.pid if lease else 0, gpu_index=gpu.index
        )
        self._observe(reason, error)

    def _restore_stale(self, gpu: GPU, lease: Lease, why: str) -> None:
        if lease.changed:
            done = restore_stale_lease(gpu, lease, trusted=self._store.trusts(lease))
            log.warning(
                "%s: restoring the settings a crashed job left (%s): %s: %s.",
                _describe(gpu),
                why,
                lease.describe_settings(),
                done,
            )
        self._store.remove(gpu.uuid)

    def _record_pre_job(self) -> None:
        for i, gpu in enumerate(self._gpus):
            try:
                gpu.power_limit_constraints_w()
                self._pre_power_w[i] = gpu.power_limit_w()
            except NotSupportedError as exc:
                self._drop_leases()
                self._observe(f"{_describe(gpu)} has no power management: {exc}", exc)
            except DeviceError as exc:
                self._drop_leases()
                self._observe(f"{_describe(gpu)} cannot report its power limit: {exc}", exc)
            try:
                self._pre_clocks[i] = gpu.locked_clocks_mhz()
            except DeviceError:
                self._pre_clocks[i] = None

    def check_foreign_clocks(self) -> None:
        """Look for a clock setting this job did not make, on every GPU it has not locked.

        NVML cannot read a lock back and shows an administrator's ``nvidia-smi -lgc`` only
        while work runs under it (an idle GPU reports nothing but idleness), so the check
        at :meth:`acquire` misses a lock on an idle GPU: the controller calls this at the
        end of the first training steps, and :meth:`lock_clocks_mhz` checks again before
        each lock. A lock found makes clocks off limits for the rest of the run (never
        locked, so never reset at restore), with one warning. One reading per GPU (a GPU
        whose reading fails is skipped); a no-op once clocks are off limits, when
        observe-only, or once restored.
        """
        with self._critical():
            self._ensure_acquired()
            if not self._changes_blocked():
                self._check_foreign_clocks(range(len(self._gpus)))

    def _check_foreign_clocks(self, targets: Iterable[int]) -> bool:
        """Leave clocks alone when someone else set them (e.g. ``nvidia-smi -lgc``).

        NVML cannot read a lock back, so locking ours and resetting it at the end would
        silently release an administrator's lock. GPUs whose clocks this guard locked are
        skipped: their reasons show the guard's own lock, which replaced any other.
        Returns whether clocks are off limits.
        """
        if self._clocks_unsupported is not None:
            return True
        for i in targets:
            if self._clocks_applied[i]:
                continue
            gpu = self._gpus[i]
            try:
                reason = gpu.foreign_clock_setting()
            except DeviceError:
                continue
            if reason is not None:
                self._clocks_unsupported = reason
                log.warning(
                    "%s: %s. Its clocks are left alone (never locked, never reset); power "
                    "limits still apply.",
                    _describe(gpu),
                    reason,
                )
                return True
        return False

    def _write_leases(self, me: ProcessIdentity) -> None:
        for i, gpu in enumerate(self._gpus):
            source = gpu.lease_source()
            lease = Lease(
                gpu_uuid=gpu.uuid,
                gpu_index=gpu.index,
                gpu_name=gpu.name,
                owner=me,
                power_limit_w=self._pre_power_w[i],
                locked_clocks_mhz=self._pre_clocks[i],
                backend=source.backend,
                simulated_gpu=source.simulated_gpu,
                state_path=source.state_path,
                zeusd_address=source.zeusd_address,
            )
            self._leases[i] = lease
            if not source.persistent:
                continue
            try:
                self._store.write(lease)
            except DeviceError as exc:
                self._drop_leases()
                self._observe(f"cannot record the pre-job settings of {_describe(gpu)}: {exc}", exc)
                return
            self._persisted[i] = True

    def _drop_leases(self) -> None:
        """Forget leases taken so far (before any change): remove files, release locks."""
        for i, gpu in enumerate(self._gpus):
            if self._persisted[i]:
                with contextlib.suppress(DeviceError):
                    self._store.remove(gpu.uuid)
                self._persisted[i] = False
            lock = self._locks[i]
            if lock is not None:
                lock.release()
                self._locks[i] = None

    def _observe(self, reason: str, error: DeviceError) -> None:
        """Enter observe-only with one warning, or raise ``error`` in strict mode."""
        if self._strict:
            raise error
        if self._observe_reason is not None:
            return
        self._observe_reason = reason
        advice = (
            f" To change settings, {error.fix or PERMISSION_HELP}."
            if isinstance(error, NoPermissionError)
            else ""
        )
        log.warning(
            "%s. Running observe-only: energy and time are measured, GPU settings are left "
            "as they are.%s",
            reason,
            advice,
        )

    # ------------------------------------------------------------------ changes
    def _targets(self, gpus: Sequence[int] | None) -> list[int]:
        if gpus is None:
            return list(range(len(self._gpus)))
        bad = [i for i in gpus if not 0 <= i < len(self._gpus)]
        if bad or not gpus:
            raise ConfigError(
                f"gpus={list(gpus)!r}: positions must be in 0..{len(self._gpus) - 1} "
                "(at least one)",
                source="GPUGuard",
            )
        return list(dict.fromkeys(gpus))

    def _current_power_limit_w(self, targets: list[int]) -> float:
        try:
            return min(self._gpus[i].power_limit_w() for i in targets)
        except DeviceError:
            return min(self._pre_power_w[i] for i in targets)

    def _mark_changed(self, i: int, *, power: bool = False, clocks: bool = False) -> None:
        """Record in the lease, before the change, that GPU ``i`` is about to change."""
        lease = self._leases[i]
        if lease is None:
            return
        updated = dataclasses.replace(
            lease,
            power_limit_changed=lease.power_limit_changed or power,
            clocks_changed=lease.clocks_changed or clocks,
        )
        if updated != lease:
            if self._persisted[i]:
                self._store.write(updated)
            self._leases[i] = updated

    def _clamp_power(self, requested_w: float, targets: list[int]) -> list[float]:
        """One limit for all targets when their ranges overlap, each within its range and
        never above its pre-job limit; logs why a request was changed."""
        bounds = []
        for i in targets:
            lo, hi = self._gpus[i].power_limit_constraints_w()
            bounds.append((lo, min(hi, self._pre_power_w[i])))
        lo_all, hi_all = max(b[0] for b in bounds), min(b[1] for b in bounds)
        if lo_all <= hi_all:
            values = [min(max(requested_w, lo_all), hi_all)] * len(targets)
        else:
            values = [min(max(requested_w, lo), hi) for lo, hi in bounds]
        reasons: list[str] = []
        for i, value, (lo, cap) in zip(targets, values, bounds, strict=True):
            if value == requested_w:
                continue
            pre = self._pre_power_w[i]
            if requested_w > value == cap:
                why = f"above the pre-job limit {pre:g} W" if cap == pre else "above the maximum"
            elif requested_w < value == lo:
                why = "below the minimum"
            else:
                why = "kept equal across the GPUs"
            reasons.append(f"{_describe(self._gpus[i])}: {why}, applying {value:g} W")
        if reasons:
            log.info("Power limit %g W requested is clamped: %s.", requested_w, "; ".join(reasons))
        return values

    def _changes_blocked(self) -> bool:
        return self._observe_reason is not None or self._restored

    def set_power_limit_w(self, power_limit_w: float, gpus: Sequence[int] | None = None) -> float:
        """Set the power limit of some GPUs (all by default), clamped to what is allowed.

        The request is clamped into every target GPU's range and never above its pre-job
        limit; when the targets' ranges overlap, they all get the same limit. If changing
        GPU k fails, the GPUs already changed are put back to their pre-job settings and
        the job becomes observe-only (strict mode: the error is raised).

        Args:
            power_limit_w: the requested limit in watts.
            gpus: positions of the GPUs to change; None: all.

        Returns:
            The limit applied (the lowest one if the GPUs needed different limits); in
            observe-only mode nothing changes and the current limit is returned.

        Raises:
            ConfigError: ``power_limit_w`` is not a finite positive number, or a bad position.
            DeviceError: strict mode, a change failed (after rolling back).
        """
        if not (math.isfinite(power_limit_w) and power_limit_w > 0):
            raise ConfigError(
                f"power_limit_w: {power_limit_w!r} is not allowed; "
                "use a finite number of watts > 0",
                source="GPUGuard",
            )
        with self._critical():
            self._ensure_acquired()
            targets = self._targets(gpus)
            if self._changes_blocked():
                return self._current_power_limit_w(targets)
            i = targets[0]
            try:
                values = self._clamp_power(power_limit_w, targets)
                for i, value in zip(targets, values, strict=True):
                    self._mark_changed(i, power=True)
                    self._gpus[i].set_power_limit_w(value)
                    self._power_applied[i] = True
            except DeviceError as exc:
                self._power_applied[i] = self._power_applied[i] or _maybe_applied(exc)
                self._change_failed(i, exc)
                return self._current_power_limit_w(targets)
            return min(values)

    def _clamp_clocks(self, min_mhz: int, max_mhz: int, targets: list[int]) -> tuple[int, int]:
        """Clamp a clock range into the GPUs' supported clocks, never above a pre-job lock."""
        lo_all, hi_all = 0, max_mhz
        for i in targets:
            supported = self._gpus[i].supported_sm_clocks_mhz()
            hi = max(supported)
            pre = self._pre_clocks[i]
            if pre is not None:
                hi = min(hi, pre[1])
            lo_all, hi_all = max(lo_all, min(supported)), min(hi_all, hi)
        new_max = max(min(max_mhz, hi_all), lo_all)
        new_min = min(max(min_mhz, lo_all), new_max)
        if (new_min, new_max) != (min_mhz, max_mhz):
            log.info(
                "Clock lock %d-%d MHz requested is clamped to %d-%d MHz (the supported clocks "
                "of the GPUs, capped at any clock lock they had before the job).",
                min_mhz,
                max_mhz,
                new_min,
                new_max,
            )
        return new_min, new_max

    def lock_clocks_mhz(
        self,
        min_mhz: int,
        max_mhz: int,
        gpus: Sequence[int] | None = None,
        *,
        refusal_stops_clocks: bool = False,
    ) -> tuple[int, int] | None:
        """Lock the SM clock of some GPUs (all by default) into ``[min_mhz, max_mhz]``.

        The range is clamped to the supported clocks and never above the upper end of a
        clock lock the GPU had before the job. Failures are handled as in
        :meth:`set_power_limit_w`, except that a GPU without clock locking
        (:class:`NotSupportedError`) only disables clock control, with one warning.

        Args:
            min_mhz: lowest SM clock.
            max_mhz: highest SM clock.
            gpus: positions of the GPUs to change; None: all.
            refusal_stops_clocks: a refusal (no permission, or not supported) only turns
                clock control off, with one warning, in strict mode too (power limits still
                apply; :attr:`clocks_off_reason` says why).

        Returns:
            The ``(min_mhz, max_mhz)`` applied, or None when nothing was changed
            (observe-only, or clock locking unsupported or refused).

        Raises:
            ConfigError: ``min_mhz > max_mhz`` or not positive, or a bad position.
            DeviceError: strict mode, a change failed (after rolling back).
        """
        if not 0 < min_mhz <= max_mhz:
            raise ConfigError(
                f"min_mhz={min_mhz!r}, max_mhz={max_mhz!r}: need 0 < min_mhz <= max_mhz",
                source="GPUGuard",
            )
        with self._critical():
            self._ensure_acquired()
            targets = self._targets(gpus)
            if self._changes_blocked() or self._check_foreign_clocks(targets):
                return None
            return self._lock_targets(
                min_mhz, max_mhz, targets, refusal_stops_clocks=refusal_stops_clocks
            )

    @property
    def clocks_off_reason(self) -> str | None:
        """Why this job leaves the SM clocks alone (an administrator's lock, a GPU that
        cannot or may not lock them), or None."""
        return self._clocks_unsupported

    def _lock_targets(
        self, min_mhz: int, max_mhz: int, targets: list[int], *, refusal_stops_clocks: bool
    ) -> tuple[int, int] | None:
        """Lock ``targets``; on a failure roll back and handle it (see the callers)."""
        i = targets[0]
        try:
            applied = self._clamp_clocks(min_mhz, max_mhz, targets)
            for i in targets:
                self._mark_changed(i, clocks=True)
                self._gpus[i].set_locked_clocks_mhz(*applied)
                self._clocks_applied[i] = True
        except DeviceError as exc:
            self._clocks_applied[i] = self._clocks_applied[i] or _maybe_applied(exc)
            if refusal_stops_clocks and isinstance(exc, NoPermissionError | NotSupportedError):
                self._roll_back(clocks_only=True)
                self._clocks_off(self._gpus[i], exc)
            else:
                self._change_failed(i, exc, clocks=True)
            return None
        return applied

    def reset_clocks(self, gpus: Sequence[int] | None = None) -> None:
        """Put the clock state of some GPUs (all by default) back to its pre-job state.

        Only GPUs whose clocks this guard changed are touched: a pre-job lock is set
        again, otherwise the lock is released. After :meth:`restore` nothing is touched
        (the GPUs are back and released).

        Raises:
            ConfigError: a bad position.
            DeviceError: strict mode, a reset failed.
        """
        with self._critical():
            if self._restored:
                return
            self._ensure_acquired()
            for i in self._targets(gpus):
                lease = self._leases[i]
                if not self._clocks_applied[i] or lease is None:
                    continue
                try:
                    apply_saved_settings(self._gpus[i], lease, power=False, clocks=True)
                except DeviceError as exc:
                    self._change_failed(i, exc, clocks=True)
                    return
                self._clocks_applied[i] = False

    def _change_failed(self, i: int, exc: DeviceError, *, clocks: bool = False) -> None:
        """A change of GPU ``i`` failed: roll every change back, then observe (or raise).

        A clock operation the GPU does not support only disables clock control."""
        gpu = self._gpus[i]
        if clocks and isinstance(exc, NotSupportedError):
            self._roll_back(clocks_only=True)
            if self._strict:
                raise exc
            self._clocks_off(gpu, exc)
            return
        self._roll_back(clocks_only=False)
        if isinstance(exc, NoPermissionError):
            reason = f"no permission to change the settings of {_describe(gpu)} ({exc})"
        elif isinstance(exc, NotSupportedError):
            reason = f"{_describe(gpu)} does not support changing its settings ({exc})"
        else:
            reason = (
                f"changing {_describe(gpu)} failed ({exc}); the GPUs already changed were put "
                "back to their pre-job settings"
            )
        self._observe(reason, exc)

    def _clocks_off(self, gpu: GPU, exc: DeviceError) -> None:
        """Leave the clocks alone from now on (power limits still apply), with one warning."""
        if self._clocks_unsupported is None:
            self._clocks_unsupported = f"{_describe(gpu)} cannot lock its clocks ({exc})"
            log.warning(
                "%s cannot lock its clocks (%s): clocks are left alone, power limits still apply.",
                _describe(gpu),
                exc,
            )

    def _roll_back(self, *, clocks_only: bool) -> None:
        for j, gpu in enumerate(self._gpus):
            lease = self._leases[j]
            power = self._power_applied[j] and not clocks_only
            clocks = self._clocks_applied[j]
            if lease is None or not (power or clocks):
                continue
            try:
                apply_saved_settings(gpu, lease, power=power, clocks=clocks)
            except DeviceError as exc:
                log.error(
                    "%s: rolling back to %s failed: %s (retried at restore).",
                    _describe(gpu),
                    lease.describe_settings(),
                    exc,
                )
                continue
            self._power_applied[j] = self._power_applied[j] and clocks_only
            self._clocks_applied[j] = False

    def stop_changes(self, reason: str, error: DeviceError) -> None:
        """A GPU failed mid-run: put back what can be put back now, then only observe.

        Every GPU whose settings this guard changed is rolled back to its pre-job settings
        (one that cannot be reached keeps its lease and is retried at :meth:`restore`),
        and the job becomes observe-only with one warning.

        Args:
            reason: what failed, for the warning.
            error: the device error behind it.

        Raises:
            DeviceError: strict mode: ``error``, after rolling back.
        """
        with self._critical():
            if self._changes_blocked():
                return
            self._roll_back(clocks_only=False)
            self._observe(reason, error)

    # ------------------------------------------------------------------ restore
    def restore(self) -> None:
        """Put every GPU back to its pre-job settings, exactly once.

        Idempotent and safe from a signal handler; a no-op in a forked child (the parent
        restores). Each GPU whose restore succeeded has its lease removed; a GPU that
        could not be restored (lost, driver failure) keeps its lease, with an error log, so
        ``lightning-energy recover`` can repair it later. Never raises for device errors.
        """
        with self._critical():
            if self._restored or (self._acquired and os.getpid() != self._owner_pid):
                return
            self._restored = True
            for i, gpu in enumerate(self._gpus):
                self._restore_gpu(i, gpu)
            self._uninstall_signal_handlers()
            if self._atexit_registered:
                atexit.unregister(self._restore_at_exit)
                self._atexit_registered = False

    def _restore_gpu(self, i: int, gpu: GPU) -> None:
        lease = self._leases[i]
        lock, self._locks[i] = self._locks[i], None
        try:
            if lease is None:
                return
            power, clocks = self._power_applied[i], self._clocks_applied[i]
            if power or clocks:
                apply_saved_settings(gpu, lease, power=power, clocks=clocks)
                log.info("%s: restored %s.", _describe(gpu), lease.describe_settings())
            if self._persisted[i]:
                self._store.remove(gpu.uuid)
                self._persisted[i] = False
        except DeviceError as exc:
            kept = (
                f" Its lease {self._store.path_for(gpu.uuid)} is kept: run `lightning-energy "
                "recover` once the GPU is reachable."
                if self._persisted[i]
                else ""
            )
            settings = lease.describe_settings() if lease else "its settings"
            log.error("%s: could not restore %s: %s.%s", _describe(gpu), settings, exc, kept)
        finally:
            if lock is not None:
                lock.release()

    def _restore_at_exit(self) -> None:
        if not self._restored:
            log.warning(
                "GPU settings restored at interpreter exit: the run that changed them never "
                "ended (end it with `controller.teardown()`; a GPUGuard of your own with "
                "`with GPUGuard(...)` or `restore()`)."
            )
            self.restore()

    # ------------------------------------------------------------ signal handlers
    def _install_signal_handlers(self) -> None:
        if not self._install_handlers:
            return
        if threading.current_thread() is not threading.main_thread():
            log.info(
                "GPUGuard created outside the main thread: no SIGTERM/SIGINT handlers (GPUs "
                "are restored by the with block, restore() or at interpreter exit)."
            )
            return
        for signum in _SIGNALS:
            previous = signal.getsignal(signum)
            if previous is None or previous == signal.SIG_IGN:
                continue  # installed outside Python, or ignored on purpose: leave it alone
            try:
                signal.signal(signum, self._handler)
            except ValueError as exc:  # not the main interpreter
                log.info("cannot install a %s handler: %s", signal.Signals(signum).name, exc)
                continue
            self._previous_handlers[signum] = previous

    def handle_signals(self) -> None:
        """Install the SIGTERM/SIGINT handlers now, also when built without them.

        For frameworks that install their own handler when training starts (Lightning):
        called after that, the guard's handler runs first, restores at once, then hands
        the signal to the framework's. A no-op once restored, when observe-only, when
        installed already, or outside the main thread.
        """
        with self._critical():
            self._ensure_acquired()
            if self._changes_blocked() or self._previous_handlers:
                return
            self._install_handlers = True
            self._install_signal_handlers()

    def add_signal_listener(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(signum)`` when a SIGTERM/SIGINT handler of this guard has restored.

        It runs inside the signal handler, before the signal is handed on: it must only do
        what a handler may (set a flag, write to a socket), never take a lock.
        """
        self._signal_listeners.append(listener)

    def _uninstall_signal_handlers(self) -> None:
        for signum, previous in self._previous_handlers.items():
            if signal.getsignal(signum) is not self._handler:
                continue  # replaced by someone else since; ours only chains now
            try:
                signal.signal(signum, _live_handler(previous, signum))
            except ValueError:
                log.debug("cannot put the %s handler back from this thread", signum)

    # ---------------------------------------------------------- context manager
    def __enter__(self) -> GPUGuard:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.restore()
