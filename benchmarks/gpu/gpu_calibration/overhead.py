"""Read-only runs of the controller on the workload, and what they cost per step.

* ``controller_observe``: the workload's loop without, then with, ``EnergyController``
  hooks around each step, the controller configured to change nothing
  (``power_limit: {enabled: false}``): the time per step both ways, the wall time of the
  hooks per step, the energy the controller measured, and whether the settings moved.
* ``callback_overhead``: a Lightning ``Trainer`` fit of the same workload (manual
  optimisation: each step runs the workload's step), without and with ``EnergyCallback``
  (the same read-only controller on the same GPU): the median time per step both ways.

The controller takes the bench's GPU (read-only in a read-only run) and the run's private
lease directory, and installs no signal handler of its own before training starts.
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from gpu_calibration.run import Run, Skip, distribution

if TYPE_CHECKING:
    from lightning_energy.controller import EnergyController

__all__ = ["callback_overhead", "controller_observe"]

# Steps of the Lightning fits: the first ones (compilation, caches) are not timed.
_FIT_STEPS = 40
_FIT_WARMUP_STEPS = 5


def _observing_controller(run: Run) -> EnergyController:
    """A controller of the bench's GPU that measures and changes nothing."""
    # Imported here: a restore-check child needs neither.
    from lightning_energy.config import EnergyConfig
    from lightning_energy.controller import EnergyController

    config = EnergyConfig.from_mapping(
        {"device": {"lease_dir": run.options.lease_dir}, "power_limit": {"enabled": False}}
    )
    return EnergyController(config, devices=run.bench.device_set(), install_signal_handlers=False)


def _pct(with_s: float, without_s: float) -> float | None:
    return 100.0 * (with_s - without_s) / without_s if without_s > 0 else None


def controller_observe(run: Run) -> None:
    """The workload without and with a read-only controller's hooks around each step."""
    bench = run.bench
    loop_s = max(2.0, 20 * run.period_s)
    run.need(2 * loop_s + 4, "two loops of the workload")
    before = bench.fresh_settings()
    for _ in range(3):  # warm
        bench.step()
    bench.synchronize()
    without_s: list[float] = []
    end_s = bench.now() + loop_s
    while bench.now() < end_s:
        start_s = bench.now()
        bench.step()
        bench.synchronize()
        without_s.append(bench.now() - start_s)
    controller = _observing_controller(run)
    with_s: list[float] = []
    hooks_us: list[float] = []
    try:
        controller.setup()
        end_s = bench.now() + loop_s
        while bench.now() < end_s:
            start_s, wall_0 = bench.now(), time.perf_counter()
            controller.on_step_start()
            wall_1 = time.perf_counter()
            bench.step()
            bench.synchronize()
            wall_2 = time.perf_counter()
            controller.on_step_end()
            wall_3 = time.perf_counter()
            with_s.append(bench.now() - start_s)
            hooks_us.append(1e6 * ((wall_1 - wall_0) + (wall_3 - wall_2)))
    finally:
        summary = controller.teardown()
    after = bench.fresh_settings()
    without = statistics.median(without_s)
    with_ = statistics.median(with_s)
    outcome = {
        "steps_without": len(without_s),
        "steps_with": len(with_s),
        "time_per_step_s": {"without": without, "with": with_},
        "overhead_per_step_pct": _pct(with_, without),
        "hooks_us_per_step": distribution(hooks_us),
        "energy_j": summary.energy_j,
        "observe_only": summary.observe_only,
        "read_error": summary.read_error,
        "settings_unchanged": after == before,
    }
    run.result["controller_observe"] = outcome
    if not summary.energy_j > 0:
        run.problems.append(f"controller_observe: the controller measured no energy: {outcome}")
    if after != before:
        run.problems.append(f"controller_observe: settings changed from {before} to {after}")


@contextmanager
def _quiet_lightning() -> Iterator[None]:
    """Lightning's advice (workers, tensor cores, no optimizer) off for the fits."""
    logger = logging.getLogger("lightning.pytorch")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def _fit_step_times_s(run: Run, callbacks: list[Any]) -> list[float]:
    """Wall seconds per step of a Lightning fit of the workload, after the warm-up."""
    import lightning.pytorch as pl
    import torch

    bench = run.bench

    class Workload(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            bench.step()
            bench.synchronize()

        def configure_optimizers(self) -> None:
            return None

    ends: list[float] = []

    class Timer(pl.Callback):
        def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
            ends.append(time.perf_counter())

    accelerator, devices = bench.lightning_target()
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=devices,
        max_epochs=1,  # without an optimizer the global step does not move: one epoch
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[Timer(), *callbacks],
    )
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.zeros(_FIT_STEPS)), batch_size=1
    )
    trainer.fit(Workload(), data)
    timed = ends[_FIT_WARMUP_STEPS - 1 :]
    return [b - a for a, b in itertools.pairwise(timed)]


def callback_overhead(run: Run) -> None:
    """Lightning fits of the workload without and with ``EnergyCallback`` (read-only)."""
    try:
        import lightning.pytorch  # noqa: F401
    except ImportError as exc:
        raise Skip(f"lightning is not importable here ({exc})") from exc
    from lightning_energy.integrations.lightning import EnergyCallback

    run.need(20.0, "two Lightning fits")
    before = run.bench.fresh_settings()
    with _quiet_lightning():
        without_s = _fit_step_times_s(run, [])
        callback = EnergyCallback({"power_limit": {"enabled": False}})
        callback.controller = _observing_controller(run)
        with_s = _fit_step_times_s(run, [callback])
    after = run.bench.fresh_settings()
    without = statistics.median(without_s)
    with_ = statistics.median(with_s)
    summary = callback.summary
    run.result["callback_overhead"] = {
        "steps_timed": len(with_s),
        "time_per_step_s": {"without": without, "with": with_},
        "overhead_per_step_s": with_ - without,
        "overhead_per_step_pct": _pct(with_, without),
        "callback_energy_j": None if summary is None else summary.energy_j,
        "settings_unchanged": after == before,
    }
    if after != before:
        run.problems.append(f"callback_overhead: settings changed from {before} to {after}")
