"""Kareus' runtime on a simulated GPU: streams and events, CTA-limited groups, plan checks."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from lightning_energy.errors import ConfigError
from lightning_energy.kareus import runtime
from lightning_energy.kareus.compose import KIND_KEYS, InstructionOption, KareusPlan
from lightning_energy.kareus.partition import SEQUENTIAL, PartitionSetting
from lightning_energy.kareus.runtime import (
    NCCL_MAX_CTAS,
    RUNTIME_OPS,
    CommStream,
    Overlap,
    PartitionRun,
    PlanSettings,
    cta_groups,
)
from lightning_energy.kareus.workload import LLAMA_3_2_3B
from lightning_energy.perseus.planning.schedule import Instruction, one_f_one_b
from tests.lightning_energy.device.fake_cuda import FakeCuda, FakeStream, cuda_devices

OP_S = 1.0  # every compute op
COLLECTIVE_S = 10.0  # the all-reduce, longer than any partition's compute


class NcclConfig:
    """``ProcessGroupNCCL.NCCLConfig`` as torch binds ``ncclConfig_t``: these attributes
    only (a misspelt one raises), NCCL's "undefined" until set."""

    __slots__ = ("blocking", "cga_cluster_size", "max_ctas", "min_ctas", "net_name")

    def __init__(self) -> None:
        undefined = -(2**31)
        self.blocking = self.cga_cluster_size = self.min_ctas = self.max_ctas = undefined
        self.net_name = None


class NcclOptions:
    """``ProcessGroupNCCL.Options(is_high_priority_stream=False)``: its communicator's
    ``config`` and the stream priority, nothing else."""

    __slots__ = ("config", "is_high_priority_stream")

    def __init__(self, is_high_priority_stream: bool = False) -> None:
        self.config = NcclConfig()
        self.is_high_priority_stream = is_high_priority_stream


class FakeWork:
    """An NCCL collective's handle: ``wait()`` makes the current stream wait for the
    collective (the host does not block)."""

    def __init__(self, done: Any) -> None:
        self.done = done

    def wait(self) -> bool:
        if self.done is not None:
            torch.cuda.current_stream().wait_event(self.done)
        return True


class FakeDist:
    """``torch.distributed`` of one rank in a world of tensor-parallel pairs.

    ``all_reduce`` runs as ProcessGroupNCCL does: on the communicator's own stream, which
    first waits for the caller's current stream; it records where and when it ran.
    """

    ProcessGroupNCCL = type("ProcessGroupNCCL", (), {"Options": NcclOptions})

    def __init__(self, cuda: FakeCuda | None = None, *, rank: int = 2, world: int = 4) -> None:
        self.cuda = cuda
        self.rank, self.world = rank, world
        self.backend = "nccl"
        self.created: list[tuple[list[int], str, Any]] = []  # ranks, backend, pg_options
        self.reduces: list[dict[str, Any]] = []
        self._nccl_streams: dict[int, FakeStream] = {}

    def tp_ranks(self, rank: int) -> list[int]:
        return [rank - rank % 2, rank - rank % 2 + 1]

    def get_process_group_ranks(self, group: Any) -> list[int]:
        return list(group["ranks"])

    def get_world_size(self, group: Any = None) -> int:
        return self.world if group is None else len(group["ranks"])

    def get_backend(self, group: Any = None) -> str:
        return self.backend if group is None else str(group["backend"])

    def all_gather_object(self, out: list[Any], obj: Any) -> None:
        for r in range(self.world):
            out[r] = self.tp_ranks(r)

    def new_group(self, ranks: list[int], backend: str, pg_options: Any = None) -> Any:
        self.created.append((list(ranks), backend, pg_options))
        return {"ranks": list(ranks), "backend": backend, "options": pg_options}

    def all_reduce(self, tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
        assert async_op
        if self.cuda is None:  # gloo on a CPU: the sum of two equal ranks, in place
            tensor.mul_(2)
            return FakeWork(None)
        caller = fake(torch.cuda.current_stream())
        nccl = self._nccl_streams.setdefault(id(group), fake(torch.cuda.Stream(caller.device)))
        nccl.wait_stream(caller)
        start_s = max(self.cuda.now_s, nccl.ready_s)
        self.cuda.launch(COLLECTIVE_S, nccl)
        self.reduces.append({"caller": caller, "start_s": start_s, "group": group})
        done = torch.cuda.Event()
        done.record(nccl)  # type: ignore[arg-type]
        return FakeWork(done)


def fake(stream: object) -> FakeStream:
    """``stream`` as the fake CUDA runtime's own (``torch.cuda`` hands those out while the
    fake is installed)."""
    assert isinstance(stream, FakeStream)
    return stream


def tp_group(backend: str = "nccl") -> dict[str, Any]:
    return {"ranks": [2, 3], "backend": backend, "options": None}


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    return FakeCuda(cuda_devices(2)).install(monkeypatch)


@pytest.fixture
def dist(monkeypatch: pytest.MonkeyPatch, cuda: FakeCuda) -> FakeDist:
    fake = FakeDist(cuda)
    monkeypatch.setattr(runtime, "dist", fake)
    monkeypatch.setattr("lightning_energy.collectives.dist", fake)
    return fake


def run_partition(
    cuda: FakeCuda, key: str, slot: int, *, ops: tuple[str, ...] | None = None
) -> tuple[PartitionRun, FakeStream]:
    """One partition on ``cuda:1``: every op a kernel of ``OP_S`` on the compute stream,
    the boundary before each reached first; returns the run and the compute stream."""
    device = torch.device("cuda", 1)
    torch.cuda.set_device(device)
    compute = fake(torch.cuda.current_stream(device))
    group = tp_group()
    run = PartitionRun(key, Overlap(4, slot), group, CommStream(device), torch.ones(3), ops=ops)
    for position in range(len(run.ops)):
        run.reach(position)
        cuda.launch(OP_S, compute)
    return run, compute


@pytest.mark.parametrize("key", list(RUNTIME_OPS))
def test_the_collective_waits_on_its_stream_for_the_slot_and_the_consumer_for_it(
    cuda: FakeCuda, dist: FakeDist, key: str
) -> None:
    slot = len(RUNTIME_OPS[key]) - 2
    run, compute = run_partition(cuda, key, slot)
    (reduce,) = dist.reduces
    # Issued from the communication stream of the layer's device, not the compute stream,
    # once the compute reached the op of the slot (the slot's event), not when the host
    # issued it (time 0: nothing has run on the GPU yet).
    assert reduce["caller"] is not compute and reduce["caller"].device_index == 1
    assert reduce["start_s"] == slot * OP_S
    assert run.issued_before == RUNTIME_OPS[key][slot]
    compute_end_s = len(RUNTIME_OPS[key]) * OP_S
    assert compute.ready_s == compute_end_s  # the compute overlapped it
    run.finish()
    # The consumer (the compute stream) waits for the collective; the host never did.
    assert compute.ready_s == slot * OP_S + COLLECTIVE_S > compute_end_s
    assert cuda.now_s == 0.0 and cuda.synchronize_calls == []


def test_a_sequential_collective_runs_alone_before_the_compute(
    cuda: FakeCuda, dist: FakeDist
) -> None:
    run, compute = run_partition(cuda, "fwd_mlp", SEQUENTIAL)
    (reduce,) = dist.reduces
    assert reduce["start_s"] == 0.0 and run.issued_before == "residual_add"
    # The first op waited for the collective: the compute ends after both, back to back.
    assert compute.ready_s == COLLECTIVE_S + len(RUNTIME_OPS["fwd_mlp"]) * OP_S


def test_a_slot_after_the_ops_of_a_short_partition_issues_at_its_end(
    cuda: FakeCuda, dist: FakeDist
) -> None:
    ops = RUNTIME_OPS["fwd_attn"][:1]  # a layer's last partition: the residual add only
    run, compute = run_partition(cuda, "fwd_attn", 4, ops=ops)
    assert dist.reduces == []
    assert run.finish() is not None
    (reduce,) = dist.reduces
    assert reduce["start_s"] == OP_S and run.issued_before == "the end"
    assert compute.ready_s == OP_S + COLLECTIVE_S


def test_no_tensor_no_collective(cuda: FakeCuda, dist: FakeDist) -> None:
    device = torch.device("cuda", 0)
    run = PartitionRun("bwd_attn", Overlap(None, 0), tp_group(), CommStream(device), None)
    for position in range(len(run.ops)):
        run.reach(position)
    assert run.finish() is None and dist.reduces == []


def test_the_reduced_tensor_keeps_its_producers_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    # A row-parallel linear's partial sums: the all-reduce's gradient is the identity (each
    # rank's partial sum gets the gradient of the sum), so it must not enter the graph.
    monkeypatch.setattr(runtime, "dist", FakeDist())
    weight = torch.full((3,), 3.0, requires_grad=True)
    partial = weight * torch.ones(3)
    device = torch.device("cpu")
    run = PartitionRun("fwd_mlp", Overlap(None, 0), tp_group("gloo"), CommStream(device), partial)
    run.reach(0)
    reduced = run.finish()
    assert reduced is not None and reduced.tolist() == [6.0, 6.0, 6.0]
    torch.autograd.backward(partial, torch.ones(3))
    assert weight.grad is not None and weight.grad.tolist() == [1.0, 1.0, 1.0]


def test_one_group_per_cta_count_limited_through_the_nccl_options(
    dist: FakeDist, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NCCL_MIN_CTAS", raising=False)
    monkeypatch.delenv("NCCL_MAX_CTAS", raising=False)
    groups = cta_groups(tp_group(), (8, 2, 8, 4))
    assert sorted(groups) == [2, 4, 8]
    # Collective: a group for every tensor-parallel pair, in the same order on every rank;
    # this rank keeps those of its own pair.
    assert [(ranks, backend) for ranks, backend, _ in dist.created] == [
        (pair, "nccl") for _ in range(3) for pair in ([0, 1], [2, 3])
    ]
    for n, group in groups.items():
        assert group["ranks"] == [2, 3]
        config = group["options"].config
        assert (config.min_ctas, config.max_ctas) == (n, n)
    # Per communicator, never process-wide.
    assert "NCCL_MIN_CTAS" not in os.environ and "NCCL_MAX_CTAS" not in os.environ


def test_gloo_groups_get_no_nccl_options(dist: FakeDist) -> None:
    groups = cta_groups(tp_group("gloo"), (3,))
    assert groups[3]["backend"] == "gloo" and groups[3]["options"] is None


def plan(
    setting: PartitionSetting | None = None,
    *,
    keys: dict[str, tuple[str, ...]] | None = None,
    layers_per_stage: tuple[int, ...] | None = (2, 2),
    tp_size: int | None = 2,
) -> KareusPlan:
    """A 1F1B plan of 2 stages and 2 micro-batches, every partition at ``setting``."""
    setting = setting or PartitionSetting(1410, 4, 1)
    schedule = one_f_one_b(2, 2)
    keys = keys or KIND_KEYS
    choices = tuple(
        InstructionOption(
            setting.clock_mhz, tuple((key, setting) for key in keys[inst.kind]), 1.0, 1.0
        )
        for inst in schedule.nodes
    )
    return KareusPlan(schedule, choices, {}, layers_per_stage, tp_size)


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        (PartitionSetting(1410, 4, 7), "slot 7 is not allowed; use -1 (sequential) to 6"),
        (PartitionSetting(1410, 4, -2), "slot -2 is not allowed"),
        (PartitionSetting(1410, 0, 0), f"ctas 0 is not allowed; use 1 to {NCCL_MAX_CTAS}"),
        (PartitionSetting(1410, NCCL_MAX_CTAS + 1, 0), f"ctas {NCCL_MAX_CTAS + 1} is not"),
    ],
)
def test_bad_settings_are_refused_naming_what_is_allowed(
    setting: PartitionSetting, expected: str
) -> None:
    with pytest.raises(ConfigError, match=r"plan\.json") as info:
        PlanSettings(plan(setting), source="plan.json")
    assert expected in str(info.value)


def test_a_slot_of_the_attention_is_too_late_for_the_mlp() -> None:
    with pytest.raises(ConfigError) as info:
        PlanSettings(plan(PartitionSetting(1410, 4, 5)))
    message = str(info.value)
    assert "fwd_mlp: slot 5 is not allowed; use -1 (sequential) to 4 (before fc2)" in message
    assert "fwd_attn" not in message  # 5 is an op of the attention partitions


def test_other_partition_keys_are_refused() -> None:
    swapped = {"forward": ("fwd_mlp", "fwd_attn"), "backward": KIND_KEYS["backward"]}
    with pytest.raises(ConfigError, match=r"partition keys \['fwd_mlp', 'fwd_attn'\]"):
        PlanSettings(plan(keys=swapped))


def test_a_plan_for_another_model_is_refused() -> None:
    settings = PlanSettings(plan(), source="plan.json")
    settings.check_model(tp_size=2, layers_per_stage={0: 2, 1: 2})
    with pytest.raises(ConfigError) as info:
        settings.check_model(tp_size=4, layers_per_stage={1: 3, 2: 1})
    message = str(info.value)
    assert "tensor_model_parallel_size: 4 is not allowed" in message and "measured at 2" in message
    assert "stage 1: 3 Kareus layers are not allowed" in message and "composed for 2" in message
    assert "stage 2: not in the plan, which has 2" in message


def test_a_plan_for_another_schedule_is_refused() -> None:
    settings = PlanSettings(plan())
    with pytest.raises(ConfigError, match="the pipeline runs 1f1b with 2, 4 and 1"):
        settings.clock_plan(one_f_one_b(2, 4))


def test_the_clock_plan_has_every_instructions_clock() -> None:
    kareus_plan = plan(PartitionSetting(1110, 4, 1))
    clocks = PlanSettings(kareus_plan).clock_plan(one_f_one_b(2, 2))
    assert [clocks.frequency_mhz(i) for i in clocks.schedule.nodes] == [1110] * 8


def test_settings_per_instruction_and_key() -> None:
    schedule = one_f_one_b(2, 2)
    choices = []
    for inst in schedule.nodes:
        parts = tuple(
            (key, PartitionSetting(1410, 1 + inst.microbatch + 2 * n, inst.stage - 1))
            for n, key in enumerate(KIND_KEYS[inst.kind])
        )
        choices.append(InstructionOption(1410, parts, 1.0, 1.0))
    settings = PlanSettings(KareusPlan(schedule, tuple(choices)))
    assert settings.overlap(Instruction(1, 1, "backward"), "bwd_mlp") == Overlap(4, 0)
    assert settings.overlap(Instruction(0, 0, "forward"), "fwd_attn") == Overlap(1, -1)
    assert settings.ctas == (1, 2, 3, 4)


def test_the_plan_file_keeps_the_model_it_was_made_for(tmp_path: Any) -> None:
    path = tmp_path / "plan.json"
    plan(layers_per_stage=(3, 1), tp_size=8).save(path)
    loaded = KareusPlan.load(path)
    assert (loaded.layers_per_stage, loaded.tp_size) == ((3, 1), 8)
    unrecorded = plan(layers_per_stage=None, tp_size=None)
    unrecorded.save(path)
    assert (KareusPlan.load(path).layers_per_stage, KareusPlan.load(path).tp_size) == (None, None)


@pytest.mark.parametrize("key", list(RUNTIME_OPS))
def test_the_planner_models_the_ops_the_runtime_runs_in_its_order(key: str) -> None:
    # A plan's slot names an op by position: the simulated partitions the plans are made
    # from must order them as the layers run them.
    assert tuple(op.name for op in LLAMA_3_2_3B.partition(key).ops) == RUNTIME_OPS[key]
