"""The node's CPU and DRAM energy: counted through wraps and failed readings, once per node,
beside the GPUs' in the summary, the report, the metrics and the grams."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_energy.config import EnergyConfig
from lightning_energy.controller import EnergyController
from lightning_energy.controller.job_plan import RankInfo, job_totals, node_meters
from lightning_energy.device.rapl import RaplCounters
from lightning_energy.errors import ConfigError
from lightning_energy.integrations.adapter import format_summary, summary_values
from lightning_energy.node_energy import NodeEnergyMeter, energy_counted
from lightning_energy.report import build_report, format_report, load_report, save_report
from tests.lightning_energy.device.fake_powercap import AMD_RANGE_UJ, FakePowercap
from tests.lightning_energy.processes import free_port, run_module_ranks

PERMISSION = "RAPL not readable (permission)"


class ManualClock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _meter(tree: FakePowercap, clock: ManualClock) -> NodeEnergyMeter:
    return NodeEnergyMeter(RaplCounters(tree.root, read_text=tree.read_text), clock=clock)


# ---------------------------------------------------------------------------- the meter
def test_a_counter_that_wraps_between_readings_counts_on(tmp_path: Path) -> None:
    tree = FakePowercap.amd(tmp_path, packages=2)
    tree.set_uj("package-0", AMD_RANGE_UJ - 5_000_000)  # 5 J before the end of its range
    clock = ManualClock()
    meter = _meter(tree, clock)
    assert meter.sample()
    clock.now_s = 1.0
    tree.add_j("package-0", 30.0)
    tree.add_j("package-1", 12.5)
    assert tree.energy_uj("package-0") < AMD_RANGE_UJ - 5_000_000  # it went backwards
    assert meter.read_j() == pytest.approx(42.5)
    summary = meter.summary()
    assert summary["package_energy_j"] == pytest.approx(42.5)
    assert summary["dram_energy_j"] is None and summary["counted"] == "CPU packages (no DRAM)"
    assert summary["complete"] and summary["note"] is None


def test_readings_too_far_apart_for_the_wrap_time_are_a_lower_bound(tmp_path: Path) -> None:
    tree = FakePowercap.amd(tmp_path, packages=1)  # 65.5 kJ: 65 s at 1 kW
    clock = ManualClock()
    meter = _meter(tree, clock)
    meter.sample()
    clock.now_s = 30.0  # under half the wrap time at 1 kW
    tree.add_j("package-0", 3_000.0)
    meter.sample()
    assert meter.summary()["complete"]
    clock.now_s = 70.0  # 40 s later: a whole range could have gone by unseen
    tree.add_j("package-0", 4_000.0)
    meter.sample()
    summary = meter.summary()
    assert not summary["complete"] and "lower bound" in summary["note"]
    assert summary["energy_j"] == pytest.approx(7_000.0)


@dataclass(frozen=True)
class _Domain:
    label: str
    kind: str
    max_energy_range_uj: int


class InMemoryCounters:
    """Counters in memory: the meter's arithmetic without files."""

    def __init__(self, range_uj: int, start_uj: int) -> None:
        self.domains = (_Domain("package-0", "package", range_uj),)
        self.left_out: list[str] = []
        self.value_uj = start_uj

    def add_uj(self, energy_uj: int) -> None:
        self.value_uj = (self.value_uj + energy_uj) % self.domains[0].max_energy_range_uj

    def read_uj(self) -> list[int]:
        return [self.value_uj]


@given(
    range_uj=st.integers(min_value=1, max_value=2**64 - 1),
    data=st.data(),
)
def test_any_moves_below_the_range_add_up_whatever_the_wraps(
    range_uj: int, data: st.DataObject
) -> None:
    start = data.draw(st.integers(min_value=0, max_value=range_uj - 1), label="start")
    moves = data.draw(st.lists(st.integers(min_value=0, max_value=range_uj - 1)), label="moves")
    source = InMemoryCounters(range_uj, start)
    clock = ManualClock()
    meter = NodeEnergyMeter(source, clock=clock)
    meter.sample()
    for move in moves:
        source.add_uj(move)
        clock.now_s += 1.0
        assert meter.sample()
    assert meter.energy_j == pytest.approx(sum(moves) / 1e6, rel=1e-12)


def test_a_domain_seen_drawing_more_is_read_against_its_shorter_wrap_time(tmp_path: Path) -> None:
    tree = FakePowercap.amd(tmp_path, packages=1)
    clock = ManualClock()
    meter = _meter(tree, clock)
    meter.sample()
    clock.now_s = 1.0
    tree.add_j("package-0", 4_000.0)  # 4 kW: the range lasts 16 s
    meter.sample()
    clock.now_s = 11.0  # 10 s: safe at 1 kW, over half the wrap time at 4 kW
    meter.sample()
    assert not meter.summary()["complete"]


def test_failed_readings_lose_nothing_once_readable_again(tmp_path: Path) -> None:
    tree = FakePowercap.intel(tmp_path, packages=1)
    clock = ManualClock()
    meter = _meter(tree, clock)
    meter.sample()
    tree.deny("package-0")
    tree.add_j("package-0", 50.0)
    tree.add_j("package-0/dram", 5.0)
    clock.now_s = 1.0
    assert meter.read_j() is None and "permission denied" in (meter.error or "")
    tree.allow("package-0")
    clock.now_s = 2.0
    assert meter.read_j() == pytest.approx(55.0)
    assert meter.summary()["complete"]
    tree.write("package-0/dram", "energy_uj", "garbage")
    assert not meter.sample()
    summary = meter.summary()
    assert not summary["complete"] and "the last readings failed" in summary["note"]
    assert summary["energy_j"] == pytest.approx(55.0)  # what was read, never a made-up zero


def test_the_background_reader_stops_after_a_last_reading(tmp_path: Path) -> None:
    tree = FakePowercap.intel(tmp_path, packages=2)
    meter = NodeEnergyMeter(RaplCounters(tree.root), period_s=0.01)
    meter.start()
    tree.add_j("package-1/dram", 7.0)
    meter.close()  # the leak check fails the test if the thread is still alive
    assert meter.energy_j == pytest.approx(7.0)
    meter.close()


def test_what_a_total_counts_is_said_in_words() -> None:
    both = {"measured": True, "energy_j": 1.0, "dram_energy_j": 0.2}
    amd = {"measured": True, "energy_j": 1.0, "dram_energy_j": None}
    denied = {"measured": False, "why": PERMISSION}
    assert energy_counted([both]) == "GPUs + CPU packages + DRAM"
    assert energy_counted([amd]) == "GPUs + CPU packages (no DRAM)"
    assert energy_counted([denied]) == f"GPUs only: {PERMISSION}"
    assert energy_counted([both, amd]) == "GPUs + CPU packages + DRAM (DRAM on 1 of 2 nodes)"
    assert energy_counted([both, denied]) == (
        f"GPUs + CPU packages + DRAM (1 of 2 nodes not measured: {PERMISSION})"
    )


# ---------------------------------------------------------------------------- configuration
def test_node_energy_is_on_by_default_and_false_turns_it_off() -> None:
    assert EnergyConfig().node_energy.enabled
    off = EnergyConfig.from_mapping({"node_energy": False})
    assert not off.node_energy.enabled
    assert EnergyConfig.from_mapping(off.to_mapping()).node_energy == off.node_energy
    given = EnergyConfig.from_mapping({"node_energy": {"powercap_root": "/host/powercap"}})
    assert given.node_energy.powercap_root == "/host/powercap"
    assert EnergyConfig().merged({"node_energy": False}).node_energy.enabled is False


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (5, "node_energy: 5 is not allowed; use true, false or a mapping"),
        ({"powercap_root": ""}, "node_energy.powercap_root: '' is not allowed"),
        ({"enabled": "yes"}, "node_energy.enabled: 'yes' is not allowed; use true or false"),
        ({"root": "/sys"}, "node_energy.root: unknown key; allowed keys: enabled, powercap_root"),
    ],
)
def test_a_bad_node_energy_section_is_named(section: Any, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        EnergyConfig.from_mapping({"node_energy": section, "power_limit": {"eta": 7}})
    assert any(message in p for p in caught.value.problems)
    assert any(p.startswith("power_limit.eta") for p in caught.value.problems)  # all at once


# ---------------------------------------------------------------------------- a run
def _config(tmp_path: Path, tree: FakePowercap | None, **extra: Any) -> EnergyConfig:
    return EnergyConfig.from_mapping(
        {
            "device": {
                "backend": "simulated",
                "lease_dir": str(tmp_path / "leases"),
                "start": "2023-06-01T00:00:00",
            },
            "power_limit": {"power_limits_w": [300, 200], "warmup_steps": 1, "settle_steps": 1},
            "log_every_n_steps": 4,
            "node_energy": {"powercap_root": None if tree is None else str(tree.root)},
            **extra,
        }
    )


def _run(config: EnergyConfig, tree: FakePowercap | None, steps: int = 10) -> EnergyController:
    controller = EnergyController(config, install_signal_handlers=False)
    controller.setup()
    for _ in range(steps):
        controller.on_step_start()
        controller.on_step_end()
        if tree is not None:
            for label, joules in (
                ("package-0", 30.0),
                ("package-1", 20.0),
                ("package-0/dram", 4.0),
            ):
                tree.add_j(label, joules)
    controller.teardown()
    return controller


def test_a_run_counts_the_node_beside_the_gpus_in_every_total(tmp_path: Path) -> None:
    tree = FakePowercap.intel(tmp_path / "tree", packages=2)
    carbon = {"provider": "constant", "constant_g_per_kwh": 360.0}
    controller = _run(_config(tmp_path, tree, carbon=carbon), tree)
    summary = controller.teardown()
    node = summary.node_energy
    assert node is not None and node["measured"] and node["complete"]
    assert node["energy_j"] == pytest.approx(10 * 54.0)
    assert node["package_energy_j"] == pytest.approx(10 * 50.0)
    assert node["domains"] == ["package-0", "package-0/dram", "package-1", "package-1/dram"]
    assert summary.energy_counted == "GPUs + CPU packages + DRAM"
    # Interval by interval, and in the logged metrics.
    assert sum(e.get("node_energy_j", 0.0) for e in controller.timeline) == pytest.approx(
        node["energy_j"]
    )
    assert controller.metrics["energy/node_total_j"] == pytest.approx(node["energy_j"])
    assert summary_values(summary)["energy/summary/node_energy_j"] == pytest.approx(540.0)
    # Grams: the node's at the same intensity, and the total the GPUs' plus the node's.
    carbon_summary = summary.carbon or {}
    assert carbon_summary["node_emissions_g"] == pytest.approx(540.0 * 360.0 / 3.6e6)
    assert carbon_summary["total_emissions_g"] == pytest.approx(
        carbon_summary["emissions_g"] + carbon_summary["node_emissions_g"]
    )
    assert sum(e.get("node_emissions_g", 0.0) for e in controller.timeline) == pytest.approx(
        carbon_summary["node_emissions_g"]
    )
    job = controller.gather_job_totals()
    assert job["node_energy_j"] == pytest.approx(540.0)
    assert job["total_energy_j"] == pytest.approx(job["energy_j"] + 540.0)
    # The report and both tables say it.
    path = save_report(build_report(controller), tmp_path / "run.json")
    rows = _rows(format_report(load_report(path)))
    assert rows["CPU + DRAM energy"] == "0.54 kJ"
    total = (summary.energy_j + 540.0) / 1000
    assert rows["total energy"] == f"{total:.2f} kJ (GPUs + CPU packages + DRAM)"
    assert "GPUs + CPU packages + DRAM" in rows["emissions (total)"]
    assert "emissions (GPUs)" in rows
    assert _rows(format_summary(controller.teardown()))["CPU + DRAM energy"] == "0.54 kJ"


def test_an_unreadable_node_is_reported_as_not_measured_never_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree = FakePowercap.intel(tmp_path / "tree", packages=2)
    tree.deny("package-0")
    tree.install(monkeypatch)  # an unprivileged process's view, also when tests run as root
    controller = _run(_config(tmp_path, tree), tree)
    summary = controller.teardown()
    node = summary.node_energy
    assert node is not None and not node["measured"] and "energy_j" not in node
    assert node["why"] == PERMISSION and "docs/permissions.md" in node["reason"]
    assert summary.energy_counted == f"GPUs only: {PERMISSION}"
    assert not any("node_energy_j" in e for e in controller.timeline)
    assert not any(k.startswith("energy/node") for k in controller.metrics)
    rows = _rows(format_report(build_report(controller)))
    assert (
        rows["CPU + DRAM energy"].startswith("not measured: ")
        and "permission" in rows["CPU + DRAM energy"]
    )
    assert rows["total energy"].endswith(f"(GPUs only: {PERMISSION})")
    job = controller.gather_job_totals()
    assert job["node_energy_j"] is None and job["counted"] == f"GPUs only: {PERMISSION}"


def test_node_energy_false_reads_no_counter(tmp_path: Path) -> None:
    tree = FakePowercap.intel(tmp_path / "tree", packages=2)
    config = _config(tmp_path, tree).merged({"node_energy": {"enabled": False}})
    summary = _run(config, tree).teardown()
    assert summary.energy_counted == "GPUs only: turned off (node_energy: false)"


def test_a_report_with_a_bad_node_section_is_refused(tmp_path: Path) -> None:
    from lightning_energy.report import ReportError

    report = build_report(_run(_config(tmp_path, None), None, steps=2))
    report["summary"]["node_energy"] = {"measured": "yes", "energy_j": "many"}
    path = save_report(report, tmp_path / "run.json")
    with pytest.raises(ReportError) as caught:
        load_report(path)
    assert "summary.node_energy.measured" in str(caught.value)
    assert "summary.node_energy.energy_j" in str(caught.value)


def test_the_lightning_callback_logs_and_summarises_the_node(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from lightning_energy.integrations.lightning import EnergyCallback
    from tests.lightning_energy.integrations._models import (
        energy_config,
        make_loader,
        module_class,
    )

    tree = FakePowercap.amd(tmp_path / "tree", packages=1)

    class BusyCPUs(pl.Callback):
        """The CPUs draw 12 J a step (after the energy callback's hook of the step)."""

        def on_train_batch_end(self, *args: Any) -> None:
            tree.add_j("package-0", 12.0)

    config = energy_config(tmp_path, node_energy={"powercap_root": str(tree.root)})
    callback = EnergyCallback({**config, "log_every_n_steps": 5})
    trainer = pl.Trainer(
        max_steps=20,
        accelerator="cpu",
        devices=1,
        callbacks=[callback, BusyCPUs()],
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=pl.loggers.CSVLogger(tmp_path),
    )
    trainer.fit(module_class(pl)(), make_loader())
    summary = callback.summary
    assert summary is not None and summary.node_energy is not None
    assert summary.node_energy["energy_j"] == pytest.approx(20 * 12.0)
    assert summary.energy_counted == "GPUs + CPU packages (no DRAM)"
    # Logged at step 20 before that step's 12 J, which the summary's last reading counts.
    assert float(trainer.logged_metrics["energy/node_total_j"]) == pytest.approx(19 * 12.0)


def _rows(table: str) -> dict[str, str]:
    pairs = (line.strip().split("  ", 1) for line in table.splitlines())
    return {name: value.strip() for name, value in pairs}


# ---------------------------------------------------------------------------- ranks
def test_the_lowest_rank_reading_a_node_measures_it() -> None:
    ranks = [
        RankInfo(2, "b#1", ("GPU-c",), "boot-2:/sys/class/powercap"),
        RankInfo(1, "a#0", ("GPU-b",), "boot-1:/sys/class/powercap"),
        RankInfo(0, "a#0", ("GPU-a",), "boot-1:/sys/class/powercap"),
        RankInfo(3, "b#1", ("GPU-d",), None),
    ]
    assert node_meters(ranks) == {"boot-1:/sys/class/powercap": 0, "boot-2:/sys/class/powercap": 2}
    assert RankInfo.from_dict(ranks[0].to_dict()) == ranks[0]


def test_job_totals_count_each_node_once_and_name_the_unmeasured() -> None:
    measured = {"measured": True, "energy_j": 100.0, "dram_energy_j": 10.0}
    ranks = [
        {"rank": 0, "node": "a", "energy_j": 50.0, "energy_saved_j": 0.0, "emissions_g": 2.0,
         "node_energy": measured, "node_emissions_g": 4.0},
        {"rank": 1, "node": "a", "energy_j": 50.0, "energy_saved_j": 0.0, "emissions_g": 2.0,
         "node_energy": {"measured": False, "measured_by": 0, "why": "measured by rank 0"}},
        {"rank": 2, "node": "b", "energy_j": 50.0, "energy_saved_j": 0.0, "emissions_g": 2.0,
         "node_energy": {"measured": False, "why": PERMISSION}},
        {"rank": 3, "node": "b", "energy_j": 50.0, "energy_saved_j": 0.0, "emissions_g": 2.0,
         "node_energy": {"measured": False, "why": PERMISSION}},
    ]  # fmt: skip
    job = job_totals(ranks)
    assert job["node_energy_j"] == 100.0 and job["total_energy_j"] == 300.0
    assert job["node_emissions_g"] == 4.0 and job["total_emissions_g"] == 12.0
    assert [(n["node"], n["rank"]) for n in job["node_energy"]] == [("a", 0), ("b", 2)]
    assert job["counted"] == f"GPUs + CPU packages + DRAM (1 of 2 nodes not measured: {PERMISSION})"


@pytest.mark.slow
def test_two_ranks_on_one_node_count_its_cpus_once(tmp_path: Path) -> None:
    tree = FakePowercap.intel(tmp_path / "tree", packages=2)
    counter = [str(tree.path("package-0")), tree.range_uj, 5.0]
    options = {"powercap_root": str(tree.root), "node_counter": counter, "steps": 30}
    port = str(free_port())
    shared = {"state_dir": str(tmp_path / "gpus"), "lease_dir": str(tmp_path / "leases")}
    run_module_ranks(
        "tests.lightning_energy.job_worker",
        [
            [str(r), port, str(tmp_path), json.dumps({**shared, **options, "local_rank": r})]
            for r in range(2)
        ],
        tmp_path,
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    measuring, other = (r["summary"]["node_energy"] for r in ranks)
    assert measuring["measured"] and measuring["energy_j"] == pytest.approx(30 * 5.0)
    assert not other["measured"] and other["measured_by"] == 0
    job = ranks[0]["job"]
    assert job == ranks[1]["job"]
    assert job["node_energy_j"] == pytest.approx(150.0)  # once, not once per rank
    assert [(n["node"], n["rank"]) for n in job["node_energy"]] == [(measuring["node"], 0)]
    assert ranks[0]["summary"]["energy_counted"] == "GPUs + CPU packages + DRAM"
