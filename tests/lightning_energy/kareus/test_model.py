"""The overlap model: its physics, its calibration on the measured Kareus file, its check."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from lightning_energy.errors import ConfigError, ProfileError
from lightning_energy.kareus.measured import read_partition_csv
from lightning_energy.kareus.model import (
    OverlapModel,
    OverlapPhysics,
    check,
    fit,
    load_calibration,
    save_calibration,
    shipped_physics,
)
from lightning_energy.kareus.partition import OP_CLASSES, SEQUENTIAL
from lightning_energy.kareus.workload import LLAMA_3_2_3B, MEASURED_FWD_ATTN
from tests.conftest import DATA_DIR

MEASURED = DATA_DIR / "kareus" / "fwd_attn_tp2_bs4_seq4096_default.csv"
HELD_OUT_1200 = DATA_DIR / "kareus" / "fwd_attn_tp2_bs4_seq4096_1200mhz.csv"
CTAS = np.arange(1, 21)


@pytest.fixture(scope="module")
def model() -> OverlapModel:
    return OverlapModel(shipped_physics(), harness=False)


def test_every_op_class_has_a_rate_a_host_cost_and_a_clock_share() -> None:
    physics = OverlapPhysics()
    for op_class in OP_CLASSES:
        assert hasattr(physics, f"host_{op_class}_s")
        assert hasattr(physics, f"{op_class}_compute_share")
        assert OverlapModel(physics).op_rate(op_class) > 0


def test_communication_time_falls_and_saturates_with_ctas(model: OverlapModel) -> None:
    part = LLAMA_3_2_3B.partition("fwd_attn")
    alone = model.predict(part, clock_mhz=1410, ctas=CTAS, slot=SEQUENTIAL)
    compute = model.predict(part, clock_mhz=1410, ctas=1, slot=SEQUENTIAL)
    comm_s = alone.comm_s
    assert np.all(np.diff(comm_s) < 0)  # more CTAs, shorter collective
    gains = -np.diff(comm_s)
    assert np.all(np.diff(gains) < 0)  # each CTA buys less than the one before
    # Never faster than the link: V / link_gbps bounds it below.
    ph = model.physics
    assert comm_s.min() > part.comm_bytes / (ph.link_gbps * 1e9)
    assert np.all(alone.time_s > comm_s) and compute.time_s[0] > alone.time_s[-1]


def test_compute_slows_with_the_sms_the_collective_holds(model: OverlapModel) -> None:
    """With the collective overlapping everything, the part of the partition past the
    collective's end runs at full speed; before it, compute runs on fewer SMs."""
    slow = dataclasses.replace(model.physics, sm_slowdown=4.0, comm_slowdown=0.0)
    fast = dataclasses.replace(model.physics, sm_slowdown=0.0, comm_slowdown=0.0)
    part = LLAMA_3_2_3B.partition("bwd_mlp")
    t_slow = OverlapModel(slow, harness=False).predict(part, clock_mhz=1410, ctas=CTAS, slot=0)
    t_fast = OverlapModel(fast, harness=False).predict(part, clock_mhz=1410, ctas=CTAS, slot=0)
    assert np.all(t_slow.time_s >= t_fast.time_s - 1e-12)
    assert np.any(t_slow.time_s > t_fast.time_s * 1.01)


def test_an_overlap_takes_at_least_the_longer_and_at_most_both_in_turn(
    model: OverlapModel,
) -> None:
    for key in ("fwd_attn", "fwd_mlp", "bwd_attn", "bwd_mlp"):
        part = LLAMA_3_2_3B.partition(key)
        ops_s, _ = model.compute(part.ops, np.asarray([1410.0]))
        sequential = model.predict(part, clock_mhz=1410, ctas=CTAS, slot=SEQUENTIAL)
        for slot in range(len(part.ops)):
            over = model.predict(part, clock_mhz=1410, ctas=CTAS, slot=slot)
            assert np.all(over.time_s >= np.maximum(ops_s.sum(), sequential.comm_s) - 1e-12)
            slowest = (1 + model.physics.comm_slowdown) * sequential.comm_s + ops_s.sum() * (
                1 + model.physics.sm_slowdown * CTAS / (model.physics.num_sms - CTAS)
            )
            assert np.all(
                over.time_s
                <= slowest
                + sum(getattr(model.physics, f"host_{op.op_class}_s") for op in part.ops)
                + model.physics.host_comm_s
            )


def test_static_power_is_drawn_while_blocked(model: OverlapModel) -> None:
    """While only the collective runs (sequential slot) the compute units wait: each
    second more of it costs the group's static power and little more (the CTAs, links)."""
    part = MEASURED_FWD_ATTN
    pred = model.predict(part, clock_mhz=1410, ctas=[1, 2], block_threads=512, slot=SEQUENTIAL)
    static_w = part.tp_size * model.physics.static_power_w
    marginal_w = (pred.energy_j[0] - pred.energy_j[1]) / (pred.time_s[0] - pred.time_s[1])
    assert static_w < marginal_w < 1.25 * static_w
    assert np.all(pred.energy_j > static_w * pred.time_s)


def test_a_lower_clock_is_slower_and_uses_less_energy(model: OverlapModel) -> None:
    part = LLAMA_3_2_3B.partition("fwd_mlp")
    pred = model.predict(part, clock_mhz=[1410, 1200, 1005], ctas=16, slot=0)
    assert np.all(np.diff(pred.time_s) > 0) and np.all(np.diff(pred.energy_j) < 0)


def test_measurements_carry_the_measured_noise(model: OverlapModel) -> None:
    part = LLAMA_3_2_3B.partition("fwd_attn")
    ctas = np.full(4000, 8)
    exact = model.predict(part, clock_mhz=1410, ctas=8, slot=2)
    noisy = model.measure(part, np.random.default_rng(0), clock_mhz=1410, ctas=ctas, slot=2)
    rel_t = noisy.time_s / exact.time_s[0] - 1
    rel_e = noisy.energy_j / exact.energy_j[0] - 1
    assert np.std(rel_t) == pytest.approx(model.physics.time_noise, rel=0.1)
    assert np.std(rel_e) == pytest.approx(model.physics.energy_noise, rel=0.1)
    assert abs(np.mean(rel_e)) < 3 * model.physics.energy_noise / np.sqrt(len(ctas))


def test_the_shipped_calibration_reproduces_the_measurements() -> None:
    """The calibration shipped with the package, on the file it was fitted to; the bounds
    are loose enough to hold for any honest refit, tight enough to catch a broken model."""
    report = check(
        OverlapModel(shipped_physics()), MEASURED_FWD_ATTN, read_partition_csv(MEASURED), 1410
    )
    assert report.settings == 640
    assert report.time_median_error < 0.03 and report.time_max_error < 0.12
    assert report.energy_median_error < 0.01 and report.energy_max_error < 0.05
    assert report.time_rank_correlation > 0.85 and report.energy_rank_correlation > 0.8
    # The static power it found is an A100's (Kareus uses 85 W while blocked).
    assert 60 < shipped_physics().static_power_w < 100


def test_a_fit_on_half_the_settings_predicts_the_other_half() -> None:
    rows = read_partition_csv(MEASURED)
    even = rows.ctas % 2 == 0

    def subset(mask: np.ndarray) -> object:
        return dataclasses.replace(
            rows,
            **{
                f: getattr(rows, f)[mask]
                for f in (
                    "window_start",
                    "window_end",
                    "ctas",
                    "block_threads",
                    "times_s",
                    "energies_j",
                )
            },
        )

    model, fitted = fit(MEASURED_FWD_ATTN, subset(even), 1410)  # type: ignore[arg-type]
    held_out = check(model, MEASURED_FWD_ATTN, subset(~even), 1410)  # type: ignore[arg-type]
    assert fitted.time_median_error < 0.04 and held_out.time_median_error < 0.04
    assert held_out.time_max_error < 0.15
    assert held_out.energy_median_error < 0.015 and held_out.energy_max_error < 0.06
    assert held_out.time_rank_correlation > 0.85 and held_out.energy_rank_correlation > 0.8
    assert model.physics.time_noise == pytest.approx(rows.noise()[0], rel=0.3)


def test_the_check_at_another_clock_ranks_well_and_states_its_energy_bias() -> None:
    """At 1200 MHz (not fitted to) time is predicted about as well as at the fitted clock;
    the clock scaling of power comes from the A100 physics preset, which lowers dynamic
    energy less than this partition did: energy is over-predicted by about a tenth, the
    ranking of settings holds."""
    report = check(
        OverlapModel(shipped_physics()), MEASURED_FWD_ATTN, read_partition_csv(HELD_OUT_1200), 1200
    )
    assert report.settings == 236
    assert report.time_median_error < 0.04 and report.time_max_error < 0.15
    assert report.time_rank_correlation > 0.9 and report.energy_rank_correlation > 0.9
    assert report.energy_median_error < 0.15


def test_bad_settings_are_refused_with_what_is_allowed(model: OverlapModel) -> None:
    part = LLAMA_3_2_3B.partition("fwd_mlp")
    with pytest.raises(ConfigError, match=r"slot 5 is not allowed; use -1 \(sequential\) or 0..4"):
        model.predict(part, clock_mhz=1410, ctas=4, slot=5)
    with pytest.raises(ConfigError, match=r"window \(3, 1\) is not allowed"):
        model.predict(part, clock_mhz=1410, ctas=4, window=(3, 1))
    with pytest.raises(ConfigError, match=r"ctas: use 1..107"):
        model.predict(part, clock_mhz=1410, ctas=108, slot=0)
    with pytest.raises(ConfigError, match="either slot or window"):
        model.predict(part, clock_mhz=1410, ctas=4)
    with pytest.raises(ConfigError, match="compute_share"):
        OverlapPhysics(gemm_compute_share=1.5)
    with pytest.raises(ConfigError, match="ref_clock_mhz"):
        OverlapModel(OverlapPhysics(ref_clock_mhz=5000))


def test_calibration_files_round_trip_and_bad_ones_are_refused(tmp_path: Path) -> None:
    model = OverlapModel(shipped_physics())
    report = check(model, MEASURED_FWD_ATTN, read_partition_csv(MEASURED), 1410)
    path = tmp_path / "calibration.json"
    save_calibration(model, report, path, provenance="test")
    physics, fitted = load_calibration(path)
    assert physics == model.physics and fitted["settings"] == 640
    path.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ProfileError, match="not an overlap calibration"):
        load_calibration(path)
    data = json.loads(
        json.dumps(
            {"format": "lightning-energy/kareus-overlap-calibration", "physics": {"warp_speed": 9}}
        )
    )
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="warp_speed"):
        load_calibration(path)


@pytest.mark.parametrize("value", [10**400, -(10**400)])
def test_a_calibration_constant_no_float_holds_is_named(tmp_path: Path, value: int) -> None:
    path = tmp_path / "calibration.json"
    physics = {"static_power_w": value}
    path.write_text(
        json.dumps({"format": "lightning-energy/kareus-overlap-calibration", "physics": physics})
    )
    with pytest.raises(ProfileError, match=r"static_power_w: .* use a finite number >= 0"):
        load_calibration(path)
