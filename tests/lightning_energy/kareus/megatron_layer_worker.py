"""One rank of a 4-process gloo Megatron-Core GPT (TP 2, PP 2) with Kareus layers
(test_megatron_layer.py).

Builds Megatron-Core's own GPT (local layer spec) and the same GPT with Kareus layers (the
same weights), and runs, through Megatron-Core's 1F1B schedule on CPU:

* ``reference``: the plain GPT, one training iteration and one evaluation;
* ``baseline``: the Kareus GPT without a plan (plain nano-batching), the same;
* ``planned``: the Kareus GPT under ``MegatronEnergy(kareus=...)`` with a plan whose
  settings differ per instruction, on simulated GPUs, two iterations;
* ``bad_plan``: a plan for other layer counts, refused before the run opens.

Each run writes its losses, every parameter's gradient, and every partition the Kareus
layers ran (its instruction, key, setting and where its collective was issued) to
``rank<r>.json``. The default process group rejects CPU tensors as NCCL does, for this
package's modules.

Usage: ``python -m tests.lightning_energy.kareus.megatron_layer_worker RANK PORT OUT_DIR``
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel import schedules

from lightning_energy.errors import ConfigError
from lightning_energy.integrations.megatron import MegatronEnergy
from lightning_energy.kareus import megatron_layer, runtime
from lightning_energy.kareus.compose import KIND_KEYS, InstructionOption, KareusPlan
from lightning_energy.kareus.megatron_layer import KareusMegatron
from lightning_energy.kareus.partition import PartitionSetting
from lightning_energy.perseus.planning.schedule import one_f_one_b
from tests.lightning_energy.perseus import nccl_like

WORLD, TP, PP = 4, 2, 2
MICROBATCHES = 4
ROOT = Path(__file__).resolve().parents[3]
CLOCKS_MHZ = (1410, 1110)


def _load_cpu_harness() -> Any:
    path = ROOT / "examples" / "megatron" / "megatron_cpu.py"
    spec = importlib.util.spec_from_file_location("megatron_cpu", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["megatron_cpu"] = module
    spec.loader.exec_module(module)
    return module


mc = _load_cpu_harness()


def setting(key: str, microbatch: int, stage: int) -> PartitionSetting:
    """A different setting for every micro-batch and stage: every slot of each key, from
    sequential to the last op, and three CTA counts."""
    ops = len(runtime.RUNTIME_OPS[key])
    slot = (microbatch * PP + stage) % (ops + 1) - 1
    return PartitionSetting(CLOCKS_MHZ[microbatch % 2], 1 + (microbatch + stage) % 3, slot)


def plan(layers_per_stage: tuple[int, ...]) -> KareusPlan:
    schedule = one_f_one_b(PP, MICROBATCHES)
    choices = []
    for inst in schedule.nodes:
        parts = tuple(
            (key, setting(key, inst.microbatch, inst.stage)) for key in KIND_KEYS[inst.kind]
        )
        choices.append(InstructionOption(parts[0][1].clock_mhz, parts, 0.0, 0.0))
    return KareusPlan(schedule, tuple(choices), {}, layers_per_stage, TP)


def iterate(forward_backward: Any, model: GPTModel, seed: int, **kwargs: Any) -> list[float]:
    for p in model.parameters():
        p.grad = None
    losses = forward_backward(
        forward_step_func=mc.gpt_forward_step,
        data_iterator=mc.gpt_batches(MICROBATCHES, seed),
        model=[model],
        num_microbatches=MICROBATCHES,
        seq_length=mc.GPT_SEQ_LENGTH,
        micro_batch_size=mc.GPT_MICRO_BATCH_SIZE,
        **kwargs,
    )
    return [float(item["loss"]) for item in losses]


def gradients(model: GPTModel) -> dict[str, list[float]]:
    return {
        name: p.grad.flatten().tolist()
        for name, p in model.named_parameters()
        if p.grad is not None
    }


class PartitionLog:
    """Every partition the Kareus layers finish: its instruction, key, setting, the CTA
    count of its group and the op its collective was issued before."""

    def __init__(self, kareus: KareusMegatron) -> None:
        self.kareus = kareus
        self.rows: list[dict[str, Any]] = []
        self.finish = runtime.PartitionRun.finish

    def __enter__(self) -> PartitionLog:
        log = self

        def finish(run: runtime.PartitionRun) -> Any:
            result = log.finish(run)
            inst = log.kareus._instruction
            groups = {id(g): n for n, g in log.kareus._groups.items()}
            log.rows.append(
                {
                    "instruction": None if inst is None else str(inst),
                    "key": run.key,
                    "ops": len(run.ops),
                    "ctas": run.overlap.ctas,
                    "slot": run.overlap.slot,
                    "group_ctas": groups.get(id(run._group)),
                    "tp_group": run._group is log.kareus.tp_group,
                    "issued_before": run.issued_before,
                }
            )
            return result

        runtime.PartitionRun.finish = finish  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        runtime.PartitionRun.finish = self.finish  # type: ignore[method-assign]


def run_reference(forward_backward: Any) -> tuple[GPTModel, dict[str, Any]]:
    model = mc.build_gpt(get_gpt_layer_local_spec())
    losses = iterate(forward_backward, model, seed=0)
    grads = gradients(model)
    evaluation = iterate(forward_backward, model, seed=1, forward_only=True)
    return model, {"losses": losses, "grads": grads, "evaluation": evaluation}


def run_baseline(forward_backward: Any, reference: GPTModel) -> dict[str, Any]:
    kareus = KareusMegatron()
    model = mc.build_gpt(kareus.layer_spec())
    model.load_state_dict(reference.state_dict())
    with PartitionLog(kareus) as log:
        losses = iterate(forward_backward, model, seed=0)
    grads = gradients(model)
    evaluation = iterate(forward_backward, model, seed=1, forward_only=True)
    return {"losses": losses, "grads": grads, "evaluation": evaluation, "partitions": log.rows}


def run_planned(out_dir: Path, reference: GPTModel) -> dict[str, Any]:
    planned = plan((mc.GPT_LAYERS // PP,) * PP)
    kareus = KareusMegatron(planned)
    model = mc.build_gpt(kareus.layer_spec())
    model.load_state_dict(reference.state_dict())
    energy = MegatronEnergy(
        {
            "device": {
                "backend": "simulated",
                "gpu": "a100",
                "start": "2026-01-05T12:00:00",
                "lease_dir": str(out_dir / "leases"),
            }
        },
        kareus=kareus,
    )
    forward_backward = energy.wrap(schedules.get_forward_backward_func())
    with energy:
        iterate(forward_backward, model, seed=0)  # the first iteration runs at the found clocks
        assert energy.pipeline is not None and energy.pipeline.runtime.plan is not None
        applied = energy.pipeline.runtime.plan
        clocks = {str(inst): applied.frequency_mhz(inst) for inst in applied.schedule.nodes}
        with PartitionLog(kareus) as log:
            losses = iterate(forward_backward, model, seed=0)
    groups = {str(n): sorted(dist.get_process_group_ranks(g)) for n, g in kareus._groups.items()}
    return {
        "losses": losses,
        "grads": gradients(model),
        "partitions": log.rows,
        "clocks": clocks,
        "plan_clocks": {
            str(i): c.clock_mhz
            for i, c in zip(planned.schedule.nodes, planned.choices, strict=True)
        },
        "groups": groups,
        "tp_ranks": sorted(dist.get_process_group_ranks(kareus.tp_group)),
    }


def run_bad_plan(out_dir: Path) -> dict[str, Any]:
    kareus = KareusMegatron(plan((3, 1)))
    model = mc.build_gpt(kareus.layer_spec())
    energy = MegatronEnergy(
        {"device": {"backend": "simulated", "gpu": "a100", "lease_dir": str(out_dir / "l2")}},
        kareus=kareus,
    )
    forward_backward = energy.wrap(schedules.get_forward_backward_func())
    error = None
    try:
        iterate(forward_backward, model, seed=0)
    except ConfigError as exc:
        error = str(exc)
    return {"error": error, "opened": energy.running or energy.pipeline is not None}


def main() -> None:
    rank, port, out_dir = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "LOCAL_RANK": str(rank)})
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    nccl_like.install()
    runtime.dist = megatron_layer.dist = nccl_like.NcclLikeDistributed()  # type: ignore[assignment]
    results: dict[str, Any] = {"rank": rank}
    try:
        with mc.cuda_calls_on_cpu():
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP
            )
            results["pipeline_rank"] = parallel_state.get_pipeline_model_parallel_rank()
            forward_backward = schedules.get_forward_backward_func()
            reference, results["reference"] = run_reference(forward_backward)
            results["baseline"] = run_baseline(forward_backward, reference)
            results["planned"] = run_planned(out_dir, reference)
            results["bad_plan"] = run_bad_plan(out_dir)
    finally:
        (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
