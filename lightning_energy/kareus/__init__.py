"""Kareus: nano-batch overlap with the communication CTAs, launch slot and clock co-tuned
per partition, planned with Perseus (Wu, Chung and Chowdhury, OSDI'26).

The pieces, in the order a user meets them:

* :mod:`.partition`: what a partition and its settings are;
* :mod:`.model`: the physical model of compute and a collective sharing SMs, calibrated on
  the measured Kareus partition data (the simulated GPU's knowledge of these knobs);
* :mod:`.workload`: transformer layers as partitions, and a simulated GPU group measuring
  them;
* :mod:`.search`: the multi-objective partition search (Optuna, or exhaustive), with a
  measurement file to resume from;
* :mod:`.compose`: partition points into instruction options, the Perseus planner's
  frontier, and the plan (clock and partition settings of every instruction);
* :mod:`.runtime`: a plan's settings checked against the model, the CTA-limited NCCL
  groups, and one partition's collective issued at its launch slot on a communication
  stream;
* :mod:`.data_parallel`: the knobs of data-parallel training (the gradient all-reduce's
  CTAs through a CTA-limited group, DDP's bucket size, the clock), applied when DDP wraps
  the model;
* :mod:`.dp_workload`: the simulated GPU's answer for data-parallel training, a backward
  with its gradient all-reduce in overlapped buckets, measured for the partition search;
* :mod:`.dp_search`: the data-parallel CTAs and clock measured online, during training
  (switchable CTA-limited gradient groups behind a DDP hook; Accelerate's ``attach_energy``
  runs it);
* :mod:`.megatron_layer` (needs Megatron-Core; not imported here): the runtime for
  Megatron-Core, a layer spec whose layers overlap two nano-batches at a plan's settings
  (``KareusMegatron``, given to ``MegatronEnergy(kareus=...)``, which applies the plan's
  clocks: one plan drives both). Without a plan the layers run plain nano-batching.

Example (simulated; see ``benchmarks/kareus.py`` for the whole comparison)::

    from lightning_energy.kareus import (
        LLAMA_3_2_3B, KareusPlanner, OverlapModel, SearchSpace, SimulatedPartitions,
        instruction_options, search_partition, shipped_physics,
    )

    meter = SimulatedPartitions(OverlapModel(shipped_physics()), LLAMA_3_2_3B)
    ...

Applying a plan (every rank, after ``parallel_state.initialize_model_parallel``)::

    from lightning_energy.kareus.megatron_layer import KareusMegatron

    kareus = KareusMegatron("kareus_plan.json")
    model = GPTModel(config, transformer_layer_spec=kareus.layer_spec(), ...)
    forward_backward = MegatronEnergy("energy.yaml", kareus=kareus).wrap(
        get_forward_backward_func()
    )
"""

from __future__ import annotations

from lightning_energy.kareus.compose import (
    KIND_KEYS,
    InstructionOption,
    KareusPlan,
    KareusPlanner,
    KareusPoint,
    instruction_options,
    planner_from_files,
    reprice,
)
from lightning_energy.kareus.measured import PartitionMeasurements, read_partition_csv
from lightning_energy.kareus.model import (
    FitReport,
    OverlapModel,
    OverlapPhysics,
    Prediction,
    check,
    fit,
    shipped_physics,
)
from lightning_energy.kareus.partition import (
    PARTITION_KEYS,
    SEQUENTIAL,
    ComputeOp,
    Partition,
    PartitionSetting,
)
from lightning_energy.kareus.search import (
    SAMPLERS,
    MeasuredPoint,
    MeasurementCache,
    PartitionMeter,
    SearchResult,
    SearchSpace,
    hypervolume,
    pareto_front,
    read_measurements,
    search_partition,
)
from lightning_energy.kareus.workload import (
    LLAMA_3_2_3B,
    MEASURED_FWD_ATTN,
    SimulatedPartitions,
    TransformerShape,
)

__all__ = [
    "KIND_KEYS",
    "LLAMA_3_2_3B",
    "MEASURED_FWD_ATTN",
    "PARTITION_KEYS",
    "SAMPLERS",
    "SEQUENTIAL",
    "ComputeOp",
    "FitReport",
    "InstructionOption",
    "KareusPlan",
    "KareusPlanner",
    "KareusPoint",
    "MeasuredPoint",
    "MeasurementCache",
    "OverlapModel",
    "OverlapPhysics",
    "Partition",
    "PartitionMeasurements",
    "PartitionMeter",
    "PartitionSetting",
    "Prediction",
    "SearchResult",
    "SearchSpace",
    "SimulatedPartitions",
    "TransformerShape",
    "check",
    "fit",
    "hypervolume",
    "instruction_options",
    "pareto_front",
    "planner_from_files",
    "read_measurements",
    "read_partition_csv",
    "reprice",
    "search_partition",
    "shipped_physics",
]
