"""Per-instruction clocks off the training thread: :class:`ClockController`.

A dedicated thread (``lightning-energy-perseus-clock``) locks the GPU clock through the
:class:`~lightning_energy.device.guard.GPUGuard`. The training thread only records a marker
with each request (a blocking CUDA event on the stage device's current stream, where the
instruction's kernels are queued); the thread, working on the stage's device, sleeps until
the GPU reaches it, then applies the newest request the GPU has passed (older ones
coalesce), so changes land at instruction boundaries, never stall the CPU issuing kernels
and never queue without bound. Resetting the clocks never waits for the GPU (a stream may
never advance again: a dead peer).

:func:`agree_on_clock_control` has every rank find out, together, whether clocks may be
changed at all.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_energy.device import cuda_stream
from lightning_energy.device.base import GPU
from lightning_energy.device.cuda_events import StreamPoint
from lightning_energy.device.guard import GPUGuard
from lightning_energy.errors import ConfigError

__all__ = ["ClockController", "agree_on_clock_control"]

log = logging.getLogger(__name__)

_THREAD_NAME = "lightning-energy-perseus-clock"


class _Reached:
    """Devices without a stream (CPU, simulated GPUs): every point is reached at once."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class ClockController:
    """Locks one GPU's SM clock from a dedicated thread, following the stage's stream.

    The training thread only records a marker on the stage device's current stream with
    each request. The thread (its CUDA calls on the stage's device) waits, blocking, not
    spinning, for the oldest pending marker, then applies the newest request whose marker
    the GPU has reached and drops the older ones: when setting a clock takes longer than an
    instruction runs, requests coalesce instead of queueing without bound, and the clock
    set is the one of the instruction the GPU runs now.

    Nothing that puts clocks back waits for the GPU: a stream may never reach a marker
    again (a peer died in the middle of a receive), so :meth:`reset` drops the pending
    requests and resets the clocks at once, and a request made before it is never applied.
    :meth:`flush`, the one wait while training runs, gives up after ``flush_timeout_s``.

    Args:
        guard: the guard every change goes through (restores the GPU at the end).
        gpu_position: position of the GPU in the guard's list.
        gpu: the GPU, to read back the clock actually locked (None: the guard's answer).
        device: the stage's device; on a CUDA device, changes follow its current stream.
            None: the current CUDA device of the thread building the controller (when
            there is CUDA).
        wait_for_device: on CUDA, apply a change only when the GPU reaches the point of
            the stream where it was requested; otherwise at once (no stream is followed).
        marker: makes a marker at the current point of the stream (default: a blocking
            CUDA event on the stage device's current stream, else an already reached one).
        flush_timeout_s: the longest :meth:`flush` waits for the GPU.

    Raises:
        ConfigError: ``flush_timeout_s`` is not a positive number of seconds.
    """

    def __init__(
        self,
        guard: GPUGuard,
        gpu_position: int = 0,
        *,
        gpu: GPU | None = None,
        device: torch.device | None = None,
        wait_for_device: bool = True,
        marker: Callable[[], StreamPoint] | None = None,
        flush_timeout_s: float = 60.0,
    ):
        if not 0 < flush_timeout_s < float("inf"):
            raise ConfigError(
                f"flush_timeout_s: {flush_timeout_s!r} is not allowed; use a finite number "
                "of seconds > 0",
                source="ClockController",
            )
        self.guard = guard
        self.gpu_position = gpu_position
        self.gpu = gpu
        #: The CUDA device whose stream the changes follow (None: none, changes at once).
        #: The stream the changes follow (None: none, changes apply at once).
        self.stream = cuda_stream(device) if wait_for_device else None
        if marker is None:
            marker = _Reached if self.stream is None else self.stream.marker
        self._marker = marker
        self.flush_timeout_s = flush_timeout_s
        self._cond = threading.Condition()
        self._apply_lock = threading.Lock()  # one change or reset of the GPU at a time
        self._pending: list[tuple[int, StreamPoint]] = []
        self._busy = False  # the thread works on a request (not voided since)
        self._waiting = False  # the thread waits for the GPU to reach a marker
        self._epoch = 0  # moves on at every reset and stop: earlier requests are void
        self._thread: threading.Thread | None = None
        self._current: int | None = None
        self._requested: int | None = None
        self._error: BaseException | None = None
        self._warned_flush = False
        self.changes = 0

    @property
    def current_mhz(self) -> int | None:
        """The clock the GPU was last locked to, as read back (None: none yet, or reset)."""
        return self._current

    def start(self) -> None:
        """Start the worker thread (idempotent)."""
        with self._cond:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name=_THREAD_NAME, daemon=True)
            self._thread.start()

    def request(self, freq_mhz: int) -> None:
        """Ask for ``freq_mhz`` from the current point of the GPU stream on; never blocks.

        Raises:
            EnergyError: an earlier change failed in strict mode (re-raised here).
        """
        self._raise_pending()
        if freq_mhz == self._requested:
            return
        self.start()
        marker = self._marker()
        with self._cond:
            self._requested = freq_mhz
            self._pending.append((freq_mhz, marker))
            self._cond.notify_all()

    def flush(self) -> bool:
        """Wait until every requested change is applied (or superseded): before a
        measured instruction, on simulated GPUs. Waits at most ``flush_timeout_s`` (one
        warning when the GPU did not get there: its stream may be stalled).

        Returns:
            True when every request was applied, False when the wait gave up.

        Raises:
            EnergyError: a change failed in strict mode.
        """
        with self._cond:
            done = self._cond.wait_for(
                lambda: not self._pending and not self._busy, timeout=self.flush_timeout_s
            )
        if not done and not self._warned_flush:
            self._warned_flush = True
            log.warning(
                "Perseus: the GPU did not reach a requested clock change within %.0f s (is "
                "its stream stalled, waiting for a peer?); going on without waiting for it.",
                self.flush_timeout_s,
            )
        self._raise_pending()
        return done

    def reset(self) -> None:
        """Put the GPU's clocks back to their pre-job state now. Requests not applied yet
        are dropped (never applied later) and the GPU is not waited for.

        Raises:
            EnergyError: a change failed in strict mode (after the reset).
        """
        with self._cond:
            self._drop_pending()
            self._requested = None
        with self._apply_lock:  # a change being applied now ends first
            self._current = None
            self.guard.reset_clocks([self.gpu_position])
        self._raise_pending()

    def stop(self) -> None:
        """Stop the thread, dropping what is pending (idempotent). A thread waiting for the
        GPU is not waited for: it applies nothing more and ends when the stream moves."""
        with self._cond:
            thread, self._thread = self._thread, None
            waiting = self._waiting
            self._drop_pending()
        if thread is not None and not waiting:
            thread.join(self.flush_timeout_s)

    def _drop_pending(self) -> None:
        """Void every request not applied yet, the one being waited for too (under the
        condition's lock)."""
        self._pending.clear()
        self._busy = False
        self._epoch += 1
        self._cond.notify_all()

    def _raise_pending(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _next(self) -> tuple[StreamPoint, int] | None:
        """The oldest pending request's marker and the epoch it belongs to (None: this
        thread was stopped)."""
        me = threading.current_thread()
        with self._cond:
            self._cond.wait_for(lambda: bool(self._pending) or self._thread is not me)
            if self._thread is not me:
                return None
            self._busy = self._waiting = True
            return self._pending[0][1], self._epoch

    def _take_newest_reached(self) -> int:
        """Drop the pending requests the GPU has passed; the newest of them."""
        last = 0
        for k in range(1, len(self._pending)):
            if not self._pending[k][1].query():
                break  # markers are in stream order: later ones are not reached
            last = k
        freq = self._pending[last][0]
        del self._pending[: last + 1]
        return freq

    def _apply_reached(self, epoch: int) -> None:
        """Apply the newest request the GPU has passed, unless a reset or stop came since
        the thread started waiting (``epoch``)."""
        with self._apply_lock:
            with self._cond:
                if epoch != self._epoch:
                    return
                freq = self._take_newest_reached()
            if freq == self._current:
                return
            applied = self.guard.lock_clocks_mhz(freq, freq, gpus=[self.gpu_position])
            if self.gpu is not None:
                applied = self.gpu.locked_clocks_mhz()
            self._current = None if applied is None else applied[1]
            self.changes += 1

    def _run(self) -> None:
        try:
            if self.stream is not None:
                # Every CUDA call of this thread on the stage's GPU.
                self.stream.make_current()
        except BaseException as exc:  # handed to the training thread
            self._error = exc
        while (item := self._next()) is not None:
            marker, epoch = item
            try:
                try:
                    marker.synchronize()
                finally:
                    with self._cond:
                        self._waiting = False
                self._apply_reached(epoch)
            except BaseException as exc:  # handed to the training thread
                self._error = exc
                with self._cond:
                    if epoch == self._epoch:
                        self._drop_pending()
            finally:
                with self._cond:
                    if epoch == self._epoch:  # else a reset or stop voided it already
                        self._busy = False
                        self._cond.notify_all()


def agree_on_clock_control(
    guard: GPUGuard, freq_mhz: int | None, gpu_position: int = 0, group: Any = None
) -> bool:
    """Lock ``freq_mhz`` to find out whether clocks may be changed, and agree on it.

    Without permission (or with a GPU that cannot lock its clocks, or observe-only for
    any other reason) the guard logs its one warning; every rank of ``group`` then learns
    that clocks cannot be controlled everywhere, and those that locked one reset it, so
    no rank profiles or plans clocks that would never be applied.

    Every rank of ``group`` must call it at the same point, whatever happened before on
    that rank: a rank that cannot control clocks (its supported clocks could not be read:
    ``freq_mhz=None``) votes against, and a lock that raises (strict mode) raises only
    after the vote, so the other ranks never wait for a rank that left.

    Args:
        guard: the guard of this rank's GPU.
        freq_mhz: the clock to lock (the first one Perseus wants); None: this rank cannot
            control clocks and only votes against.
        gpu_position: position of the GPU in the guard.
        group: a process group taking CPU objects (None: the default group); a single
            process decides alone.

    Returns:
        True when every rank locked ``freq_mhz``.

    Raises:
        Exception: what locking raised on this rank (strict mode), after the vote.
    """
    locked = False
    failure: Exception | None = None
    if freq_mhz is not None and not guard.observe_only:
        try:
            locked = guard.lock_clocks_mhz(freq_mhz, freq_mhz, gpus=[gpu_position]) is not None
        except Exception as exc:  # re-raised once every rank has its vote
            failure = exc
    agreed = locked
    if dist.is_initialized():
        votes: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(votes, locked, group=group)
        agreed = all(votes)
        if locked and not agreed:
            guard.reset_clocks([gpu_position])
            refused = [r for r, vote in enumerate(votes) if not vote]
            log.info("Perseus disabled: rank(s) %s cannot change GPU clocks.", refused)
    if failure is not None:
        raise failure
    return agreed
