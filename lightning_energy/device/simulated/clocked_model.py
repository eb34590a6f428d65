"""What the physics and the calibrated GPU models share: work that slows with the SM clock,
a power limit that caps the clock, and a simulated training step.

A piece of work takes ``t0_s`` at the maximum clock ``f_max``; its compute-bound share
``beta`` scales with the clock and the rest does not: at clock ``f`` it takes
``beta * t0_s * f_max / f + (1 - beta) * t0_s``. Under a power limit the work runs at the
highest supported clock (at most the upper bound of a clock lock) whose power fits under the
limit, or at the lowest clock when none does, so a power limit wins over a clock lock, as on
NVIDIA GPUs. A subclass says what power work draws at a clock.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

__all__ = ["ClockedModel"]


class ClockedModel(ABC):
    """A GPU model whose work slows with the SM clock (a :class:`~.simulated.GPUModel`).

    Subclasses are frozen dataclasses with these fields:

    Attributes:
        sm_clocks_mhz: supported SM clocks, descending; the first is ``f_max``.
        step_time_s: duration of one simulated training step at ``f_max``.
        step_compute_bound_share: compute-bound share ``beta`` of that step.
    """

    sm_clocks_mhz: tuple[int, ...]
    step_time_s: float
    step_compute_bound_share: float

    @abstractmethod
    def work_power_w(self, compute_bound_share: float, freq_mhz: float) -> float:
        """Average power of work with compute-bound share ``beta`` run at ``freq_mhz``."""

    def step_problems(self) -> list[str]:
        """The problems of the training step's fields (empty when they are valid)."""
        problems = []
        if not self.step_time_s > 0:
            problems.append(f"step_time_s: {self.step_time_s!r} is not allowed; use > 0")
        if not 0 <= self.step_compute_bound_share <= 1:
            problems.append(
                f"step_compute_bound_share: {self.step_compute_bound_share!r} is not allowed; "
                "use a number in [0, 1]"
            )
        return problems

    @property
    def max_clock_mhz(self) -> int:
        """``f_max``, the highest supported SM clock."""
        return self.sm_clocks_mhz[0]

    def work_time_s(self, t0_s: float, compute_bound_share: float, freq_mhz: float) -> float:
        """Duration of work taking ``t0_s`` at ``f_max`` when run at ``freq_mhz``."""
        beta = compute_bound_share
        return beta * t0_s * self.max_clock_mhz / freq_mhz + (1.0 - beta) * t0_s

    def clock_for(
        self, compute_bound_share: float, power_limit_w: float, max_clock_mhz: int | None = None
    ) -> int:
        """The static answer: the clock steady single-phase work settles at under a power
        limit and an optional clock ceiling (the governor of a simulated GPU,
        :mod:`.governor`, dithers around it, within a supported clock of it, until the
        limit stops binding).

        Args:
            compute_bound_share: the work's ``beta``.
            power_limit_w: the power limit in force.
            max_clock_mhz: the upper bound of a clock lock, if any.

        Returns:
            The highest supported clock not above ``max_clock_mhz`` whose average power fits
            under ``power_limit_w``; the lowest supported clock when none fits.
        """
        ceiling = self.max_clock_mhz if max_clock_mhz is None else max_clock_mhz
        for freq in self.sm_clocks_mhz:
            if freq <= ceiling and self.work_power_w(compute_bound_share, freq) <= power_limit_w:
                return freq
        return self.sm_clocks_mhz[-1]

    def run(
        self,
        t0_s: float,
        compute_bound_share: float,
        power_limit_w: float,
        max_clock_mhz: int | None,
    ) -> tuple[float, float]:
        """Duration and average power of a piece of work under the given settings.

        Args:
            t0_s: the work's duration at ``f_max``.
            compute_bound_share: its compute-bound share ``beta``.
            power_limit_w: the power limit in force.
            max_clock_mhz: the upper bound of a clock lock, if any.

        Returns:
            ``(duration_s, power_w)``.
        """
        freq = self.clock_for(compute_bound_share, power_limit_w, max_clock_mhz)
        return (
            self.work_time_s(t0_s, compute_bound_share, freq),
            self.work_power_w(compute_bound_share, freq),
        )

    def step_work(self) -> tuple[float, float]:
        """``(t0_s, compute_bound_share)`` of one simulated training step."""
        return self.step_time_s, self.step_compute_bound_share
