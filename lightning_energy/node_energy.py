"""The node's CPU-package and DRAM energy, measured beside the GPUs' (never optimised).

CodeCarbon and Zeus count the CPUs and DRAM of a node (RAPL) besides its GPUs; so does a
run here, where the counters can be read, so its grams compare with theirs. One rank per
node measures (the lowest of the ranks that read the same counters: see
:func:`lightning_energy.controller.job_plan.node_meters`); the run summary, the report and the job's
totals say what was counted and, when nothing could be, why.

A RAPL counter starts again from 0 after its range: about every minute on a big server
(65.5 kJ at 1 kW). :class:`NodeEnergyMeter` reads every counter in the background every
:data:`SAMPLE_PERIOD_S` seconds (and at each logging interval) and takes a counter that
went backwards as one wrap. Two readings further apart than half a counter's wrap time (at
the highest power it was seen drawing, and at least at :data:`POWER_BOUND_W`) could hide a
second wrap: the energy is then a lower bound, and the summary says so.

Example:
    >>> from lightning_energy.config import NodeEnergyConfig
    >>> found = open_counters(NodeEnergyConfig(), simulated=True)
    >>> found.why
    'simulated GPUs'
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from lightning_energy.device.rapl import DEFAULT_POWERCAP_ROOT, RaplCounters
from lightning_energy.errors import NodeEnergyError

if TYPE_CHECKING:
    from lightning_energy.config import NodeEnergyConfig

__all__ = [
    "POWER_BOUND_W",
    "SAMPLE_PERIOD_S",
    "CounterSource",
    "NodeEnergyMeter",
    "NotMeasured",
    "counter_delta_uj",
    "energy_counted",
    "open_counters",
]

log = logging.getLogger(__name__)

#: Seconds between two background readings of the counters.
SAMPLE_PERIOD_S = 1.0
#: The power a read gap is judged at, at least, before a domain was seen drawing more.
POWER_BOUND_W = 1000.0
_UJ_PER_J = 1e6
#: The shortest stretch a domain's power is estimated over: a counter moves in steps of
#: about a millisecond, so two readings microseconds apart say nothing about power.
_MIN_POWER_SPAN_S = 0.5


class CounterDomain(Protocol):
    """One cumulative energy counter (a RAPL domain)."""

    @property
    def label(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def max_energy_range_uj(self) -> int: ...


class CounterSource(Protocol):
    """Where the node's counters are read: RAPL through powercap, or a fake."""

    @property
    def domains(self) -> Sequence[CounterDomain]: ...

    @property
    def left_out(self) -> Sequence[str]: ...

    def read_uj(self) -> list[int]:
        """One reading of every counter, in the order of ``domains``.

        Raises:
            NodeEnergyError: a counter cannot be read.
        """
        ...


@dataclass(frozen=True)
class NotMeasured:
    """Why the node's energy is not measured on this rank.

    Attributes:
        why: in a few words (``RAPL not readable (permission)``).
        reason: the whole story, naming the file or setting.
    """

    why: str
    reason: str

    def summary(self) -> dict[str, Any]:
        """The node's summary entry."""
        return {"measured": False, "why": self.why, "reason": self.reason}


def open_counters(config: NodeEnergyConfig, *, simulated: bool) -> RaplCounters | NotMeasured:
    """The node's counters as configured, or why there are none (never raises).

    Args:
        config: the ``node_energy:`` section.
        simulated: whether the GPUs are simulated: their energy is on a virtual clock, so
            the host's real CPU energy is not theirs; a tree is read only when
            ``powercap_root`` names one.
    """
    if not config.enabled:
        return NotMeasured("turned off (node_energy: false)", "node_energy is false")
    if config.powercap_root is None and simulated:
        return NotMeasured(
            "simulated GPUs",
            "simulated GPUs run on a virtual clock, the host's CPUs do not "
            "(node_energy.powercap_root reads a powercap tree anyway)",
        )
    try:
        return RaplCounters(config.powercap_root or DEFAULT_POWERCAP_ROOT)
    except NodeEnergyError as exc:
        log.info("CPU and DRAM energy not measured: %s", exc)
        return NotMeasured(exc.why, str(exc))


def counter_delta_uj(previous_uj: int, current_uj: int, range_uj: int) -> int:
    """The energy between two readings of a counter that starts again from 0 after
    ``range_uj``: a reading below the previous one wrapped once.

    Example:
        >>> counter_delta_uj(90, 30, 100)
        40
    """
    if current_uj >= previous_uj:
        return current_uj - previous_uj
    return range_uj - previous_uj + current_uj


class NodeEnergyMeter:
    """Cumulative energy of every counter of ``source``, read in the background.

    A failed reading costs nothing while the next one comes before a wrap could be
    missed: the energy in between is counted then. The summary says when the energy is
    incomplete (a read gap that may hide a wrap, or readings that failed at the end).

    Args:
        source: the counters.
        clock: seconds, for the read gaps (a monotonic clock).
        period_s: seconds between background readings.
    """

    def __init__(
        self,
        source: CounterSource,
        *,
        clock: Callable[[], float] = time.monotonic,
        period_s: float = SAMPLE_PERIOD_S,
    ) -> None:
        self._source = source
        self._domains = tuple(source.domains)
        self._clock = clock
        self._period_s = period_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: tuple[float, list[int]] | None = None
        self._total_uj = [0] * len(self._domains)
        self._peak_w = [0.0] * len(self._domains)
        self._last_ok = False
        self.gap: str | None = None
        self.error: str | None = None

    @property
    def energy_j(self) -> float | None:
        """Energy since the first reading, up to the last good one (None: none yet)."""
        with self._lock:
            return None if self._last is None else sum(self._total_uj) / _UJ_PER_J

    def start(self) -> None:
        """Take the first reading and read in the background from now on."""
        self.sample()
        self._thread = threading.Thread(
            target=self._run, name="lightning-energy-node-energy", daemon=True
        )
        self._thread.start()

    def read_j(self) -> float | None:
        """Read now: the energy so far, or None when this reading failed."""
        return self.energy_j if self.sample() else None

    def sample(self) -> bool:
        """Read every counter once and count what they moved (never raises).

        Returns:
            Whether the reading succeeded.
        """
        with self._lock:
            try:
                readings = self._source.read_uj()
            except NodeEnergyError as exc:
                self._last_ok = False
                if self.error is None:
                    log.warning("reading the CPU and DRAM energy counters failed: %s", exc)
                self.error = str(exc)
                return False
            now = self._clock()
            if self._last is not None:
                then, before = self._last
                for i, domain in enumerate(self._domains):
                    delta = counter_delta_uj(before[i], readings[i], domain.max_energy_range_uj)
                    self._total_uj[i] += delta
                    self._check_gap(i, now - then, delta)
            self._last = (now, readings)
            self._last_ok = True
            return True

    def _check_gap(self, i: int, elapsed_s: float, delta_uj: int) -> None:
        """Keep the domain's highest power; flag a gap that may hide a second wrap."""
        if elapsed_s <= 0:
            return
        domain = self._domains[i]
        power_w = max(self._peak_w[i], POWER_BOUND_W)
        wrap_s = domain.max_energy_range_uj / _UJ_PER_J / power_w
        if elapsed_s < wrap_s / 2:
            if elapsed_s >= _MIN_POWER_SPAN_S:
                self._peak_w[i] = max(self._peak_w[i], delta_uj / _UJ_PER_J / elapsed_s)
        elif self.gap is None:
            self.gap = (
                f"{domain.label} was read {elapsed_s:.0f} s apart, over half its counter's "
                f"wrap time ({wrap_s:.0f} s at {power_w:.0f} W): a wrap may be missed, the "
                "energy is a lower bound"
            )
            log.warning("CPU and DRAM energy: %s.", self.gap)

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            self.sample()

    def close(self) -> None:
        """Stop reading in the background, after a last reading. Idempotent."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self.sample()

    def summary(self) -> dict[str, Any]:
        """What was measured: energy by kind, the domains counted and left out, and
        whether it is complete (``note`` says why not)."""
        with self._lock:
            by_kind: dict[str, float] = {}
            for domain, uj in zip(self._domains, self._total_uj, strict=True):
                by_kind[domain.kind] = by_kind.get(domain.kind, 0.0) + uj / _UJ_PER_J
            read = self._last is not None
            note = self.gap
            if not self._last_ok:
                note = f"the last readings failed ({self.error}): the energy after them is missing"
        return {
            "measured": True,
            "energy_j": sum(by_kind.values()) if read else None,
            "package_energy_j": by_kind.get("package") if read else None,
            "dram_energy_j": by_kind.get("dram") if read else None,
            "domains": [d.label for d in self._domains],
            "left_out": list(self._source.left_out),
            "counted": "CPU packages + DRAM" if "dram" in by_kind else "CPU packages (no DRAM)",
            "complete": note is None,
            "note": note,
        }


def energy_counted(nodes: Sequence[Mapping[str, Any]]) -> str:
    """What a total counts, in words, from the summaries of every node of a job.

    Args:
        nodes: one summary per node (:meth:`NodeEnergyMeter.summary` or
            :meth:`NotMeasured.summary`).

    Returns:
        ``GPUs + CPU packages + DRAM``, ``GPUs + CPU packages (no DRAM)``, or ``GPUs only:
        RAPL not readable (permission)``; nodes measured partly are named by count.

    Example:
        >>> energy_counted([{"measured": False, "why": "RAPL not readable (permission)"}])
        'GPUs only: RAPL not readable (permission)'
    """
    measured = [n for n in nodes if n.get("measured")]
    missing = sorted({str(n.get("why") or "not measured") for n in nodes if not n.get("measured")})
    if not measured:
        return "GPUs only: " + ("; ".join(missing) or "CPU and DRAM not measured")
    with_dram = sum(1 for n in measured if n.get("dram_energy_j") is not None)
    text = "GPUs + CPU packages" + (" + DRAM" if with_dram else "")
    notes = []
    if not with_dram:
        notes.append("no DRAM")
    elif with_dram < len(measured):
        notes.append(f"DRAM on {with_dram} of {len(measured)} nodes")
    if missing:
        unmeasured = len(nodes) - len(measured)
        notes.append(f"{unmeasured} of {len(nodes)} nodes not measured: {'; '.join(missing)}")
    return text + (f" ({'; '.join(notes)})" if notes else "")
