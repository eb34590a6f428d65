"""Split a coarse energy counter's updates between the pieces of work they cover.

An NVIDIA energy counter (``nvmlDeviceGetTotalEnergyConsumption``) moves only every
counter period ``P`` (about 100 ms on many boards): a read at time ``t`` returns the energy
used up to the counter's last update ``tau <= t``, and ``tau`` is not observable. Perseus'
instructions last milliseconds. The difference of two reads around one instruction is
the energy between two *earlier* updates: mostly 0 J, sometimes a whole period's worth, and
over a random phase its mean is the instruction's time at the power averaged over the
period before it -- blended with the bubbles around the instruction, so biased (low when
bubbles draw less than the instruction). Averaging more instructions does not remove that
bias.

:class:`EnergyTimeline` removes it. The caller marks the counter at every boundary of a
labelled timeline (each instruction's start and end, a bubble, a step's compute and its
wait), where each segment between two marks has one label and runs at one power. Then:

1. every mark where the counter moved brackets an update: it happened after the previous
   mark and within the last period (``(max(t_prev, t - P), t]``); as the phase of the
   counter is uniform, the update is placed at the middle of that bracket, which is
   right on average and, because one segment (one power) fills the bracket, errs on
   the energy by at most half the bracket at that segment's power;
2. when the updates of a stretch are strictly periodic (the simulated counter's are, and
   a hardware timer's should be), a phase and period that fit every bracket of the
   stretch place them much closer (a 2-variable linear program); updates that wander
   fit no such line and keep their bracket middles;
3. the counter's value at each update is the energy of exactly the timeline before it:
   ``sum over labels of (seconds of that label up to the update) x (its power)`` plus
   the stretch's origin, so the powers of all labels follow by least squares (each
   update weighed by how precisely it is placed). The time a label ran is measured
   exactly (clocks, not the counter), so each label's energy per segment is its power
   times its mean segment time.

This holds for any phase of the counter and any period (with a continuous counter,
``P = 0``, every mark is an exact reading and the powers are exact). The error left is
the placement of updates: unbiased, and shrinking with the number of updates, i.e. with
the time measured in counter periods (see :func:`min_profile_s`). Segments labelled
``None`` (a clock change landing, work outside the measured loop) are left out: the
stretch ends there and the next one starts after them, as it does when the counter goes
back (a driver reload).

Example:
    >>> timeline = EnergyTimeline(counter_period_s=0.0)
    >>> timeline.mark(0.0, 0.0, "busy")
    >>> timeline.mark(1.0, 300.0, "idle")
    >>> timeline.mark(3.0, 440.0, None)
    >>> {k: round(v.power_w, 3) for k, v in timeline.fit().items()}
    {'busy': 300.0, 'idle': 70.0}
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import linprog

from lightning_energy.errors import ConfigError, ProfileError

__all__ = ["COUNTER_PERIODS_PER_CLOCK", "EnergyTimeline", "LabelEnergy", "min_profile_s"]

#: Counter periods to measure at each profiled clock: the updates they bring split a
#: pipeline rank's forward, backward and wait power within a few percent on 10-100 ms
#: counters with 8-40 ms instructions (20 s per clock on a 100 ms counter; see
#: docs/perseus.md).
COUNTER_PERIODS_PER_CLOCK = 200

# How far the counter's period may be from the one given (the NVML probe's precision).
_PERIOD_SLACK = 0.05

# Shorter than this, a segment overlap is rounding.
_EPS_S = 1e-9


def min_profile_s(counter_period_s: float) -> float:
    """Seconds to measure at each profiled clock on a counter that moves every
    ``counter_period_s`` (0: a continuous counter needs no minimum)."""
    return COUNTER_PERIODS_PER_CLOCK * counter_period_s


@dataclass(frozen=True)
class LabelEnergy:
    """What the timeline tells about one label.

    Attributes:
        power_w: its mean power, fitted from the counter's increments.
        seconds: the time it ran, measured.
        segments: how many segments it had (instructions, waits).
    """

    power_w: float
    seconds: float
    segments: int

    @property
    def segment_s(self) -> float:
        """Mean duration of one segment."""
        return self.seconds / self.segments

    @property
    def segment_energy_j(self) -> float:
        """Mean energy of one segment (power times mean duration)."""
        return self.power_w * self.segment_s


class EnergyTimeline:
    """Counter marks at the boundaries of labelled segments; powers per label.

    Args:
        counter_period_s: how often the energy counter moves (0: continuously); see
            :meth:`~lightning_energy.device.base.GPU.energy_counter_period_s`.

    Raises:
        ConfigError: a negative or non-finite period.
    """

    def __init__(self, counter_period_s: float) -> None:
        if not 0.0 <= counter_period_s < math.inf:
            raise ConfigError(
                f"counter_period_s: {counter_period_s!r} is not allowed; "
                "use a finite number of seconds >= 0"
            )
        self.counter_period_s = float(counter_period_s)
        self._times: list[float] = []
        self._energies: list[float] = []
        self._labels: list[Hashable | None] = []

    def __len__(self) -> int:
        return len(self._times)

    def mark(self, time_s: float, energy_j: float, label: Hashable | None) -> None:
        """Record the counter at ``time_s``; the segment starting here has ``label``.

        Args:
            time_s: when the counter was read (monotonic; GPU synchronised).
            energy_j: the counter's value.
            label: what runs from now to the next mark (None: leave it out).

        Raises:
            ConfigError: ``time_s`` is before the previous mark.
        """
        if self._times and time_s < self._times[-1]:
            raise ConfigError(
                f"time_s={time_s!r}: before the previous mark at {self._times[-1]!r} s"
            )
        self._times.append(float(time_s))
        self._energies.append(float(energy_j))
        self._labels.append(label)

    def leave_out(self) -> None:
        """Leave out the segment running since the last mark (work that went unmarked,
        such as a step that could not be measured): its label becomes None."""
        if self._labels:
            self._labels[-1] = None

    def clear(self) -> None:
        """Forget every mark."""
        self._times.clear()
        self._energies.clear()
        self._labels.clear()

    def updates(self) -> int:
        """How many counter updates the marks bracket."""
        return len(self._ticks())

    # ------------------------------------------------------------------ fitting
    def _ticks(self) -> list[tuple[int, float, float, float]]:
        """``(chain, bracket start, bracket end, counter value)`` of every update the
        marks bracket. A chain is a stretch of marks whose counter values share one
        origin: a counter that goes back (driver reload) or a left-out segment starts a
        new one."""
        period = self.counter_period_s
        t, e, labels = self._times, self._energies, self._labels
        ticks: list[tuple[int, float, float, float]] = []
        chain = 0
        for i in range(len(t)):
            if i > 0 and (e[i] < e[i - 1] or (labels[i - 1] is None and t[i] > t[i - 1])):
                chain += 1
                if period > 0:
                    continue  # the value may predate the reload or the left-out segment
            if period == 0:
                ticks.append((chain, t[i], t[i], e[i]))
            elif i > 0 and e[i] > e[i - 1]:
                ticks.append((chain, max(t[i - 1], t[i] - period), t[i], e[i]))
        return ticks

    def fit(self) -> dict[Hashable, LabelEnergy]:
        """Fit every label's power from the counter's updates.

        Returns:
            ``{label: LabelEnergy}`` for every label measured between two updates.

        Raises:
            ProfileError: the counter never moved twice within the measured segments, or
                the segments' mixes cannot tell some labels apart.
        """
        labels = sorted({x for x in self._labels if x is not None}, key=repr)
        column = {label: j for j, label in enumerate(labels)}
        n, k = len(self._times), len(labels)
        cols = [k if x is None else column[x] for x in self._labels]
        cum = np.zeros((max(n, 1), k + 1))
        counts = np.zeros(k, dtype=np.int64)
        for i in range(n - 1):
            cum[i + 1] = cum[i]
            cum[i + 1, cols[i]] += self._times[i + 1] - self._times[i]
            if cols[i] < k:
                counts[cols[i]] += 1

        def segment(tau: float) -> int:
            return max(bisect.bisect_left(self._times, tau) - 1, 0)

        ticks = self._ticks()
        per_chain: dict[int, int] = {}
        for chain, *_ in ticks:
            per_chain[chain] = per_chain.get(chain, 0) + 1
        ticks = [tick for tick in ticks if per_chain[tick[0]] >= 2]
        chains = sorted({tick[0] for tick in ticks})
        origins: dict[int, float] = {}
        for chain, _, _, value in ticks:
            origins.setdefault(chain, value)  # values relative to it: well conditioned
        places = self._place(ticks)
        if not ticks:
            raise ProfileError(
                f"the energy counter moved {self.updates()} time(s) over {self._span_s():.3f} s "
                f"of measured work: measure longer (at least "
                f"{min_profile_s(self.counter_period_s):.1f} s per clock on a "
                f"{self.counter_period_s * 1000:.0f} ms counter)"
            )
        # v_n = (seconds of each label up to the update) . powers + the chain's origin.
        x = np.zeros((len(ticks), k + len(chains)))
        widths = np.zeros(len(ticks))
        seg_cols = np.zeros(len(ticks), dtype=np.int64)
        v = np.zeros(len(ticks))
        for r, ((chain, _, high, value), (tau, width)) in enumerate(
            zip(ticks, places, strict=True)
        ):
            i = segment(high)
            x[r, :k] = cum[i, :k]
            if cols[i] < k:
                x[r, cols[i]] += tau - self._times[i]
            x[r, k + chains.index(chain)] = 1.0
            widths[r] = width
            seg_cols[r] = cols[i]
            v[r] = value - origins[chain]
        seen = [j for j in range(k) if np.ptp(x[:, j]) > _EPS_S] + list(range(k, k + len(chains)))
        x = x[:, seen]
        # The placement error of an update is uniform over its bracket at the power of the
        # segment there: weigh each by the inverse of its spread (two passes: the powers
        # are what is being fitted).
        power = np.full(len(ticks), 1.0)
        solution = np.zeros(len(seen))
        for _ in range(2):
            spread = widths * power + _EPS_S * max(float(np.abs(v).max()), 1.0)
            w = 1.0 / spread
            solution, _, rank, _ = np.linalg.lstsq(x * w[:, None], v * w)
            if rank < len(seen):
                raise ProfileError(
                    f"the energy counter's {len(ticks)} updates cannot tell "
                    f"{[labels[j] for j in seen if j < k]} apart: measure longer, or more "
                    "varied work"
                )
            fitted = dict(zip(seen, solution, strict=True))
            mean_w = max(float(np.mean([fitted[j] for j in seen if j < k] or [1.0])), 1e-3)
            power = np.array([max(fitted.get(int(c), mean_w), 1e-3 * mean_w) for c in seg_cols])
        seconds = cum[-1, :k]
        return {
            labels[j]: LabelEnergy(float(p), float(seconds[j]), int(counts[j]))
            for j, p in zip(seen, solution, strict=True)
            if j < k and counts[j] > 0
        }

    def _place(self, ticks: list[tuple[int, float, float, float]]) -> list[tuple[float, float]]:
        """``(time, uncertainty)`` of each update: the middle of its bracket; or, where
        the updates of a chain are strictly periodic, as the simulated counter's and a
        hardware timer's are, ``c + m P`` with the phase ``c`` and period ``P`` that fit
        every bracket of the chain (found by a small linear program). A counter whose
        updates are not periodic fits no such line and keeps its brackets."""
        places = [(0.5 * (low + high), high - low) for _, low, high, _ in ticks]
        period = self.counter_period_s
        if period <= 0:
            return places
        start = 0
        while start < len(ticks):
            end = start
            while end < len(ticks) and ticks[end][0] == ticks[start][0]:
                end += 1
            fitted = _periodic_times([(low, high) for _, low, high, _ in ticks[start:end]], period)
            if fitted is not None:
                places[start:end] = fitted
            start = end
        return places

    def _span_s(self) -> float:
        return self._times[-1] - self._times[0] if self._times else 0.0


def _period_counts(brackets: list[tuple[float, float]], period_s: float) -> list[int] | None:
    """Whole periods from the first update to each, or None when the brackets do not
    follow a period within ``_PERIOD_SLACK`` of ``period_s``.

    The update's possible times are carried from bracket to bracket, shifted by whole
    periods: the count is the shift that meets the next bracket, and the overlap narrows
    what is carried on. Two such intervals are carried: one at exactly ``period_s`` (it
    decides when it meets the bracket) and one widened by the slack per period (for a
    period that is a little off).
    """
    exact = slack = brackets[0]
    counts = [0]
    for low, high in brackets[1:]:
        first = max(1, math.floor((low - slack[1]) / (period_s * (1 + _PERIOD_SLACK))))
        last = math.ceil((high - slack[0]) / (period_s * (1 - _PERIOD_SLACK)))
        best: tuple[float, float, int] | None = None
        for k in range(first, last + 1):
            shift, widen = k * period_s, _PERIOD_SLACK * k * period_s
            met = min(high, exact[1] + shift) - max(low, exact[0] + shift)
            loose = min(high, slack[1] + shift + widen) - max(low, slack[0] + shift - widen)
            if loose >= 0 and (best is None or (met, loose) > best[:2]):
                best = (met, loose, k)
        if best is None:
            return None
        met, _, k = best
        shift, widen = k * period_s, _PERIOD_SLACK * k * period_s
        slack = (max(low, slack[0] + shift - widen), min(high, slack[1] + shift + widen))
        exact = (max(low, exact[0] + shift), min(high, exact[1] + shift)) if met >= 0 else slack
        counts.append(counts[-1] + k)
    return counts


def _periodic_times(
    brackets: list[tuple[float, float]], period_s: float
) -> list[tuple[float, float]] | None:
    """Update times ``c + m_n P`` consistent with every bracket, with their uncertainty;
    None when no phase and period (within ``_PERIOD_SLACK`` of ``period_s``) fit them
    all, or when those that fit leave the times less certain than the brackets do.

    ``m_n`` counts periods from the first update (:func:`_period_counts`). Among the lines
    that fit, the one furthest inside the tightest brackets is taken; the uncertainty is
    how far the fitting lines spread at the first and last update (it is largest at one
    of them).
    """
    if len(brackets) < 3:
        return None
    counts = _period_counts(brackets, period_s)
    if counts is None:
        return None
    m = np.asarray(counts, dtype=np.float64)
    low = np.asarray([b[0] for b in brackets]) - brackets[0][0]
    high = np.asarray([b[1] for b in brackets]) - brackets[0][0]
    # Variables (c, P, s): low + s <= c + m P <= high - s.
    ones = np.ones_like(m)
    a_ub = np.vstack([np.column_stack([ones, m, ones]), np.column_stack([-ones, -m, ones])])
    b_ub = np.concatenate([high, -low])
    period_bounds = ((1 - _PERIOD_SLACK) * period_s, (1 + _PERIOD_SLACK) * period_s)

    def solve(objective: list[float], margin: tuple[float | None, float | None]) -> Any:
        return linprog(
            c=objective,
            A_ub=a_ub,
            b_ub=b_ub,
            bounds=[(None, None), period_bounds, margin],
            method="highs",
        )

    best = solve([0.0, 0.0, -1.0], (None, None))
    if not best.success or best.x[2] < -_EPS_S:
        return None
    spread = 0.0
    for objective in ([1.0, 0.0, 0.0], [1.0, m[-1], 0.0]):
        lowest, highest = solve(objective, (0.0, None)), solve([-x for x in objective], (0.0, None))
        if not (lowest.success and highest.success):
            return None
        spread = max(spread, -highest.fun - lowest.fun)
    if spread >= float(np.median(high - low)):
        return None
    c, p, _ = best.x
    return [(float(brackets[0][0] + c + k * p), spread) for k in m]
