"""Perseus for PyTorch Lightning (``lightning.pytorch``): two strategies and a callback.

* :class:`PerseusPipelineStrategy` (``strategy="perseus_pipeline"``) trains a
  LightningModule that declares its stage split (:class:`PipelineModule`) with
  ``torch.distributed.pipelining`` (GPipe, 1F1B or interleaved 1F1B), one pipeline rank per
  process, and runs every forward and backward at its planned clock: from a plan file, or
  profiled online during the first iterations and planned automatically.
* :class:`PerseusDDPStrategy` (``strategy="perseus_ddp"``) is ``DDPStrategy`` whose faster
  ranks lower their clock to reach the gradient all-reduce when the slowest rank does.
* :class:`PerseusCallback` does the same on any DDP strategy; the
  ``lightning.pytorch.callbacks_factory`` entry point adds it when the file named by
  ``LIGHTNING_ENERGY_CONFIG`` says ``perseus: {enabled: true, mode: ddp}``.

Settings come from the ``perseus:`` section of the energy configuration (``energy=``, else
``LIGHTNING_ENERGY_CONFIG``); a strategy argument overrides the key it names. With an
``EnergyCallback`` in the same Trainer, Perseus changes the clocks of the callback's GPUs
through its guard (one opening, one lease); alone, it opens this rank's GPU from the
``device:`` section. Either way the GPU is restored at the end, on exceptions and on
SIGTERM. From the LightningCLI YAML (the energy configuration named by
``LIGHTNING_ENERGY_CONFIG``)::

    trainer:
      accelerator: cpu
      devices: 2
      strategy:
        class_path: lightning_energy.integrations.perseus_lightning.PerseusPipelineStrategy
        init_args:
          microbatches: 4

For the ``pytorch_lightning`` namespace, see
:mod:`lightning_energy.integrations.perseus_pytorch_lightning`.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from lightning_energy.integrations._perseus_core import (
    PerseusCallbackCore,
    PerseusDDPCore,
    PerseusPipelineCore,
    PipelineModule,
    register_perseus_strategies,
)

__all__ = ["PerseusCallback", "PerseusDDPStrategy", "PerseusPipelineStrategy", "PipelineModule"]


class PerseusPipelineStrategy(PerseusPipelineCore, DDPStrategy):
    """Pipeline-parallel training with per-instruction GPU clocks (Perseus).

    Every process is one pipeline rank; all ranks see the same batches (no data
    parallelism: the model is not wrapped in DDP, each rank updates its stages). Every
    argument but ``energy``, ``simulated_stage_times_s`` and ``**kwargs`` overrides the
    configuration key named after it (None: the configuration's value).

    Args:
        energy: the energy configuration (YAML path, mapping or ``EnergyConfig``; None:
            ``LIGHTNING_ENERGY_CONFIG``, else defaults with simulated ``a100`` GPUs).
        schedule: ``perseus.schedule``: ``"gpipe"``, ``"1f1b"`` or ``"interleaved_1f1b"``.
        microbatches: ``perseus.microbatches``: microbatches per batch.
        virtual_stages: ``perseus.virtual_stages``: stages per rank (interleaved 1F1B).
        plan: ``perseus.plan``: a plan JSON to apply (None: profile online and plan).
        target_time_s: ``perseus.target_time_s``: iteration time to plan for (None: no
            slowdown); see :meth:`set_target_time` to change it while training.
        profile_clocks_mhz: ``perseus.profile_clocks_mhz``: clocks to profile online.
        warmup_iterations: ``perseus.warmup_iterations``.
        iterations_per_clock: ``perseus.iterations_per_clock``.
        replan_every_iterations: ``perseus.replan_every_iterations``: after planning, how
            often the ranks check for a new target time.
        device_backend: ``device.backend``: ``"auto"``, ``"nvml"`` or ``"simulated"``.
        simulated_gpu: ``device.gpu``: the simulated GPU (a preset modelling clocks,
            ``"a100"`` or ``"h100"``).
        simulated_stage_times_s: simulated GPUs: ``[forward, backward]`` time at the
            maximum clock of one microbatch on each stage.
        compute_bound_share: ``perseus.compute_bound_share`` (simulated GPUs).
        lease_dir: ``device.lease_dir``: where GPU leases live.
        strict: ``strict``: raise instead of observing when GPU settings cannot change.
        **kwargs: passed to ``DDPStrategy`` (``process_group_backend``, ...).

    Raises:
        ConfigError: bad settings (at construction) or a module without a stage split
            (at setup).
    """


class PerseusDDPStrategy(PerseusDDPCore, DDPStrategy):
    """``DDPStrategy`` whose ranks finish their compute together (straggler mitigation).

    Every argument but ``energy`` and ``**kwargs`` overrides the configuration key named
    after it (None: the configuration's value).

    Args:
        energy: the energy configuration (YAML path, mapping or ``EnergyConfig``; None:
            ``LIGHTNING_ENERGY_CONFIG``, else defaults with simulated ``a100`` GPUs).
        window_steps: ``perseus.window_steps``: steps between re-evaluations.
        steps_per_clock: ``perseus.steps_per_clock``: profiled steps per clock.
        margin: ``perseus.margin``: finish this much (relative) before the straggler.
        profile_clocks_mhz: ``perseus.profile_clocks_mhz``: clocks to profile.
        device_backend: ``device.backend``.
        simulated_gpu: ``device.gpu``: the simulated GPU (a preset modelling clocks).
        simulated_step_s: ``perseus.simulated_step_s``: simulated compute of a step.
        compute_bound_share: ``perseus.compute_bound_share`` (simulated GPUs).
        slowdowns: ``device.slowdowns``: simulated straggler factor of each local rank.
        lease_dir: ``device.lease_dir``.
        strict: ``strict``.
        **kwargs: passed to ``DDPStrategy``.
    """


class PerseusCallback(PerseusCallbackCore, Callback):
    """Perseus switched on by the configuration alone; see :class:`PerseusCallbackCore`.

    Args:
        config: the energy configuration (its ``perseus:`` section).
    """


register_perseus_strategies(StrategyRegistry, PerseusPipelineStrategy, PerseusDDPStrategy)
