"""The Kareus layer in Megatron-Core: a 4-process gloo GPT (TP 2, PP 2) on CPU."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core")

from lightning_energy.errors import ConfigError
from lightning_energy.kareus import megatron_layer
from lightning_energy.kareus.megatron_layer import KareusMegatron
from lightning_energy.kareus.partition import PartitionSetting
from lightning_energy.kareus.runtime import BASELINE, RUNTIME_OPS, Overlap
from lightning_energy.perseus.planning.schedule import Instruction

from .. import processes
from ..processes import ROOT, free_port, run_launch
from .megatron_layer_worker import PP, setting
from .test_runtime import FakeDist, plan, tp_group

WORLD = 4


def run_workers(tmp_path: Path) -> list[dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if k != "LIGHTNING_ENERGY_CONFIG"}
    env["PYTHONPATH"] = str(ROOT)
    port = str(free_port())
    module = "tests.lightning_energy.kareus.megatron_layer_worker"
    commands = [[sys.executable, "-m", module, str(r), port, str(tmp_path)] for r in range(WORLD)]
    processes.run_ranks(commands, tmp_path, envs=[env] * WORLD, timeout_s=600)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]


def assert_same_training(run: dict[str, Any], reference: dict[str, Any], rank: int) -> None:
    """The same losses and gradients as the plain layer, to float32 reduction order."""
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5), rank
    assert set(run["grads"]) == set(reference["grads"]), rank
    for name, grad in reference["grads"].items():
        assert run["grads"][name] == pytest.approx(grad, rel=1e-4, abs=1e-6), (rank, name)


def issued_before(row: dict[str, Any]) -> str | None:
    """Where a partition's collective must have been issued: before the op of its slot
    (the first with a sequential one); a layer's last partition, which runs only the first
    op, issues a later slot's collective at its end."""
    ops = RUNTIME_OPS[row["key"]][: row["ops"]]
    slot = max(row["slot"], 0)
    return ops[slot] if slot < len(ops) else "the end"


@pytest.mark.slow
def test_kareus_layers_train_as_megatron_layers_at_the_planned_settings(tmp_path: Path) -> None:
    ranks = run_workers(tmp_path)
    for rank, result in enumerate(ranks):
        stage = result["pipeline_rank"]
        reference, baseline, planned = result["reference"], result["baseline"], result["planned"]
        last = stage == PP - 1
        assert bool(reference["losses"]) == last and len(reference["grads"]) > 0
        # Plain nano-batching, and a plan's settings, train exactly as Megatron's layer.
        assert_same_training(baseline, reference, rank)
        assert baseline["evaluation"] == pytest.approx(reference["evaluation"], rel=1e-5)
        assert_same_training(planned, reference, rank)

        # Plain nano-batching: NCCL's defaults (the tensor-parallel group), every
        # collective issued before the first op of its partition; per micro-batch and
        # layer 5 forward and 5 backward partitions, 4 of each with a collective.
        rows = baseline["partitions"]
        assert len(rows) == 4 * 2 * 10, rank
        assert all(r["instruction"] is None and r["tp_group"] for r in rows)
        with_collective = [r for r in rows if r["issued_before"] is not None]
        assert len(with_collective) == 4 * 2 * 8
        assert all(r["issued_before"] == RUNTIME_OPS[r["key"]][0] for r in with_collective)

        # The plan: each instruction's setting reached every partition of its kind, on the
        # group of its CTA count, issued before the op of its slot, forward and backward.
        rows = planned["partitions"]
        assert len(rows) == 4 * 2 * 10, rank
        seen = set()
        for row in rows:
            kind, where = row["instruction"][0], row["instruction"][1:]
            row_stage, microbatch = (int(v) for v in where.split("."))
            assert row_stage == stage and row["key"].startswith("fwd" if kind == "F" else "bwd")
            expected = setting(row["key"], microbatch, stage)
            assert (row["ctas"], row["slot"]) == (expected.ctas, expected.slot), row
            assert row["group_ctas"] == expected.ctas, row
            if row["issued_before"] is not None:
                assert row["issued_before"] == issued_before(row), row
            seen.add((row["instruction"], row["key"], row["slot"]))
        assert len({s[0] for s in seen}) == 2 * 4
        # The plan's clocks are the Perseus plan the pipeline applies.
        assert planned["clocks"] == planned["plan_clocks"]
        # One group per CTA count of the plan, each over this rank's tensor-parallel ranks.
        assert sorted(planned["groups"]) == ["1", "2", "3"]
        assert all(ranks_ == planned["tp_ranks"] for ranks_ in planned["groups"].values())

        bad = result["bad_plan"]
        assert bad["error"] is not None and "Kareus layers are not allowed" in bad["error"]
        assert f"stage {stage}: 2 Kareus layers" in bad["error"]
        assert not bad["opened"]
    # Every slot of every key ran somewhere (each rank runs its stage's instructions).
    slots = {(r["key"], r["slot"]) for res in ranks for r in res["planned"]["partitions"]}
    for key, ops in RUNTIME_OPS.items():
        assert {s for k, s in slots if k == key} == set(range(-1, len(ops))), key


@pytest.fixture
def dist(monkeypatch: pytest.MonkeyPatch) -> FakeDist:
    fake = FakeDist()
    for module in ("lightning_energy.collectives", "lightning_energy.kareus.runtime"):
        monkeypatch.setattr(f"{module}.dist", fake)
    monkeypatch.setattr(megatron_layer, "dist", fake)
    return fake


def test_each_instruction_runs_its_partitions_at_its_settings(dist: FakeDist) -> None:
    kareus = KareusMegatron(plan(PartitionSetting(1410, 6, 2)), tp_group=tp_group())
    group = kareus._groups[6]
    assert group["options"].config.max_ctas == 6
    # Outside an instruction (evaluation, or no pipeline adapter): plain nano-batching.
    assert kareus.overlap("fwd_attn") == (BASELINE, kareus.tp_group)
    with kareus.instruction(Instruction(1, 0, "backward")):
        assert kareus.overlap("bwd_mlp") == (Overlap(6, 2), group)
        assert kareus.overlap("fwd_mlp") == (BASELINE, kareus.tp_group)  # a recomputed forward
    assert kareus.overlap("bwd_mlp") == (BASELINE, kareus.tp_group)


def test_without_a_plan_no_group_is_created(dist: FakeDist) -> None:
    kareus = KareusMegatron(tp_group=tp_group())
    with kareus.instruction(Instruction(0, 0, "forward")):
        assert kareus.overlap("fwd_attn") == (BASELINE, kareus.tp_group)
    assert dist.created == [] and kareus.clock_plan(plan().schedule) is None


def test_a_plan_for_another_tensor_parallel_size_is_refused_before_any_group(
    dist: FakeDist,
) -> None:
    with pytest.raises(ConfigError, match="tensor_model_parallel_size: 2 is not allowed"):
        KareusMegatron(plan(tp_size=8), tp_group=tp_group())
    assert dist.created == []


def test_tensor_parallelism_is_required(dist: FakeDist) -> None:
    alone = {"ranks": [2], "backend": "nccl", "options": None}
    with pytest.raises(ConfigError, match="tensor_model_parallel_size: 1 is not allowed; use >= 2"):
        KareusMegatron(tp_group=alone)


def test_the_spec_refuses_what_the_layer_cannot_run(dist: FakeDist) -> None:
    kareus = KareusMegatron(tp_group=tp_group())
    with pytest.raises(ConfigError, match="num_experts: 8 is not allowed; use None"):
        kareus.layer_spec(num_experts=8)
    spec = kareus.layer_spec()
    assert spec.module is megatron_layer.KareusTransformerLayer and spec.params["kareus"] is kareus


def test_the_adapter_refuses_a_second_plan_and_odd_micro_batches(dist: FakeDist) -> None:
    from megatron.core.pipeline_parallel import schedules

    from lightning_energy.integrations.megatron import MegatronEnergy

    kareus = KareusMegatron(plan(), tp_group=tp_group())
    device = {"backend": "simulated", "gpu": "a100"}
    with pytest.raises(ConfigError, match=r"perseus\.plan: 'p\.json' is not allowed with a Kareus"):
        MegatronEnergy({"device": device, "perseus": {"plan": "p.json"}}, kareus=kareus)
    energy = MegatronEnergy({"device": device}, kareus=kareus)
    assert energy.config.perseus.enabled  # the plan's clocks apply through Perseus
    wrapped = energy.wrap(schedules.forward_backward_pipelining_without_interleaving)
    with pytest.raises(ConfigError, match="micro_batch_size: 3 is not allowed with Kareus"):
        wrapped(model=[], num_microbatches=4, micro_batch_size=3)
    assert energy.pipeline is None and not energy.running


@pytest.mark.slow
def test_the_example_trains_as_megatron_with_a_plan(tmp_path: Path) -> None:
    plan(PartitionSetting(1110, 3, 2)).save(tmp_path / "plan.json")  # 1F1B, 2 micro-batches
    env = {k: v for k, v in os.environ.items() if k != "LIGHTNING_ENERGY_CONFIG"}
    env["PYTHONPATH"] = str(ROOT)
    done = run_launch(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "4",
            str(ROOT / "examples" / "megatron" / "kareus_gpt.py"),
            "--plan",
            "plan.json",
            "--microbatches",
            "2",
        ],
        cwd=tmp_path,
        env=env,
        timeout_s=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    (line,) = done.stdout.strip().splitlines()
    result = json.loads(line)
    assert result["plan"] == "plan.json" and len(result["kareus"]) == 3
    assert result["kareus"] == pytest.approx(result["plain"], rel=1e-5)
    assert result["max_rel_diff"] < 1e-5
