"""One typed configuration, from Python, a YAML file or the environment.

The same schema serves every integration (Lightning callback and strategy, LightningCLI
YAML, Fabric, Accelerate, the Transformers Trainer, the CLI)::

    device:
      backend: auto            # auto | nvml | zeusd | simulated
      gpu: a40                 # simulated GPU: a40 | v100 (Zeus traces), a100 | h100, or a CSV path
      calibration: null        # or a JSON from benchmarks/gpu/calibrate.py (replaces gpu)
      workload: imagenet/resnet50
      noise_std: 0.02
    power_limit:
      selector: cost           # energy | time | cost | max_slowdown | target_time
      eta: 0.5
    carbon:                    # optional; see docs/carbon.md
      provider: trace
      region: DE
    perseus:                   # optional; see docs/perseus.md
      enabled: true
      mode: ddp                # ddp (straggler clocks) | pipeline
    kareus:                    # optional; see docs/kareus.md (planned by `lightning-energy plan`)
      enabled: true
      measurements_dir: runs/kareus
      non_partition_profile: runs/kareus/non_partition.csv
      layers_per_stage: [15, 13]
      tp_size: 8
    batch_size:                # optional; see docs/batch-size.md
      enabled: true
      job_key: resnet50-imagenet
      monitor: val_acc
      target: 0.65
      batch_sizes: [64, 128, 256]
      default_batch_size: 128
    node_energy:               # CPU packages and DRAM (RAPL); or `node_energy: false`
      enabled: true
      powercap_root: null      # /sys/class/powercap with real GPUs
    strict: false
    report: run.json

``EnergyConfig.from_mapping`` validates everything when it is built and reports every
problem at once (key, bad value, allowed values) in one :class:`ConfigError`.
``load_config()`` reads the file named by ``LIGHTNING_ENERGY_CONFIG``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import date, datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from lightning_energy.errors import ConfigError

if TYPE_CHECKING:
    from carbon.config import CarbonConfig
    from lightning_energy.device.simulated import SimulatedSpec
    from lightning_energy.kareus.data_parallel import DataParallelSetting
    from lightning_energy.optimize.selectors import Selector

__all__ = [
    "CONFIG_ENV_VAR",
    "KNOBS",
    "BatchSizeConfig",
    "DeviceConfig",
    "EnergyConfig",
    "KareusConfig",
    "NodeEnergyConfig",
    "PerseusConfig",
    "PowerLimitConfig",
    "load_config",
]

#: The environment variable naming the YAML configuration file.
CONFIG_ENV_VAR = "LIGHTNING_ENERGY_CONFIG"

_BACKENDS = ("auto", "nvml", "zeusd", "simulated")
#: What ``power_limit.knob`` may name.
KNOBS = ("auto", "power_limit", "locked_clock")
_PERSEUS_MODES = ("ddp", "pipeline")
_PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")


@dataclass(frozen=True)
class DeviceConfig:
    """Which GPUs to drive and, for the simulated backend, what they run.

    Attributes:
        backend: ``auto`` (NVML when a GPU is visible, changed through zeusd when
            ``ZEUSD_SOCK_PATH`` or ``ZEUSD_HOST_PORT`` is set and the process may not
            change settings itself; else simulated), ``nvml``, ``zeusd`` (NVML's GPUs
            changed through Zeus' daemon) or ``simulated``.
        gpu: simulated GPU: ``a40``/``v100`` (real Zeus traces), ``a100``/``h100``
            (physics presets) or the path of a Zeus-format power trace CSV.
        workload: simulated trace workload, ``dataset/network`` (None: a default one).
        batch_size: simulated trace batch size (None: the workload's middle one).
        steps_per_epoch: simulated steps per trace epoch (None: the traced dataset in
            batches, about 0.37 s a step for the A40's ImageNet/ResNet-50).
        noise_std: relative Gaussian noise of simulated measurements.
        seed: seed of the simulated noise.
        slowdowns: per-GPU slowdown factors of simulated GPUs (a straggler > 1).
        step_time_s: physics presets (``a100``/``h100``): seconds per step at full clock.
        start: simulated GPUs: the date and time (ISO 8601, UTC when no offset) the
            virtual clock starts at, e.g. to replay a chosen day of a carbon trace
            (None: now).
        lease_dir: where GPU leases are kept (None: ``/run/lightning-energy``, machine-wide).
        state_dir: simulated GPUs: keep each GPU's settings in a file ``<uuid>.json`` in
            this directory, so they outlive the process and every process opening the
            GPU shares them, as with a real GPU (and leases are taken, as with NVML).
            None: in memory, private to the process.
        calibration: simulated GPUs: the path of a calibration JSON written by
            ``benchmarks/gpu/calibrate.py``; the simulated GPU is then the measured one
            (its counter period, idle power, limits, clocks and step time and power per
            limit and clock) and ``gpu`` is not used. None: ``gpu`` decides.
    """

    backend: str = "auto"
    gpu: str = "a40"
    workload: str | None = None
    batch_size: int | None = None
    steps_per_epoch: int | None = None
    noise_std: float = 0.0
    seed: int = 0
    slowdowns: tuple[float, ...] = ()
    step_time_s: float | None = None
    start: str | None = None
    lease_dir: str | None = None
    state_dir: str | None = None
    calibration: str | None = None

    def simulated_spec(self) -> SimulatedSpec:
        """The simulated-GPU specification this section describes (one GPU per rank)."""
        from lightning_energy.device.simulated import SimulatedSpec

        return SimulatedSpec(
            gpu=self.gpu,
            workload=self.workload,
            batch_size=self.batch_size,
            steps_per_epoch=self.steps_per_epoch,
            count=max(1, len(self.slowdowns)),
            noise_std=self.noise_std,
            seed=self.seed,
            slowdowns=self.slowdowns,
            step_time_s=self.step_time_s,
            state_dir=self.state_dir,
            calibration=self.calibration,
        )

    def start_time(self) -> datetime | None:
        """``start`` as an aware UTC datetime (None when unset)."""
        if self.start is None:
            return None
        value = datetime.fromisoformat(self.start)
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value


@dataclass(frozen=True)
class PowerLimitConfig:
    """How the power limit, or the locked SM clock, is chosen.

    Attributes:
        enabled: optimise the setting (False: measure and report only).
        knob: what is profiled and chosen: ``power_limit``, ``locked_clock`` (the SM clock
            locked at one frequency; the power limit stays at its pre-job value) or
            ``auto`` (locked clocks where this job may lock them, else power limits).
        selector: ``energy``, ``time``, ``cost``, ``max_slowdown`` or ``target_time``.
        eta: weight of energy in the Zeus cost (``cost`` selector), in [0, 1].
        max_slowdown: allowed slowdown factor (``max_slowdown`` selector), >= 1.
        target_time_s: target time per step (``target_time`` selector), > 0.
        power_limits_w: explicit candidate limits (None: every ``step_w`` from max to min).
        step_w: spacing of the default candidates, in watts.
        warmup_steps: steps before the first measurement.
        settle_steps: unmeasured steps after each power-limit change.
        settle_s: unmeasured seconds after each power-limit change, besides
            ``settle_steps`` (a board applies a new limit after tens to hundreds of ms;
            set it when ``settle_steps`` steps are shorter than that).
        clock_step_mhz: spacing of the candidate locked clocks, in MHz: from the highest
            supported SM clock (at the highest memory clock) down, every supported clock
            at least this far below the previous candidate.
    """

    enabled: bool = True
    knob: str = "power_limit"
    selector: str = "cost"
    eta: float = 0.5
    max_slowdown: float = 1.1
    target_time_s: float | None = None
    power_limits_w: tuple[float, ...] | None = None
    step_w: float = 25.0
    warmup_steps: int = 10
    settle_steps: int = 2
    settle_s: float = 0.0
    clock_step_mhz: float = 90.0

    def make_selector(self) -> Selector:
        """Build the selector this section names (already validated)."""
        from lightning_energy.optimize.selectors import make_selector

        return make_selector(
            self.selector,
            eta=self.eta,
            max_slowdown=self.max_slowdown,
            target_time_s=self.target_time_s,
        )

    def candidates_w(self, min_w: float, max_w: float) -> list[float]:
        """Candidate power limits within [min_w, max_w], highest first."""
        if self.power_limits_w is not None:
            return sorted(self.power_limits_w, reverse=True)
        limits: list[float] = []
        limit = max_w
        while limit >= min_w - 1e-9:
            limits.append(limit)
            limit -= self.step_w
        return limits


@dataclass(frozen=True)
class PerseusConfig:
    """Per-instruction and straggler-aware GPU clocks (Perseus), see docs/perseus.md.

    The Perseus strategies read this section; an argument given to a strategy overrides
    the key of the same name. ``enabled`` and ``mode`` only matter where nothing else
    names Perseus (``LIGHTNING_ENERGY_CONFIG`` with the Lightning entry point): ``ddp``
    installs the straggler equaliser, ``pipeline`` needs the ``perseus_pipeline`` strategy.

    Attributes:
        enabled: install Perseus where the configuration alone decides.
        mode: ``ddp`` (data parallel: fast ranks wait for the straggler at a lower clock)
            or ``pipeline`` (per-instruction clocks of a pipeline schedule).
        profile_clocks_mhz: clocks to profile (None: a few from the maximum to 60 %).
        compute_bound_share: simulated GPUs: the compute-bound share of the work, in [0, 1].
        window_steps: ddp: steps between re-evaluations of the straggler, >= 1.
        steps_per_clock: ddp: profiled steps per clock, >= 1.
        margin: ddp: finish this much (relative) before the straggler, in [0, 0.5).
        simulated_step_s: ddp, simulated GPUs: compute time of a step at the maximum
            clock, > 0.
        schedule: pipeline: ``1f1b``, ``gpipe`` or ``interleaved_1f1b``.
        microbatches: pipeline: microbatches per batch, >= 1.
        virtual_stages: pipeline: stages per rank (interleaved 1F1B), >= 1.
        plan: pipeline: a plan JSON to apply (None: profile online and plan).
        target_time_s: pipeline: iteration time to plan for (None: no slowdown), > 0.
        warmup_iterations: pipeline: iterations at full clock before profiling, >= 0.
        iterations_per_clock: pipeline: measured iterations per clock, >= 1, at least
            (one more lets each clock change land, and a clock is measured for at least
            200 energy counter periods; see
            :class:`~lightning_energy.perseus.runtime.online.OnlinePerseus`).
        replan_every_iterations: pipeline: how often the ranks look for a new target
            time once planned, >= 1.
    """

    enabled: bool = False
    mode: str = "ddp"
    profile_clocks_mhz: tuple[int, ...] | None = None
    compute_bound_share: float = 0.85
    window_steps: int = 10
    steps_per_clock: int = 2
    margin: float = 0.01
    simulated_step_s: float = 0.2
    schedule: str = "1f1b"
    microbatches: int = 4
    virtual_stages: int = 1
    plan: str | None = None
    target_time_s: float | None = None
    warmup_iterations: int = 1
    iterations_per_clock: int = 1
    replan_every_iterations: int = 10


@dataclass(frozen=True)
class KareusConfig:
    """Kareus: nano-batch overlap co-tuned per partition and planned with Perseus, see
    docs/kareus.md. ``lightning-energy plan --config`` reads this section; the pipeline
    (schedule, micro-batches, virtual stages) comes from the ``perseus`` section.

    Attributes:
        enabled: plan with Kareus.
        measurements_dir: folder of the partition searches' measurement files, one per key
            (``fwd_attn.jsonl``, ``fwd_mlp.jsonl``, ``bwd_attn.jsonl``, ``bwd_mlp.jsonl``).
        non_partition_profile: a profile CSV (``stage,instruction,frequency,time,energy``)
            of each stage's work outside the transformer layers for one micro-batch
            (embedding, output layer, loss), per clock.
        layers_per_stage: transformer layers on each pipeline stage, each >= 1.
        tp_size: the tensor-parallel size the partitions were measured at, >= 2 (None:
            not recorded); the plan records it and the runtime refuses another.
        data_parallel_ctas: data-parallel training: the CTAs of the gradient all-reduce,
            1 to 32 (None: NCCL's own).
        data_parallel_bucket_cap_mb: data-parallel training: DDP's bucket size in MB
            (None: DDP's 25 MB).
        data_parallel_clock_mhz: data-parallel training: the SM clock locked for training,
            one the GPUs support (None: left as it is).
        data_parallel_search: data-parallel training under Accelerate: measure every
            candidate ``(CTAs, clock)`` during training and apply the best (see
            :mod:`lightning_energy.kareus.dp_search`).
        data_parallel_search_ctas: the search's CTA counts, each 1 to 32.
        data_parallel_search_clocks_mhz: the search's clocks (None: the clock is not
            searched).
        data_parallel_search_steps: measured steps per candidate at least, >= 1.

    The ``data_parallel_*`` keys are applied by the Lightning energy DDP strategy and by
    Accelerate's ``attach_energy``; the search only by ``attach_energy``.
    """

    enabled: bool = False
    measurements_dir: str | None = None
    non_partition_profile: str | None = None
    layers_per_stage: tuple[int, ...] | None = None
    tp_size: int | None = None
    data_parallel_ctas: int | None = None
    data_parallel_bucket_cap_mb: float | None = None
    data_parallel_clock_mhz: int | None = None
    data_parallel_search: bool = False
    data_parallel_search_ctas: tuple[int, ...] | None = None
    data_parallel_search_clocks_mhz: tuple[int, ...] | None = None
    data_parallel_search_steps: int = 5

    def data_parallel(self) -> DataParallelSetting | None:
        """The data-parallel setting of the section (None: no such key set)."""
        values = self.data_parallel_values()
        if values is None:
            return None
        from lightning_energy.kareus.data_parallel import DataParallelSetting

        return DataParallelSetting(ctas=values[0], bucket_cap_mb=values[1], clock_mhz=values[2])

    def data_parallel_values(self) -> tuple[int | None, float, int | None] | None:
        """The data-parallel CTAs, bucket size and clock, DDP's bucket size where none is
        given (None: no such key set)."""
        keys = (
            self.data_parallel_ctas,
            self.data_parallel_bucket_cap_mb,
            self.data_parallel_clock_mhz,
        )
        if all(value is None for value in keys):
            return None
        from lightning_energy.kareus.data_parallel import DDP_DEFAULT_BUCKET_CAP_MB

        cap = self.data_parallel_bucket_cap_mb
        return (
            self.data_parallel_ctas,
            DDP_DEFAULT_BUCKET_CAP_MB if cap is None else cap,
            self.data_parallel_clock_mhz,
        )


@dataclass(frozen=True)
class BatchSizeConfig:
    """Batch-size optimisation across recurring runs of a job, see docs/batch-size.md.

    ``BatchSizeCallback`` reads this section (its arguments override it); with
    ``enabled: true`` the Lightning entry point adds the callback by itself. The tuning
    store is named by ``LIGHTNING_ENERGY_STORE_URL`` (a URL can hold a password, so it is
    not a key of this file).

    Attributes:
        enabled: add the batch-size callback where the configuration alone decides.
        job_key: the name of the recurring job.
        monitor: the validation metric logged by the module (e.g. ``val_acc``).
        target: the value of ``monitor`` that counts as converged.
        batch_sizes: every batch size allowed (positive integers).
        default_batch_size: the batch size exploration starts from (one of batch_sizes).
        higher_is_better: false for losses and error rates.
        max_epochs: a run not converged after this many epochs has failed (None: the
            Trainer's ``max_epochs``).
        attribute: the batch-size attribute set on the datamodule, module or hparams.
        eta: energy weight of the cost, in [0, 1].
        beta: a run stops once its cost exceeds beta x the cheapest converged run, >= 1.
        window: Thompson sampling uses each batch size's latest runs (None: all), >= 2.
        seed: seed of the sampling.
        allow_network_fs: accept a SQLite store on a network file system.
    """

    enabled: bool = False
    job_key: str | None = None
    monitor: str | None = None
    target: float | None = None
    batch_sizes: tuple[int, ...] | None = None
    default_batch_size: int | None = None
    higher_is_better: bool = True
    max_epochs: int | None = None
    attribute: str = "batch_size"
    eta: float = 0.5
    beta: float = 2.0
    window: int | None = None
    seed: int = 0
    allow_network_fs: bool = False


@dataclass(frozen=True)
class NodeEnergyConfig:
    """The node's CPU-package and DRAM energy (RAPL), measured beside the GPUs' and counted
    in the totals and grams; see :mod:`lightning_energy.node_energy`.

    In YAML, ``node_energy: false`` is short for ``node_energy: {enabled: false}``.

    Attributes:
        enabled: measure it where the counters can be read (False: GPUs only).
        powercap_root: the powercap directory to read, e.g. where a container mounts the
            host's ``/sys/class/powercap``. None: ``/sys/class/powercap`` with real GPUs;
            none with simulated GPUs (their energy is on a virtual clock, the host's CPU
            energy is not theirs).
    """

    enabled: bool = True
    powercap_root: str | None = None


@dataclass(frozen=True)
class EnergyConfig:
    """The whole configuration of an energy-optimised training job.

    Build it with :meth:`from_mapping` (validating) or :func:`load_config`.
    """

    device: DeviceConfig = field(default_factory=DeviceConfig)
    power_limit: PowerLimitConfig = field(default_factory=PowerLimitConfig)
    carbon: CarbonConfig | None = None
    perseus: PerseusConfig = field(default_factory=PerseusConfig)
    kareus: KareusConfig = field(default_factory=KareusConfig)
    batch_size: BatchSizeConfig = field(default_factory=BatchSizeConfig)
    node_energy: NodeEnergyConfig = field(default_factory=NodeEnergyConfig)
    strict: bool = False
    report: str | None = None
    log_every_n_steps: int = 50
    source: str = "python"

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, source: str = "python") -> EnergyConfig:
        """Validate ``data`` (the YAML schema) and build the configuration.

        Raises:
            ConfigError: listing every problem found.
        """
        problems: list[str] = []
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"the configuration must be a mapping of sections, got {type(data).__name__}",
                source,
            )
        known = {
            "device",
            "power_limit",
            "carbon",
            "perseus",
            "kareus",
            "batch_size",
            "node_energy",
            "strict",
            "report",
            "log_every_n_steps",
        }
        for key in data:
            if key not in known:
                problems.append(
                    f"unknown key {_shown(key)}; allowed keys: {', '.join(sorted(known))}"
                )
        device = _build(DeviceConfig, data.get("device"), "device", problems)
        power_limit = _build(PowerLimitConfig, data.get("power_limit"), "power_limit", problems)
        if device is not None:
            _check_device(device, problems)
        if power_limit is not None:
            _check_power_limit(power_limit, problems)
        perseus = _build(PerseusConfig, data.get("perseus"), "perseus", problems)
        if perseus is not None:
            _check_perseus(perseus, problems)
        kareus = _build(KareusConfig, data.get("kareus"), "kareus", problems)
        if kareus is not None:
            _check_kareus(kareus, data.get("kareus") or {}, problems)
        batch_size = _build(BatchSizeConfig, data.get("batch_size"), "batch_size", problems)
        if batch_size is not None:
            _check_batch_size(batch_size, problems)
        carbon = _build_carbon(data.get("carbon"), problems)
        node_energy = _build_node_energy(data.get("node_energy"), problems)
        strict = data.get("strict", False)
        if not isinstance(strict, bool):
            problems.append(f"strict: {_shown(strict)} is not allowed; use true or false")
        report = data.get("report")
        if report is not None and not (isinstance(report, str) and report.strip()):
            problems.append(f"report: {_shown(report)} is not allowed; use a file path or null")
        every = data.get("log_every_n_steps", 50)
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            problems.append(
                f"log_every_n_steps: {_shown(every)} is not allowed; use an integer >= 1"
            )
        if problems:
            raise ConfigError(problems, source)
        assert device is not None and power_limit is not None
        assert perseus is not None and batch_size is not None and node_energy is not None
        assert kareus is not None
        return cls(
            device=device,
            power_limit=power_limit,
            carbon=carbon,
            perseus=perseus,
            kareus=kareus,
            batch_size=batch_size,
            node_energy=node_energy,
            strict=bool(strict),
            report=report,
            log_every_n_steps=int(every),
            source=source,
        )

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> EnergyConfig:
        """Read and validate a YAML file.

        Raises:
            ConfigError: the file is missing, unreadable, not YAML, or invalid.
        """
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read the file: {exc.strerror or exc}", str(path)) from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"not a UTF-8 text file (byte {exc.start}); save the YAML as UTF-8", str(path)
            ) from exc
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"not valid YAML: {exc}", str(path)) from exc
        except RecursionError as exc:
            raise ConfigError("not valid YAML: nested too deeply", str(path)) from exc
        return cls.from_mapping(data if data is not None else {}, source=str(path))

    def merged(self, overrides: Mapping[str, Any]) -> EnergyConfig:
        """A new configuration with ``overrides`` (same schema) applied section by section."""
        base = self.to_mapping()
        for key, value in overrides.items():
            if isinstance(value, Mapping) and isinstance(base.get(key), Mapping):
                base[key] = {**base[key], **value}
            else:
                base[key] = value
        return EnergyConfig.from_mapping(base, source=self.source)

    def to_mapping(self) -> dict[str, Any]:
        """The configuration as plain data (the YAML schema); carbon secrets are never in it."""
        out: dict[str, Any] = {
            "device": _plain(dataclasses.asdict(self.device)),
            "power_limit": _plain(dataclasses.asdict(self.power_limit)),
            "perseus": _plain(dataclasses.asdict(self.perseus)),
            "kareus": _plain(dataclasses.asdict(self.kareus)),
            "batch_size": _plain(dataclasses.asdict(self.batch_size)),
            "node_energy": _plain(dataclasses.asdict(self.node_energy)),
            "strict": self.strict,
            "report": self.report,
            "log_every_n_steps": self.log_every_n_steps,
        }
        if self.carbon is not None:
            out["carbon"] = self.carbon.to_mapping()
        return out


def load_config(
    path: str | os.PathLike[str] | None = None, *, env: Mapping[str, str] | None = None
) -> EnergyConfig | None:
    """Load the configuration file ``path``, or the one named by ``LIGHTNING_ENERGY_CONFIG``.

    Returns:
        The configuration, or None when no path is given and the variable is unset/empty.

    Raises:
        ConfigError: the file named is missing or invalid.
    """
    if path is None:
        value = (env if env is not None else os.environ).get(CONFIG_ENV_VAR, "").strip()
        if not value:
            return None
        path = value
    return EnergyConfig.from_yaml(path)


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _build(cls: type[Any], section: Any, name: str, problems: list[str]) -> Any:
    """Build a section dataclass, type-checking every key; None if the section is unusable."""
    if section is None:
        return cls()
    if not isinstance(section, Mapping):
        problems.append(f"{name}: must be a mapping of keys, got {_shown(section)}")
        return None
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, value in section.items():
        if key not in fields:
            problems.append(
                f"{name}.{key if isinstance(key, str) else _shown(key)}: unknown key; "
                f"allowed keys: {', '.join(sorted(fields))}"
            )
            continue
        field_ = fields[key]
        converted = _convert(value, str(field_.type), f"{name}.{key}", problems)
        if converted is not _INVALID:
            values[key] = converted
    return cls(**values)


_INVALID = object()


def _shown(value: Any) -> str:
    """``repr(value)`` cut to a readable length (a whole YAML document can be a value)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _number(value: Any) -> float | None:
    """``value`` as a finite float, or None when it is not a finite number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _convert(value: Any, annotation: str, key: str, problems: list[str]) -> Any:
    """Check ``value`` against a field's type annotation; ``_INVALID`` when it is wrong.

    ``X | None`` fields accept null; numbers must be finite; times written unquoted in
    YAML (which reads them as dates) are taken as their ISO 8601 text.
    """
    kind = annotation.removesuffix(" | None")
    if value is None:
        if kind != annotation:
            return None
        problems.append(f"{key}: null is not allowed; {_EXPECTED[kind]}")
        return _INVALID
    converted: Any = _INVALID
    if kind == "bool":
        converted = value if isinstance(value, bool) else _INVALID
    elif kind == "int":
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**63:
            converted = value
    elif kind == "float":
        number = _number(value)
        converted = _INVALID if number is None else number
    elif kind == "tuple[float, ...]":
        if isinstance(value, list | tuple):
            numbers = [_number(v) for v in value]
            if all(n is not None for n in numbers):
                converted = tuple(n for n in numbers if n is not None)
    elif kind == "tuple[int, ...]":
        if isinstance(value, list | tuple) and all(
            isinstance(v, int) and not isinstance(v, bool) and abs(v) < 2**63 for v in value
        ):
            converted = tuple(value)
    elif isinstance(value, str):
        converted = value
    elif isinstance(value, datetime | date) and key == "device.start":
        converted = value.isoformat()
    if converted is _INVALID:
        problems.append(f"{key}: {_shown(value)} is not allowed; {_EXPECTED[kind]}")
    return converted


_EXPECTED = {
    "bool": "use true or false",
    "int": "use an integer (64-bit)",
    "float": "use a finite number",
    "tuple[float, ...]": "use a list of numbers, each finite",
    "tuple[int, ...]": "use a list of integers",
    "str": "use a string",
}


def _check_device(device: DeviceConfig, problems: list[str]) -> None:
    if device.backend not in _BACKENDS:
        problems.append(
            f"device.backend: {device.backend!r} is not allowed; allowed: {', '.join(_BACKENDS)}"
        )
    if device.steps_per_epoch is not None and device.steps_per_epoch < 1:
        problems.append(
            f"device.steps_per_epoch: {device.steps_per_epoch} is not allowed; use an integer >= 1"
        )
    if not 0.0 <= device.noise_std < 1.0:
        problems.append(f"device.noise_std: {device.noise_std} is not allowed; use 0 <= x < 1")
    if any(s < 1.0 for s in device.slowdowns):
        problems.append(
            f"device.slowdowns: {list(device.slowdowns)} is not allowed; every factor must be >= 1"
        )
    if device.batch_size is not None and device.batch_size < 1:
        problems.append(f"device.batch_size: {device.batch_size} is not allowed; use >= 1")
    if device.step_time_s is not None and device.step_time_s <= 0:
        problems.append(f"device.step_time_s: {device.step_time_s} is not allowed; use > 0")
    for key in ("gpu", "workload", "lease_dir", "calibration"):
        value = getattr(device, key)
        if value is not None and (not value.strip() or "\0" in value):
            problems.append(f"device.{key}: {value!r} is not allowed; use a non-empty name or path")
    if device.start is not None:
        try:
            device.start_time()
        except (ValueError, OverflowError):
            problems.append(
                f"device.start: {_shown(device.start)} is not allowed; use an ISO 8601 date and "
                "time such as 2023-06-01T00:00:00Z"
            )
    if problems or device.backend in ("nvml", "zeusd"):
        return
    # The simulated GPU is used whenever no real one is found: check it now, not mid-fit.
    from lightning_energy.errors import ProfileError

    try:
        device.simulated_spec().model()
    except ConfigError as exc:
        problems.extend(f"device.{p}" for p in exc.problems)
    except ProfileError as exc:
        # Name every key that chose what to replay: the workload and batch size when given.
        chosen = "".join(
            f", device.{k} {getattr(device, k)!r}"
            for k in ("workload", "batch_size")
            if getattr(device, k) is not None
        )
        problems.append(
            f"device.gpu {device.gpu!r}{chosen}: {exc}; allowed gpu: a40, v100, a100, h100, "
            "h200, a100_sxm, a100_pcie, a40_physics or the path of a Zeus-format power trace CSV"
        )


def _check_power_limit(section: PowerLimitConfig, problems: list[str]) -> None:
    try:
        section.make_selector()
    except ConfigError as exc:
        problems.extend(f"power_limit.{p}" for p in exc.problems)
    if not section.step_w >= 1:
        problems.append(f"power_limit.step_w: {section.step_w} is not allowed; use watts >= 1")
    if section.power_limits_w is not None and (
        not section.power_limits_w or any(p <= 0 for p in section.power_limits_w)
    ):
        problems.append(
            f"power_limit.power_limits_w: {list(section.power_limits_w)} is not allowed; "
            "use a non-empty list of positive watts"
        )
    if section.warmup_steps < 0:
        problems.append(
            f"power_limit.warmup_steps: {section.warmup_steps} is not allowed; use >= 0"
        )
    if section.settle_steps < 0:
        problems.append(
            f"power_limit.settle_steps: {section.settle_steps} is not allowed; use >= 0"
        )
    if not 0 <= section.settle_s <= 60:
        problems.append(
            f"power_limit.settle_s: {section.settle_s} is not allowed; use seconds in [0, 60]"
        )
    if section.knob not in KNOBS:
        problems.append(
            f"power_limit.knob: {section.knob!r} is not allowed; allowed: {', '.join(KNOBS)}"
        )
    if not 1 <= section.clock_step_mhz <= 10_000:
        problems.append(
            f"power_limit.clock_step_mhz: {section.clock_step_mhz} is not allowed; use MHz in "
            "[1, 10000]"
        )


def _check_perseus(section: PerseusConfig, problems: list[str]) -> None:
    if section.mode not in _PERSEUS_MODES:
        problems.append(
            f"perseus.mode: {_shown(section.mode)} is not allowed; allowed: "
            f"{', '.join(_PERSEUS_MODES)}"
        )
    if section.schedule not in _PIPELINE_SCHEDULES:
        problems.append(
            f"perseus.schedule: {_shown(section.schedule)} is not allowed; allowed: "
            f"{', '.join(_PIPELINE_SCHEDULES)}"
        )
    clocks = section.profile_clocks_mhz
    if clocks is not None and (len(set(clocks)) < 2 or any(c <= 0 for c in clocks)):
        problems.append(
            f"perseus.profile_clocks_mhz: {list(clocks)} is not allowed; use two or more "
            "distinct clocks in MHz, each > 0"
        )
    if not 0.0 <= section.compute_bound_share <= 1.0:
        problems.append(
            f"perseus.compute_bound_share: {section.compute_bound_share} is not allowed; "
            "use 0 <= x <= 1"
        )
    if not 0.0 <= section.margin < 0.5:
        problems.append(f"perseus.margin: {section.margin} is not allowed; use 0 <= x < 0.5")
    for key in ("simulated_step_s", "target_time_s"):
        value = getattr(section, key)
        if value is not None and not value > 0:
            problems.append(f"perseus.{key}: {value} is not allowed; use seconds > 0")
    for key, lowest in (
        ("window_steps", 1),
        ("steps_per_clock", 1),
        ("microbatches", 1),
        ("virtual_stages", 1),
        ("warmup_iterations", 0),
        ("iterations_per_clock", 1),
        ("replan_every_iterations", 1),
    ):
        value = getattr(section, key)
        if value < lowest:
            problems.append(f"perseus.{key}: {value} is not allowed; use an integer >= {lowest}")
    if section.plan is not None and (not section.plan.strip() or "\0" in section.plan):
        problems.append(f"perseus.plan: {section.plan!r} is not allowed; use a file path or null")


def _check_kareus(section: KareusConfig, given: Mapping[str, Any], problems: list[str]) -> None:
    for key in ("measurements_dir", "non_partition_profile"):
        value = getattr(section, key)
        if value is not None and (not value.strip() or "\0" in value):
            problems.append(f"kareus.{key}: {value!r} is not allowed; use a path or null")
    layers = section.layers_per_stage
    if layers is not None and (not layers or min(layers) < 1):
        problems.append(
            f"kareus.layers_per_stage: {list(layers)} is not allowed; use one integer >= 1 "
            "per pipeline stage"
        )
    if section.tp_size is not None and section.tp_size < 2:
        problems.append(
            f"kareus.tp_size: {section.tp_size} is not allowed; use an integer >= 2 or null"
        )
    values = section.data_parallel_values()
    if values is not None:
        from lightning_energy.kareus.data_parallel import setting_problems

        problems.extend(setting_problems(*values, "kareus.data_parallel_"))
    _check_data_parallel_search(section, problems)
    if section.enabled:
        # A key given with a bad value is reported as such, not as missing.
        missing = [
            f"kareus.{key}"
            for key in ("measurements_dir", "non_partition_profile", "layers_per_stage")
            if getattr(section, key) is None and given.get(key) is None
        ]
        if missing:
            problems.append(
                f"kareus.enabled: true is not allowed without {', '.join(missing)}; set them "
                "or use false"
            )


def _check_data_parallel_search(section: KareusConfig, problems: list[str]) -> None:
    default = KareusConfig()
    search_keys = [  # set to other than their defaults (a written-out config has them all)
        f"kareus.{key}"
        for key in (
            "data_parallel_search_ctas",
            "data_parallel_search_clocks_mhz",
            "data_parallel_search_steps",
        )
        if getattr(section, key) != getattr(default, key)
    ]
    if not section.data_parallel_search:
        if search_keys:
            problems.append(
                f"{', '.join(search_keys)}: set kareus.data_parallel_search: true to search, "
                "or leave them out"
            )
        return
    from lightning_energy.kareus.dp_search import search_problems

    problems.extend(
        search_problems(
            section.data_parallel_search_ctas,
            section.data_parallel_search_clocks_mhz,
            section.data_parallel_search_steps,
        )
    )
    if section.data_parallel_ctas is not None:
        problems.append(
            "kareus.data_parallel_ctas: not allowed with kareus.data_parallel_search: true (the "
            "search chooses the CTAs among kareus.data_parallel_search_ctas); use null"
        )
    if (
        section.data_parallel_clock_mhz is not None
        and section.data_parallel_search_clocks_mhz is not None
    ):
        problems.append(
            "kareus.data_parallel_clock_mhz: not allowed with "
            "kareus.data_parallel_search_clocks_mhz (the search chooses the clock); use null "
            "for one of them"
        )


def _check_batch_size(section: BatchSizeConfig, problems: list[str]) -> None:
    from lightning_energy.optimize.cost import check_eta

    problems.extend(check_eta(section.eta, "batch_size.eta"))
    if not section.beta >= 1.0:
        problems.append(f"batch_size.beta: {section.beta} is not allowed; use a number >= 1")
    if section.window is not None and section.window < 2:
        problems.append(
            f"batch_size.window: {section.window} is not allowed; use null or an integer >= 2"
        )
    if section.max_epochs is not None and section.max_epochs < 1:
        problems.append(
            f"batch_size.max_epochs: {section.max_epochs} is not allowed; use an integer >= 1"
        )
    if not section.attribute.isidentifier():
        problems.append(
            f"batch_size.attribute: {_shown(section.attribute)} is not allowed; give an "
            "attribute name"
        )
    for key in ("job_key", "monitor"):
        value = getattr(section, key)
        if value is not None and not value.strip():
            problems.append(f"batch_size.{key}: {value!r} is not allowed; use a non-empty name")
    sizes = section.batch_sizes
    if sizes is not None:
        if not sizes or any(b < 1 for b in sizes):
            problems.append(
                f"batch_size.batch_sizes: {list(sizes)} is not allowed; give positive integers"
            )
        elif len(set(sizes)) != len(sizes):
            problems.append(
                f"batch_size.batch_sizes: {list(sizes)} is not allowed; give each size once"
            )
    default = section.default_batch_size
    if default is not None and sizes and default not in sizes:
        problems.append(
            f"batch_size.default_batch_size: {default} is not allowed; use one of "
            f"batch_sizes {sorted(sizes)}"
        )
    if section.enabled:
        missing = [
            key
            for key in ("job_key", "monitor", "target", "batch_sizes", "default_batch_size")
            if getattr(section, key) is None
        ]
        if missing:
            needed = ", ".join(f"batch_size.{k}" for k in missing)
            problems.append(
                f"batch_size.enabled: true is not allowed without {needed}; set them or use false"
            )


def _build_node_energy(section: Any, problems: list[str]) -> NodeEnergyConfig | None:
    """The ``node_energy:`` section: a mapping, or true/false for ``enabled``."""
    if isinstance(section, bool):
        return NodeEnergyConfig(enabled=section)
    if section is not None and not isinstance(section, Mapping):
        problems.append(
            f"node_energy: {_shown(section)} is not allowed; use true, false or a mapping of "
            "keys (enabled, powercap_root)"
        )
        return None
    built: NodeEnergyConfig | None = _build(NodeEnergyConfig, section, "node_energy", problems)
    root = None if built is None else built.powercap_root
    if root is not None and (not root.strip() or "\0" in root):
        problems.append(
            f"node_energy.powercap_root: {_shown(root)} is not allowed; use a directory path "
            "or null"
        )
    return built


def _build_carbon(section: Any, problems: list[str]) -> CarbonConfig | None:
    if section is None:
        return None
    from carbon.config import CarbonConfig
    from carbon.errors import CarbonConfigError

    if isinstance(section, CarbonConfig):
        return section
    if not isinstance(section, Mapping):
        problems.append(f"carbon: must be a mapping of keys, got {section!r}")
        return None
    try:
        return CarbonConfig.from_mapping(section)
    except CarbonConfigError as exc:
        problems.extend(p if p.startswith("carbon.") else f"carbon.{p}" for p in exc.problems)
        return None
