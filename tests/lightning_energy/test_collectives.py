"""Collectives: the gather-based aggregation every adapter uses, and the local default."""

from __future__ import annotations

from typing import Any

from lightning_energy.collectives import GatherCollective, LocalCollective, default_collective


def test_gather_collective_sums_energy_and_takes_the_slowest_time() -> None:
    rows = {0: [10.0, 2.0, 1.0], 1: [30.0, 5.0, 1.5]}
    sent: list[Any] = []

    def all_gather(values: list[float]) -> list[list[float]]:
        assert values == rows[0]
        return [rows[0], rows[1]]

    def broadcast(obj: Any, src: int) -> Any:
        sent.append((obj, src))
        return "from rank 0"

    collective = GatherCollective(0, 2, all_gather, broadcast)
    sums, maxes = collective.sum_and_max([10.0, 2.0], [1.0])
    assert sums == [40.0, 7.0]
    assert maxes == [1.5]
    assert collective.broadcast("mine") == "from rank 0"
    assert sent == [("mine", 0)]
    assert (collective.rank, collective.world_size) == (0, 2)


def test_without_a_process_group_everything_is_local() -> None:
    collective = default_collective()
    assert isinstance(collective, LocalCollective)
    assert collective.sum_and_max([1.0], [2.0]) == ([1.0], [2.0])
    assert collective.broadcast({"a": 1}) == {"a": 1}
