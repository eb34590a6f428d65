"""``lightning-energy plan --config``: Kareus planned from the searches' files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lightning_energy.cli import EXIT_OK, EXIT_USAGE, main
from lightning_energy.kareus.compose import KareusPlan
from lightning_energy.kareus.partition import PARTITION_KEYS
from lightning_energy.kareus.search import MeasurementCache, SearchSpace, search_partition
from lightning_energy.perseus.planning.profile import PipelineProfile
from tests.lightning_energy.kareus.meters import STATIC_W, ExactMeter

LAYERS = [3, 2]


@pytest.fixture
def config(tmp_path: Path) -> Path:
    """Measurement files of each partition, the non-partition profile, the YAML."""
    meter = ExactMeter()
    folder = tmp_path / "kareus"
    for key in PARTITION_KEYS:
        space = SearchSpace((1410, 1200), (4, 16), meter.group.partition(key).slots)
        search_partition(
            meter,
            key,
            space,
            budget=1,
            static_power_w=STATIC_W,
            sampler="exhaustive",
            cache=MeasurementCache(key, folder / f"{key}.jsonl"),
        )
    rest = folder / "non_partition.csv"
    PipelineProfile.from_rows(
        meter.group.non_partition_rows(LAYERS, (1410, 1200)), blocked_power_w=STATIC_W
    ).to_csv(rest)
    path = tmp_path / "energy.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "perseus": {"schedule": "1f1b", "microbatches": 4},
                "kareus": {
                    "enabled": True,
                    "measurements_dir": str(folder),
                    "non_partition_profile": str(rest),
                    "layers_per_stage": LAYERS,
                    "tp_size": 2,
                },
            }
        )
    )
    return path


def test_the_config_plans_kareus_and_writes_its_plan(
    config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    argv = [
        "plan",
        "--config",
        str(config),
        "--p2p-power-w",
        str(STATIC_W),
        "--no-progress",
        "--output",
        str(out),
    ]
    assert main(argv) == EXIT_OK
    text = capsys.readouterr().out
    assert "1f1b: 2 stages on 2 GPUs, 4 microbatches" in text
    assert "baseline (every instruction at its fastest option)" in text
    plan = KareusPlan.load(out)
    assert plan.schedule.num_microbatches == 4
    # The model it was made for, which the runtime checks the job against.
    assert (plan.layers_per_stage, plan.tp_size) == (tuple(LAYERS), 2)
    assert {c.clock_mhz for c in plan.choices} <= {1410, 1200}
    assert main([*argv, "--microbatches", "6", "--json", "--energy-optimal"]) == EXIT_OK
    summary = json.loads(capsys.readouterr().out)
    assert (summary["planner"], summary["microbatches"]) == ("kareus", 6)
    assert summary["config"] == str(config)
    assert KareusPlan.load(out).schedule.num_microbatches == 6


def test_what_is_missing_is_named(
    config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = yaml.safe_load(config.read_text())
    (Path(data["kareus"]["measurements_dir"]) / "bwd_mlp.jsonl").unlink()
    assert (
        main(["plan", "--config", str(config), "--output", str(tmp_path / "p.json")]) == EXIT_USAGE
    )
    assert "measurement files ['bwd_mlp.jsonl'] missing" in capsys.readouterr().err
    data["kareus"]["enabled"] = False
    config.write_text(yaml.safe_dump(data))
    assert main(["plan", "--config", str(config)]) == EXIT_USAGE
    assert "kareus.enabled: false is not allowed with --config" in capsys.readouterr().err
    assert main(["plan", "--profile", "p.csv"]) == EXIT_USAGE
    assert "--microbatches: required with --profile" in capsys.readouterr().err
    assert main(["plan", "--profile", "p.csv", "--config", str(config)]) == EXIT_USAGE
