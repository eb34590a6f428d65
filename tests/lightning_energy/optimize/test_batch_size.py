"""Batch-size optimizer: pruning order, Thompson sampling, early stopping, job identity."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import numpy as np
import pytest

from lightning_energy.errors import ConfigError
from lightning_energy.optimize.batch_size import (
    JobSpec,
    Observation,
    Trial,
    best_choice,
    pruning_state,
    thompson_choice,
)
from lightning_energy.optimize.cost import zeus_cost
from lightning_energy.optimize.recurring import BatchSizeOptimizer
from lightning_energy.store import Store

SIZES = (8, 16, 32, 64, 128, 256)


def _spec(**overrides: object) -> JobSpec:
    fields: dict[str, object] = {
        "key": "cifar100-shufflenet",
        "gpu_model": "NVIDIA A40",
        "gpu_count": 1,
        "default_batch_size": 64,
        "batch_sizes": SIZES,
        "target_metric": 0.6,
        "max_epochs": 100,
        "max_power_limit_w": 300.0,
    }
    fields.update(overrides)
    return JobSpec(**fields)  # type: ignore[arg-type]


@pytest.fixture
def store() -> Iterator[Store]:
    opened = Store.open("sqlite://")
    yield opened
    opened.close()


def _run(optimizer: BatchSizeOptimizer, batch_size: int, cost: float, converged: bool) -> None:
    """Record a run whose cost is ``cost`` (energy only, eta = 1 in these tests)."""
    optimizer.record(
        Trial(
            batch_size=batch_size,
            epochs=10,
            energy_j=cost,
            time_s=0.0,
            converged=converged,
            started_at=0.0,
            finished_at=1.0,
        )
    )


def _drive(
    optimizer: BatchSizeOptimizer, outcome: dict[int, tuple[float, bool]], runs: int
) -> list[int]:
    chosen = []
    for _ in range(runs):
        batch_size = optimizer.next_batch_size()
        chosen.append(batch_size)
        _run(optimizer, batch_size, *outcome[batch_size])
    return chosen


# --------------------------------------------------------------------------- cost
def test_zeus_cost() -> None:
    assert zeus_cost(1000.0, 10.0, eta=0.5, max_power_w=300.0) == 0.5 * 1000 + 0.5 * 3000
    assert zeus_cost(1000.0, 10.0, eta=1.0, max_power_w=300.0) == 1000.0
    assert zeus_cost(1000.0, 10.0, eta=0.0, max_power_w=600.0) == 6000.0
    with pytest.raises(ConfigError) as bad:
        zeus_cost(1.0, 1.0, eta=1.5, max_power_w=0.0)
    assert len(bad.value.problems) == 2


# --------------------------------------------------------------------------- pruning
def test_pruning_explores_down_then_up_twice_then_samples(store: Store) -> None:
    outcome = {
        8: (500.0, False),
        16: (130.0, True),
        32: (100.0, True),  # the cheapest: round two starts here
        64: (120.0, True),
        128: (150.0, True),
        256: (400.0, False),
    }
    optimizer = BatchSizeOptimizer(_spec(), store, eta=1.0)
    assert optimizer.phase == "pruning"
    chosen = _drive(optimizer, outcome, 10)
    # Round 1 from the default 64: down 64, 32, 16, 8 (fails), then up 128, 256 (fails).
    # Round 2 from the cheapest survivor 32 over {16, 32, 64, 128}: down 32, 16, up 64, 128.
    assert chosen == [64, 32, 16, 8, 128, 256, 32, 16, 64, 128]
    assert optimizer.phase == "thompson"
    state = pruning_state(SIZES, 64, optimizer._observations(store.trials(optimizer.job.job_id)))
    assert state.next_batch_size is None and state.survivors == (16, 32, 64, 128)


def test_a_failure_in_round_two_prunes_that_direction() -> None:
    obs = [
        Observation(64, 120.0, True),
        Observation(32, 100.0, True),
        Observation(16, 130.0, True),
        Observation(8, 900.0, False),
        Observation(128, 150.0, True),
        Observation(256, 900.0, False),
        Observation(32, 101.0, True),
        Observation(16, 900.0, False),  # fails this time: 16 is out
    ]
    state = pruning_state(SIZES, 64, obs)
    assert state.next_batch_size == 64 and state.round == 1
    state = pruning_state(SIZES, 64, [*obs, Observation(64, 119.0, True)])
    assert state.next_batch_size == 128
    done = pruning_state(
        SIZES, 64, [*obs, Observation(64, 119.0, True), Observation(128, 900.0, False)]
    )
    assert done.next_batch_size is None and done.survivors == (32, 64)


def test_default_that_fails_goes_straight_up() -> None:
    obs = [Observation(64, 900.0, False)]
    assert pruning_state(SIZES, 64, obs).next_batch_size == 128
    obs += [Observation(128, 100.0, True), Observation(256, 90.0, True)]
    state = pruning_state(SIZES, 64, obs)
    # Round 2 starts from the cheapest of round 1 (256) and walks down.
    assert state.round == 1 and state.next_batch_size == 256


def test_runs_of_unexpected_batch_sizes_are_skipped_by_pruning() -> None:
    # A concurrent run with batch size 128 finished while 32 was expected.
    obs = [Observation(64, 120.0, True), Observation(128, 150.0, True)]
    assert pruning_state(SIZES, 64, obs).next_batch_size == 32
    obs.append(Observation(32, 100.0, True))
    assert pruning_state(SIZES, 64, obs).next_batch_size == 16


def test_no_survivor_falls_back_to_the_default(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    optimizer = BatchSizeOptimizer(_spec(batch_sizes=(32, 64, 128)), store, eta=1.0)
    outcome = {32: (1.0, False), 64: (1.0, False), 128: (1.0, False)}
    assert _drive(optimizer, outcome, 2) == [64, 128]
    with caplog.at_level(logging.WARNING):
        assert optimizer.next_batch_size() == 64
    assert "no batch size reached the target" in caplog.text


# --------------------------------------------------------------------------- Thompson sampling
def test_thompson_sampling_converges_to_the_cheapest_arm(store: Store) -> None:
    """Noisy synthetic costs: 32 is cheapest on average, 64 and 16 are within the noise."""
    means = {8: 160.0, 16: 106.0, 32: 100.0, 64: 104.0, 128: 125.0, 256: 150.0}
    noise = np.random.default_rng(7)
    optimizer = BatchSizeOptimizer(_spec(), store, eta=1.0, beta=math.inf, seed=3)
    chosen = []
    for _ in range(100):
        batch_size = optimizer.next_batch_size()
        chosen.append(batch_size)
        _run(optimizer, batch_size, float(noise.normal(means[batch_size], 12.0)), True)
    sampled = chosen[12:]  # after the two pruning rounds over six batch sizes
    assert len(set(sampled)) >= 2  # it does explore a close competitor
    assert chosen[-30:].count(32) >= 25, chosen[-30:]
    best = optimizer.best()
    assert best is not None and best.batch_size == 32


def test_thompson_choice_explores_arms_with_fewer_than_two_runs_first() -> None:
    rng = np.random.default_rng(0)
    obs = [Observation(16, 10.0, True), Observation(16, 12.0, True), Observation(32, 50.0, True)]
    assert thompson_choice([16, 32, 64], obs, rng) == 64  # never observed
    obs.append(Observation(64, 1.0, True))
    assert thompson_choice([16, 32, 64], obs, rng) == 32  # one run each: the smaller first


def test_thompson_choice_is_reproducible_and_uses_the_window() -> None:
    # The workload drifted: 16 used to be cheap and is now expensive.
    obs = [Observation(16, 10.0 + i % 2, True) for i in range(20)]
    obs += [Observation(32, 50.0 + i % 2, True) for i in range(4)]
    obs += [Observation(16, 90.0 + i % 2, True) for i in range(4)]
    picks_all = {thompson_choice([16, 32], obs, np.random.default_rng(s)) for s in range(20)}
    picks_windowed = {
        thompson_choice([16, 32], obs, np.random.default_rng(s), window=4) for s in range(20)
    }
    assert picks_all == {16} and picks_windowed == {32}
    again = [thompson_choice([16, 32], obs[:10], np.random.default_rng(5)) for _ in range(3)]
    assert len(set(again)) == 1


def test_same_seed_and_history_give_the_same_decision(store: Store) -> None:
    first = BatchSizeOptimizer(_spec(), store, eta=1.0, seed=11)
    outcome = {b: (100.0 + (b % 7) * 5, True) for b in SIZES}
    noise = np.random.default_rng(0)
    for _ in range(14):
        b = first.next_batch_size()
        _run(first, b, outcome[b][0] + float(noise.normal(0, 20)), True)
    second = BatchSizeOptimizer(_spec(), store, eta=1.0, seed=11)
    assert first.next_batch_size() == second.next_batch_size()


# --------------------------------------------------------------------------- early stopping
def test_early_stop_rule(store: Store) -> None:
    optimizer = BatchSizeOptimizer(_spec(max_epochs=30), store, eta=1.0, beta=2.0)
    # Nothing converged yet: only max_epochs stops a run.
    assert not optimizer.should_stop_early(1e12, epochs=29)
    assert optimizer.should_stop_early(0.0, epochs=30)
    _run(optimizer, 64, 300.0, False)  # failures do not set the bar
    assert optimizer.best_cost() is None
    _run(optimizer, 64, 100.0, True)
    assert optimizer.best_cost() == 100.0
    assert not optimizer.should_stop_early(200.0, epochs=3)
    assert optimizer.should_stop_early(200.1, epochs=3)
    # Another process records a cheaper run: seen when the next batch size is chosen.
    other = BatchSizeOptimizer(_spec(max_epochs=30), store, eta=1.0, beta=2.0)
    _run(other, 32, 50.0, True)
    assert not optimizer.should_stop_early(150.0)
    optimizer.next_batch_size()
    assert optimizer.should_stop_early(150.0)
    never = BatchSizeOptimizer(_spec(max_epochs=30), store, eta=1.0, beta=math.inf)
    assert not never.should_stop_early(1e300, epochs=1)


def test_cost_uses_every_gpu_of_the_job(store: Store) -> None:
    optimizer = BatchSizeOptimizer(_spec(gpu_count=4), store, eta=0.25)
    assert optimizer.cost(1000.0, 2.0) == pytest.approx(0.25 * 1000 + 0.75 * 1200 * 2)
    stored = optimizer.record(
        Trial(
            batch_size=64,
            epochs=3,
            energy_j=1000.0,
            time_s=2.0,
            converged=True,
            started_at=0.0,
            finished_at=2.0,
            power_limit_w=250.0,
            metric=0.61,
        )
    )
    assert stored.cost == optimizer.cost(1000.0, 2.0) and stored.eta == 0.25
    assert stored.power_limit_w == 250.0 and stored.metric == 0.61 and stored.id == 1


def test_a_new_eta_rescores_the_history(store: Store) -> None:
    time_first = BatchSizeOptimizer(_spec(), store, eta=0.0)
    for b, energy, time_s in ((64, 1000.0, 10.0), (32, 600.0, 20.0)):
        time_first.record(
            Trial(
                batch_size=b,
                epochs=5,
                energy_j=energy,
                time_s=time_s,
                converged=True,
                started_at=0.0,
                finished_at=1.0,
            )
        )
    assert time_first.best().batch_size == 64  # type: ignore[union-attr]
    energy_first = BatchSizeOptimizer(_spec(), store, eta=1.0)
    best = energy_first.best()
    assert best is not None and best.batch_size == 32 and best.mean_cost == 600.0
    # The stored costs keep the eta they were recorded with.
    assert best_choice(store.trials(energy_first.job.job_id)).batch_size == 64  # type: ignore[union-attr]


# --------------------------------------------------------------------------- validation
def test_job_spec_reports_every_problem() -> None:
    with pytest.raises(ConfigError) as bad:
        _spec(
            key="",
            gpu_count=0,
            batch_sizes=(32, 32),
            default_batch_size=48,
            max_epochs=0,
            max_power_limit_w=-1.0,
            target_metric=math.nan,
        )
    text = str(bad.value)
    assert len(bad.value.problems) == 7
    for key in (
        "key",
        "gpu_count",
        "batch_sizes",
        "default_batch_size",
        "max_epochs",
        "max_power_limit_w",
        "target_metric",
    ):
        assert f"{key}:" in text
    assert _spec(batch_sizes=(256, 8, 64)).batch_sizes == (8, 64, 256)
    assert _spec(higher_is_better=False, target_metric=40.0).reached(39.5)
    assert not _spec().reached(0.59)


def test_optimizer_arguments_are_validated(store: Store) -> None:
    with pytest.raises(ConfigError) as bad:
        BatchSizeOptimizer(_spec(), store, eta=2.0, beta=0.5, window=1, pruning_rounds=0)
    assert len(bad.value.problems) == 4


def test_a_changed_job_definition_is_refused(store: Store) -> None:
    BatchSizeOptimizer(_spec(), store)
    BatchSizeOptimizer(_spec(max_epochs=50), store)  # max_epochs may change
    with pytest.raises(ConfigError, match=r"target_metric: 0\.7 differs from 0\.6"):
        BatchSizeOptimizer(_spec(target_metric=0.7), store)
    # Another GPU count is another job.
    BatchSizeOptimizer(_spec(target_metric=0.7, gpu_count=8), store)


def test_record_validates_its_input(store: Store) -> None:
    optimizer = BatchSizeOptimizer(_spec(), store)
    with pytest.raises(ConfigError) as bad:
        optimizer.record(
            Trial(
                batch_size=48,
                epochs=1,
                energy_j=-1.0,
                time_s=math.inf,
                converged=True,
                started_at=0.0,
                finished_at=1.0,
            )
        )
    assert len(bad.value.problems) == 3
    assert store.trials() == []


def test_power_profiles_are_kept_per_batch_size(store: Store) -> None:
    optimizer = BatchSizeOptimizer(_spec(), store)
    optimizer.save_power_profile(64, {"chosen_w": 200.0})
    later = BatchSizeOptimizer(_spec(), store)
    assert later.load_power_profile(64) == {"chosen_w": 200.0}
    assert later.load_power_profile(32) is None


@pytest.mark.parametrize("huge", [10**400, -(10**400)])
def test_numbers_no_float_holds_are_refused_by_name(store: Store, huge: int) -> None:
    with pytest.raises(ConfigError) as bad:
        _spec(target_metric=huge, max_power_limit_w=huge)
    assert [p.split(":")[0] for p in bad.value.problems] == ["target_metric", "max_power_limit_w"]
    with pytest.raises(ConfigError, match="beta: "):
        BatchSizeOptimizer(_spec(), store, beta=huge)
    optimizer = BatchSizeOptimizer(_spec(), store)
    with pytest.raises(ConfigError) as bad:
        optimizer.record(
            Trial(
                batch_size=64,
                epochs=huge,
                energy_j=huge,
                time_s=huge,
                converged=True,
                started_at=0.0,
                finished_at=1.0,
            )
        )
    assert [p.split(":")[0] for p in bad.value.problems] == ["energy_j", "time_s", "epochs"]
