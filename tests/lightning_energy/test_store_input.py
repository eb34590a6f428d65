"""A store whose bookkeeping rows were changed by something else (``schema_version``, a
job's settings, a saved power profile) gives one StoreError saying so, never another
exception."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_energy.errors import StoreError
from lightning_energy.store import JobId, Store, TrialRecord

JOB = JobId("resnet50-imagenet", "NVIDIA A40", 2)

_SETTINGS = settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
#: What SQLite lets a NOT NULL column hold, whatever its declared type.
_CELLS = st.one_of(
    st.text(max_size=20),
    st.sampled_from(["1", "0", "-1", " 1", "1.0", "٣", "[]", "null", "{", "[" * 5000, "{}"]),
    # JSON integers beyond any float, and digits beyond what int() reads
    st.sampled_from([str(10**400), str(-(10**400)), "1" * 5000]),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False),
    st.binary(max_size=10),
)


def _fresh(tmp_path: Path) -> Path:
    path = tmp_path / "h.sqlite"
    path.unlink(missing_ok=True)
    with Store.open(f"sqlite:///{path}") as store:
        store.register_job(JOB, {"batch_sizes": [32, 64]})
        store.save_power_profile(JOB, 32, {"measured": {}})
    return path


@_SETTINGS
@given(value=_CELLS)
def test_any_schema_version_opens_or_is_refused(tmp_path: Path, value: object) -> None:
    path = _fresh(tmp_path)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE le_meta SET value = ? WHERE name = 'schema_version'", (value,))
    try:
        Store.open(f"sqlite:///{path}").close()
    except StoreError as exc:
        assert "schema" in str(exc) and str(path) in str(exc)


@_SETTINGS
@given(value=_CELLS)
def test_any_stored_settings_and_profile_are_read_or_refused(tmp_path: Path, value: object) -> None:
    path = _fresh(tmp_path)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE le_jobs SET settings = ?", (value,))
        conn.execute("UPDATE le_power_profiles SET state = ?", (value,))
    with Store.open(f"sqlite:///{path}") as store:
        for read in (
            store.jobs,
            lambda: store.register_job(JOB, {}),
            lambda: store.load_power_profile(JOB, 32),
        ):
            try:
                result = read()
            except StoreError as exc:
                assert "not a JSON object" in str(exc)
            else:
                assert result is not None


@pytest.mark.parametrize(
    "value",
    ["one", "", "-3", "1e3", "1" * 5000, "1" + "0" * 400],
    ids=["word", "empty", "negative", "exponent", "5000-digits", "no-integer"],
)
def test_a_schema_version_that_is_not_a_number_is_named(tmp_path: Path, value: str) -> None:
    path = _fresh(tmp_path)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE le_meta SET value = ? WHERE name = 'schema_version'", (value,))
    with pytest.raises(StoreError, match=f"schema_version {value[:40]!r} in le_meta"):
        Store.open(f"sqlite:///{path}")


def test_history_of_a_store_with_bad_settings_fails_with_one_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_energy.cli import EXIT_FAILURE, main

    path = _fresh(tmp_path)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE le_jobs SET settings = 'not json'")
    assert main(["history", "--store", f"sqlite:///{path}"]) == EXIT_FAILURE
    err = capsys.readouterr().err
    assert err.startswith("error:") and "settings of job 'resnet50-imagenet'" in err
    with sqlite3.connect(path) as conn:  # nothing was changed
        assert conn.execute("SELECT settings FROM le_jobs").fetchone() == ("not json",)


_TRIAL_COLUMNS = (
    "run_id",
    "batch_size",
    "power_limit_w",
    "epochs",
    "energy_j",
    "time_s",
    "cost",
    "eta",
    "converged",
    "metric",
    "started_at",
    "finished_at",
)


@_SETTINGS
@given(column=st.sampled_from(_TRIAL_COLUMNS), value=st.one_of(_CELLS, st.none()))
def test_any_stored_trial_field_is_read_or_refused_by_history(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], column: str, value: object
) -> None:
    from lightning_energy.cli import EXIT_FAILURE, EXIT_OK, main

    path = _fresh(tmp_path)
    with Store.open(f"sqlite:///{path}") as store:
        store.add_trial(
            TrialRecord(JOB, 32, 250.0, 3, 4.2e6, 3600.0, 5e6, 0.5, True, 1.7e9, 1.7e9 + 3600)
        )
    with sqlite3.connect(path) as conn:
        try:
            conn.execute(f"UPDATE le_trials SET {column} = ?", (value,))
        except sqlite3.IntegrityError:
            return  # NOT NULL or UNIQUE: SQLite itself keeps it out
    capsys.readouterr()
    code = main(["history", "--store", f"sqlite:///{path}"])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    if code == EXIT_OK:
        with Store.open(f"sqlite:///{path}") as store:
            (trial,) = store.trials()
        assert isinstance(trial.energy_j, float) and isinstance(trial.batch_size, int)
        assert isinstance(trial.converged, bool)
    else:
        assert code == EXIT_FAILURE
        assert err.startswith("error: trial 1") and f"{column} holds" in err


@pytest.mark.parametrize("column", ["started_at", "finished_at"])
@pytest.mark.parametrize("value", [-62_135_596_801, 6.77680361916768e16])
def test_history_refuses_a_time_no_calendar_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], column: str, value: float
) -> None:
    from lightning_energy.cli import EXIT_FAILURE, main

    path = _fresh(tmp_path)
    with Store.open(f"sqlite:///{path}") as store:
        store.add_trial(
            TrialRecord(JOB, 32, 250.0, 3, 4.2e6, 3600.0, 5e6, 0.5, True, 1.7e9, 1.7e9 + 3600)
        )
    with sqlite3.connect(path) as conn:
        conn.execute(f"UPDATE le_trials SET {column} = ?", (value,))
    capsys.readouterr()
    assert main(["history", "--store", f"sqlite:///{path}"]) == EXIT_FAILURE
    err = capsys.readouterr().err
    assert err.startswith("error: trial 1") and f"{column} holds" in err and "1970" in err


def test_history_names_the_field_that_holds_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_energy.cli import EXIT_FAILURE, main

    path = _fresh(tmp_path)
    with Store.open(f"sqlite:///{path}") as store:
        store.add_trial(TrialRecord(JOB, 32, 250.0, 3, 4.2e6, 3600.0, 5e6, 0.5, True, 1.0, 2.0))
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE le_trials SET energy_j = 'a lot'")
    assert main(["history", "--store", f"sqlite:///{path}"]) == EXIT_FAILURE
    err = capsys.readouterr().err
    assert "energy_j holds 'a lot' (str), not a finite number" in err
