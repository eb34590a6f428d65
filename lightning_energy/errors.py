"""The exception tree of ``lightning_energy``.

Every error the package raises derives from :class:`EnergyError`; vendor errors (NVML
return codes, OS errors on lease files) are translated at the boundary where they occur,
with the GPU and the operation attached, so callers catch one family::

    EnergyError
    ├── ConfigError                 bad configuration; lists every problem found at once
    ├── ProfileError                a power/frequency profile or plan is malformed
    ├── CheckpointMismatchError     a resumed state belongs to another GPU model or job
    ├── StoreError                  the tuning-history database failed or is unsafe
    ├── JobSetupError               strict mode: a rank of the job cannot change its GPUs
    ├── NodeEnergyError             the node's CPU and DRAM energy (RAPL) cannot be read
    └── DeviceError                 anything a GPU backend reports (``gpu_index`` attached)
        ├── NoPermissionError       the process may not change GPU settings
        ├── NotSupportedError       the GPU or driver lacks the feature
        ├── GPULostError            the GPU fell off the bus / was reset
        ├── GPUNotFoundError        no such GPU (index, UUID or CUDA_VISIBLE_DEVICES entry)
        ├── DriverError             NVML missing, not initialised, or another driver failure
        │   └── DaemonUnreachableError  the GPU-settings daemon (zeusd) does not answer
        ├── LeaseConflictError      another live process holds the GPU's lease
        └── UntrustedLeaseError     a lease file or directory that may not be acted on
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = [
    "CheckpointMismatchError",
    "ConfigError",
    "DaemonUnreachableError",
    "DeviceError",
    "DriverError",
    "EnergyError",
    "GPULostError",
    "GPUNotFoundError",
    "JobSetupError",
    "LeaseConflictError",
    "NoPermissionError",
    "NodeEnergyError",
    "NotSupportedError",
    "ProfileError",
    "StoreError",
    "UntrustedLeaseError",
    "raise_profile_problems",
]

#: How many problems a :class:`ProfileError` lists before it counts the rest.
_MAX_LISTED = 20


def _bulleted(problems: Sequence[str], limit: int | None = None) -> str:
    """One indented line per problem; past ``limit`` of them, one line counting the rest.

    ``carbon.errors.CarbonConfigError`` lists its problems alike but keeps its own lines:
    ``carbon`` imports nothing from this package, and importing ``carbon`` here would load
    its providers (``requests``) with every ``lightning_energy`` import.
    """
    shown = problems if limit is None else problems[:limit]
    lines = "\n".join(f"  - {p}" for p in shown)
    if len(problems) > len(shown):
        lines += f"\n  - ... and {len(problems) - len(shown)} more"
    return lines


class EnergyError(Exception):
    """Base class of every exception raised by ``lightning_energy``."""


class ConfigError(EnergyError, ValueError):
    """Invalid configuration.

    Args:
        problems: one message per problem, each naming the key, the bad value and what is
            allowed. All of them are reported together so a user fixes the file once.
        source: where the configuration came from (a file path, ``"env"``, ``"python"``).
    """

    def __init__(self, problems: str | Iterable[str], source: str | None = None) -> None:
        self.problems: list[str] = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        where = f" in {source}" if source else ""
        if len(self.problems) == 1:
            message = f"invalid configuration{where}: {self.problems[0]}"
        else:
            lines = _bulleted(self.problems)
            message = f"{len(self.problems)} problems in the configuration{where}:\n{lines}"
        super().__init__(message)


class ProfileError(EnergyError, ValueError):
    """A profile, trace or plan file is malformed (missing rows, non-positive values...)."""


def raise_profile_problems(problems: Sequence[str], what: str) -> None:
    """Raise one :class:`ProfileError` listing every problem of ``what`` (the first 20,
    then how many more); return when there is none.

    Args:
        problems: one message per problem.
        what: what they were found in (``"the pipeline profile run.csv"``).

    Raises:
        ProfileError: when there is any problem.
    """
    if problems:
        lines = _bulleted(problems, _MAX_LISTED)
        raise ProfileError(f"{len(problems)} problem(s) in {what}:\n{lines}")


class CheckpointMismatchError(EnergyError, ValueError):
    """A saved controller state cannot be applied to this job (another GPU model, ...)."""


class StoreError(EnergyError):
    """The persistent tuning history cannot be used."""


class JobSetupError(EnergyError):
    """Strict mode: some rank of the job cannot change its GPUs, so every rank stops.

    The message names each such rank and why; every rank raises the same one.
    """


class NodeEnergyError(EnergyError):
    """The CPU-package and DRAM energy counters of the node (RAPL) cannot be read.

    Never raised out of a training run: the node's energy is then reported as not
    measured, with this error's message as the reason.

    Args:
        message: what failed, naming the file or directory.
        why: the kind of failure in a few words, for summaries: ``permission``, ``no
            RAPL``, ``unreadable`` or ``read failed``.
    """

    def __init__(self, message: str, *, why: str) -> None:
        self.why = why
        super().__init__(message)


class DeviceError(EnergyError):
    """A GPU backend failed.

    Args:
        message: what failed, in words.
        gpu_index: the index of the GPU concerned, when there is one.
        operation: the backend call that failed (e.g. ``"set_power_limit"``).
    """

    def __init__(
        self, message: str, *, gpu_index: int | None = None, operation: str | None = None
    ) -> None:
        self.gpu_index = gpu_index
        self.operation = operation
        prefix = f"GPU {gpu_index}: " if gpu_index is not None else ""
        suffix = f" (during {operation})" if operation else ""
        super().__init__(f"{prefix}{message}{suffix}")


class NoPermissionError(DeviceError):
    """The process may not change GPU settings: it needs root or CAP_SYS_ADMIN, or, through
    zeusd, a token with the ``gpu-control`` scope.

    Args:
        message: what was refused, in words.
        gpu_index: the GPU concerned, when there is one.
        operation: the backend call that was refused.
        fix: how to get the permission, when the backend knows better than the default
            advice (root or ``CAP_SYS_ADMIN``); None: that default.
    """

    def __init__(
        self,
        message: str,
        *,
        gpu_index: int | None = None,
        operation: str | None = None,
        fix: str | None = None,
    ) -> None:
        self.fix = fix
        super().__init__(message, gpu_index=gpu_index, operation=operation)


class NotSupportedError(DeviceError):
    """The GPU, its driver or its mode (MIG, vGPU) does not support the operation."""


class GPULostError(DeviceError):
    """The GPU fell off the bus or was reset while in use."""


class GPUNotFoundError(DeviceError):
    """No GPU matches the index or UUID requested."""


class DriverError(DeviceError):
    """NVML is missing or uninitialised, or the driver failed in another way."""


class DaemonUnreachableError(DriverError):
    """The daemon that changes GPU settings for unprivileged processes (zeusd) cannot be
    reached: no socket, nothing listening, a dropped connection or no answer in time.

    Args:
        message: what failed, naming the daemon's address and the request.
        gpu_index: the GPU concerned, when there is one.
        operation: the request that failed.
        maybe_applied: a change was sent and may have been applied all the same (no
            answer in time, a dropped connection): whoever restores must put the GPU
            back as if it had been.
    """

    def __init__(
        self,
        message: str,
        *,
        gpu_index: int | None = None,
        operation: str | None = None,
        maybe_applied: bool = False,
    ) -> None:
        self.maybe_applied = maybe_applied
        super().__init__(message, gpu_index=gpu_index, operation=operation)


class LeaseConflictError(DeviceError):
    """Another live process owns the GPU's settings lease.

    Args:
        message: what happened.
        owner_pid: the process that holds the lease.
        gpu_index: the GPU concerned.
    """

    def __init__(self, message: str, *, owner_pid: int, gpu_index: int | None = None) -> None:
        self.owner_pid = owner_pid
        super().__init__(message, gpu_index=gpu_index, operation="acquire_lease")


class UntrustedLeaseError(DeviceError):
    """A lease file, lock file or lease directory that is not safe to act on: a symbolic
    link, FIFO or other non-regular file, an oversized or malformed lease of another user,
    a directory others may rewrite, or a lease asking for more than its owner may claim."""
