"""CarbonPacer on a simulated GPU's clock: the intensity it serves is the one in force."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carbon.config import CarbonConfig
from lightning_energy.pacing import CarbonPacer

T0 = datetime(2023, 3, 1, tzinfo=timezone.utc)
SPAN_S = 3 * 86400.0


def _write_trace(path: Path, gaps_s: list[int]) -> list[tuple[float, float]]:
    """Rows every gap of ``gaps_s`` (cycled) over three days, each value its own."""
    rows, t, k = [], 0.0, 0
    while t < SPAN_S:
        rows.append((t, 100.0 + k))
        t += gaps_s[k % len(gaps_s)]
        k += 1
    lines = ["Datetime (UTC),Carbon Intensity"] + [
        f"{T0 + timedelta(seconds=s):%Y-%m-%d %H:%M:%S},{v:.1f}" for s, v in rows
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return rows


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    gaps_s=st.lists(st.sampled_from([300, 900, 1800, 3600, 5400]), min_size=1, max_size=12),
    poll_s=st.sampled_from([60.0, 900.0, 3600.0, 7200.0]),
    horizon_s=st.sampled_from([0.0, 3600.0, 172800.0]),
    asks_s=st.lists(st.floats(1.0, 2000.0), min_size=1, max_size=80),
)
def test_a_replayed_trace_is_served_at_the_value_in_force_whatever_the_polling(
    tmp_path_factory: pytest.TempPathFactory,
    gaps_s: list[int],
    poll_s: float,
    horizon_s: float,
    asks_s: list[float],
) -> None:
    # Rows at irregular spacings, any polling period, with or without a forecast fetched:
    # every ask on the simulated clock gets the row in force then, never one held past
    # its end until the next poll.
    path = tmp_path_factory.mktemp("trace") / "grid.csv"
    rows = _write_trace(path, gaps_s)
    clock = {"now": T0}
    config = CarbonConfig(
        provider="trace", region=str(path), poll_interval_s=poll_s, forecast_horizon_s=horizon_s
    )
    pacer = CarbonPacer(config, now=lambda: clock["now"], virtual_clock=True)
    pacer.start()
    try:
        for ask_s in asks_s:
            clock["now"] += timedelta(seconds=ask_s)
            elapsed_s = (clock["now"] - T0).total_seconds()
            in_force = [v for s, v in rows if s <= elapsed_s][-1]
            assert pacer.intensity_g_per_kwh() == in_force, elapsed_s
    finally:
        pacer.stop()
