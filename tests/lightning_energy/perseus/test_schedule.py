from __future__ import annotations

import pytest

from lightning_energy.errors import ConfigError
from lightning_energy.perseus import (
    Instruction,
    build_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
)


@pytest.mark.parametrize("builder", [gpipe, one_f_one_b])
@pytest.mark.parametrize(("stages", "microbatches"), [(1, 1), (2, 3), (4, 8), (3, 2)])
def test_uniform_iteration_time(builder, stages: int, microbatches: int) -> None:  # type: ignore[no-untyped-def]
    schedule = builder(stages, microbatches)
    durations = [1.0 if inst.kind == "forward" else 2.0 for inst in schedule.nodes]
    # Both fill and drain the pipeline once: (M + S - 1) slots of forward + backward.
    assert schedule.longest_path(durations) == pytest.approx(3.0 * (microbatches + stages - 1))


def test_every_instruction_once_per_device() -> None:
    for schedule in (gpipe(3, 4), one_f_one_b(3, 4), interleaved_1f1b(2, 4, 2)):
        assert len(schedule.nodes) == len(set(schedule.nodes)) == 2 * 4 * schedule.num_stages
        for device, order in enumerate(schedule.device_orders):
            assert {inst.stage % schedule.num_devices for inst in order} == {device}


def test_one_f_one_b_order_and_edges() -> None:
    schedule = one_f_one_b(3, 4)
    assert [str(i) for i in schedule.device_orders[0]] == [
        "F0.0",
        "F0.1",
        "F0.2",
        "B0.0",
        "F0.3",
        "B0.1",
        "B0.2",
        "B0.3",
    ]
    assert [str(i) for i in schedule.device_orders[2]] == [
        "F2.0",
        "B2.0",
        "F2.1",
        "B2.1",
        "F2.2",
        "B2.2",
        "F2.3",
        "B2.3",
    ]
    index = schedule.index
    edges = set(schedule.edges)
    assert (index[Instruction(0, 1, "forward")], index[Instruction(1, 1, "forward")]) in edges
    assert (index[Instruction(2, 3, "backward")], index[Instruction(1, 3, "backward")]) in edges
    assert len(schedule.topological_order) == len(schedule.nodes)


def test_critical_path_runs_through_slowest_stage() -> None:
    schedule = one_f_one_b(2, 3)
    slow = [3.0 if inst.stage == 1 else 1.0 for inst in schedule.nodes]
    # F0.0, then stage 1 runs back to back (6 instructions), then B0.2.
    assert schedule.longest_path(slow) == pytest.approx(1 + 6 * 3 + 1)


def test_interleaved_layout() -> None:
    schedule = interleaved_1f1b(num_devices=2, num_microbatches=4, virtual_stages=2)
    assert schedule.num_stages == 4 and schedule.virtual_stages == 2
    assert schedule.device_of(3) == 1
    first = [str(i) for i in schedule.device_orders[0][:4]]
    assert first == ["F0.0", "F0.1", "F2.0", "F2.1"]


def test_build_schedule_errors() -> None:
    with pytest.raises(ConfigError, match="allowed"):
        build_schedule("zb", 2, 2)
    with pytest.raises(ConfigError, match="num_microbatches: 0 is not allowed"):
        build_schedule("1f1b", 2, 0)
    with pytest.raises(ConfigError, match="multiple of virtual_stages"):
        build_schedule("interleaved_1f1b", 3, 4, virtual_stages=2)
    with pytest.raises(ConfigError, match="only 'interleaved_1f1b'"):
        build_schedule("gpipe", 2, 2, virtual_stages=2)
    with pytest.raises(ConfigError, match="multiple of the number of rounds"):
        interleaved_1f1b(2, 5, 2)
    assert build_schedule("interleaved_1f1b", 4, 4, virtual_stages=2).num_devices == 2


def test_producers_and_consumers_are_the_cross_stage_edges() -> None:
    """Every edge between stages links an instruction to its consumer and back; the first
    forward and the last backward of a microbatch consume nothing from another stage."""
    for schedule in (gpipe(3, 2), one_f_one_b(3, 2), interleaved_1f1b(2, 2, 2)):
        nodes, index = schedule.nodes, schedule.index
        cross = {  # the data edges: one microbatch's activations or gradients
            (a, b)
            for a, b in schedule.edges
            if (nodes[a].microbatch, nodes[a].kind) == (nodes[b].microbatch, nodes[b].kind)
            and abs(nodes[a].stage - nodes[b].stage) == 1
        }
        linked = set()
        for inst in nodes:
            consumer = schedule.consumer(inst)
            if consumer is not None:
                assert schedule.producer(consumer) == inst
                linked.add((index[inst], index[consumer]))
        assert linked == cross
        last = schedule.num_stages - 1
        assert schedule.producer(Instruction(0, 1, "forward")) is None
        assert schedule.producer(Instruction(last, 1, "backward")) is None
        assert schedule.consumer(Instruction(last, 1, "forward")) is None
        assert schedule.consumer(Instruction(0, 1, "backward")) is None
