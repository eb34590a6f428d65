"""Shared fixtures. Every test is checked for leaks: threads, signal handlers, env vars and
simulated GPU settings."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from hypothesis import settings

from carbon.providers.trace import TraceProvider
from lightning_energy.device.simulated import live_simulated_gpus, track_simulated_gpus

DATA_DIR = Path(__file__).parent / "data"

# Property tests draw the same examples on every run, so a green run stays green on a fresh
# machine; set HYPOTHESIS_PROFILE=explore to draw new ones while developing. No example has
# a time limit: how long one takes says how busy the machine is, not whether it is right.
settings.register_profile("repeatable", derandomize=True, database=None, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

_SIGNALS = [signal.SIGINT, signal.SIGTERM]


def pytest_make_parametrize_id(config: pytest.Config, val: object, argname: str) -> str | None:
    """Integers of hundreds of digits (bad input past a float's range) named by their size,
    not spelt out in every test id."""
    digits = str(val).lstrip("-") if isinstance(val, int | str) else ""
    if len(digits) > 30 and digits.isdigit():
        return f"{'-' if str(val).startswith('-') else ''}{len(digits)}-digits"
    return None


def _live_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.is_alive()}


# Set by pytest itself at every phase, or by torch/Lightning/Accelerate/Transformers as
# process-wide settings the first time they run (not by this package).
_FRAMEWORK_ENV = ("PYTEST_CURRENT_TEST", "PYTORCH_", "TORCHINDUCTOR_", "PL_", "KMP_", "TOKENIZERS_")


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(_FRAMEWORK_ENV)}


@pytest.fixture(autouse=True)
def _no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves threads, signal handlers or environment variables behind."""
    threads_before = _live_threads()
    handlers_before = {s: signal.getsignal(s) for s in _SIGNALS}
    env_before = _environment()
    yield
    problems: list[str] = []
    deadline = time.monotonic() + 5.0
    leaked = _live_threads() - threads_before
    while leaked and time.monotonic() < deadline:
        time.sleep(0.05)
        leaked = _live_threads() - threads_before
    # Lightning/torch keep a few daemon workers alive for the whole process (pin memory,
    # compile workers); only our own threads are named with the "lightning-energy" prefix.
    ours = [
        t.name for t in leaked if t.name.startswith(("lightning-energy", "carbon", "APScheduler"))
    ]
    if ours:
        problems.append(f"threads left running: {ours}")
    for s, h in handlers_before.items():
        if signal.getsignal(s) is not h:
            problems.append(f"signal handler for {signal.Signals(s).name} changed")
            signal.signal(s, h)
    env_after = _environment()
    if env_after != env_before:
        changed = sorted(
            k for k in set(env_before) | set(env_after) if env_before.get(k) != env_after.get(k)
        )
        problems.append(f"environment variables changed: {changed}")
        for k in set(env_after) - set(env_before):
            del os.environ[k]
        os.environ.update(env_before)
    if problems:
        pytest.fail("test leaked state: " + "; ".join(problems))


@pytest.fixture(autouse=True)
def _no_zeusd_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts without a zeusd configured, whatever the shell that started the
    suite exports (``device.backend: auto`` would otherwise change GPUs through it)."""
    for var in ("ZEUSD_SOCK_PATH", "ZEUSD_HOST_PORT", "ZEUSD_TOKEN"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def default_signal_handlers() -> Iterator[None]:
    """SIGINT and SIGTERM with Python's default handlers for the test, whatever the suite
    was started with: a background job of a non-interactive shell, ``nohup`` and some CI
    runners start it with SIGINT ignored, and a guard rightly keeps an ignored signal
    ignored. Tests that send themselves a signal use this; the dispositions found are put
    back afterwards."""
    found = {s: signal.getsignal(s) for s in _SIGNALS}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        for s, handler in found.items():
            signal.signal(s, handler)


@pytest.fixture(autouse=True)
def _no_gpu_settings_leak(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves a simulated GPU's power limit or clock lock changed.

    Every simulated GPU built during the test must end with the settings it was built with;
    every one alive before it, with the settings it had when the test started. Tests that
    deliberately leave state behind (persistence, crash recovery) are marked
    ``@pytest.mark.gpu_state_may_change``.
    """
    before = [(gpu, gpu.settings()) for gpu in live_simulated_gpus()]
    with track_simulated_gpus() as created:
        yield
    if request.node.get_closest_marker("gpu_state_may_change"):
        return
    expected = before + [(gpu, gpu.initial_settings) for gpu in created]
    changed = [
        f"{gpu.uuid}: {settings} -> {gpu.settings()}"
        for gpu, settings in expected
        if gpu.settings() != settings
    ]
    if changed:
        pytest.fail(
            "GPU settings left changed (power_limit_w, locked_clocks_mhz): " + "; ".join(changed)
        )


# A replayed trace is read at "now"; a "now" this close to the wall clock means the test
# replays whatever day of the trace the calendar gives, so its outcome changes with the date.
_WALL_CLOCK_TOLERANCE = timedelta(days=2)


@pytest.fixture(autouse=True)
def _no_wall_clock_traces(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """Fail a test that replays a carbon trace at the wall clock's date.

    Pin the simulated start (``device.start``) or give the provider a ``now``. Tests of the
    wall-clock default itself are marked ``@pytest.mark.wall_clock``.
    """
    if request.node.get_closest_marker("wall_clock"):
        yield
        return
    reads: list[datetime] = []
    original = TraceProvider.now

    def now(self: TraceProvider) -> datetime:
        value = original(self)
        if abs(value - datetime.now(timezone.utc)) < _WALL_CLOCK_TOLERANCE:
            reads.append(value)
        return value

    monkeypatch.setattr(TraceProvider, "now", now)
    yield
    if reads:
        pytest.fail(
            f"the test replayed a carbon trace at the wall clock ({reads[0].isoformat()}): its "
            "outcome depends on the date it runs; pin device.start or the provider's now"
        )


@pytest.fixture
def data_dir() -> Path:
    """The directory of the test data files (copied from the project's reference data)."""
    return DATA_DIR
