"""CarbonPacer on a simulated GPU's clock: the intensity it serves is the one in force."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carbon.config import CarbonConfig
from lightning_energy.pacing import CarbonPacer
from tests.carbon.conftest import ApiServer, Reply

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


class _HeldPolicy:
    """A policy whose decisions wait until the test lets them through, as a plan over
    days of intervals keeps a CPU busy for seconds."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.started = threading.Event()
        self.release = threading.Event()
        self.threads: list[str] = []

    def observe(self, history: Any) -> None:
        self.policy.observe(history)

    def decide(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(threading.current_thread().name)
        self.started.set()
        assert self.release.wait(timeout=60), "the test never released the decision"
        return self.policy.decide(*args, **kwargs)


FRONTIER = [(1.0, 300.0, "300 W"), (1.25, 250.0, "250 W")]


def _wall_clock_pacer(clock: dict[str, datetime]) -> tuple[CarbonPacer, _HeldPolicy]:
    config = CarbonConfig(
        provider="constant", policy="forecast", deadline=timedelta(hours=36), poll_interval_s=600
    )
    pacer = CarbonPacer(config, now=lambda: clock["now"], virtual_clock=False)
    held = _HeldPolicy(pacer.policy)
    pacer.policy = held  # type: ignore[assignment]
    return pacer, held


def _in_thread(call: Callable[[], Any]) -> Any:
    """``call()`` on another thread; fails when it has not returned after a minute (it
    waited for the held decision)."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(call()))
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the caller waited for the decision"
    return out[0]


def test_on_the_wall_clock_the_first_interval_is_charged_at_the_grids_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first poll runs in the background; the intensity read right after ``start()``
    charges the run's first logging interval, so it must be the grid's, not the fallback
    (400 g/kWh) of a poll still on its way: a real API answers in tens of milliseconds."""
    now = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
    server = ApiServer()
    server.route(
        "/v4/carbon-intensity/latest",
        Reply.json({"zone": "FR", "carbonIntensity": 35, "datetime": now.isoformat()}, delay_s=0.2),
    )
    server.start()
    monkeypatch.setenv("ELECTRICITYMAPS_TOKEN", "a-token")
    config = CarbonConfig(
        provider="electricitymaps", region="FR", base_url=server.url + "/v4", poll_interval_s=600
    )
    pacer = CarbonPacer(config, now=lambda: datetime.now(timezone.utc), virtual_clock=False)
    try:
        pacer.start()
        assert pacer.intensity_g_per_kwh() == 35.0
        assert len(server.requests_to("/v4/carbon-intensity/latest")) == 1
    finally:
        pacer.stop()
        server.stop()


def test_on_the_wall_clock_the_policy_decides_in_the_background(tmp_path: Path) -> None:
    clock = {"now": T0}
    pacer, held = _wall_clock_pacer(clock)
    pacer.start()
    try:
        first = _in_thread(lambda: pacer.update(10_000, FRONTIER, 30.0))
        assert held.started.wait(timeout=60)
        # The boundary that asked goes on at once, with no pace until the plan is ready.
        assert first.scale is None and not first.pause and first.reason == "planning the pace"
        clock["now"] += timedelta(seconds=30)
        again = _in_thread(lambda: pacer.update(9_990, FRONTIER, 30.0))
        assert again.scale is None  # still planning: nothing new is asked for meanwhile
        assert held.threads == ["lightning-energy-pace-planner"]
        held.release.set()
        decided = _in_thread(lambda: pacer.update(9_980, FRONTIER, 30.0, wait=True))
        assert decided.scale is not None and decided.reason != "planning the pace"
        clock["now"] += timedelta(seconds=30)
        held_on = pacer.update(9_970, FRONTIER, 30.0)  # within the interval: held
        assert (held_on.scale, held_on.reason) == (decided.scale, decided.reason)
        assert len(held.threads) == 1
    finally:
        held.release.set()
        pacer.stop()


def test_a_failed_background_decision_is_raised_on_the_next_update() -> None:
    clock = {"now": T0}
    pacer, held = _wall_clock_pacer(clock)

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("policy failed")

    held.decide = failing  # type: ignore[method-assign]
    pacer.start()
    try:
        pacer.update(10_000, FRONTIER, 30.0)
        with pytest.raises(RuntimeError, match="policy failed"):
            pacer.update(10_000, FRONTIER, 30.0, wait=True)
    finally:
        pacer.stop()


def test_on_a_virtual_clock_decisions_are_made_at_once() -> None:
    clock = {"now": T0}
    config = CarbonConfig(
        provider="constant", policy="forecast", deadline=timedelta(hours=36), poll_interval_s=600
    )
    pacer = CarbonPacer(config, now=lambda: clock["now"], virtual_clock=True)
    pacer.start()
    try:
        update = pacer.update(10_000, FRONTIER, 30.0)
        assert update.scale is not None
        assert not [t for t in threading.enumerate() if t.name.endswith("pace-planner")]
    finally:
        pacer.stop()
