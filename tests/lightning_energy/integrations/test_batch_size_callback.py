"""BatchSizeCallback on real Lightning fits with simulated GPUs, across recurring runs."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_energy.errors import ConfigError, StoreError
from lightning_energy.integrations.batch_size import batch_size_callback_class
from lightning_energy.store import Store
from tests.lightning_energy.integrations._models import make_loader, module_class
from tests.lightning_energy.processes import run_launch

# Epochs each batch size needs to reach the target; 8 never does.
EPOCHS_TO_TARGET = {8: None, 16: 2, 32: 3}
MAX_EPOCHS = 6


def _energy_config(tmp_path: Path) -> dict[str, Any]:
    return {
        # 100 steps an epoch: ~37 s steps, each longer than a profiling window must last.
        "device": {
            "backend": "simulated",
            "gpu": "a40",
            "steps_per_epoch": 100,
            "lease_dir": str(tmp_path / "leases"),
        },
        "power_limit": {
            "selector": "cost",
            "power_limits_w": [300.0, 250.0, 200.0],
            "warmup_steps": 1,
            "settle_steps": 1,
        },
        "log_every_n_steps": 5,
    }


def _classes(ns: Any) -> tuple[type, type]:
    """A datamodule keeping ``batch_size`` and a module whose score depends on it."""

    class Data(ns.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            self.batch_size = 999  # replaced by the callback before dataloaders are built

        def train_dataloader(self) -> Any:
            return make_loader(n=512, batch_size=self.batch_size)

        def val_dataloader(self) -> Any:
            return make_loader(n=16, batch_size=16)

    class Scored(module_class(ns)):  # type: ignore[misc]
        """Logs ``val_score`` = epochs done / epochs needed at the loader's batch size."""

        loader_batch_size: int | None = None

        def on_train_start(self) -> None:
            self.loader_batch_size = self.trainer.train_dataloader.batch_size

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            needed = EPOCHS_TO_TARGET[self.trainer.datamodule.batch_size]
            score = 0.0 if needed is None else (self.current_epoch + 1) / needed
            self.log("val_score", score)

    return Data, Scored


def _fit(
    ns: Any,
    tmp_path: Path,
    store_url: str,
    *,
    energy_first: bool = False,
    report: Path | None = None,
    **callback_kw: Any,
) -> tuple[Any, Any, Any]:
    from importlib import import_module

    energy_module = "lightning" if ns.__name__ == "lightning.pytorch" else "pytorch_lightning"
    energy_config = _energy_config(tmp_path)
    if report is not None:
        energy_config["report"] = str(report)
    energy_cb = import_module(f"lightning_energy.integrations.{energy_module}").EnergyCallback(
        energy_config
    )
    kwargs: dict[str, Any] = {
        "monitor": "val_score",
        "target": 1.0,
        "batch_sizes": [8, 16, 32],
        "default_batch_size": 16,
        "store": store_url,
    }
    kwargs.update(callback_kw)
    batch_cb = batch_size_callback_class(ns.__name__)("toy-job", **kwargs)
    data_cls, model_cls = _classes(ns)
    model = model_cls()
    trainer = ns.Trainer(
        max_epochs=MAX_EPOCHS,
        accelerator="cpu",
        devices=1,
        callbacks=[energy_cb, batch_cb] if energy_first else [batch_cb, energy_cb],
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    )
    trainer.fit(model, datamodule=data_cls())
    return trainer, batch_cb, model


@pytest.mark.slow
def test_recurring_runs_prune_stop_early_and_reuse_profiles(tmp_path: Path) -> None:
    import lightning.pytorch as ns

    url = f"sqlite:///{tmp_path / 'history.sqlite'}"
    used, profiled = [], []
    for _ in range(5):
        trainer, batch_cb, model = _fit(ns, tmp_path, url)
        assert model.loader_batch_size == batch_cb.batch_size == trainer.datamodule.batch_size
        used.append(batch_cb.batch_size)
        decisions = batch_cb.controller.decisions
        profiled.append(any(d["reason"] == "profile window" for d in decisions))
    # Round 1 from the default 16: 16, then 8 (fails), then up 32; round 2 from the cheapest
    # (32: 3 epochs x 4 steps < 2 epochs x 8 steps): 32, then down 16.
    assert used == [16, 8, 32, 32, 16]

    with Store.open(url) as store:
        trials = store.trials()
        assert [t.batch_size for t in trials] == used
        assert [t.converged for t in trials] == [True, False, True, True, True]
        # Stopped as soon as the target was reached.
        assert [t.epochs for i, t in enumerate(trials) if i != 1] == [2, 3, 3, 2]
        assert all(t.energy_j > 0 and t.time_s > 0 and t.power_limit_w for t in trials)
        (job,) = store.jobs()
        assert job.job.gpu_count == 1 and "A40" in job.job.gpu_model
        # Batch size 8 never converges: stopped early once it cost more than 2x the best
        # run so far (16), long before max_epochs.
        failed, first = trials[1], trials[0]
        assert failed.epochs < MAX_EPOCHS and failed.cost > 2.0 * first.cost
        per_epoch = failed.cost / failed.epochs
        assert failed.cost - per_epoch <= 2.0 * first.cost * 1.001  # not one epoch later
        for batch_size in (8, 16, 32):
            profile = store.load_power_profile(job.job, batch_size)
            assert profile is not None and "optimizers" in profile
    # A batch size's first run profiles the power limits; later runs with it reuse the
    # profile saved in the store and profile nothing.
    assert profiled == [True, True, True, False, False]


@pytest.mark.parametrize("energy_first", [False, True], ids=["batch-size-first", "energy-first"])
def test_the_report_lists_the_batch_size_beside_the_power_limits_it_profiled(
    tmp_path: Path, energy_first: bool
) -> None:
    """The batch size is a knob of the energy callback's run, in either callback order: its
    choice is a decision of the run's ledger and report, and the power limits, whose
    clocks it leaves alone, are profiled and carbon-paced beside it."""
    import lightning.pytorch as ns

    report = tmp_path / "report.json"
    url = f"sqlite:///{tmp_path / 'history.sqlite'}"
    _, batch_cb, _ = _fit(ns, tmp_path, url, energy_first=energy_first, report=report)
    decisions = json.loads(report.read_text())["decisions"]
    chosen = [d for d in decisions if d["kind"] == "batch_size"]
    assert [(d["value"], d["purpose"], d["step"]) for d in chosen] == [(16.0, "choice", 0)]
    assert "toy-job" in chosen[0]["reason"]
    assert any(d["kind"] == "power_limit" and d["purpose"] == "profile" for d in decisions)
    controller = batch_cb.controller
    assert [k.name for k in controller.knobs] == ["power_limit", "batch_size"]
    assert controller.paced_knob() is controller.power_limit


def test_pytorch_lightning_namespace(tmp_path: Path) -> None:
    import pytorch_lightning as ns

    url = f"sqlite:///{tmp_path / 'history.sqlite'}"
    trainer, batch_cb, model = _fit(ns, tmp_path, url)
    from lightning_energy.integrations import batch_size, pytorch_lightning

    # One mechanism for both namespaces: the namespace module's own class, as for the
    # energy callback, also reachable by its older name.
    assert type(batch_cb) is pytorch_lightning.BatchSizeCallback is batch_size.PLBatchSizeCallback
    assert isinstance(batch_cb, ns.Callback)
    assert batch_cb.batch_size == 16 and model.loader_batch_size == 16
    assert trainer.current_epoch == 2  # stopped after the 2 epochs 16 needs
    with Store.open(url) as store:
        (trial,) = store.trials()
    assert trial.converged and trial.epochs == 2 and trial.metric == 1.0


def test_misconfiguration_fails_before_training(tmp_path: Path) -> None:
    import lightning.pytorch as ns

    url = f"sqlite:///{tmp_path / 'history.sqlite'}"
    with pytest.raises(ConfigError, match="default_batch_size"):
        batch_size_callback_class()(
            "j", monitor="m", target=1.0, batch_sizes=[8], default_batch_size=4
        )
    with pytest.raises(ConfigError, match="monitor: 'nope' was not logged"):
        _fit(ns, tmp_path, url, monitor="nope")
    with pytest.raises(ConfigError, match="attribute: 'bs' is on neither"):
        _fit(ns, tmp_path, url, attribute="bs")
    with pytest.raises(ConfigError, match=r"target_metric: 2\.0 differs from 1\.0"):
        _fit(ns, tmp_path, url, target=2.0)
    data_cls, model_cls = _classes(ns)
    batch_cb = batch_size_callback_class()(
        "j", monitor="val_score", target=1.0, batch_sizes=[16], default_batch_size=16, store=url
    )
    assert isinstance(batch_cb, ns.Callback)
    lonely = ns.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        callbacks=[batch_cb],
    )
    with pytest.raises(ConfigError, match="needs an EnergyCallback"):
        lonely.fit(model_cls(), datamodule=data_cls())


def test_unavailable_store_trains_with_the_default(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import lightning.pytorch as ns

    bad = "postgresql+nosuchdriver://u:secret@127.0.0.1:9/db"
    _, batch_cb, model = _fit(ns, tmp_path, bad)
    assert batch_cb.batch_size == 16 and model.loader_batch_size == 16
    assert "tuning store unavailable" in caplog.text and "secret" not in caplog.text
    with pytest.raises(StoreError, match="tuning store unavailable") as failure:
        _fit(ns, tmp_path, bad, strict=True)
    assert "secret" not in str(failure.value)


@pytest.mark.slow
def test_two_process_ddp_only_rank_zero_uses_the_store(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'history.sqlite'}"
    env = dict(
        os.environ,
        PYTHONPATH=str(Path(__file__).resolve().parents[3]),
        ENERGY_CFG=json.dumps(_energy_config(tmp_path)),
        OUT_DIR=str(tmp_path),
        STORE_URL=url,
        DEFAULT_BS="32",
        PL_DISABLE_FORK="1",
    )
    worker = "tests.lightning_energy.integrations.ddp_batch_size_worker"
    out = run_launch([sys.executable, "-m", worker], env=env, timeout_s=240)
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["opened"] for r in ranks] == [1, 0]
    assert ranks[0]["batch_size"] == ranks[1]["batch_size"] == 32
    assert ranks[0]["loader"] == ranks[1]["loader"] == 32
    assert ranks[0]["epochs"] == ranks[1]["epochs"] == 3
    with Store.open(url) as store:
        (trial,) = store.trials()
    assert trial.job.gpu_count == 2 and trial.converged and trial.epochs == 3


def _section(**overrides: Any) -> dict[str, Any]:
    return {
        "job_key": "toy-job",
        "monitor": "val_score",
        "target": 1.0,
        "batch_sizes": [8, 16, 32],
        "default_batch_size": 16,
        **overrides,
    }


def test_settings_come_from_the_batch_size_section_and_arguments_override_them() -> None:
    cls = batch_size_callback_class()
    callback = cls(config={"batch_size": _section(eta=0.2)}, default_batch_size=8)
    assert callback.settings.default_batch_size == 8  # the argument wins
    assert callback.settings.eta == 0.2 and callback.settings.job_key == "toy-job"
    with pytest.raises(ConfigError) as info:
        cls("j", target=1.0, batch_sizes=[8], default_batch_size=8)
    assert info.value.problems == [
        "batch_size.monitor: missing; set it in the batch_size: section (or as the "
        "callback's argument of that name)"
    ]
    with pytest.raises(ConfigError, match=r"batch_size\.eta: 3\.0 is not allowed"):
        cls(config={"batch_size": _section()}, eta=3.0)


def test_a_config_file_alone_adds_the_callback_to_an_unchanged_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lightning.pytorch as ns

    url = f"sqlite:///{tmp_path / 'history.sqlite'}"
    path = tmp_path / "energy.yaml"
    path.write_text(json.dumps({**_energy_config(tmp_path), "batch_size": _section(enabled=True)}))
    monkeypatch.setenv("LIGHTNING_ENERGY_CONFIG", str(path))
    monkeypatch.setenv("LIGHTNING_ENERGY_STORE_URL", url)
    data_cls, model_cls = _classes(ns)
    model = model_cls()
    trainer = ns.Trainer(
        max_epochs=MAX_EPOCHS,
        accelerator="cpu",
        devices=1,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    )
    trainer.fit(model, datamodule=data_cls())
    assert model.loader_batch_size == 16
    assert trainer.current_epoch == 2  # stopped once 16 reached the target
    with Store.open(url) as store:
        (trial,) = store.trials()
    assert trial.batch_size == 16 and trial.converged and trial.job.key == "toy-job"
