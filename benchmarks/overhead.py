"""Controller overhead per training step, and Lightning fit time with/without the callback.

Four measurements, in one run:

1. Controller time per step: the time spent inside ``EnergyController.on_step_start``
   plus ``on_step_end``, over a whole profile-and-train run (profiling windows, interval
   closes and metric updates included), as ``mean_step_overhead_us`` (what it costs in
   total), ``median_step_overhead_us``, ``p99_step_overhead_us``,
   ``p999_step_overhead_us`` (the steps that close a window or an interval) and
   ``first_step_overhead_us`` (the one-time cost of the first step). The GPU is a simulated
   A40 whose simulated work is excluded (its ``run_step`` is not timed), so only the
   controller's own bookkeeping and the energy-counter reads are timed.
2. ``sampler_cpu_share``: the CPU time of the NVML power-sampler thread (GPUs without an
   energy counter integrate sampled power every 50 ms) over the wall time it ran, on the
   in-memory pynvml of the tests (``tests/lightning_energy/device/fake_pynvml.py``), whose
   readings cost no driver call: the thread's own share of one core, a lower bound.
3. ``fit_time_ratio``: wall time of ``Trainer.fit`` on a small MLP with the
   ``EnergyCallback`` over the same fit without it; runs alternate (A, B, A, B, ...) and the
   ratio of the medians is reported, so machine noise hits both sides alike.
4. Carbon pacing at a step boundary, with pacing on (``forecast`` policy, pausing allowed,
   a deadline a week away, a decision due every 5 minutes, the DE 2023 trace): how long
   the training thread waits in ``CarbonPacer.update`` at a boundary where a decision is
   due, when the decision is made on that thread (``pacing_inline_ms_*``: what a simulated
   GPU's virtual clock does, and what every wall-clock job did before) and when it is made
   in the background (``pacing_wait_ms_*``: a wall-clock job), mean, median, p99 and max
   over ``--decisions`` boundaries, and the background decisions' own time
   (``pacing_decision_ms_*``).
5. Pipeline ranks (``pipeline_*``): two processes (gloo) each run one stage of a 1F1B
   ``PipelineRun`` whose plan changes the clock at every instruction, on the in-memory
   pynvml's GPUs (the path of real GPUs: the clock thread, no simulated work). Per step
   and rank, the host time in Perseus' hooks around the forwards and backwards and the
   iteration (``hooks``), and in handing the last stage's loss to every rank (``loss``:
   from the end of the schedule to the return of ``PipelineRun.step``), as mean, median
   and p99 in us. On the CPU the stages, the loss and the collective (gloo) are on the
   host; on CUDA (``--pipeline-device cuda``, two GPUs) they run on the GPUs.

Targets (benchmarks/README.md): median overhead <= 50 us, fit ratio <= 1.01, pacing never
holds a step up for more than a few milliseconds.

Usage::

    python benchmarks/overhead.py [--steps 10000] [--fit-steps 500] [--repeats 5]
        [--decisions 20] [--pipeline-steps 2000] [--pipeline-device cpu] [--json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import socket
import statistics
import sys
import tempfile
import threading
import time
import types
import warnings
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from carbon.config import CarbonConfig
from lightning_energy.config import EnergyConfig
from lightning_energy.controller import EnergyController
from lightning_energy.device import DeviceSet, SimulatedSpec, physics_preset, simulated_gpus
from lightning_energy.pacing import CarbonPacer

FAKE_PYNVML_DIR = Path(__file__).resolve().parents[1] / "tests" / "lightning_energy" / "device"
SAMPLER_THREAD = "lightning-energy-power-sampler"


def step_overhead_us(steps: int, lease_dir: str) -> dict[str, float]:
    """Mean, median, p99, p99.9 and first of the controller's times per step, in us."""
    importlib.import_module("torch")  # a training process has torch loaded before step 1
    gpus = simulated_gpus(SimulatedSpec(gpu="a40", noise_std=0.02))
    devices = DeviceSet(gpus=gpus, clock=gpus[0].clock.now, backend="simulated")
    config = EnergyConfig.from_mapping(
        {"device": {"backend": "simulated", "lease_dir": lease_dir}, "log_every_n_steps": 50}
    )
    controller = EnergyController(config, devices=devices, install_signal_handlers=False)
    controller.setup()
    samples: list[float] = []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            controller.on_step_start()
            t1 = time.perf_counter()
            gpus[0].run_step()  # the "training step": simulated GPU work, not timed
            t2 = time.perf_counter()
            controller.on_step_end()
            t3 = time.perf_counter()
            samples.append((t1 - t0) + (t3 - t2))
    finally:
        controller.teardown()
    first_s = samples[0]
    samples.sort()
    return {
        "mean_step_overhead_us": statistics.fmean(samples) * 1e6,
        "median_step_overhead_us": statistics.median(samples) * 1e6,
        "p99_step_overhead_us": samples[int(0.99 * (len(samples) - 1))] * 1e6,
        "p999_step_overhead_us": samples[int(0.999 * (len(samples) - 1))] * 1e6,
        "max_step_overhead_us": samples[-1] * 1e6,
        "first_step_overhead_us": first_s * 1e6,
        "profile_complete": float(controller.profile_done),
    }


def _fake_pynvml() -> types.ModuleType:
    """The tests' in-memory pynvml (``fake_pynvml``): ``a100`` and ``make_module``."""
    sys.path.insert(0, str(FAKE_PYNVML_DIR))
    try:
        return importlib.import_module("fake_pynvml")
    finally:
        sys.path.remove(str(FAKE_PYNVML_DIR))


def _summary_us(name: str, samples_s: Sequence[float]) -> dict[str, float]:
    """Mean, median and p99 of ``samples_s``, in us, as ``{name}_{mean,median,p99}_us``."""
    ordered = sorted(samples_s)
    return {
        f"{name}_mean_us": statistics.fmean(ordered) * 1e6,
        f"{name}_median_us": statistics.median(ordered) * 1e6,
        f"{name}_p99_us": ordered[int(0.99 * (len(ordered) - 1))] * 1e6,
    }


def window_readings(lease_dir: str) -> dict[str, float]:
    """Readings per profiling window on 20 ms steps and a 100 ms energy counter.

    Each reading synchronises the GPUs and, across ranks, is a collective; a window of
    10 s is 500 such steps. Counted over a whole profile of four limits (the warm-up
    window has no reading).
    """
    gpus = simulated_gpus(SimulatedSpec(gpu="a100", step_time_s=0.02))
    devices = DeviceSet(gpus=gpus, clock=gpus[0].clock.now, backend="simulated")
    config = EnergyConfig.from_mapping(
        {
            "device": {"backend": "simulated", "lease_dir": lease_dir},
            "power_limit": {"selector": "energy", "power_limits_w": [400, 300, 250, 200]},
        }
    )
    controller = EnergyController(config, devices=devices, install_signal_handlers=False)
    controller.setup()
    readings = 0
    sum_and_max = controller.collective.sum_and_max

    def counted(sums: Sequence[float], maxima: Sequence[float]) -> tuple[list[float], list[float]]:
        nonlocal readings
        readings += 1
        return sum_and_max(sums, maxima)

    controller.collective.sum_and_max = counted  # type: ignore[method-assign, assignment]
    try:
        while not controller.profile_done:
            controller.on_step_start()
            gpus[0].run_step()
            controller.on_step_end()
    finally:
        controller.teardown()
    windows = sum(1 for d in controller.decisions if d["purpose"] == "profile") - 1
    return {
        "profile_windows": float(windows),
        "profile_steps": float(controller.steps),
        "readings_per_window": (readings - 1) / windows,  # less the setup's counter period
    }


def sampler_cpu_share(duration_s: float) -> dict[str, float]:
    """CPU share of the power-sampler thread on an in-memory pynvml GPU with no counter."""
    fake = _fake_pynvml()
    from lightning_energy.device.nvml import nvml_gpus

    previous = sys.modules.get("pynvml")
    sys.modules["pynvml"] = fake.make_module([fake.a100(0, energy_mj=None, power_mw=200_000)])
    try:
        (gpu,) = nvml_gpus([0])
        try:
            gpu.energy_j()  # no counter: starts the sampler
            (thread,) = [t for t in threading.enumerate() if t.name == SAMPLER_THREAD]
            assert thread.ident is not None
            clock = time.pthread_getcpuclockid(thread.ident)
            c0, t0 = time.clock_gettime(clock), time.perf_counter()
            time.sleep(duration_s)
            c1, t1 = time.clock_gettime(clock), time.perf_counter()
            gpu.energy_j()
        finally:
            gpu.close()
    finally:
        if previous is None:
            del sys.modules["pynvml"]
        else:
            sys.modules["pynvml"] = previous
    return {
        "sampler_cpu_share": (c1 - c0) / (t1 - t0),
        "sampler_cpu_us_per_s": (c1 - c0) / (t1 - t0) * 1e6,
        "sampler_wall_s": t1 - t0,
    }


def _fit_seconds(with_callback: bool, steps: int, lease_dir: str) -> tuple[float, float]:
    """Wall and process-CPU seconds of one ``Trainer.fit``."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_energy.integrations.lightning import EnergyCallback

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)
            )

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024 * 16, 256, generator=g)
    data = TensorDataset(x, torch.randint(0, 10, (1024 * 16,), generator=g))
    callbacks: list[pl.Callback] = []
    if with_callback:
        callbacks.append(
            EnergyCallback(device={"backend": "simulated", "gpu": "a40", "lease_dir": lease_dir})
        )
    torch.manual_seed(0)
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    t0, c0 = time.perf_counter(), time.process_time()
    trainer.fit(MLP(), DataLoader(data, batch_size=1024))
    return time.perf_counter() - t0, time.process_time() - c0


def fit_time_ratio(steps: int, repeats: int, lease_dir: str) -> dict[str, float]:
    """Median fit time with the callback over the median without it (alternating runs).

    Wall time is what a user sees; process CPU time is reported too because it is far
    less disturbed by other load on a shared machine.
    """
    _fit_seconds(False, 20, lease_dir)  # warm-up: imports, allocator, thread pools
    runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for _ in range(repeats):
        for with_callback in (False, True):
            runs[with_callback].append(_fit_seconds(with_callback, steps, lease_dir))

    def median(with_callback: bool, i: int) -> float:
        return statistics.median(r[i] for r in runs[with_callback])

    return {
        "fit_time_ratio": median(True, 0) / median(False, 0),
        "fit_cpu_time_ratio": median(True, 1) / median(False, 1),
        "fit_with_callback_s": median(True, 0),
        "fit_without_callback_s": median(False, 0),
    }


def _stats_ms(prefix: str, samples_s: Sequence[float]) -> dict[str, float]:
    ordered = sorted(samples_s)
    return {
        f"{prefix}_mean": statistics.fmean(ordered) * 1e3,
        f"{prefix}_median": statistics.median(ordered) * 1e3,
        f"{prefix}_p99": ordered[math.ceil(0.99 * len(ordered)) - 1] * 1e3,  # nearest rank
        f"{prefix}_max": ordered[-1] * 1e3,
    }


def _pacing_frontier() -> list[tuple[float, float, str]]:
    """(seconds, joules, label) per step of a simulated A100 at 400 W down to 150 W."""
    model = physics_preset("a100")
    frontier = []
    for limit_w in range(400, 125, -25):
        duration_s, power_w = model.run(1.0, model.step_compute_bound_share, limit_w, None)
        frontier.append((duration_s, duration_s * power_w, f"{limit_w} W"))
    return frontier


def pacing_wait_ms(decisions: int) -> dict[str, float]:
    """The training thread's wait at boundaries where a pacing decision is due: decided on
    that thread, and decided in the background."""
    config = CarbonConfig(
        provider="trace",
        region="DE",
        policy="forecast",
        allow_pause=True,
        deadline=timedelta(days=7),
        poll_interval_s=300.0,
    )
    frontier = _pacing_frontier()
    steps = int(3 * 86400 / frontier[0][0])  # three days of work at full speed
    start = datetime(2023, 3, 6, tzinfo=timezone.utc)
    results: dict[str, float] = {}
    decided_s: list[float] = []
    for inline in (True, False):
        clock = {"now": start}

        def now(clock: dict[str, datetime] = clock) -> datetime:
            return clock["now"]

        pacer = CarbonPacer(config, now=now, virtual_clock=inline)
        decide = pacer.policy.decide

        def timed(*args: Any, decide: Any = decide, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = decide(*args, **kwargs)
            decided_s.append(time.perf_counter() - t0)
            return out

        pacer.policy.decide = timed  # type: ignore[method-assign]  # timed where it runs
        waits: list[float] = []
        pacer.start()
        try:
            for k in range(decisions):
                left = steps - k * int(300 / frontier[0][0])
                t0 = time.perf_counter()
                pacer.update(left, frontier, 60.0, emitted_g=0.0)
                waits.append(time.perf_counter() - t0)
                # The five minutes of training until the next boundary: the background
                # decision finishes meanwhile.
                pacer.update(left, frontier, 60.0, emitted_g=0.0, wait=True)
                clock["now"] += timedelta(seconds=300)
        finally:
            pacer.stop()
        results.update(_stats_ms("pacing_inline_ms" if inline else "pacing_wait_ms", waits))
        if not inline:
            results.update(_stats_ms("pacing_decision_ms", decided_s))
        decided_s.clear()
    return results


PIPELINE_MICROBATCHES = 8
PIPELINE_WIDTH = 64


class _TwoStages:
    """A module declaring two linear stages (``PipelineModule``) and an MSE loss."""

    def __init__(self) -> None:
        import torch

        torch.manual_seed(0)
        self.stages = [torch.nn.Linear(PIPELINE_WIDTH, PIPELINE_WIDTH) for _ in range(2)]

    def pipeline_stages(self) -> list[Any]:
        return list(self.stages)

    def pipeline_loss(self, output: Any, target: Any) -> Any:
        import torch

        return torch.nn.functional.mse_loss(output, target)


def _timed(samples: list[float], fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, adding the time of each call to ``samples[-1]``."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            samples[-1] += time.perf_counter() - t0

    return timed


def _pipeline_rank(rank: int, port: int, steps: int, device: str, out_dir: str) -> None:
    """One rank of :func:`pipeline_overhead_us`: writes its samples (s) to ``out_dir``."""
    import torch
    import torch.distributed as dist

    from lightning_energy.config import EnergyConfig
    from lightning_energy.perseus.planning.plan import Plan
    from lightning_energy.perseus.runtime.pipeline_run import PipelineRun, pipeline_schedule
    from lightning_energy.perseus.runtime.rank_gpu import open_rank_gpu

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    fake = _fake_pynvml()
    sys.modules["pynvml"] = fake.make_module([fake.a100(0), fake.a100(1)])
    on_cuda = device == "cuda"
    root = torch.device("cuda", rank) if on_cuda else torch.device("cpu")
    if on_cuda:
        torch.cuda.set_device(root)
    dist.init_process_group(
        "nccl" if on_cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
    )
    section = {"enabled": True, "schedule": "1f1b", "microbatches": PIPELINE_MICROBATCHES}
    base = EnergyConfig.from_mapping({"perseus": section})
    schedule = pipeline_schedule(base.perseus, 2)
    clocks = tuple(1410 if i % 2 else 1005 for i in range(len(schedule.nodes)))
    plan_path = Path(out_dir, f"plan{rank}.json")
    plan_path.write_text(Plan(schedule, clocks).to_json())
    config = EnergyConfig.from_mapping(
        {
            "device": {"backend": "nvml", "lease_dir": str(Path(out_dir, "leases"))},
            "perseus": {**section, "plan": str(plan_path)},
        }
    )
    outer: list[float] = []  # iteration start and end: outside the schedule
    inner: list[float] = []  # before and after each forward and backward: inside it
    schedule_s: list[float] = []
    total: list[float] = []
    # The in-memory pynvml's GPU of this local rank: a real GPU's settings are never touched.
    rank_gpu = open_rank_gpu(config, local_rank=rank, install_signal_handlers=False)
    try:
        module = _TwoStages()
        for stage in module.stages:
            stage.to(root)
        run = PipelineRun(
            rank_gpu, config.perseus, module, global_rank=rank, world_size=2, root_device=root
        )
        pipeline = run.pipeline
        for name, samples in (
            ("iteration_start", outer),
            ("iteration_end", outer),
            ("before", inner),
            ("after", inner),
        ):
            setattr(pipeline, name, _timed(samples, getattr(pipeline, name)))
        run._pipe.step = _timed(schedule_s, run._pipe.step)
        generator = torch.Generator().manual_seed(rank)
        batch = PIPELINE_MICROBATCHES * 4
        x = torch.randn(batch, PIPELINE_WIDTH, generator=generator).to(root)
        y = torch.randn(batch, PIPELINE_WIDTH, generator=generator).to(root)
        try:
            for _ in range(steps):
                for samples in (outer, inner, schedule_s):
                    samples.append(0.0)
                t0 = time.perf_counter()
                run.step(x, y)
                total.append(time.perf_counter() - t0)
        finally:
            run.close()
    finally:
        rank_gpu.close()
        dist.destroy_process_group()
    hooks = [o + i for o, i in zip(outer, inner, strict=True)]
    # The loss hand-off: what step() does besides the schedule and the iteration's hooks.
    loss = [t - s - o for t, s, o in zip(total, schedule_s, outer, strict=True)]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"hooks": hooks, "loss": loss}))


def pipeline_overhead_us(steps: int, device: str) -> dict[str, float]:
    """Per step and pipeline rank, the host time in Perseus' hooks and in the loss
    hand-off of a 2-process ``PipelineRun`` (the first 10 % of the steps left out)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        mp.spawn(_pipeline_rank, args=(port, steps, device, out_dir), nprocs=2)
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(2)]
    result: dict[str, float] = {}
    warm = steps // 10
    for r, samples in enumerate(ranks):
        for part in ("hooks", "loss"):
            result.update(_summary_us(f"pipeline_rank{r}_{part}", samples[part][warm:]))
    return result


def main(argv: Sequence[str] | None = None) -> None:
    """Run the measurements and print them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--steps", type=int, default=10000, help="controller steps to time (0: none)"
    )
    parser.add_argument(
        "--sampler-s", type=float, default=5.0, help="power-sampler seconds (0: none)"
    )
    parser.add_argument("--fit-steps", type=int, default=500, help="training steps per fit")
    parser.add_argument(
        "--repeats", type=int, default=5, help="fits with and without (0: no fit comparison)"
    )
    parser.add_argument(
        "--decisions", type=int, default=20, help="pacing boundaries with a decision due"
    )
    parser.add_argument(
        "--pipeline-steps", type=int, default=2000, help="pipeline steps per rank (0: none)"
    )
    parser.add_argument(
        "--pipeline-device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the pipeline's stages run (cuda: two GPUs, NCCL)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    result: dict[str, float] = {}
    try:
        with tempfile.TemporaryDirectory() as lease_dir:
            if args.steps > 0:
                result.update(step_overhead_us(args.steps, lease_dir))
                result.update(window_readings(lease_dir))
            if args.sampler_s > 0:
                result.update(sampler_cpu_share(args.sampler_s))
            if args.decisions > 0:
                result.update(pacing_wait_ms(args.decisions))
            if args.repeats > 0:
                result.update(fit_time_ratio(args.fit_steps, args.repeats, lease_dir))
        if args.pipeline_steps > 0:
            result.update(pipeline_overhead_us(args.pipeline_steps, args.pipeline_device))
    finally:
        logging.disable(logging.NOTSET)
    if args.json:
        print(json.dumps(result))
        return
    if args.steps > 0:
        print(
            f"controller overhead per step over {args.steps} steps: mean "
            f"{result['mean_step_overhead_us']:.1f} us, median "
            f"{result['median_step_overhead_us']:.1f} us, p99 "
            f"{result['p99_step_overhead_us']:.1f} us, p99.9 "
            f"{result['p999_step_overhead_us']:.1f} us, max "
            f"{result['max_step_overhead_us']:.0f} us; first step "
            f"{result['first_step_overhead_us']:.0f} us (target median <= 50 us)"
        )
        print(
            f"profiling on 20 ms steps and a 100 ms counter: "
            f"{result['readings_per_window']:.1f} readings (GPU sync + collective) per window "
            f"of {result['profile_steps'] / result['profile_windows']:.0f} steps on average"
        )
    if args.sampler_s > 0:
        print(
            f"NVML power-sampler thread (in-memory pynvml, 50 ms period): "
            f"{result['sampler_cpu_share']:.3%} of one core "
            f"({result['sampler_cpu_us_per_s']:.0f} us CPU per s over "
            f"{result['sampler_wall_s']:.1f} s)"
        )
    if args.repeats > 0:
        print(
            f"Lightning fit time with/without EnergyCallback: {result['fit_time_ratio']:.4f} "
            f"wall ({result['fit_with_callback_s']:.2f} s / "
            f"{result['fit_without_callback_s']:.2f} s), "
            f"{result['fit_cpu_time_ratio']:.4f} process CPU; medians of {args.repeats} "
            "(target <= 1.01)"
        )
    if args.decisions > 0:
        print(
            f"carbon pacing at a boundary with a decision due (forecast policy, pausing, "
            f"7-day deadline, {args.decisions} decisions): step thread waits "
            f"{result['pacing_wait_ms_median']:.2f} ms median, "
            f"{result['pacing_wait_ms_mean']:.2f} ms mean, "
            f"{result['pacing_wait_ms_p99']:.2f} ms p99, {result['pacing_wait_ms_max']:.2f} ms "
            f"max with background planning; {result['pacing_inline_ms_median']:.0f} ms "
            f"median, {result['pacing_inline_ms_max']:.0f} ms max decided on the step thread "
            f"(each background decision: {result['pacing_decision_ms_median']:.0f} ms median)"
        )
    if args.pipeline_steps > 0:
        for r, role in enumerate(("first stage", "last stage")):
            parts = [
                f"{part} mean {result[f'pipeline_rank{r}_{part}_mean_us']:.1f} us, median "
                f"{result[f'pipeline_rank{r}_{part}_median_us']:.1f} us, p99 "
                f"{result[f'pipeline_rank{r}_{part}_p99_us']:.1f} us"
                for part in ("hooks", "loss")
            ]
            print(
                f"pipeline rank {r} ({role}, {args.pipeline_device}) per step over "
                f"{args.pipeline_steps} steps: " + "; ".join(parts)
            )


if __name__ == "__main__":
    main()
