"""Jobs of several ranks act as one: who drives which GPU, one plan, the job's totals.

The multi-process tests run two real gloo ranks whose simulated GPUs keep their settings
in shared files (as a real GPU's live in the driver), so leases, two processes on one GPU
and ranks that cannot optimise behave as they would on a cluster.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from lightning_energy.collectives import GatherCollective
from lightning_energy.controller.job_plan import (
    Capability,
    RankInfo,
    agree,
    describe_shared,
    job_totals,
    measuring_ranks,
    node_name,
    shared_gpus,
)
from lightning_energy.device import SimulatedSpec, simulated_gpus
from lightning_energy.device.guard import GPUGuard
from tests.lightning_energy.processes import free_port, run_module_ranks

WORKER = "tests.lightning_energy.job_worker"


# ---------------------------------------------------------------------------- pure logic
def test_a_gpu_opened_by_two_ranks_belongs_to_the_lowest() -> None:
    ranks = [
        RankInfo(0, "a#0", ("GPU-x",)),
        RankInfo(1, "a#0", ("GPU-x",)),
        RankInfo(2, "a#0", ("GPU-y", "GPU-x")),
    ]
    assert shared_gpus(ranks, 0) == {}
    assert shared_gpus(ranks, 1) == {"GPU-x": 0}
    assert shared_gpus(ranks, 2) == {"GPU-x": 0}
    assert shared_gpus([RankInfo(0, "a", ("GPU-x",)), RankInfo(1, "b", ("GPU-y",))], 1) == {}


def test_mig_instances_of_one_gpu_are_measured_by_the_lowest_rank() -> None:
    """Every MIG instance reports its whole GPU's energy: count it for one rank only."""
    ranks = [
        RankInfo(0, "a#0", ("MIG-a",), physical=("GPU-p",)),
        RankInfo(1, "a#0", ("MIG-b",), physical=("GPU-p",)),
        RankInfo(2, "a#0", ("MIG-c",), physical=("GPU-q",)),
    ]
    assert shared_gpus(ranks, 0) == {}
    assert shared_gpus(ranks, 1) == {"MIG-b": 0}
    assert shared_gpus(ranks, 2) == {}
    assert measuring_ranks(ranks) == 2  # one per physical GPU
    why = describe_shared(shared_gpus(ranks, 1), ranks)
    assert "MIG-b" in why and "GPU-p" in why and "rank 0" in why
    assert "local rank" not in why  # not a launcher mistake
    assert [RankInfo.from_dict(r.to_dict()) for r in ranks] == ranks
    whole = RankInfo(0, "a#0", ("GPU-x",))  # a whole GPU is its own physical GPU
    assert whole.physical_gpus == ("GPU-x",)


def test_the_job_optimises_when_any_rank_can_and_names_the_others() -> None:
    plan = agree([Capability(0, True, None), Capability(1, False, "no permission")])
    assert plan.optimises and plan.observing == (1,)
    assert plan.message is not None and "rank 1: no permission" in plan.message
    everyone = agree([Capability(1, False, "MIG"), Capability(0, False, "leased")])
    assert not everyone.optimises and everyone.observing == (0, 1)
    assert everyone.message is not None and everyone.message.startswith("every rank observes")
    assert agree([Capability(0, True, None), Capability(1, True, None)]).message is None


def test_job_totals_count_each_gpu_once() -> None:
    ranks = [
        {
            "rank": 1,
            "node": "b",
            "counted": True,
            "gpus": [{"uuid": "G1"}],
            "energy_j": 30.0,
            "energy_saved_j": 3.0,
            "emissions_g": 2.0,
        },
        {
            "rank": 0,
            "node": "a",
            "counted": True,
            "gpus": [{"uuid": "G0"}],
            "energy_j": 10.0,
            "energy_saved_j": 1.0,
            "emissions_g": 1.0,
        },
        {
            "rank": 2,
            "node": "a",
            "counted": False,
            "gpus": [{"uuid": "G0"}],
            "energy_j": 10.0,
            "energy_saved_j": 1.0,
            "emissions_g": 1.0,
        },
    ]
    totals = job_totals(ranks)
    assert totals["scope"] == "job"
    assert (totals["ranks"], totals["nodes"]) == (3, 2)
    assert totals["energy_j"] == 40.0 and totals["energy_saved_j"] == 4.0
    assert totals["emissions_g"] == 3.0
    assert [(g["uuid"], g["rank"], g["node"]) for g in totals["gpus"]] == [
        ("G0", 0, "a"),
        ("G1", 1, "b"),
    ]
    assert [r["rank"] for r in totals["per_rank"]] == [0, 1, 2]


def test_node_names_tell_nodes_of_one_host_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID"):
        monkeypatch.delenv(name, raising=False)
    alone = node_name()
    assert "#" not in alone
    monkeypatch.setenv("SLURM_NODEID", "3")
    assert node_name() == f"{alone}#3"
    assert node_name(1) == f"{alone}#1"  # the framework's own node rank wins


def test_objects_are_gathered_through_a_float_all_gather() -> None:
    """Ranks of different payload lengths, non-ASCII text: every rank gets every object."""
    barrier = threading.Barrier(2)
    slots: list[list[float]] = [[], []]
    results: list[list[Any]] = [[], []]

    def make(rank: int) -> GatherCollective:
        def all_gather(values: list[float]) -> list[list[float]]:
            slots[rank] = list(values)
            barrier.wait()
            rows = [list(s) for s in slots]
            barrier.wait()
            assert len({len(r) for r in rows}) == 1  # like torch: equal shapes on every rank
            return rows

        return GatherCollective(rank, 2, all_gather, lambda obj, src: obj)

    objects = [{"node": "héte", "gpus": ["GPU-1"]}, {"node": "b", "gpus": [], "n": 12345}]

    def run(rank: int) -> None:
        results[rank] = make(rank).all_gather_object(objects[rank])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == [objects, objects]


# ---------------------------------------------------------------------------- two ranks
def _run(tmp_path: Path, options: list[dict[str, Any]]) -> list[dict[str, Any]]:
    port = str(free_port())
    shared = {"state_dir": str(tmp_path / "gpus"), "lease_dir": str(tmp_path / "leases")}
    run_module_ranks(
        WORKER,
        [[str(r), port, str(tmp_path), json.dumps({**shared, **o})] for r, o in enumerate(options)],
        tmp_path,
    )
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(len(options))]


def _foreign_job(tmp_path: Path, index: int) -> GPUGuard:
    """Another live job holding the lease of simulated GPU ``index`` (this test process)."""
    spec = SimulatedSpec(gpu="a40", first_index=index, state_dir=str(tmp_path / "gpus"))
    guard = GPUGuard(
        simulated_gpus(spec), lease_dir=tmp_path / "leases", install_signal_handlers=False
    )
    guard.acquire()
    return guard


@pytest.mark.slow
def test_a_rank_whose_gpu_is_leased_observes_while_the_other_optimises(tmp_path: Path) -> None:
    other = _foreign_job(tmp_path, 1)
    try:
        ranks = _run(tmp_path, [{"local_rank": 0}, {"local_rank": 1}])
    finally:
        other.restore()
    optimising, observing = ranks
    assert not optimising["summary"]["observe_only"] and observing["summary"]["observe_only"]
    chosen = [v for kind, v, _ in optimising["decisions"] if kind == "power_limit"]
    assert chosen, "rank 0 profiled and chose a limit"
    assert not [d for d in observing["decisions"] if d[0] == "power_limit"]
    assert (
        "leased" in observing["decisions"][0][2] and "another job" in observing["decisions"][0][2]
    )
    # One job-wide profile: both ranks measured every window together.
    assert optimising["profile"] == observing["profile"] and optimising["profile"]
    for rank in ranks:
        assert rank["power_limit_w"] == 300.0  # every GPU back at its pre-job limit
        assert rank["job"]["energy_j"] == pytest.approx(
            optimising["summary"]["energy_j"] + observing["summary"]["energy_j"]
        )


@pytest.mark.slow
def test_strict_mode_fails_every_rank_with_the_same_message(tmp_path: Path) -> None:
    other = _foreign_job(tmp_path, 1)
    try:
        ranks = _run(
            tmp_path, [{"local_rank": 0, "strict": True}, {"local_rank": 1, "strict": True}]
        )
    finally:
        other.restore()
    errors = [r["error"] for r in ranks]
    assert [e["type"] for e in errors] == ["JobSetupError", "JobSetupError"]
    assert errors[0]["message"] == errors[1]["message"]
    assert "rank 1" in errors[0]["message"] and "rank 0:" not in errors[0]["message"]
    assert [r["power_limit_w"] for r in ranks] == [300.0, 300.0]
    assert sorted(p.name for p in (tmp_path / "leases").iterdir() if p.suffix == ".json") == []


@pytest.mark.slow
def test_two_ranks_on_one_gpu_measure_it_once(tmp_path: Path) -> None:
    ranks = _run(tmp_path, [{"local_rank": 0}, {"local_rank": 0}])
    driver, duplicate = ranks
    assert driver["uuid"] == duplicate["uuid"]
    assert not driver["summary"]["observe_only"] and duplicate["summary"]["observe_only"]
    reason = duplicate["decisions"][0][2]
    assert "rank 0" in reason and "of this job" in reason and "another job" not in reason
    job = driver["job"]
    assert job == duplicate["job"]
    assert job["energy_j"] == pytest.approx(driver["summary"]["energy_j"])  # counted once
    assert [g["rank"] for g in job["gpus"]] == [0]
    assert driver["power_limit_w"] == 300.0


@pytest.mark.slow
def test_ranks_whose_gpus_allow_different_limits_profile_the_same_candidates(
    tmp_path: Path,
) -> None:
    """An administrator left one GPU capped at 200 W (or a node has another GPU model):
    every rank must profile the limits the whole job can set, or the rank with fewer
    windows ends its profile while the other waits in a window's collective."""
    capped = simulated_gpus(
        SimulatedSpec(gpu="a40", first_index=1, state_dir=str(tmp_path / "gpus"))
    )[0]
    capped.set_power_limit_w(200.0)
    try:
        ranks = _run(tmp_path, [{"local_rank": 0}, {"local_rank": 1}])
    finally:
        capped.set_power_limit_w(300.0)
    assert [r.get("error") for r in ranks] == [None, None]
    assert ranks[0]["decisions"] == ranks[1]["decisions"]
    profiled = sorted(m["power_limit_w"] for m in ranks[0]["profile"])
    assert profiled == sorted(m["power_limit_w"] for m in ranks[1]["profile"]) == [150.0, 200.0]
    assert [r["power_limit_w"] for r in ranks] == [300.0, 200.0]  # each its pre-job limit


@pytest.mark.slow
@pytest.mark.parametrize("given", ["argument", "environment"])
def test_simulated_gpus_of_two_nodes_are_two_gpus(tmp_path: Path, given: str) -> None:
    """The node rank given to the controller, or only in the launcher's environment (the
    adapters of DeepSpeed, Megatron, Accelerate and Transformers pass none)."""
    options: list[dict[str, Any]]
    if given == "argument":
        options = [{"local_rank": 0, "node_rank": n} for n in (0, 1)]
    else:
        options = [{"local_rank": 0, "env": {"GROUP_RANK": str(n)}} for n in (0, 1)]
    ranks = _run(tmp_path, options)
    assert ranks[0]["uuid"] != ranks[1]["uuid"]
    assert not any(r["summary"]["observe_only"] for r in ranks)
    job = ranks[0]["job"]
    assert job["nodes"] == 2 and len(job["gpus"]) == 2
    assert job["energy_j"] == pytest.approx(sum(r["summary"]["energy_j"] for r in ranks))
    assert ranks[0]["summary"]["energy_j"] != ranks[1]["summary"]["energy_j"]  # own noise


def test_a_report_with_a_job_section_shows_the_job_total_and_refuses_bad_ones(
    tmp_path: Path,
) -> None:
    from lightning_energy.config import EnergyConfig
    from lightning_energy.controller import EnergyController
    from lightning_energy.report import ReportError, build_report, format_report, load_report

    config = EnergyConfig.from_mapping(
        {"device": {"backend": "simulated", "lease_dir": str(tmp_path / "leases")}}
    )
    controller = EnergyController(config, install_signal_handlers=False)
    controller.setup()
    for _ in range(3):
        controller.on_step_start()
        controller.on_step_end()
    controller.teardown()
    report = build_report(controller)
    own_j = report["summary"]["energy_j"]
    report["job"] = job_totals(
        [
            {"rank": 0, "node": "a", "energy_j": own_j, "energy_saved_j": 0.0},
            {"rank": 1, "node": "b", "energy_j": 2 * own_j, "energy_saved_j": 0.0},
        ]
    )
    path = tmp_path / "run.json"
    path.write_text(json.dumps(report))
    table = format_report(load_report(path))
    assert "energy (rank 0)" in table and "whole job: 2 ranks on 2 node(s)" in table
    bad_jobs: list[object] = [[], {"ranks": None, "energy_j": 1.0}, {"ranks": 2, "energy_j": "x"}]
    for bad in bad_jobs:
        path.write_text(json.dumps({**report, "job": bad}))
        with pytest.raises(ReportError, match="'job"):
            load_report(path)
