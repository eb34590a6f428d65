"""The partition search: the time-energy Pareto set of (clock, CTAs, slot), measuring little.

For one partition key, :func:`search_partition` measures settings of a
:class:`SearchSpace` through a :class:`PartitionMeter` (a GPU group, or the simulated one
of :mod:`.workload`) and returns the Pareto-optimal ones for two objectives, both
minimised: the partition's time and its **effective energy**, the energy minus the
group's static power times the time. Effective energies add up (the static power of the
composed iteration is counted once, by the planner), which is why partitions measured
apart compose (:mod:`.compose`).

Samplers:

* ``"tpe"`` (default) or ``"nsga2"``: Optuna's multi-objective samplers driven by
  ask/tell, a batch of settings per round (one measurement run each), until ``budget``
  settings are measured; a setting asked twice is answered from what was measured;
* ``"exhaustive"``: every setting of the grid, for small grids (and as the reference).

Every measurement goes to a :class:`MeasurementCache` (a JSON-lines file, rewritten
atomically after each batch); a search given the same file resumes: what is cached counts
against the budget and is not measured again.

Example (the simulated A100 group of the Kareus micro-benchmark)::

    meter = SimulatedPartitions(OverlapModel(shipped_physics()), LLAMA_3_2_3B, seed=0)
    space = SearchSpace(clocks_mhz=range(1410, 899, -30), ctas=range(1, 21),
                        slots=meter.partition("fwd_attn").slots)
    result = search_partition(
        meter, "fwd_attn", space, budget=space.size * 3 // 10, static_power_w=8 * 80.0,
        cache=MeasurementCache("fwd_attn", "fwd_attn.jsonl"),
    )
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from lightning_energy.errors import ConfigError, ProfileError, raise_profile_problems
from lightning_energy.files import write_atomically
from lightning_energy.kareus.partition import MAX_SETTING, SEQUENTIAL, PartitionSetting

__all__ = [
    "CACHE_FORMAT",
    "SAMPLERS",
    "MeasuredPoint",
    "MeasurementCache",
    "PartitionMeter",
    "SearchResult",
    "SearchSpace",
    "hypervolume",
    "pareto_front",
    "read_measurements",
    "search_partition",
]

log = logging.getLogger(__name__)

#: The search's samplers.
SAMPLERS = ("tpe", "nsga2", "exhaustive")

CACHE_FORMAT = "lightning-energy/kareus-measurements"


class PartitionMeter(Protocol):
    """Measures partitions: one ``(time_s, energy_j)`` per setting, in order."""

    def measure(
        self, key: str, settings: Sequence[PartitionSetting]
    ) -> list[tuple[float, float]]:  # pragma: no cover - protocol
        ...


@dataclass(frozen=True)
class SearchSpace:
    """The settings a search may measure.

    Attributes:
        clocks_mhz: SM clocks (descending).
        ctas: CTA counts of the collective (ascending).
        slots: launch slots (:data:`~.partition.SEQUENTIAL` and op indices).
        block_threads: threads per CTA (one value; Kareus fixes it too).
    """

    clocks_mhz: tuple[int, ...]
    ctas: tuple[int, ...]
    slots: tuple[int, ...]
    block_threads: int = 1024

    def __init__(
        self,
        clocks_mhz: Iterable[int],
        ctas: Iterable[int],
        slots: Iterable[int],
        block_threads: int = 1024,
    ) -> None:
        object.__setattr__(
            self, "clocks_mhz", tuple(sorted({int(c) for c in clocks_mhz}, reverse=True))
        )
        object.__setattr__(self, "ctas", tuple(sorted({int(c) for c in ctas})))
        object.__setattr__(self, "slots", tuple(sorted({int(s) for s in slots})))
        object.__setattr__(self, "block_threads", int(block_threads))
        problems = []
        if not self.clocks_mhz or self.clocks_mhz[-1] <= 0:
            problems.append(f"clocks_mhz: {list(self.clocks_mhz)}: give clocks > 0 MHz")
        if not self.ctas or self.ctas[0] < 1:
            problems.append(f"ctas: {list(self.ctas)}: give CTA counts >= 1")
        if not self.slots or self.slots[0] < SEQUENTIAL:
            problems.append(f"slots: {list(self.slots)}: give -1 (sequential) or op indices >= 0")
        if self.block_threads < 1:
            problems.append(f"block_threads: {self.block_threads}: use >= 1")
        if problems:
            raise ConfigError(problems, source="search space")

    @property
    def size(self) -> int:
        """Settings in the grid."""
        return len(self.clocks_mhz) * len(self.ctas) * len(self.slots)

    def grid(self) -> list[PartitionSetting]:
        """Every setting, clock by clock."""
        return [
            PartitionSetting(f, n, s, self.block_threads)
            for f in self.clocks_mhz
            for n in self.ctas
            for s in self.slots
        ]

    def __contains__(self, setting: object) -> bool:
        return (
            isinstance(setting, PartitionSetting)
            and setting.clock_mhz in self.clocks_mhz
            and setting.ctas in self.ctas
            and setting.slot in self.slots
            and setting.block_threads == self.block_threads
        )


@dataclass(frozen=True)
class MeasuredPoint:
    """One measured setting.

    Attributes:
        setting: the setting.
        time_s: time of one partition.
        energy_j: energy of the group over it.
    """

    setting: PartitionSetting
    time_s: float
    energy_j: float

    def effective_energy_j(self, static_power_w: float) -> float:
        """Energy minus ``static_power_w`` times the time."""
        return self.energy_j - static_power_w * self.time_s

    def to_dict(self) -> dict[str, Any]:
        """The point as JSON-ready data."""
        return {**self.setting.to_dict(), "time_s": self.time_s, "energy_j": self.energy_j}


def pareto_front(points: Iterable[MeasuredPoint], static_power_w: float) -> list[MeasuredPoint]:
    """The points no other point beats in both time and effective energy, fastest first."""
    ordered = sorted(points, key=lambda p: (p.time_s, p.effective_energy_j(static_power_w)))
    front: list[MeasuredPoint] = []
    best = math.inf
    for p in ordered:
        cost = p.effective_energy_j(static_power_w)
        if cost < best:
            front.append(p)
            best = cost
    return front


def hypervolume(objectives: Iterable[tuple[float, float]], reference: tuple[float, float]) -> float:
    """Area dominated by 2-objective points (both minimised) and bounded by ``reference``."""
    inside = sorted((t, e) for t, e in objectives if t < reference[0] and e < reference[1])
    area, best_e = 0.0, reference[1]
    for i, (t, e) in enumerate(inside):
        best_e = min(best_e, e)
        next_t = inside[i + 1][0] if i + 1 < len(inside) else reference[0]
        area += (next_t - t) * (reference[1] - best_e)
    return area


class MeasurementCache:
    """Measured points of one partition key in a JSON-lines file.

    The first line names the format and the key; every other line is one point
    (``clock_mhz``, ``ctas``, ``slot``, ``block_threads``, ``time_s``, ``energy_j``). The
    file is rewritten atomically (temporary file, then rename) after each batch, so a
    crash leaves the last complete version.

    Args:
        key: the partition key it holds.
        path: the file (created on the first batch); None keeps the points in memory only.
    """

    def __init__(self, key: str, path: str | os.PathLike[str] | None = None) -> None:
        self.path = None if path is None else Path(path)
        self.key = key
        self._points: dict[PartitionSetting, MeasuredPoint] = {}
        if self.path is not None and self.path.exists():
            for point in read_measurements(self.path, key):
                self._points[point.setting] = point

    def __len__(self) -> int:
        return len(self._points)

    def points(self) -> list[MeasuredPoint]:
        """Every cached point, in the order measured."""
        return list(self._points.values())

    def get(self, setting: PartitionSetting) -> MeasuredPoint | None:
        """The cached point of ``setting``, if measured."""
        return self._points.get(setting)

    def add(self, points: Iterable[MeasuredPoint]) -> None:
        """Cache ``points`` and rewrite the file."""
        for point in points:
            self._points[point.setting] = point
        if self.path is None:
            return
        lines = [json.dumps({"format": CACHE_FORMAT, "key": self.key})]
        lines.extend(json.dumps(point.to_dict()) for point in self._points.values())
        write_atomically(self.path, "\n".join(lines) + "\n")


def read_measurements(path: str | os.PathLike[str], key: str | None = None) -> list[MeasuredPoint]:
    """The points of a :class:`MeasurementCache` file.

    Args:
        path: the file.
        key: the partition key it must hold (None: any).

    Raises:
        ProfileError: unreadable, another format or key, or a malformed line (every problem
            listed).
    """
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"cannot read the partition measurements {path}: {exc}") from exc
    try:
        head = json.loads(lines[0]) if lines else None
    except ValueError:  # not JSON, or a number too long
        head = None
    if not isinstance(head, dict) or head.get("format") != CACHE_FORMAT:
        raise ProfileError(f"{path}: not a partition measurement file (format {CACHE_FORMAT!r})")
    if key is not None and head.get("key") != key:
        raise ProfileError(f"{path}: holds partition {head.get('key')!r}, not {key!r}")
    points: list[MeasuredPoint] = []
    problems: list[str] = []
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            setting = PartitionSetting(
                int(row["clock_mhz"]), int(row["ctas"]), int(row["slot"]), int(row["block_threads"])
            )
            time_s, energy_j = float(row["time_s"]), float(row["energy_j"])
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            # OverflowError: an infinity where an integer goes, or an integer beyond any float
            problems.append(f"line {number}: {exc!r}")
            continue
        if not all(
            abs(v) < MAX_SETTING
            for v in (setting.clock_mhz, setting.ctas, setting.slot, setting.block_threads)
        ):
            problems.append(
                f"line {number}: clock_mhz, ctas, slot and block_threads must be integers of "
                f"size below {MAX_SETTING}"
            )
            continue
        if not (math.isfinite(time_s) and time_s > 0 and math.isfinite(energy_j) and energy_j > 0):
            problems.append(f"line {number}: time_s and energy_j must be finite and > 0")
            continue
        points.append(MeasuredPoint(setting, time_s, energy_j))
    raise_profile_problems(problems, str(path))
    return points


@dataclass(frozen=True)
class SearchResult:
    """What a search measured and found.

    Attributes:
        key: the partition key.
        points: every measured point (cached ones first).
        front: the Pareto-optimal points, fastest first.
        measured: points measured by this search (not taken from the cache).
        grid_size: settings in the search space.
    """

    key: str
    points: tuple[MeasuredPoint, ...]
    front: tuple[MeasuredPoint, ...]
    measured: int
    grid_size: int


def search_partition(
    meter: PartitionMeter,
    key: str,
    space: SearchSpace,
    *,
    budget: int,
    static_power_w: float,
    sampler: str = "tpe",
    cache: MeasurementCache | None = None,
    batch_size: int = 8,
    seed: int = 0,
) -> SearchResult:
    """Find the Pareto-optimal settings of one partition, measuring at most ``budget``.

    Args:
        meter: measures settings.
        key: the partition key.
        space: the settings allowed.
        budget: the most settings measured in all (cached ones included); the whole grid
            for ``"exhaustive"`` regardless.
        static_power_w: static power of the group, subtracted (times the time) from the
            energy for the effective energy.
        sampler: one of :data:`SAMPLERS`.
        cache: where measurements go and are resumed from (None: nowhere).
        batch_size: settings measured per round.
        seed: seed of the sampler.

    Raises:
        ConfigError: a bad sampler, budget or batch size, or Optuna missing for a
            sampler that needs it.
    """
    problems = []
    if sampler not in SAMPLERS:
        problems.append(f"sampler: {sampler!r} is not allowed; allowed: {', '.join(SAMPLERS)}")
    if budget < 1:
        problems.append(f"budget: {budget!r} is not allowed; use >= 1")
    if batch_size < 1:
        problems.append(f"batch_size: {batch_size!r} is not allowed; use >= 1")
    if not (math.isfinite(static_power_w) and static_power_w >= 0):
        problems.append(f"static_power_w: {static_power_w!r} is not allowed; use >= 0")
    if cache is not None and cache.key != key:
        problems.append(f"cache: holds {cache.key!r}, the search is for {key!r}")
    if problems:
        raise ConfigError(problems, source=f"partition search {key!r}")
    cache = cache if cache is not None else MeasurementCache(key)
    known = [p for p in cache.points() if p.setting in space]
    before = len(known)
    if sampler == "exhaustive":
        todo = [s for s in space.grid() if cache.get(s) is None]
        for i in range(0, len(todo), batch_size):
            _measure(meter, key, todo[i : i + batch_size], cache)
    else:
        _optuna_search(meter, key, space, budget, static_power_w, sampler, cache, batch_size, seed)
    points = tuple(p for p in cache.points() if p.setting in space)
    front = tuple(pareto_front(points, static_power_w))
    log.info(
        "Partition %s: %d settings measured (%d cached) of %d, %d Pareto-optimal.",
        key,
        len(points),
        before,
        space.size,
        len(front),
    )
    return SearchResult(key, points, front, len(points) - before, space.size)


def _measure(
    meter: PartitionMeter, key: str, settings: Sequence[PartitionSetting], cache: MeasurementCache
) -> list[MeasuredPoint]:
    """Measure ``settings`` (clock by clock, as a GPU would) and cache them."""
    ordered = sorted(settings, key=lambda s: (-s.clock_mhz, s.slot, s.ctas))
    values = meter.measure(key, ordered)
    if len(values) != len(ordered):
        raise ProfileError(f"the meter returned {len(values)} results for {len(ordered)} settings")
    points = [
        MeasuredPoint(s, float(t), float(e)) for s, (t, e) in zip(ordered, values, strict=True)
    ]
    cache.add(points)
    return points


def _optuna_search(
    meter: PartitionMeter,
    key: str,
    space: SearchSpace,
    budget: int,
    static_power_w: float,
    sampler_name: str,
    cache: MeasurementCache,
    batch_size: int,
    seed: int,
) -> None:
    """Ask/tell with an Optuna multi-objective sampler until ``budget`` points are cached."""
    try:
        import optuna
    except ImportError:
        raise ConfigError(
            f"sampler {sampler_name!r} needs Optuna: pip install 'lightning-energy[kareus]' "
            "(or use sampler='exhaustive')"
        ) from None
    # Optuna logs every finished trial at INFO; quiet for the search, as it was afterwards.
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        _ask_and_tell(
            optuna, meter, key, space, budget, static_power_w, sampler_name, cache, batch_size, seed
        )
    finally:
        optuna.logging.set_verbosity(verbosity)


def _ask_and_tell(
    optuna: Any,
    meter: PartitionMeter,
    key: str,
    space: SearchSpace,
    budget: int,
    static_power_w: float,
    sampler_name: str,
    cache: MeasurementCache,
    batch_size: int,
    seed: int,
) -> None:
    """The ask/tell loop of :func:`_optuna_search`."""
    from optuna.distributions import CategoricalDistribution

    distributions: dict[str, Any] = {
        "clock_mhz": _int_or_categorical(space.clocks_mhz),
        "ctas": _int_or_categorical(space.ctas),
        "slot": CategoricalDistribution(list(space.slots)),
    }
    if sampler_name == "tpe":
        with warnings.catch_warnings():  # multivariate TPE is marked experimental
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            sampler: Any = optuna.samplers.TPESampler(
                seed=seed, multivariate=True, n_startup_trials=max(10, budget // 10)
            )
    else:
        sampler = optuna.samplers.NSGAIISampler(seed=seed, population_size=max(8, batch_size * 2))
    study = optuna.create_study(directions=["minimize", "minimize"], sampler=sampler)

    def values(point: MeasuredPoint) -> list[float]:
        return [point.time_s, point.effective_energy_j(static_power_w)]

    for point in cache.points():
        if point.setting in space:
            study.add_trial(
                optuna.trial.create_trial(
                    params={
                        "clock_mhz": point.setting.clock_mhz,
                        "ctas": point.setting.ctas,
                        "slot": point.setting.slot,
                    },
                    distributions=distributions,
                    values=values(point),
                )
            )
    rng = np.random.default_rng(seed)
    grid = space.grid()
    while (done := sum(1 for p in cache.points() if p.setting in space)) < min(budget, space.size):
        want = min(batch_size, budget - done)
        trials: list[tuple[Any, PartitionSetting]] = []
        fresh: list[PartitionSetting] = []
        asked = 0
        while len(fresh) < want and asked < 20 * want:
            asked += 1
            trial = study.ask(distributions)
            setting = PartitionSetting(
                int(trial.params["clock_mhz"]),
                int(trial.params["ctas"]),
                int(trial.params["slot"]),
                space.block_threads,
            )
            if setting in fresh or (setting not in space):
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                continue
            cached = cache.get(setting)
            if cached is not None:
                study.tell(trial, values(cached))
                continue
            trials.append((trial, setting))
            fresh.append(setting)
        if len(fresh) < want:
            # The sampler keeps proposing measured settings: fill up with unmeasured ones.
            left = [s for s in grid if cache.get(s) is None and s not in fresh]
            picks = rng.choice(len(left), size=min(want - len(fresh), len(left)), replace=False)
            fresh.extend(left[int(i)] for i in picks)
        measured = {p.setting: p for p in _measure(meter, key, fresh, cache)}
        for trial, setting in trials:
            study.tell(trial, values(measured[setting]))
        for setting in fresh[len(trials) :]:
            study.add_trial(
                optuna.trial.create_trial(
                    params={
                        "clock_mhz": setting.clock_mhz,
                        "ctas": setting.ctas,
                        "slot": setting.slot,
                    },
                    distributions=distributions,
                    values=values(measured[setting]),
                )
            )


def _int_or_categorical(values: Sequence[int]) -> Any:
    """An evenly spaced integer range, or a categorical of the values."""
    from optuna.distributions import CategoricalDistribution, IntDistribution

    ordered = sorted(values)
    steps = {b - a for a, b in itertools.pairwise(ordered)}
    if len(ordered) > 1 and len(steps) == 1:
        return IntDistribution(ordered[0], ordered[-1], step=steps.pop())
    if len(ordered) == 1:
        return IntDistribution(ordered[0], ordered[0])
    return CategoricalDistribution(list(ordered))
