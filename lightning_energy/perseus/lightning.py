"""Perseus for PyTorch Lightning (``lightning.pytorch``): two strategies.

* :class:`PerseusPipelineStrategy` (``strategy="perseus_pipeline"``) trains a
  LightningModule that declares its stage split (:class:`PipelineModule`) with
  ``torch.distributed.pipelining`` (GPipe, 1F1B or interleaved 1F1B), one pipeline rank per
  process, and runs every forward and backward at its planned clock: from a plan file, or
  profiled online during the first iterations and planned automatically.
* :class:`PerseusDDPStrategy` (``strategy="perseus_ddp"``) is ``DDPStrategy`` whose faster
  ranks lower their clock to reach the gradient all-reduce when the slowest rank does.

Both take their GPU from :func:`~lightning_energy.device.open_devices` (NVML on NVIDIA GPUs,
the simulated GPU on CPU machines), change clocks only through a
:class:`~lightning_energy.device.guard.GPUGuard`, and restore the GPU at the end, on
exceptions and on SIGTERM. From the LightningCLI YAML::

    trainer:
      accelerator: cpu
      devices: 2
      strategy:
        class_path: lightning_energy.perseus.lightning.PerseusPipelineStrategy
        init_args:
          schedule: 1f1b
          microbatches: 4

For the ``pytorch_lightning`` namespace, see :mod:`lightning_energy.perseus.pytorch_lightning`.
"""

from __future__ import annotations

from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from lightning_energy.perseus._strategy_core import (
    PerseusDDPCore,
    PerseusPipelineCore,
    PipelineModule,
    register_perseus_strategies,
)

__all__ = ["PerseusDDPStrategy", "PerseusPipelineStrategy", "PipelineModule"]


class PerseusPipelineStrategy(PerseusPipelineCore, DDPStrategy):
    """Pipeline-parallel training with per-instruction GPU clocks (Perseus).

    Every process is one pipeline rank; all ranks see the same batches (no data
    parallelism: the model is not wrapped in DDP, each rank updates its stages).

    Args:
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved_1f1b"``.
        microbatches: microbatches per batch.
        virtual_stages: stages per rank (interleaved 1F1B).
        plan: a plan JSON to apply; None: profile online and plan.
        target_time_s: iteration time to plan for (None: no slowdown); see
            :meth:`set_target_time` to change it while training.
        profile_clocks_mhz: clocks to profile online (default: 4 from max to 60 %).
        warmup_iterations: iterations at full clock before profiling.
        iterations_per_clock: measured iterations per clock, at least (see
            :class:`~lightning_energy.perseus.online.OnlinePerseus`: one more lets each
            change land, and a clock is measured for at least 200 energy counter periods).
        replan_every_iterations: after planning, how often (in iterations) the ranks check
            for a new target time (one small collective over a gloo group).
        device_backend: ``"auto"``, ``"nvml"`` or ``"simulated"`` (None: the
            ``LIGHTNING_ENERGY_DEVICE`` variable, else auto).
        simulated_gpu: physics preset of simulated GPUs (``"a100"``, ``"h100"``).
        simulated_stage_times_s: simulated GPUs: ``[forward, backward]`` time at the
            maximum clock of one microbatch on each stage.
        compute_bound_share: simulated GPUs: compute-bound share of every instruction.
        lease_dir: where GPU leases live (default: the per-user state directory).
        strict: raise instead of observing when GPU settings cannot be changed.
        **kwargs: passed to ``DDPStrategy`` (``process_group_backend``, ...).

    Raises:
        ConfigError: bad arguments (at construction) or a module without a stage split
            (at setup).
    """


class PerseusDDPStrategy(PerseusDDPCore, DDPStrategy):
    """``DDPStrategy`` whose ranks finish their compute together (straggler mitigation).

    Args:
        window_steps: steps between re-evaluations of the straggler.
        steps_per_clock: profiled steps per clock.
        margin: finish this much (relative) before the straggler.
        profile_clocks_mhz: clocks to profile (default: 3 from max to 60 %).
        device_backend: ``"auto"``, ``"nvml"`` or ``"simulated"`` (None: the
            ``LIGHTNING_ENERGY_DEVICE`` variable, else auto).
        simulated_gpu: physics preset of simulated GPUs.
        simulated_step_s: simulated GPUs: compute time of a step at the maximum clock.
        compute_bound_share: simulated GPUs: its compute-bound share.
        slowdowns: simulated GPUs: straggler factor of each local rank (1.0: normal).
        lease_dir: where GPU leases live.
        strict: raise instead of observing when GPU settings cannot be changed.
        **kwargs: passed to ``DDPStrategy``.
    """


register_perseus_strategies(StrategyRegistry, PerseusPipelineStrategy, PerseusDDPStrategy)
