"""Kareus on a SIMULATED Llama 3.2 3B: frontiers, search cost and planning time; the model's
calibration and its check against measurements.

Three modes:

* ``--calibrate``: fit the overlap model (``lightning_energy/kareus/model.py``) on the
  measured Kareus partition file (A100, TP 2, default clocks) and write the package's
  calibration JSON; prints the fit's errors.
* ``--check FILE --clock-mhz F``: the shipped calibration's errors on any measured partition
  file in the Kareus format taken at clock ``F`` (median and max relative error of time and
  energy, rank correlation of the settings), e.g. the 1200 MHz file it was not fitted to.
* default: the comparison on a simulated Llama 3.2 3B (TP 8, PP 2, 1F1B, 8 micro-batches,
  A100s; the Kareus artifact's first configuration): the iteration time-energy frontier of
  Perseus alone (whole micro-batches, the collective after the compute), of nano-batching +
  Perseus (two nano-batches, the collective issued at once with the most CTAs: the
  communication library's default) and of Kareus (per-partition search, composition,
  planning), with the artifact's two measures: energy at Perseus' fastest iteration time
  and time at Perseus' least energy. Every method plans from noisy measurements (the
  noise measured in the Kareus file) and every plan is then costed on the noise-free model,
  which is what is reported. Search cost: settings measured against the grid, and the
  hypervolume of what the search found against that of the whole grid measured under the
  same noise (and both on noise-free values). Repeated over seeds: mean, median, min, max.

Every energy figure of the comparison is SIMULATED (the calibrated model, not a GPU).

Usage::

    python benchmarks/kareus.py --calibrate
    python benchmarks/kareus.py --check tests/data/kareus/fwd_attn_tp2_bs4_seq4096_1200mhz.csv \\
        --clock-mhz 1200
    python benchmarks/kareus.py --seeds 3 --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lightning_energy.kareus.compose import (  # noqa: E402
    KareusPlanner,
    KareusPoint,
    instruction_options,
    reprice,
)
from lightning_energy.kareus.measured import read_partition_csv  # noqa: E402
from lightning_energy.kareus.model import (  # noqa: E402
    OverlapModel,
    check,
    fit,
    save_calibration,
    shipped_physics,
)
from lightning_energy.kareus.partition import (  # noqa: E402
    PARTITION_KEYS,
    SEQUENTIAL,
    PartitionSetting,
)
from lightning_energy.kareus.search import (  # noqa: E402
    MeasuredPoint,
    SearchSpace,
    hypervolume,
    pareto_front,
    search_partition,
)
from lightning_energy.kareus.workload import (  # noqa: E402
    LLAMA_3_2_3B,
    MEASURED_FWD_ATTN,
    SimulatedPartitions,
    TransformerShape,
)
from lightning_energy.perseus.planning.profile import PipelineProfile  # noqa: E402
from lightning_energy.perseus.planning.schedule import one_f_one_b  # noqa: E402

MEASURED = ROOT / "tests" / "data" / "kareus" / "fwd_attn_tp2_bs4_seq4096_default.csv"
CALIBRATION = ROOT / "lightning_energy" / "data" / "kareus" / "a100_fwd_attn_tp2.json"
PROVENANCE = (
    "fitted by benchmarks/kareus.py --calibrate on tests/data/kareus/"
    "fwd_attn_tp2_bs4_seq4096_default.csv (Kareus, github.com/ml-energy/kareus commit "
    "9b64d9e9, Apache-2.0): two A100 GPUs, TP 2, default clocks taken as 1410 MHz"
)
#: The Kareus artifact's Llama 3.2 3B split over two pipeline stages.
LAYERS_PER_STAGE = (15, 13)
#: Clocks of the Kareus artifact's search (A100: 1410 down to 900 MHz in 30 MHz steps).
CLOCKS_MHZ = tuple(range(1410, 899, -30))
CTAS = tuple(range(1, 21))
#: What nano-batching does without Kareus: the collective at once, with the most CTAs.
DEFAULT_CTAS = 20
DEFAULT_SLOT = 0


# ---------------------------------------------------------------------- calibrate / check
def calibrate(measured: Path, clock_mhz: int, out: Path) -> dict[str, Any]:
    """Fit the model on ``measured`` and write the calibration JSON."""
    rows = read_partition_csv(measured)
    if measured.is_relative_to(ROOT):  # the shipped JSON names the file from the repository
        rows = dataclasses.replace(rows, source=str(measured.relative_to(ROOT)))
    model, report = fit(MEASURED_FWD_ATTN, rows, clock_mhz)
    save_calibration(model, report, out, provenance=PROVENANCE)
    return {"calibration": str(out), "fit": report.to_dict(), "physics": model.physics.to_dict()}


def check_file(path: Path, clock_mhz: int) -> dict[str, Any]:
    """The shipped calibration's errors on a measured file of the forward attention partition."""
    report = check(
        OverlapModel(shipped_physics()), MEASURED_FWD_ATTN, read_partition_csv(path), clock_mhz
    )
    return report.to_dict()


# ---------------------------------------------------------------------- the comparison
def fixed_points(
    meter: SimulatedPartitions, setting: Callable[[int], PartitionSetting], clocks: Sequence[int]
) -> dict[str, list[MeasuredPoint]]:
    """One measured point per key and clock, at ``setting(clock)``."""
    out = {}
    for key in PARTITION_KEYS:
        settings = [setting(f) for f in clocks]
        out[key] = [
            MeasuredPoint(s, t, e)
            for s, (t, e) in zip(settings, meter.measure(key, settings), strict=True)
        ]
    return out


def exact_lookup(
    meter: SimulatedPartitions, points: Mapping[str, Sequence[MeasuredPoint]]
) -> dict[str, dict[PartitionSetting, MeasuredPoint]]:
    """The noise-free point of every measured setting."""
    out = {}
    for key, pts in points.items():
        settings = [p.setting for p in pts]
        out[key] = {
            s: MeasuredPoint(s, t, e)
            for s, (t, e) in zip(settings, meter.exact(key, settings), strict=True)
        }
    return out


class Method:
    """One method's plans: planned from measured points, costed on noise-free ones."""

    def __init__(
        self,
        name: str,
        meter: SimulatedPartitions,
        points: Mapping[str, Sequence[MeasuredPoint]],
        rest: PipelineProfile,
        nanobatches: int,
    ) -> None:
        start = time.perf_counter()
        options = instruction_options(points, rest, LAYERS_PER_STAGE, nanobatches=nanobatches)
        self.planner = KareusPlanner(
            options, one_f_one_b(len(LAYERS_PER_STAGE), 8), blocked_power_w=rest.min_blocked_power_w
        )
        self.frontier = self.planner.frontier()
        self.planning_s = time.perf_counter() - start
        self.name = name
        self.true_options = reprice(
            self.planner.options,
            exact_lookup(meter, points),
            rest,
            LAYERS_PER_STAGE,
            nanobatches=nanobatches,
        )

    def true(self, point: KareusPoint) -> tuple[float, float]:
        """Noise-free iteration time and energy of a planned point."""
        evaluation = self.planner.evaluate(point, self.true_options)
        return evaluation.iteration_time_s, evaluation.energy_j

    def at_time(self, target_s: float) -> tuple[float, float]:
        """The least-energy plan within ``target_s`` (as planned), costed noise-free."""
        return self.true(self.planner.plan_for_time(target_s))

    def at_energy(self, budget_j: float) -> tuple[float, float]:
        """The fastest frontier plan whose planned energy is within ``budget_j``, costed
        noise-free (the energy-optimal plan when none is)."""
        within = [p for p in self.frontier if p.energy_j <= budget_j]
        return self.true(within[0] if within else self.frontier[-1])

    def summary(self, rows: int = 6) -> list[dict[str, float]]:
        """About ``rows`` frontier points, both ends included, noise-free."""
        n = len(self.frontier)
        picks = sorted({round(k * (n - 1) / max(rows - 1, 1)) for k in range(rows)})
        return [
            dict(zip(("iteration_time_s", "energy_j"), self.true(self.frontier[i]), strict=True))
            for i in picks
        ]


def search_costs(
    meter: SimulatedPartitions,
    key: str,
    space: SearchSpace,
    result_front: Sequence[MeasuredPoint],
    static_w: float,
) -> dict[str, float]:
    """Hypervolume of a search's front against the whole grid's, under noise and noise-free."""
    grid = space.grid()
    exact = {
        s: MeasuredPoint(s, t, e) for s, (t, e) in zip(grid, meter.exact(key, grid), strict=True)
    }
    noisy = [
        MeasuredPoint(s, t, e) for s, (t, e) in zip(grid, meter.measure(key, grid), strict=True)
    ]
    true_front = pareto_front(exact.values(), static_w)
    reference = (
        1.1 * max(p.time_s for p in true_front),
        1.1 * max(p.effective_energy_j(static_w) for p in true_front),
    )

    def hv(points: Sequence[MeasuredPoint]) -> float:
        return hypervolume([(p.time_s, p.effective_energy_j(static_w)) for p in points], reference)

    return {
        "hypervolume_vs_grid_noisy": hv(result_front) / hv(pareto_front(noisy, static_w)),
        "hypervolume_vs_grid_true": hv([exact[p.setting] for p in result_front]) / hv(true_front),
    }


def compare(
    seed: int,
    *,
    shape: TransformerShape = LLAMA_3_2_3B,
    clocks: Sequence[int] = CLOCKS_MHZ,
    ctas: Sequence[int] = CTAS,
    budget_fraction: float = 0.3,
    sampler: str = "tpe",
) -> dict[str, Any]:
    """One seed of the comparison (every figure SIMULATED)."""
    model = OverlapModel(shipped_physics())
    static_w = shape.tp_size * model.physics.static_power_w
    nano = SimulatedPartitions(model, shape, seed=seed)
    whole = SimulatedPartitions(model, shape, seed=seed + 10_000, nanobatched=False)
    rest = PipelineProfile.from_rows(
        nano.non_partition_rows(LAYERS_PER_STAGE, clocks), blocked_power_w=static_w
    )

    perseus = Method(
        "perseus",
        whole,
        fixed_points(whole, lambda f: PartitionSetting(f, DEFAULT_CTAS, SEQUENTIAL), clocks),
        rest,
        1,
    )
    nanobatch = Method(
        "nanobatch+perseus",
        nano,
        fixed_points(nano, lambda f: PartitionSetting(f, DEFAULT_CTAS, DEFAULT_SLOT), clocks),
        rest,
        2,
    )
    searches: dict[str, Any] = {}
    points: dict[str, list[MeasuredPoint]] = {}
    search_s = 0.0
    for key in PARTITION_KEYS:
        space = SearchSpace(clocks, ctas, nano.partition(key).slots)
        start = time.perf_counter()
        result = search_partition(
            nano,
            key,
            space,
            budget=max(1, round(budget_fraction * space.size)),
            static_power_w=static_w,
            sampler=sampler,
            seed=seed,
        )
        search_s += time.perf_counter() - start
        points[key] = list(result.points)
        searches[key] = {
            "measured": len(result.points),
            "grid": space.size,
            "share": len(result.points) / space.size,
            "front": len(result.front),
            **search_costs(nano, key, space, result.front, static_w),
        }
    kareus = Method("kareus", nano, points, rest, 2)

    fastest_t, fastest_e = perseus.true(perseus.planner.plan_no_slowdown())
    least_t, least_e = perseus.true(perseus.planner.plan_energy_optimal())
    methods: dict[str, Any] = {}
    for method in (nanobatch, kareus):
        t_at, e_at = method.at_time(fastest_t)
        t_least, e_least = method.at_energy(least_e)
        methods[method.name] = {
            "energy_at_perseus_fastest_j": e_at,
            "energy_saving_at_perseus_fastest": 1 - e_at / fastest_e,
            "time_ratio_at_perseus_fastest": t_at / fastest_t,
            "time_at_perseus_least_energy_s": t_least,
            "time_saving_at_perseus_least_energy": 1 - t_least / least_t,
            "energy_ratio_at_perseus_least_energy": e_least / least_e,
            "planning_s": method.planning_s,
            "frontier_points": len(method.frontier),
            "frontier": method.summary(),
        }
    return {
        "simulated": True,
        "seed": seed,
        "model": shape.name,
        "perseus_fastest": {"iteration_time_s": fastest_t, "energy_j": fastest_e},
        "perseus_least_energy": {"iteration_time_s": least_t, "energy_j": least_e},
        "perseus_frontier_points": len(perseus.frontier),
        "perseus_planning_s": perseus.planning_s,
        "perseus_frontier": perseus.summary(),
        "methods": methods,
        "searches": searches,
        "search_wall_s": search_s,
    }


def statistics_of(values: Sequence[float]) -> dict[str, float]:
    """Mean, median, min and max."""
    return {
        "mean": statistics.fmean(values),
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def aggregate(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per method and per search key, the statistics of each figure over the seeds."""
    out: dict[str, Any] = {
        "simulated": True,
        "seeds": [r["seed"] for r in runs],
        "methods": {},
        "searches": {},
    }
    for name in runs[0]["methods"]:
        figures = [k for k, v in runs[0]["methods"][name].items() if isinstance(v, float | int)]
        out["methods"][name] = {
            f: statistics_of([r["methods"][name][f] for r in runs]) for f in figures
        }
    for key in runs[0]["searches"]:
        figures = list(runs[0]["searches"][key])
        out["searches"][key] = {
            f: statistics_of([r["searches"][key][f] for r in runs]) for f in figures
        }
    out["search_wall_s"] = statistics_of([r["search_wall_s"] for r in runs])
    return out


def report(runs: Sequence[Mapping[str, Any]], summary: Mapping[str, Any]) -> list[str]:
    """The comparison in words (every energy SIMULATED)."""
    first = runs[0]
    lines = [
        f"SIMULATED {first['model']}: TP 8, PP 2 ({'/'.join(map(str, LAYERS_PER_STAGE))} layers), "
        f"1F1B, 8 micro-batches, A100 overlap model calibrated on the Kareus measurements; "
        f"{len(runs)} seed(s)",
        f"Perseus alone: no slowdown {first['perseus_fastest']['iteration_time_s']:.3f} s "
        f"{first['perseus_fastest']['energy_j']:.0f} J, energy-optimal "
        f"{first['perseus_least_energy']['iteration_time_s']:.3f} s "
        f"{first['perseus_least_energy']['energy_j']:.0f} J (seed {first['seed']}; "
        f"frontier of {first['perseus_frontier_points']} plans, planned in "
        f"{first['perseus_planning_s']:.3f} s)",
        "method: energy saving at Perseus' fastest time (time ratio) | time saving at Perseus' "
        "least energy (energy ratio) | planning s   [median over seeds (min..max)]",
    ]

    def cell(stats: Mapping[str, float], pct: bool) -> str:
        f = (lambda v: f"{100 * v:.1f} %") if pct else (lambda v: f"{v:.3f}")
        return f"{f(stats['median'])} ({f(stats['min'])}..{f(stats['max'])})"

    for name, figures in summary["methods"].items():
        lines.append(
            f"  {name:18s} {cell(figures['energy_saving_at_perseus_fastest'], True)} "
            f"(x{figures['time_ratio_at_perseus_fastest']['median']:.4f}) | "
            f"{cell(figures['time_saving_at_perseus_least_energy'], True)} "
            f"(x{figures['energy_ratio_at_perseus_least_energy']['median']:.4f}) | "
            f"{cell(figures['planning_s'], False)}"
        )
    lines.append(
        "search: measured share of the grid | hypervolume vs the grid under noise | noise-free"
    )
    for key, figures in summary["searches"].items():
        lines.append(
            f"  {key:9s} {cell(figures['share'], True)} of {int(figures['grid']['median'])} | "
            f"{cell(figures['hypervolume_vs_grid_noisy'], True)} | "
            f"{cell(figures['hypervolume_vs_grid_true'], True)}"
        )
    lines.append(f"search wall time per seed: {cell(summary['search_wall_s'], False)} s")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--calibrate", action="store_true", help="fit the model, write the JSON")
    mode.add_argument("--check", type=Path, metavar="FILE", help="model errors on a measured file")
    parser.add_argument(
        "--clock-mhz", type=int, default=None, help="clock of --check's file / --calibrate's"
    )
    parser.add_argument("--out", type=Path, default=CALIBRATION, help="--calibrate: where to write")
    parser.add_argument("--seeds", type=int, default=3, help="comparison: seeds 0..N-1")
    parser.add_argument(
        "--budget", type=float, default=0.3, help="comparison: share of each grid measured"
    )
    parser.add_argument(
        "--sampler", default="tpe", choices=("tpe", "nsga2"), help="comparison: sampler"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.calibrate:
        out = calibrate(MEASURED, args.clock_mhz or 1410, args.out)
        text = [f"{k}: {v}" for k, v in out["fit"].items()] + [f"-> {out['calibration']}"]
    elif args.check is not None:
        if args.clock_mhz is None:
            parser.error("--check needs --clock-mhz (the clock the file was measured at)")
        out = check_file(args.check, args.clock_mhz)
        text = [f"{k}: {v}" for k, v in out.items()]
    else:
        if args.seeds < 1 or not 0 < args.budget <= 1:
            parser.error("--seeds >= 1 and 0 < --budget <= 1")
        runs = [
            compare(seed, budget_fraction=args.budget, sampler=args.sampler)
            for seed in range(args.seeds)
        ]
        summary = aggregate(runs)
        out = {"summary": summary, "runs": runs}
        text = report(runs, summary)
    print(json.dumps(out, indent=1) if args.json else "\n".join(text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
