"""Persistent tuning history: jobs, their trials and their power-limit profiles.

One code path (SQLAlchemy Core) for every database:

- **Embedded default**: SQLite at ``platformdirs.user_data_dir("lightning-energy")/
  history.sqlite``, in WAL mode with a busy timeout, so several jobs on one machine can
  read and write at once. Every update is one transaction (``BEGIN IMMEDIATE``), so a
  process killed mid-write leaves the database as it was before or after that update,
  never in between. SQLite's locking is unreliable on network file systems (NFS, CIFS,
  Lustre, GPFS...): the store refuses to open a file there unless told to.
- **Shared**: any SQLAlchemy URL (``postgresql+psycopg://user:pass@host/db`` for a
  cluster), given to :meth:`Store.open` or in ``LIGHTNING_ENERGY_STORE_URL``. The driver
  (e.g. ``psycopg``) is installed by the user; passwords never appear in messages, logs
  or reprs.

Tables (prefixed ``le_`` so a shared database can hold other things): ``le_meta`` (schema
version), ``le_jobs`` (one row per job key x GPU model x GPU count, with the job's
settings), ``le_trials`` (one row per finished training run) and ``le_power_profiles``
(the power-limit optimizer's state per job and batch size, reused across runs).

Example:
    >>> store = Store.open("sqlite://")  # in memory
    >>> job = JobId("resnet50-imagenet", "NVIDIA A40", 1)
    >>> store.register_job(job, {"default_batch_size": 256})
    {'default_batch_size': 256}
    >>> store.close()
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote, quote_plus

import platformdirs
import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, IntegrityError, NoSuchModuleError, SQLAlchemyError

from lightning_energy.errors import StoreError
from lightning_energy.numbers import is_finite

__all__ = [
    "ENV_STORE_URL",
    "NETWORK_FS_TYPES",
    "JobId",
    "JobRecord",
    "Store",
    "TrialRecord",
    "default_store_url",
    "network_filesystem_type",
    "resolve_store_url",
    "sqlite_path",
]

log = logging.getLogger(__name__)

#: Environment variable naming the store URL when none is given.
ENV_STORE_URL = "LIGHTNING_ENERGY_STORE_URL"

#: File-system types (as in ``/proc/mounts``) on which SQLite's locks cannot be trusted.
NETWORK_FS_TYPES = frozenset(
    {
        "9p",
        "afs",
        "beegfs",
        "ceph",
        "cifs",
        "fuse.ceph",
        "fuse.gcsfuse",
        "fuse.glusterfs",
        "fuse.juicefs",
        "fuse.rclone",
        "fuse.s3fs",
        "fuse.sshfs",
        "glusterfs",
        "gpfs",
        "lustre",
        "ncpfs",
        "nfs",
        "nfs4",
        "orangefs",
        "panfs",
        "pvfs2",
        "smb3",
        "smbfs",
        "wekafs",
    }
)

_SCHEMA_VERSION = 1
_WRITE = "lightning_energy_write"
_MOUNTS = Path("/proc/mounts")

_metadata = sa.MetaData()

_meta = sa.Table(
    "le_meta",
    _metadata,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("value", sa.String(255), nullable=False),
)

_jobs = sa.Table(
    "le_jobs",
    _metadata,
    sa.Column("job_key", sa.String(255), primary_key=True),
    sa.Column("gpu_model", sa.String(255), primary_key=True),
    sa.Column("gpu_count", sa.Integer, primary_key=True),
    sa.Column("settings", sa.Text, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
)

_JOB_FK = sa.ForeignKeyConstraint(
    ["job_key", "gpu_model", "gpu_count"],
    ["le_jobs.job_key", "le_jobs.gpu_model", "le_jobs.gpu_count"],
)

_trials = sa.Table(
    "le_trials",
    _metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("run_id", sa.String(64), nullable=False, unique=True),
    sa.Column("job_key", sa.String(255), nullable=False),
    sa.Column("gpu_model", sa.String(255), nullable=False),
    sa.Column("gpu_count", sa.Integer, nullable=False),
    sa.Column("batch_size", sa.Integer, nullable=False),
    sa.Column("power_limit_w", sa.Float, nullable=True),
    sa.Column("epochs", sa.Integer, nullable=False),
    sa.Column("energy_j", sa.Float, nullable=False),
    sa.Column("time_s", sa.Float, nullable=False),
    sa.Column("cost", sa.Float, nullable=False),
    sa.Column("eta", sa.Float, nullable=False),
    sa.Column("converged", sa.Boolean, nullable=False),
    sa.Column("metric", sa.Float, nullable=True),
    sa.Column("started_at", sa.Float, nullable=False),
    sa.Column("finished_at", sa.Float, nullable=False),
    _JOB_FK,
    sa.Index("le_trials_by_job", "job_key", "gpu_model", "gpu_count", "id"),
)

_profiles = sa.Table(
    "le_power_profiles",
    _metadata,
    sa.Column("job_key", sa.String(255), primary_key=True),
    sa.Column("gpu_model", sa.String(255), primary_key=True),
    sa.Column("gpu_count", sa.Integer, primary_key=True),
    sa.Column("batch_size", sa.Integer, primary_key=True),
    sa.Column("state", sa.Text, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
    sa.ForeignKeyConstraint(
        ["job_key", "gpu_model", "gpu_count"],
        ["le_jobs.job_key", "le_jobs.gpu_model", "le_jobs.gpu_count"],
    ),
)


@dataclass(frozen=True, order=True)
class JobId:
    """What identifies a recurring job: the user's key, the GPU model and the GPU count.

    The same training script on another GPU model or another number of GPUs has other
    costs, so it is another job.
    """

    key: str
    gpu_model: str
    gpu_count: int

    def __str__(self) -> str:
        return f"{self.key} on {self.gpu_count}x {self.gpu_model}"


@dataclass(frozen=True)
class JobRecord:
    """A job as stored: its identity, its settings and when it was first seen (Unix s)."""

    job: JobId
    settings: dict[str, Any]
    created_at: float


@dataclass(frozen=True)
class TrialRecord:
    """One finished training run of a job.

    Attributes:
        job: the job it belongs to.
        batch_size: the batch size used.
        power_limit_w: the power limit per GPU it ended with (None: left unchanged).
        epochs: epochs run.
        energy_j: energy used by every GPU of the job together.
        time_s: wall-clock time of the run.
        cost: Zeus cost of the run with the ``eta`` below.
        eta: the energy weight the cost was computed with.
        converged: True when the run reached the target metric.
        started_at: start time, Unix seconds.
        finished_at: end time, Unix seconds.
        metric: the best validation metric the run reached (None when unknown).
        run_id: unique identity of the run (a random UUID by default).
        id: the database's sequence number (None before it is stored).
    """

    job: JobId
    batch_size: int
    power_limit_w: float | None
    epochs: int
    energy_j: float
    time_s: float
    cost: float
    eta: float
    converged: bool
    started_at: float
    finished_at: float
    metric: float | None = None
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    id: int | None = None


def default_store_url() -> str:
    """The embedded default: SQLite in the user's data directory."""
    path = Path(platformdirs.user_data_dir("lightning-energy")) / "history.sqlite"
    return f"sqlite:///{path}"


def resolve_store_url(url: str | None = None) -> str:
    """The URL to use: ``url``, else ``LIGHTNING_ENERGY_STORE_URL``, else the default."""
    if url:
        return url
    return os.environ.get(ENV_STORE_URL) or default_store_url()


def _parse_url(url: str) -> URL:
    try:
        return make_url(url)
    except (ArgumentError, ValueError):
        scheme = url.split(":", 1)[0] if ":" in url else "(none)"
        # The text itself may hold a password: never repeat it.
        raise StoreError(
            f"could not parse the store URL (scheme {scheme!r}); expected a SQLAlchemy URL "
            "such as sqlite:////path/history.sqlite or postgresql+psycopg://user@host/db"
        ) from None


def sqlite_path(url: str) -> Path | None:
    """The database file of a SQLite URL; None for an in-memory or a non-SQLite URL.

    Raises:
        StoreError: the URL cannot be parsed.
    """
    parsed = _parse_url(url)
    if parsed.get_backend_name() != "sqlite":
        return None
    database = parsed.database
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return Path(database).expanduser().resolve()


def _unescape_mount(text: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def network_filesystem_type(path: Path, mounts: str | None = None) -> str | None:
    """The network file-system type ``path`` lives on, or None for a local one.

    Args:
        path: an absolute path (it need not exist).
        mounts: the text of ``/proc/mounts``; read from the system when None (no such file,
            as on macOS, means no check).

    Returns:
        The type from :data:`NETWORK_FS_TYPES` of the mount holding ``path``, or None.
    """
    if mounts is None:
        try:
            mounts = _MOUNTS.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return None
    target = str(path)
    best_point, best_type = "", ""
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point, fs_type = _unescape_mount(parts[1]), parts[2]
        inside = point == "/" or target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best_point):
            best_point, best_type = point, fs_type
    return best_type if best_type in NETWORK_FS_TYPES else None


class Store:
    """The tuning-history database. Open it with :meth:`Store.open`.

    Safe to use from several processes at once (each update is one transaction); one
    ``Store`` may also be shared by the threads of a process.
    """

    def __init__(self, engine: Engine, url: URL) -> None:
        self._engine = engine
        self._url = url

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(
        cls,
        url: str | None = None,
        *,
        allow_network_fs: bool = False,
        busy_timeout_s: float = 30.0,
        synchronous: Literal["NORMAL", "FULL"] = "FULL",
    ) -> Store:
        """Open (and create when needed) the store.

        Args:
            url: a SQLAlchemy URL; None uses ``LIGHTNING_ENERGY_STORE_URL``, else SQLite in
                the user's data directory.
            allow_network_fs: open a SQLite file on a network file system anyway (only safe
                when a single process writes at a time).
            busy_timeout_s: how long a SQLite writer waits for another one's lock.
            synchronous: SQLite's ``synchronous`` setting: ``FULL`` survives power loss,
                ``NORMAL`` survives process crashes only and fsyncs less.

        Returns:
            The open store, its tables created.

        Raises:
            StoreError: bad URL, missing driver, SQLite on a network file system, a
                database created by a newer version, or any database failure.
        """
        if synchronous not in ("NORMAL", "FULL"):
            raise StoreError(f"synchronous={synchronous!r}: use 'NORMAL' or 'FULL'")
        parsed = _parse_url(resolve_store_url(url))
        masked = parsed.render_as_string(hide_password=True)
        if parsed.get_backend_name() == "sqlite":
            engine = cls._sqlite_engine(parsed, allow_network_fs, busy_timeout_s, synchronous)
        else:
            try:
                engine = sa.create_engine(parsed, pool_pre_ping=True)
            except (NoSuchModuleError, ImportError) as exc:
                raise StoreError(
                    f"no database driver for the store URL {masked}: {type(exc).__name__}: "
                    f"{_scrub(str(exc), parsed)} (for PostgreSQL install psycopg and use "
                    "postgresql+psycopg://...)"
                ) from None
        store = cls(engine, parsed)
        try:
            store._create_schema()
        except BaseException:
            engine.dispose()
            raise
        log.debug("opened the tuning store %s", masked)
        return store

    @staticmethod
    def _sqlite_engine(
        url: URL, allow_network_fs: bool, busy_timeout_s: float, synchronous: str
    ) -> Engine:
        path = sqlite_path(url.render_as_string(hide_password=False))
        if path is not None:
            fs_type = network_filesystem_type(path)
            if fs_type is not None and not allow_network_fs:
                raise StoreError(
                    f"refusing to keep the SQLite store {path} on a network file system "
                    f"({fs_type}): SQLite's file locks are unreliable there and concurrent "
                    "jobs could corrupt it. Use a local path, a shared database "
                    f"({ENV_STORE_URL}=postgresql+psycopg://user@host/db), or allow it "
                    "(allow_network_fs=True, --allow-network-fs) if only one process writes "
                    "at a time."
                )
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreError(f"cannot create the directory of the store {path}: {exc}") from exc
        engine = sa.create_engine(url, connect_args={"timeout": busy_timeout_s})
        timeout_ms = int(busy_timeout_s * 1000)

        @sa.event.listens_for(engine, "connect")
        def _configure(dbapi_connection: Any, _record: Any) -> None:
            # Transactions are begun explicitly below (the driver's implicit ones would
            # take the write lock too late to honour the busy timeout).
            dbapi_connection.isolation_level = None
            cursor = dbapi_connection.cursor()
            try:
                cursor.execute(f"PRAGMA busy_timeout = {timeout_ms}")
                if path is not None:
                    mode = cursor.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                    if str(mode).lower() != "wal":
                        log.warning("SQLite store %s could not enter WAL mode (%s)", path, mode)
                cursor.execute(f"PRAGMA synchronous = {synchronous}")
                cursor.execute("PRAGMA foreign_keys = ON")
            finally:
                cursor.close()

        @sa.event.listens_for(engine, "begin")
        def _begin(connection: Connection) -> None:
            write = connection.get_execution_options().get(_WRITE, False)
            connection.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

        return engine

    def _create_schema(self) -> None:
        for attempt in range(2):
            try:
                with self._transaction(write=True, raw=True) as conn:
                    _metadata.create_all(conn)
                    row = conn.execute(
                        sa.select(_meta.c.value).where(_meta.c.name == "schema_version")
                    ).first()
                    if row is None:
                        conn.execute(
                            _meta.insert().values(name="schema_version", value=str(_SCHEMA_VERSION))
                        )
                    elif self._schema_version(row[0]) > _SCHEMA_VERSION:
                        raise StoreError(
                            f"the store {self.url} has schema version {str(row[0])[:40]}, "
                            "written by a newer lightning-energy (this one reads version "
                            f"{_SCHEMA_VERSION})"
                        )
                return
            except SQLAlchemyError as exc:
                # Another process created the tables between our check and our CREATE.
                if attempt == 1:
                    raise self._error("cannot create the tables of", exc) from exc

    # ------------------------------------------------------------------ basics
    @property
    def url(self) -> str:
        """The store's URL with any password masked."""
        return self._url.render_as_string(hide_password=True)

    @property
    def dialect(self) -> str:
        """The database kind: ``"sqlite"``, ``"postgresql"``..."""
        return self._url.get_backend_name()

    def __repr__(self) -> str:
        return f"Store(url={self.url!r})"

    def close(self) -> None:
        """Release every connection."""
        self._engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def integrity_check(self) -> list[str]:
        """SQLite's ``PRAGMA integrity_check`` (``["ok"]`` when sound); ``[]`` elsewhere."""
        if self.dialect != "sqlite":
            return []
        with self._transaction(write=False) as conn:
            return [str(row[0]) for row in conn.exec_driver_sql("PRAGMA integrity_check")]

    # ------------------------------------------------------------------ jobs
    def register_job(self, job: JobId, settings: Mapping[str, Any]) -> dict[str, Any]:
        """Record a job the first time it is seen.

        Args:
            job: the job's identity.
            settings: what defines it (default batch size, batch sizes, target...), as JSON
                data; stored on the first call only.

        Returns:
            The settings stored for the job: ``settings`` for a new job, else the ones it
            was first registered with (the caller compares them).
        """
        text = json.dumps(dict(settings), sort_keys=True)
        for attempt in range(2):
            try:
                with self._transaction(write=True) as conn:
                    row = conn.execute(
                        sa.select(_jobs.c.settings).where(*self._job_where(_jobs, job))
                    ).first()
                    if row is not None:
                        return self._json_object(row[0], f"the settings of job {job}")
                    conn.execute(
                        _jobs.insert().values(
                            job_key=job.key,
                            gpu_model=job.gpu_model,
                            gpu_count=job.gpu_count,
                            settings=text,
                            created_at=time.time(),
                        )
                    )
                    fresh: dict[str, Any] = json.loads(text)
                    return fresh
            except StoreError as exc:
                # A concurrent writer registered the same job first: read theirs.
                if attempt == 1 or not isinstance(exc.__cause__, IntegrityError):
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def jobs(self, key: str | None = None) -> list[JobRecord]:
        """Every job (or those with ``key``), sorted by key, GPU model and count."""
        query = sa.select(_jobs).order_by(_jobs.c.job_key, _jobs.c.gpu_model, _jobs.c.gpu_count)
        if key is not None:
            query = query.where(_jobs.c.job_key == key)
        with self._transaction(write=False) as conn:
            rows = conn.execute(query).all()
        return [
            JobRecord(
                job=JobId(row.job_key, row.gpu_model, row.gpu_count),
                settings=self._json_object(row.settings, f"the settings of job {row.job_key!r}"),
                created_at=row.created_at,
            )
            for row in rows
        ]

    # ------------------------------------------------------------------ trials
    def add_trial(self, trial: TrialRecord) -> TrialRecord:
        """Append a finished run (its job must be registered); returns it with its ``id``."""
        values = {
            "run_id": trial.run_id,
            "job_key": trial.job.key,
            "gpu_model": trial.job.gpu_model,
            "gpu_count": trial.job.gpu_count,
            "batch_size": trial.batch_size,
            "power_limit_w": trial.power_limit_w,
            "epochs": trial.epochs,
            "energy_j": trial.energy_j,
            "time_s": trial.time_s,
            "cost": trial.cost,
            "eta": trial.eta,
            "converged": trial.converged,
            "metric": trial.metric,
            "started_at": trial.started_at,
            "finished_at": trial.finished_at,
        }
        with self._transaction(write=True) as conn:
            result = conn.execute(_trials.insert().values(**values))
            (new_id,) = result.inserted_primary_key or (None,)
        return replace(trial, id=int(new_id) if new_id is not None else None)

    def trials(self, job: JobId | None = None, *, key: str | None = None) -> list[TrialRecord]:
        """Finished runs in the order they were stored: of ``job``, of every job with
        ``key``, or all."""
        # The stored value of ``converged`` as it is (a Boolean column would make any text
        # true), for the check in ``_trial``.
        columns = [c for c in _trials.c if c.name != "converged"]
        converged = sa.type_coerce(_trials.c.converged, sa.Integer).label("converged")
        query = sa.select(*columns, converged).order_by(_trials.c.id)
        if job is not None:
            query = query.where(*self._job_where(_trials, job))
        elif key is not None:
            query = query.where(_trials.c.job_key == key)
        with self._transaction(write=False) as conn:
            rows = conn.execute(query).all()
        return [self._trial(row) for row in rows]

    def _trial(self, row: Any) -> TrialRecord:
        """A stored trial, or a StoreError naming the field that holds something else (a
        row changed by something other than this package: SQLite keeps any value)."""
        fields = row._mapping
        where = f"trial {row.id} (run {str(row.run_id)[:40]!r}) of job {row.job_key!r}"
        problems = [
            f"{name} holds {str(fields[name])[:40]!r} ({type(fields[name]).__name__}), not {wanted}"
            for name, (check, wanted) in _TRIAL_FIELDS.items()
            if not check(fields[name])
        ]
        if problems:
            raise StoreError(
                f"{where} in the store {self.url}: {'; '.join(problems)}; the row was changed "
                "by something else: delete it or use another store"
            )
        return TrialRecord(
            job=JobId(row.job_key, row.gpu_model, row.gpu_count),
            batch_size=row.batch_size,
            power_limit_w=None if row.power_limit_w is None else float(row.power_limit_w),
            epochs=row.epochs,
            energy_j=float(row.energy_j),
            time_s=float(row.time_s),
            cost=float(row.cost),
            eta=float(row.eta),
            converged=bool(row.converged),
            started_at=float(row.started_at),
            finished_at=float(row.finished_at),
            metric=None if row.metric is None else float(row.metric),
            run_id=row.run_id,
            id=row.id,
        )

    # ------------------------------------------------------------------ power profiles
    def save_power_profile(self, job: JobId, batch_size: int, state: Mapping[str, Any]) -> None:
        """Store (replace) the power-limit optimizer's state for a job and batch size.

        Args:
            job: a registered job.
            batch_size: the batch size the profile was measured with.
            state: the optimizer's ``state_dict()`` (JSON data).
        """
        text = json.dumps(dict(state), sort_keys=True)
        where = (*self._job_where(_profiles, job), _profiles.c.batch_size == batch_size)
        for attempt in range(2):
            try:
                with self._transaction(write=True) as conn:
                    now = time.time()
                    updated = conn.execute(
                        _profiles.update().where(*where).values(state=text, updated_at=now)
                    )
                    if updated.rowcount == 0:
                        conn.execute(
                            _profiles.insert().values(
                                job_key=job.key,
                                gpu_model=job.gpu_model,
                                gpu_count=job.gpu_count,
                                batch_size=batch_size,
                                state=text,
                                updated_at=now,
                            )
                        )
                return
            except StoreError as exc:
                # Two first saves raced (possible outside SQLite): update the winner's row.
                if attempt == 1 or not isinstance(exc.__cause__, IntegrityError):
                    raise

    def load_power_profile(self, job: JobId, batch_size: int) -> dict[str, Any] | None:
        """The power-limit optimizer's state saved for a job and batch size, or None."""
        with self._transaction(write=False) as conn:
            row = conn.execute(
                sa.select(_profiles.c.state).where(
                    *self._job_where(_profiles, job), _profiles.c.batch_size == batch_size
                )
            ).first()
        if row is None:
            return None
        return self._json_object(row[0], f"the power profile of job {job}, batch {batch_size}")

    # ------------------------------------------------------------------ helpers
    def _schema_version(self, value: object) -> int:
        """The ``schema_version`` row as a number >= 1, or a StoreError explaining it."""
        # At most 18 digits: int() refuses more than 4300, and no version has so many.
        if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 18:
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
        raise StoreError(
            f"the store {self.url} has schema_version {str(value)[:40]!r} in le_meta, which is "
            f"not a version number (this lightning-energy writes {_SCHEMA_VERSION}); the "
            "table was changed by something else: restore it or use another store"
        )

    def _json_object(self, text: object, what: str) -> dict[str, Any]:
        """A stored JSON object, or a StoreError naming what holds something else."""
        try:
            value = json.loads(text) if isinstance(text, str) else None
        except (ValueError, RecursionError):
            value = None
        if not isinstance(value, dict):
            raise StoreError(
                f"{what} in the store {self.url} is not a JSON object; the row was changed "
                "by something else: delete it or use another store"
            )
        return value

    @staticmethod
    def _job_where(table: sa.Table, job: JobId) -> tuple[sa.ColumnElement[bool], ...]:
        return (
            table.c.job_key == job.key,
            table.c.gpu_model == job.gpu_model,
            table.c.gpu_count == job.gpu_count,
        )

    @contextmanager
    def _transaction(self, *, write: bool, raw: bool = False) -> Iterator[Connection]:
        """One transaction; database errors become :class:`StoreError` unless ``raw``."""
        try:
            with self._engine.connect() as conn:
                if write:
                    conn.execution_options(**{_WRITE: True})
                with conn.begin():
                    yield conn
        except SQLAlchemyError as exc:
            if raw:
                raise
            raise self._error("database failure in", exc) from exc

    def _error(self, what: str, exc: SQLAlchemyError) -> StoreError:
        detail = _scrub(str(getattr(exc, "orig", None) or exc), self._url)
        return StoreError(f"{what} the store {self.url}: {type(exc).__name__}: {detail}")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


#: The last second of the year 9999, the end of Python's calendar, in Unix seconds.
_LAST_TIME_S = 253_402_300_799


def _is_time(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return 0 <= value <= _LAST_TIME_S


#: Each stored trial field: its check and what it must hold (for the error).
_TRIAL_FIELDS: dict[str, tuple[Callable[[object], bool], str]] = {
    "run_id": (lambda v: isinstance(v, str) and bool(v), "a run id"),
    "job_key": (lambda v: isinstance(v, str), "text"),
    "gpu_model": (lambda v: isinstance(v, str), "text"),
    "gpu_count": (lambda v: _is_count(v) and v != 0, "a count >= 1"),
    "batch_size": (lambda v: _is_count(v) and v != 0, "a count >= 1"),
    "epochs": (_is_count, "a count >= 0"),
    "power_limit_w": (lambda v: v is None or is_finite(v), "a number of watts or null"),
    "energy_j": (is_finite, "a finite number"),
    "time_s": (is_finite, "a finite number"),
    "cost": (is_finite, "a finite number"),
    "eta": (is_finite, "a finite number"),
    "converged": (lambda v: v in (0, 1) and not isinstance(v, float), "true or false"),
    "metric": (lambda v: v is None or is_finite(v), "a number or null"),
    "started_at": (_is_time, "a time (Unix seconds from 1970 to 9999)"),
    "finished_at": (_is_time, "a time (Unix seconds from 1970 to 9999)"),
}


def _scrub(text: str, url: URL) -> str:
    """``text`` with the URL's password (plain or URL-encoded) replaced by ``***``."""
    password = url.password
    if not password:
        return text
    for form in {str(password), quote_plus(str(password)), quote(str(password), safe="")}:
        text = text.replace(form, "***")
    return text
