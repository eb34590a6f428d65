"""Perseus on each pipeline engine: energy saving at no slowdown, same pipeline, same GPUs.

Every engine trains the same pipeline: ``--stages`` processes (one stage each, gloo on CPU,
simulated GPUs) whose last stage is heavier than the others, with the ``perseus:`` settings
of ``examples/deepspeed/energy.yaml`` (warm-up at the maximum clock, online profiling of a
few clocks, then the plan for no slowdown). Each engine is a command run under ``torchrun``
with one CLI (``--iterations``, ``--microbatches``, ``--stage-times-s``, ``--gpu``) that
prints one JSON line (``iteration_time_s_max``, ``energy_j_max``, ``iteration_time_s_plan``,
``energy_j_plan``, ``time_ratio``, ``energy_saving``): adding an engine is one more entry of
:data:`ENGINES`.

``torch.distributed.pipelining`` runs through
:class:`~lightning_energy.perseus.runtime.pipeline_run.PipelineRun` (this file,
``--pipelining``, is its runner); DeepSpeed and Megatron-Core through their examples,
``examples/deepspeed/train.py`` and ``examples/megatron/train.py``.

Usage::

    python benchmarks/perseus_engines.py                  # 4 stages, 8 micro-batches
    python benchmarks/perseus_engines.py --engines deepspeed --json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "deepspeed" / "energy.yaml"

#: Engine name -> the command ``torchrun`` runs on every rank (paths from the repository).
ENGINES: dict[str, list[str]] = {
    "torch.distributed.pipelining": ["benchmarks/perseus_engines.py", "--pipelining"],
    "deepspeed": ["examples/deepspeed/train.py"],
    "megatron-core": ["examples/megatron/train.py"],
}

FEATURES = 16


def default_stage_times(stages: int) -> str:
    """Every stage 0.2 s forward and 0.4 s backward, the last one 1.5 times that."""
    return ",".join(["0.2:0.4"] * (stages - 1) + ["0.3:0.6"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_engine(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one engine's command under torchrun; its JSON line."""
    command = [sys.executable, "-m", "torch.distributed.run"]
    command += ["--nproc_per_node", str(args.stages), "--master_port", str(free_port())]
    command += [str(ROOT / ENGINES[name][0]), *ENGINES[name][1:]]
    command += ["--iterations", str(args.iterations), "--microbatches", str(args.microbatches)]
    command += ["--stage-times-s", args.stage_times_s, "--gpu", args.gpu]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("LIGHTNING_ENERGY_CONFIG", None)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or len(lines) != 1:
        raise SystemExit(f"{name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return dict(json.loads(lines[0]))


# ---------------------------------------------------- torch.distributed.pipelining runner
def _pipelining(argv: list[str]) -> None:
    """One rank of the ``torch.distributed.pipelining`` row (run under torchrun)."""
    import torch
    import torch.distributed as dist

    from lightning_energy.config import EnergyConfig
    from lightning_energy.perseus.runtime.pipeline_run import PipelineRun
    from lightning_energy.perseus.runtime.rank_gpu import open_rank_gpu

    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, required=True)
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--stage-times-s", required=True)
    parser.add_argument("--gpu", required=True)
    args = parser.parse_args(argv)
    times = [[float(v) for v in pair.split(":")] for pair in args.stage_times_s.split(",")]
    dist.init_process_group("gloo")
    rank, stages = dist.get_rank(), dist.get_world_size()
    config = EnergyConfig.from_yaml(CONFIG).merged(
        {"device": {"gpu": args.gpu}, "perseus": {"microbatches": args.microbatches}}
    )

    class Stages(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stages = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Linear(FEATURES, FEATURES), torch.nn.Tanh())
                for _ in range(stages)
            )

        def pipeline_stages(self) -> list[torch.nn.Module]:
            return list(self.stages)

        def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.mse_loss(output, target)

    torch.manual_seed(0)
    gpu_rank = open_rank_gpu(config, local_rank=rank, install_signal_handlers=False)
    run = PipelineRun(
        gpu_rank,
        config.perseus,
        Stages(),
        global_rank=rank,
        world_size=stages,
        root_device=torch.device("cpu"),
        stage_times_s=times,
    )
    assert run.online is not None
    gpu = gpu_rank.gpu
    records = []
    generator = torch.Generator().manual_seed(0)
    try:
        for _ in range(args.iterations):
            x = torch.randn(2 * args.microbatches, FEATURES, generator=generator)
            phase = run.online.phase
            run.step(x, x.sin())
            records.append({"phase": phase, "end_s": gpu.now_s(), "end_j": gpu.energy_j()})
    finally:
        run.close()
    gathered: list[Any] = [None] * stages
    dist.all_gather_object(gathered, records)
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(summary("torch.distributed.pipelining", gathered, args.microbatches)))


def _window(records: list[list[dict[str, Any]]], phase: str) -> tuple[float, float]:
    """Per iteration over ``phase`` (its first iteration left out): time, all ranks' J."""
    indices = [i for i, r in enumerate(records[0]) if r["phase"] == phase][1:]
    if len(indices) < 2:
        raise SystemExit(f"too few iterations to measure the {phase!r} phase: raise --iterations")
    first, last = indices[0] - 1, indices[-1]
    time_s = records[0][last]["end_s"] - records[0][first]["end_s"]
    energy_j = sum(rank[last]["end_j"] - rank[first]["end_j"] for rank in records)
    return time_s / (last - first), energy_j / (last - first)


def summary(engine: str, records: list[list[dict[str, Any]]], microbatches: int) -> dict[str, Any]:
    (t_max, e_max), (t_plan, e_plan) = _window(records, "warmup"), _window(records, "planned")
    return {
        "engine": engine,
        "stages": len(records),
        "microbatches": microbatches,
        "iteration_time_s_max": t_max,
        "energy_j_max": e_max,
        "iteration_time_s_plan": t_plan,
        "energy_j_plan": e_plan,
        "time_ratio": t_plan / t_max,
        "energy_saving": 1.0 - e_plan / e_max,
    }


# -------------------------------------------------------------------------- driver
def table(rows: dict[str, dict[str, Any]]) -> Iterator[str]:
    yield (
        "| engine | iteration (s), max clock | with plan | time ratio "
        "| energy (J), max clock | with plan | saving |"
    )
    yield "| --- | --- | --- | --- | --- | --- | --- |"
    for name, r in rows.items():
        yield (
            f"| {name} | {r['iteration_time_s_max']:.3f} | {r['iteration_time_s_plan']:.3f} | "
            f"{r['time_ratio']:.4f} | {r['energy_j_max']:.1f} | {r['energy_j_plan']:.1f} | "
            f"{r['energy_saving'] * 100:.1f} % |"
        )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--pipelining"]:
        _pipelining(argv[1:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--stage-times-s", help="F:B per stage (default: last stage 1.5x)")
    parser.add_argument("--gpu", choices=["a100", "h100"], default="a100")
    parser.add_argument("--engines", nargs="+", choices=list(ENGINES), default=list(ENGINES))
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    args.stage_times_s = args.stage_times_s or default_stage_times(args.stages)
    rows = {name: run_engine(name, args) for name in args.engines}
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(
        f"{args.stages} stages, {args.microbatches} micro-batches, stage times "
        f"{args.stage_times_s} s, simulated {args.gpu}, {args.iterations} iterations"
    )
    print("\n".join(table(rows)))


if __name__ == "__main__":
    main()
