"""The controller's GPUs from run to run: those it opened are closed at the end of a run and
opened afresh by the next; those it was given stay the caller's."""

from __future__ import annotations

from typing import Any

import pytest

import lightning_energy.device
from lightning_energy.config import DeviceConfig
from lightning_energy.controller.rank_devices import RankDevices
from lightning_energy.device import DeviceSet, SimulatedSpec, simulated_gpus


class _CountedGPUs(DeviceSet):
    """Simulated GPUs that count how often they are closed."""

    closed = 0

    def close(self) -> None:
        self.closed += 1
        super().close()


def _given() -> _CountedGPUs:
    return _CountedGPUs(
        gpus=simulated_gpus(SimulatedSpec(gpu="a40")), clock=lambda: 0.0, backend="simulated"
    )


def test_given_gpus_are_never_closed_and_serve_every_run() -> None:
    given = _given()
    rank = RankDevices(DeviceConfig(), given, node_rank=0, local_rank=0, device=None)
    assert rank.for_new_run() is given
    rank.close()
    rank.close(forget=True)
    assert given.closed == 0
    assert rank.opened
    assert rank.for_new_run() is given


def _opening(monkeypatch: pytest.MonkeyPatch) -> list[_CountedGPUs]:
    """What ``open_rank_devices`` opened, in order."""
    opened: list[_CountedGPUs] = []

    def open_rank_devices(*args: Any, **kwargs: Any) -> _CountedGPUs:
        opened.append(_given())
        return opened[-1]

    monkeypatch.setattr(lightning_energy.device, "open_rank_devices", open_rank_devices)
    return opened


def test_opened_gpus_are_closed_at_the_end_of_a_run_and_opened_afresh_for_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    opened = _opening(monkeypatch)
    rank = RankDevices(DeviceConfig(), None, node_rank=0, local_rank=0, device=None)
    assert not rank.opened
    first = rank.for_new_run()
    assert rank.get() is first  # the same GPUs for the whole run
    rank.close()
    assert opened[0].closed == 1
    assert rank.opened  # the ended run's GPUs can still be read
    second = rank.for_new_run()
    assert opened == [first, second]
    assert opened[1].closed == 0


def test_a_failed_setup_forgets_the_gpus_it_opened(monkeypatch: pytest.MonkeyPatch) -> None:
    opened = _opening(monkeypatch)
    rank = RankDevices(DeviceConfig(), None, node_rank=0, local_rank=0, device=None)
    first = rank.for_new_run()
    rank.close(forget=True)
    assert opened == [first]
    assert opened[0].closed == 1
    assert not rank.opened
    assert rank.get() is not first
    assert len(opened) == 2
