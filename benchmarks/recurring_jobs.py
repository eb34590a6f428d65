"""Recurring jobs, trace-driven: batch size + power limit (Zeus) vs. the default and hindsight.

Reproduces the trace-driven experiment of the Zeus paper (You, Chung, Chowdhury, NSDI'23,
§6) on the shipped Zeus traces. Each of the six workloads recurs ``N`` times; each
recurrence runs until one run reaches the target metric (a run stopped early is retried,
as in Zeus). For a run with batch size ``b``:

- **Epochs to target**: one training path is sampled per run from ``zeus_summary_train.csv``
  (a seed of the same workload and batch size at the target below; a path that never
  reached it runs until it is stopped).
- **Epoch time and energy** at power limit ``p``: ``time_per_epoch`` and
  ``time_per_epoch x average_power`` of the power trace at ``(b, p)``.
- **Power limit**: the first run with a batch size profiles every measured limit during its
  first epoch (that epoch costs the mean time and energy over the limits, Zeus' JIT
  profiling) and the ``cost`` selector of :mod:`lightning_energy.optimize.selectors` picks
  the limit from the (noiseless) per-limit profile; the choice is saved as the batch size's
  power profile in the store and reused by later runs with that batch size.
- **Batch size and early stopping**:
  :class:`~lightning_energy.optimize.recurring.BatchSizeOptimizer`
  on an in-memory store (pruning, then Gaussian Thompson sampling;
  a run stops after the first epoch whose cost exceeds ``beta`` x the best run, or at
  ``max_epochs``).

Baselines (expected values over the trace's seeds, times ``N``): **default**, the default
batch size at the highest power limit; **best fixed**, the (batch size, power limit) of
lowest expected cost in hindsight, and **least-energy fixed**, that of lowest expected
energy, both among batch sizes whose every seed reaches the target within ``max_epochs``.
Reported per GPU and workload (medians over ``--repeats`` seeds):
``energy_saving_vs_default = 1 - E_zeus / E_default``, ``energy_gap_vs_best_fixed =
E_zeus / E_best - 1`` and ``energy_gap_vs_least_energy_fixed = E_zeus / E_least - 1`` over
all ``N`` recurrences (exploration included), the time change vs. default, and the
steady-state saving over the last 10 recurrences.

Targets, maximum epochs and default batch sizes are those of Zeus' trace-driven scripts
(``examples/research_reproducibility/zeus_nsdi23``): CIFAR-100/ShuffleNet-v2 accuracy 0.60,
100 epochs, b0 1024; ImageNet/ResNet-50 accuracy 0.65, 100, 256; SQuAD/BERT F1 84.0, 6, 32;
LibriSpeech/DeepSpeech2 WER 40.0 (lower is better), 16, 192; MovieLens-1M/NCF NDCG 0.41,
100, 1024; Sentiment140/BERT accuracy 0.84, 10, 128.

Usage::

    python benchmarks/recurring_jobs.py                     # shipped A40 and V100 traces
    python benchmarks/recurring_jobs.py --recurrences 50 --repeats 5 --json
    python benchmarks/recurring_jobs.py --power-trace my_power.csv --train-trace my_train.csv
"""

from __future__ import annotations

import argparse
import csv
import importlib.resources
import json
import math
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lightning_energy.device.simulated import PowerTrace
from lightning_energy.optimize.batch_size import JobSpec, Trial
from lightning_energy.optimize.cost import zeus_cost
from lightning_energy.optimize.recurring import BatchSizeOptimizer
from lightning_energy.optimize.selectors import Measurement, make_selector
from lightning_energy.store import Store

MAX_TRIES = 20  # retries per recurrence before the target is declared unreachable (Zeus)
STEADY_STATE = 10  # recurrences at the end compared in steady state
PAPER_RANGE = (0.153, 0.758)  # Zeus NSDI'23 abstract: energy-efficiency improvement


@dataclass(frozen=True)
class Workload:
    """One recurring job of the Zeus traces."""

    dataset: str
    network: str
    optimizer: str
    target_metric: float
    higher_is_better: bool
    max_epochs: int
    default_batch_size: int

    @property
    def name(self) -> str:
        return f"{self.dataset}-{self.network}"


WORKLOADS = (
    Workload("cifar100", "shufflenetv2", "adadelta", 0.6, True, 100, 1024),
    Workload("imagenet", "resnet50", "adadelta", 0.65, True, 100, 256),
    Workload("squad", "bert_base_uncased", "adamw", 84.0, True, 6, 32),
    Workload("librispeech", "deepspeech2", "adamw", 40.0, False, 16, 192),
    Workload("movielens-1m", "ncf", "adam", 0.41, True, 100, 1024),
    Workload("sentiment140", "bert_base_uncased", "adamw", 0.84, True, 10, 128),
)


@dataclass(frozen=True)
class Table:
    """A workload on one GPU: per batch size, the per-limit epoch profile and the seeds."""

    workload: Workload
    gpu: str
    max_power_limit_w: float
    profiles: dict[int, list[tuple[float, float, float]]]  # b -> [(limit_w, time_s, power_w)]
    paths: dict[int, list[int | None]]  # b -> epochs to target per seed (None: never)

    @property
    def batch_sizes(self) -> list[int]:
        return sorted(self.profiles)

    def epoch(self, batch_size: int, power_limit_w: float) -> tuple[float, float]:
        """(time_s, energy_j) of one epoch."""
        for limit_w, time_s, power_w in self.profiles[batch_size]:
            if limit_w == power_limit_w:
                return time_s, time_s * power_w
        raise KeyError((batch_size, power_limit_w))

    def profiling_epoch(self, batch_size: int) -> tuple[float, float]:
        """(time_s, energy_j) of an epoch split evenly across every measured limit."""
        points = self.profiles[batch_size]
        return (
            float(np.mean([t for _, t, _ in points])),
            float(np.mean([t * p for _, t, p in points])),
        )


def read_train_trace(path: Path | None) -> list[dict[str, str]]:
    if path is None:
        resource = (
            importlib.resources.files("lightning_energy")
            / "data"
            / "gpu_profiles"
            / "zeus_summary_train.csv"
        )
        return list(csv.DictReader(resource.read_text(encoding="utf-8").splitlines()))
    return list(csv.DictReader(path.read_text(encoding="utf-8").splitlines()))


def build_table(workload: Workload, trace: PowerTrace, train: list[dict[str, str]]) -> Table:
    paths: dict[int, list[int | None]] = {}
    for row in train:
        if (row["dataset"], row["network"], row["optimizer"]) != (
            workload.dataset,
            workload.network,
            workload.optimizer,
        ) or not math.isclose(float(row["target_metric"]), workload.target_metric):
            continue
        epoch = row["target_epoch"].strip()
        reached = int(float(epoch)) if epoch and epoch.lower() != "nan" else None
        paths.setdefault(int(row["batch_size"]), []).append(reached)
    profiles: dict[int, list[tuple[float, float, float]]] = {}
    for dataset, network, batch_size in trace.workloads():
        if (dataset, network) != (workload.dataset, workload.network) or batch_size not in paths:
            continue
        if workload.optimizer not in trace.optimizers(dataset, network, batch_size):
            continue
        w = trace.workload(dataset, network, batch_size, workload.optimizer)
        profiles[batch_size] = list(
            zip(w.power_limits_w, w.times_per_epoch_s, w.average_powers_w, strict=True)
        )
    max_limit_w = max(limit for points in profiles.values() for limit, _, _ in points)
    default = workload.default_batch_size
    if default not in profiles:
        default = max(b for b in profiles if b <= default)
        workload = Workload(**{**workload.__dict__, "default_batch_size": default})
    return Table(
        workload=workload,
        gpu=trace.gpu_name,
        max_power_limit_w=max_limit_w,
        profiles=profiles,
        paths={b: paths[b] for b in profiles},
    )


def expected(table: Table, batch_size: int, power_limit_w: float) -> tuple[float, float] | None:
    """Expected (energy_j, time_s) of one run to target, or None if a seed never reaches it."""
    epochs = table.paths[batch_size]
    if any(e is None or e > table.workload.max_epochs for e in epochs):
        return None
    mean_epochs = float(np.mean([e for e in epochs if e is not None]))
    time_s, energy_j = table.epoch(batch_size, power_limit_w)
    return mean_epochs * energy_j, mean_epochs * time_s


def simulate(
    table: Table, recurrences: int, *, eta: float, beta: float, seed: int
) -> list[list[Trial]]:
    """Run the job ``recurrences`` times; returns every run, grouped by recurrence."""
    w = table.workload
    spec = JobSpec(
        key=w.name,
        gpu_model=table.gpu,
        gpu_count=1,
        default_batch_size=w.default_batch_size,
        batch_sizes=tuple(table.batch_sizes),
        target_metric=w.target_metric,
        higher_is_better=w.higher_is_better,
        max_epochs=w.max_epochs,
        max_power_limit_w=table.max_power_limit_w,
    )
    selector = make_selector("cost", eta=eta)
    paths_rng = np.random.default_rng([seed, 1])
    clock = 0.0
    history: list[list[Trial]] = []
    with Store.open("sqlite://") as store:
        optimizer = BatchSizeOptimizer(spec, store, eta=eta, beta=beta, seed=seed)
        for _ in range(recurrences):
            runs: list[Trial] = []
            for _ in range(MAX_TRIES):
                batch_size = optimizer.next_batch_size()
                profile = optimizer.load_power_profile(batch_size)
                profiling = profile is None
                if profile is None:
                    measured = [
                        Measurement(limit, time_s, time_s * power_w, steps=1)
                        for limit, time_s, power_w in table.profiles[batch_size]
                    ]
                    chosen = selector.select(
                        measured, max_power_limit_w=table.max_power_limit_w, num_gpus=1
                    )
                    profile = {"power_limit_w": chosen.power_limit_w, "selector": "cost"}
                    optimizer.save_power_profile(batch_size, profile)
                limit_w = float(profile["power_limit_w"])
                seeds = table.paths[batch_size]
                target_epoch = seeds[int(paths_rng.integers(len(seeds)))]
                energy_j = time_s = 0.0
                epochs, converged = 0, False
                while True:
                    epochs += 1
                    if profiling and epochs == 1:
                        epoch_time_s, epoch_energy_j = table.profiling_epoch(batch_size)
                    else:
                        epoch_time_s, epoch_energy_j = table.epoch(batch_size, limit_w)
                    time_s += epoch_time_s
                    energy_j += epoch_energy_j
                    if target_epoch is not None and epochs >= target_epoch:
                        converged = True
                        break
                    if optimizer.should_stop_early(optimizer.cost(energy_j, time_s), epochs=epochs):
                        break
                trial = Trial(
                    batch_size=batch_size,
                    epochs=epochs,
                    energy_j=energy_j,
                    time_s=time_s,
                    converged=converged,
                    started_at=clock,
                    finished_at=clock + time_s,
                    power_limit_w=limit_w,
                )
                clock += time_s
                optimizer.record(trial)
                runs.append(trial)
                if converged:
                    break
            else:
                raise RuntimeError(f"{w.name} on {table.gpu}: no run converged in {MAX_TRIES}")
            history.append(runs)
    return history


def evaluate(
    table: Table, recurrences: int, *, eta: float, beta: float, seeds: Sequence[int]
) -> dict[str, Any]:
    """Zeus vs. default and best fixed for one workload on one GPU (medians over seeds)."""
    w = table.workload
    max_power_w = table.max_power_limit_w

    def cost(energy_j: float, time_s: float) -> float:
        return zeus_cost(energy_j, time_s, eta=eta, max_power_w=max_power_w)

    default = expected(table, w.default_batch_size, table.max_power_limit_w)
    if default is None:
        raise RuntimeError(f"{w.name} on {table.gpu}: the default batch size does not converge")
    fixed = {
        (b, limit): run
        for b in table.batch_sizes
        for limit, _, _ in table.profiles[b]
        if (run := expected(table, b, limit)) is not None
    }
    best_b, best_limit = min(fixed, key=lambda key: (cost(*fixed[key]), key))
    best = fixed[(best_b, best_limit)]
    least_b, least_limit = min(fixed, key=lambda key: (fixed[key][0], key))
    least = fixed[(least_b, least_limit)]
    per_seed: list[dict[str, float]] = []
    finals: list[tuple[int, float | None]] = []
    for seed in seeds:
        history = simulate(table, recurrences, eta=eta, beta=beta, seed=seed)
        runs = [run for recurrence in history for run in recurrence]
        steady = [run for recurrence in history[-STEADY_STATE:] for run in recurrence]
        energy_j = sum(r.energy_j for r in runs)
        time_s = sum(r.time_s for r in runs)
        steady_energy_j = sum(r.energy_j for r in steady)
        n_steady = min(STEADY_STATE, recurrences)
        per_seed.append(
            {
                "energy_saving_vs_default": 1 - energy_j / (recurrences * default[0]),
                "energy_gap_vs_best_fixed": energy_j / (recurrences * best[0]) - 1,
                "energy_gap_vs_least_energy_fixed": energy_j / (recurrences * least[0]) - 1,
                "time_change_vs_default": time_s / (recurrences * default[1]) - 1,
                "cost_saving_vs_default": 1
                - cost(energy_j, time_s) / (recurrences * cost(*default)),
                "cost_gap_vs_best_fixed": cost(energy_j, time_s) / (recurrences * cost(*best)) - 1,
                "steady_energy_saving_vs_default": 1 - steady_energy_j / (n_steady * default[0]),
                "failed_runs": float(sum(not r.converged for r in runs)),
                "energy_mj": energy_j / 1e6,
            }
        )
        last = history[-1][-1]
        finals.append((last.batch_size, last.power_limit_w))
    result: dict[str, Any] = {
        key: float(np.median([row[key] for row in per_seed])) for key in per_seed[0]
    }
    result.update(
        {
            "default": {"batch_size": w.default_batch_size, "power_limit_w": max_power_w},
            "best_fixed": {"batch_size": best_b, "power_limit_w": best_limit},
            "least_energy_fixed": {"batch_size": least_b, "power_limit_w": least_limit},
            "final_choices": [{"batch_size": b, "power_limit_w": p} for b, p in finals],
            "default_energy_mj": recurrences * default[0] / 1e6,
            "best_fixed_energy_mj": recurrences * best[0] / 1e6,
            "least_energy_fixed_energy_mj": recurrences * least[0] / 1e6,
            "batch_sizes": table.batch_sizes,
        }
    )
    return result


def gpu_label(path: Path) -> str:
    match = re.fullmatch(r"zeus_summary_power_(\w+)", path.stem)
    return match.group(1) if match else path.stem


def print_table(results: dict[str, dict[str, dict[str, Any]]], recurrences: int) -> None:
    header = (
        f"{'gpu':5} {'workload':32} {'default':>11} {'best fixed':>11} {'least E':>11} "
        f"{'final':>11} {'E save':>7} {'E gap':>7} {'E gap2':>7} {'T chg':>7} {'steady':>7} "
        f"{'fails':>5}"
    )
    print(
        f"{recurrences} recurrences; E save vs default; E gap vs best fixed (least cost), "
        "E gap2 vs least-energy fixed; medians over seeds"
    )
    print(header)
    print("-" * len(header))
    savings = []
    for gpu, rows in results.items():
        for name, r in rows.items():
            final, least = r["final_choices"][0], r["least_energy_fixed"]
            savings.append(r["energy_saving_vs_default"])
            print(
                f"{gpu:5} {name:32} "
                f"{r['default']['batch_size']:>5}@{r['default']['power_limit_w']:<4.0f}W "
                f"{r['best_fixed']['batch_size']:>5}@{r['best_fixed']['power_limit_w']:<4.0f}W "
                f"{least['batch_size']:>5}@{least['power_limit_w']:<4.0f}W "
                f"{final['batch_size']:>5}@{final['power_limit_w']:<4.0f}W "
                f"{r['energy_saving_vs_default']:>7.1%} {r['energy_gap_vs_best_fixed']:>7.1%} "
                f"{r['energy_gap_vs_least_energy_fixed']:>7.1%} "
                f"{r['time_change_vs_default']:>+7.1%} "
                f"{r['steady_energy_saving_vs_default']:>7.1%} {r['failed_runs']:>5.0f}"
            )
    print(
        f"energy saving vs default: {min(savings):.1%} to {max(savings):.1%} "
        f"(paper: {PAPER_RANGE[0]:.1%} to {PAPER_RANGE[1]:.1%})"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--power-trace",
        type=Path,
        action="append",
        help="Zeus-format power trace CSV; repeatable (default: the shipped A40 and V100)",
    )
    parser.add_argument(
        "--train-trace", type=Path, help="Zeus-format train trace CSV (default: shipped)"
    )
    parser.add_argument("--recurrences", type=int, default=50, help="runs of each job (N)")
    parser.add_argument("--repeats", type=int, default=5, help="seeds per workload (medians)")
    parser.add_argument("--seed", type=int, default=0, help="first seed")
    parser.add_argument("--eta", type=float, default=0.5, help="energy weight of the cost")
    parser.add_argument("--beta", type=float, default=2.0, help="early-stopping threshold")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    traces = (
        [(gpu_label(p), PowerTrace.load(p)) for p in args.power_trace]
        if args.power_trace
        else [("a40", PowerTrace.load("a40")), ("v100", PowerTrace.load("v100"))]
    )
    train = read_train_trace(args.train_trace)
    seeds = list(range(args.seed, args.seed + args.repeats))
    started = time.perf_counter()
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for label, trace in traces:
        results[label] = {}
        for workload in WORKLOADS:
            table = build_table(workload, trace, train)
            results[label][workload.name] = evaluate(
                table, args.recurrences, eta=args.eta, beta=args.beta, seeds=seeds
            )
    elapsed_s = time.perf_counter() - started
    if args.json:
        out = {
            "recurrences": args.recurrences,
            "seeds": seeds,
            "eta": args.eta,
            "beta": args.beta,
            "paper_energy_saving_range": list(PAPER_RANGE),
            "elapsed_s": elapsed_s,
            "results": results,
        }
        json.dump(out, sys.stdout, indent=2)
        print()
    else:
        print_table(results, args.recurrences)
        print(f"({elapsed_s:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
