"""The tuning-history store: round trips, SQLite safety, crash safety, concurrency, PostgreSQL."""

from __future__ import annotations

import importlib.util
import os
import pwd
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import sqlalchemy as sa

from lightning_energy import store as store_module
from lightning_energy.errors import StoreError
from lightning_energy.store import (
    ENV_STORE_URL,
    JobId,
    Store,
    TrialRecord,
    default_store_url,
    network_filesystem_type,
    sqlite_path,
)
from tests.lightning_energy.processes import free_port

WRITER = Path(__file__).with_name("store_writer.py")
JOB = JobId("resnet50-imagenet", "NVIDIA A40", 2)


def _trial(batch_size: int, converged: bool = True, job: JobId = JOB) -> TrialRecord:
    return TrialRecord(
        job=job,
        batch_size=batch_size,
        power_limit_w=225.0,
        epochs=7,
        energy_j=1.5e6,
        time_s=3600.0,
        cost=2.0e6,
        eta=0.5,
        converged=converged,
        started_at=1_700_000_000.0,
        finished_at=1_700_003_600.0,
        metric=0.76,
    )


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = Store.open(f"sqlite:///{tmp_path / 'history.sqlite'}")
    yield opened
    opened.close()


# --------------------------------------------------------------------------- basics
def test_round_trip_of_jobs_trials_and_profiles(store: Store) -> None:
    assert store.register_job(JOB, {"default_batch_size": 256}) == {"default_batch_size": 256}
    # A second registration keeps the first settings and returns them.
    assert store.register_job(JOB, {"default_batch_size": 128}) == {"default_batch_size": 256}
    other = JobId("resnet50-imagenet", "NVIDIA V100", 1)
    store.register_job(other, {})

    first = store.add_trial(_trial(256))
    second = store.add_trial(_trial(128, converged=False))
    store.add_trial(_trial(64, job=other))
    assert first.id is not None and second.id is not None and second.id > first.id

    trials = store.trials(JOB)
    assert [t.batch_size for t in trials] == [256, 128]
    assert trials[0] == first
    assert trials[1].converged is False and trials[1].metric == 0.76
    assert [t.batch_size for t in store.trials(key="resnet50-imagenet")] == [256, 128, 64]
    assert len(store.trials()) == 3
    assert [r.job for r in store.jobs()] == [JOB, other]
    assert store.jobs(key="nope") == []

    assert store.load_power_profile(JOB, 256) is None
    store.save_power_profile(JOB, 256, {"choice_w": 200.0, "profile": [1, 2]})
    store.save_power_profile(JOB, 256, {"choice_w": 175.0})
    assert store.load_power_profile(JOB, 256) == {"choice_w": 175.0}
    assert store.load_power_profile(JOB, 128) is None
    assert store.integrity_check() == ["ok"]


def test_trial_of_an_unregistered_job_is_refused(store: Store) -> None:
    with pytest.raises(StoreError, match="IntegrityError"):
        store.add_trial(_trial(64, job=JobId("ghost", "A40", 1)))


def test_duplicate_run_id_is_refused_and_leaves_no_row(store: Store) -> None:
    store.register_job(JOB, {})
    trial = store.add_trial(_trial(64))
    with pytest.raises(StoreError):
        store.add_trial(replace(trial, id=None, batch_size=32))
    assert [t.batch_size for t in store.trials(JOB)] == [64]


def test_sqlite_runs_in_wal_mode_with_full_sync(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite"
    with Store.open(f"sqlite:///{path}"):
        pass
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"le_meta", "le_jobs", "le_trials", "le_power_profiles"} <= tables


def test_default_location_and_environment_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(ENV_STORE_URL, raising=False)
    assert (
        default_store_url() == f"sqlite:///{tmp_path / 'xdg' / 'lightning-energy'}/history.sqlite"
    )
    with Store.open() as opened:
        assert opened.url == default_store_url()
    assert (tmp_path / "xdg" / "lightning-energy" / "history.sqlite").is_file()

    monkeypatch.setenv(ENV_STORE_URL, f"sqlite:///{tmp_path / 'env.sqlite'}")
    with Store.open() as opened:
        opened.register_job(JOB, {})
    assert (tmp_path / "env.sqlite").is_file()
    assert sqlite_path(f"sqlite:///{tmp_path / 'env.sqlite'}") == tmp_path / "env.sqlite"
    assert sqlite_path("sqlite://") is None
    assert sqlite_path("postgresql://u@h/db") is None


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite"
    Store.open(f"sqlite:///{path}").close()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE le_meta SET value = '99' WHERE name = 'schema_version'")
    with pytest.raises(StoreError, match="schema version 99"):
        Store.open(f"sqlite:///{path}")


# --------------------------------------------------------------------------- network FS
MOUNTS = """\
/dev/sda1 / ext4 rw,relatime 0 0
server:/export /mnt/shared nfs4 rw,relatime 0 0
//nas/share /mnt/shared/local\\040disk ext4 rw 0 0
//nas/home /home/user/smb cifs rw 0 0
lustre@o2ib:/fs /lustre lustre rw 0 0
tmpfs /tmp tmpfs rw 0 0
"""


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/home/user/data/h.sqlite", None),
        ("/mnt/shared/h.sqlite", "nfs4"),
        ("/mnt/shared/local disk/h.sqlite", None),  # longest mount point wins; \040 is a space
        ("/mnt/sharedother/h.sqlite", None),
        ("/home/user/smb/x/h.sqlite", "cifs"),
        ("/lustre/project/h.sqlite", "lustre"),
    ],
)
def test_network_filesystem_detection(path: str, expected: str | None) -> None:
    assert network_filesystem_type(Path(path), MOUNTS) == expected


def test_sqlite_on_network_fs_is_refused_unless_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/sda1 / ext4 rw 0 0\nsrv:/x {tmp_path / 'nfs'} nfs rw 0 0\n")
    monkeypatch.setattr(store_module, "_MOUNTS", mounts)
    url = f"sqlite:///{tmp_path / 'nfs' / 'h.sqlite'}"
    with pytest.raises(StoreError, match=r"network file system \(nfs\).*allow_network_fs"):
        Store.open(url)
    assert not (tmp_path / "nfs").exists()
    with Store.open(url, allow_network_fs=True) as opened:
        opened.register_job(JOB, {})
    with Store.open(f"sqlite:///{tmp_path / 'local.sqlite'}"):
        pass


# --------------------------------------------------------------------------- secrets
def test_passwords_never_appear_in_errors_or_reprs() -> None:
    with pytest.raises(StoreError) as bad_url:
        Store.open("postgresql://user:s3cr3t@host:notaport/db")
    assert "s3cr3t" not in str(bad_url.value)
    with pytest.raises(StoreError) as no_server:
        # No such driver or no server: either way the message names the URL masked.
        Store.open("postgresql+nosuchdriver://user:s3cr3t@127.0.0.1:9/db")
    assert "s3cr3t" not in str(no_server.value)
    assert "user:***@127.0.0.1:9" in str(no_server.value)
    with pytest.raises(StoreError) as garbage:
        Store.open("s3cr3t is not a url")
    assert "s3cr3t" not in str(garbage.value)


def test_repr_and_messages_mask_the_password() -> None:
    url = store_module._parse_url("postgresql://user:p%40ss@db.example/x")
    assert store_module._scrub("failed for p@ss and p%40ss", url) == "failed for *** and ***"
    store = Store(sa.create_engine("sqlite://"), url)
    assert "p@ss" not in repr(store) and "p%40ss" not in repr(store)
    assert repr(store) == "Store(url='postgresql://user:***@db.example/x')"
    store.close()


# --------------------------------------------------------------------------- crash safety
def _spawn(
    url: str, writer: str, count: int, payload: int = 64, first: int = 1
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(WRITER), url, writer, str(count), str(payload), str(first)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _check_trial(trial: TrialRecord, writer: str) -> int:
    k = trial.batch_size
    assert trial.run_id == f"{writer}-{k}"
    assert trial.energy_j == 10.0 * k and trial.time_s == float(k) and trial.cost == 15.0 * k
    assert trial.power_limit_w == 100.0 + k and trial.epochs == k % 7
    assert trial.converged is (k % 2 == 0) and trial.metric == k / 1000.0
    return k


@pytest.mark.slow
def test_sigkill_during_many_writes_leaves_a_consistent_database(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'crash.sqlite'}"
    first = 1
    for kill_after in (40, 170, 333):
        proc = _spawn(url, "w", 100_000, payload=20_000, first=first)
        assert proc.stdout is not None
        acked = {"T": first - 1, "P": first - 1}
        for line in proc.stdout:
            kind, _, k = line.strip().partition(" ")
            if kind in acked:
                acked[kind] = int(k)
            if acked["P"] >= first - 1 + kill_after:
                proc.send_signal(signal.SIGKILL)
                break
        rest, _ = proc.communicate(timeout=60)
        for line in rest.splitlines():  # acknowledged before the kill landed
            kind, _, k = line.strip().partition(" ")
            if kind in acked:
                acked[kind] = int(k)
        assert proc.returncode == -signal.SIGKILL

        with Store.open(url) as store:
            assert store.integrity_check() == ["ok"]
            ks = [
                _check_trial(t, "w") for t in store.trials(JobId("crash-test", "Simulated A40", 1))
            ]
            # Every acknowledged trial is there, in order, plus at most the one in flight.
            assert ks == list(range(1, len(ks) + 1))
            assert len(ks) in (acked["T"], acked["T"] + 1)
            state = store.load_power_profile(JobId("crash-test", "Simulated A40", 1), 1)
            assert state is not None
            # The profile is the last acknowledged one or the next one: old or new, never torn.
            assert state["k"] in (acked["P"], acked["P"] + 1)
            assert state["check"] == 7 * state["k"] and state["payload"] == "x" * 20_000
        first = len(ks) + 1


@pytest.mark.slow
def test_concurrent_writers_lose_nothing(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'shared.sqlite'}"
    writers = [f"w{i}" for i in range(4)]
    procs = [_spawn(url, name, 40, payload=2_000) for name in writers]
    for proc in procs:
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err
    with Store.open(url) as store:
        assert store.integrity_check() == ["ok"]
        trials = store.trials()
        assert len(trials) == 160 and len({t.run_id for t in trials}) == 160
        for name in writers:
            ks = [_check_trial(t, name) for t in trials if t.run_id.startswith(f"{name}-")]
            assert ks == list(range(1, 41))  # each writer's trials in its own order
        state = store.load_power_profile(JobId("crash-test", "Simulated A40", 1), 1)
        assert state is not None and state["k"] == 40 and state["writer"] in writers
        assert len(store.jobs()) == 1


# --------------------------------------------------------------------------- PostgreSQL
_DRIVERS = {
    "psycopg": "postgresql+psycopg",
    "psycopg2": "postgresql+psycopg2",
    "pg8000": "postgresql+pg8000",
}


def _postgres_bin() -> Path | None:
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(found).parent
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
    )
    return versions[-1].parent if versions else None


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    """A throwaway PostgreSQL server on 127.0.0.1 with password auth; skipped when impossible."""
    driver = next((d for d in _DRIVERS if importlib.util.find_spec(d) is not None), None)
    if driver is None:
        pytest.skip("no PostgreSQL driver importable (psycopg, psycopg2 or pg8000)")
    bin_dir = _postgres_bin()
    if bin_dir is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl) found")
    run_as: dict[str, int] = {}
    if os.geteuid() == 0:  # initdb refuses to run as root
        try:
            account = pwd.getpwnam("postgres")
        except KeyError:
            account = pwd.getpwnam("nobody")
        run_as = {"user": account.pw_uid, "group": account.pw_gid}
    base = Path(tempfile.mkdtemp(prefix="lightning-energy-pg-"))
    password_file = base / "password"
    password_file.write_text("pg-s3cret\n")
    if run_as:
        for path in (base, password_file):
            os.chown(path, run_as["user"], run_as["group"])
    data = base / "data"
    port = free_port()
    kwargs = {"capture_output": True, "text": True, "timeout": 120, "cwd": base, **run_as}
    try:
        init = subprocess.run(
            [
                str(bin_dir / "initdb"),
                "-D",
                str(data),
                "-U",
                "le_test",
                "-A",
                "scram-sha-256",
                "--pwfile",
                str(password_file),
                "--no-sync",
                "-E",
                "UTF8",
            ],
            **kwargs,  # type: ignore[call-overload]
        )
        if init.returncode != 0:
            pytest.skip(f"initdb failed: {init.stderr.strip()[-300:]}")
        options = f"-p {port} -k {base} -c listen_addresses=127.0.0.1 -c fsync=off"
        start = subprocess.run(
            [
                str(bin_dir / "pg_ctl"),
                "-D",
                str(data),
                "-l",
                str(base / "log"),
                "-w",
                "-t",
                "60",
                "-o",
                options,
                "start",
            ],
            **kwargs,  # type: ignore[call-overload]
        )
        if start.returncode != 0:
            pytest.skip(f"PostgreSQL did not start: {start.stderr.strip()[-300:]}")
        try:
            yield f"{_DRIVERS[driver]}://le_test:pg-s3cret@127.0.0.1:{port}/postgres"
        finally:
            subprocess.run(
                [str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
                **kwargs,  # type: ignore[call-overload]
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.postgres
def test_postgresql_round_trip(postgres_url: str) -> None:
    with Store.open(postgres_url) as store:
        assert "pg-s3cret" not in repr(store) and store.dialect == "postgresql"
        job = JobId("pg-round-trip", "NVIDIA A40", 1)
        store.register_job(job, {"default_batch_size": 64})
        stored = store.add_trial(_trial(64, job=job))
        assert store.trials(job) == [stored]
        store.save_power_profile(job, 64, {"choice_w": 200.0})
        store.save_power_profile(job, 64, {"choice_w": 175.0})
        assert store.load_power_profile(job, 64) == {"choice_w": 175.0}


@pytest.mark.postgres
@pytest.mark.slow
def test_postgresql_concurrent_writers(postgres_url: str) -> None:
    procs = [_spawn(postgres_url, f"pg{i}", 25) for i in range(3)]
    for proc in procs:
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err
    with Store.open(postgres_url) as store:
        trials = store.trials(JobId("crash-test", "Simulated A40", 1))
        assert len(trials) == 75 and len({t.run_id for t in trials}) == 75
        state = store.load_power_profile(JobId("crash-test", "Simulated A40", 1), 1)
        assert state is not None and state["k"] == 25


@pytest.mark.postgres
def test_postgresql_wrong_password_does_not_leak(postgres_url: str) -> None:
    wrong = postgres_url.replace("pg-s3cret", "wr0ng-pa55")
    with pytest.raises(StoreError) as failure:
        Store.open(wrong)
    assert "wr0ng-pa55" not in str(failure.value) and "le_test:***@" in str(failure.value)
