"""Kareus' knobs for data-parallel training: the gradient all-reduce's CTAs, its buckets
and the clock.

Under DDP (Lightning's DDP strategy, Accelerate) the gradient all-reduce overlaps the
backward pass. Three knobs decide how it overlaps:

* ``ctas``: the SMs the all-reduce may use, through a gradient process group whose NCCL
  communicator is limited to that many CTAs (:func:`~.runtime.cta_groups`: per
  communicator, never the process-wide ``NCCL_MIN_CTAS``/``NCCL_MAX_CTAS``);
* ``bucket_cap_mb``: DDP's bucket size, which decides when communication starts (a bucket
  is all-reduced as soon as its gradients are ready);
* ``clock_mhz``: the GPU's SM clock, locked for the whole training.

DDP takes its process group and bucket size only when it wraps the model, so a setting
is applied there: :func:`ddp_kwargs` gives the constructor's arguments and
:func:`wrap_ddp` wraps a model. The clock is locked by :func:`hold_clock` through the
energy controller's guard, as a knob of the job (:class:`DataParallelClock`).

Example::

    setting = DataParallelSetting(ctas=8, bucket_cap_mb=50)
    model = wrap_ddp(model, setting, device_ids=[local_rank])  # on every rank
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_energy.errors import ConfigError, DeviceError
from lightning_energy.kareus.runtime import NCCL_MAX_CTAS, cta_groups

if TYPE_CHECKING:
    from lightning_energy.controller import EnergyController
    from lightning_energy.device.guard import GPUGuard

__all__ = [
    "DDP_DEFAULT_BUCKET_CAP_MB",
    "DataParallelClock",
    "DataParallelSetting",
    "agree",
    "ddp_kwargs",
    "gradient_group",
    "hold_clock",
    "lock_refusal",
    "refuse_decided",
    "refuse_other_clock_owners",
    "setting_problems",
    "unsupported_clock",
    "wrap_ddp",
]

#: DDP's own bucket size (``DistributedDataParallel(bucket_cap_mb=None)``).
DDP_DEFAULT_BUCKET_CAP_MB = 25.0


@dataclass(frozen=True)
class DataParallelSetting:
    """One data-parallel setting.

    Args:
        ctas: the CTAs the gradient all-reduce may use, 1 to :data:`~.runtime.NCCL_MAX_CTAS`
            (None: NCCL's own choice, the default process group).
        bucket_cap_mb: DDP's bucket size in MB, positive and finite.
        clock_mhz: the SM clock locked for training, a clock every GPU of the job
            supports (None: left as it is); see :func:`hold_clock`.

    Raises:
        ConfigError: a value out of range, naming what is allowed.
    """

    ctas: int | None = None
    bucket_cap_mb: float = DDP_DEFAULT_BUCKET_CAP_MB
    clock_mhz: int | None = None

    def __post_init__(self) -> None:
        problems = setting_problems(self.ctas, self.bucket_cap_mb, self.clock_mhz)
        if problems:
            raise ConfigError("kareus data-parallel setting: " + "; ".join(problems))


def setting_problems(
    ctas: object, bucket_cap_mb: object, clock_mhz: object, prefix: str = ""
) -> list[str]:
    """What is wrong with a data-parallel setting's values, each naming what is allowed.

    Args:
        ctas: the CTA count (None allowed).
        bucket_cap_mb: the bucket size in MB.
        clock_mhz: the clock (None allowed).
        prefix: put before each name (a configuration section's, e.g. ``"kareus."``).

    Returns:
        One message per bad value (none: the setting is good).
    """
    problems = []
    if ctas is not None and not (_whole(ctas) and 1 <= ctas <= NCCL_MAX_CTAS):
        problems.append(
            f"{prefix}ctas: {ctas!r} is not allowed; use 1 to {NCCL_MAX_CTAS} (NCCL's channel "
            "limit) or null (NCCL's default)"
        )
    if not (_number(bucket_cap_mb) and math.isfinite(bucket_cap_mb) and bucket_cap_mb > 0):
        problems.append(
            f"{prefix}bucket_cap_mb: {bucket_cap_mb!r} is not allowed; use a positive number of MB"
        )
    if clock_mhz is not None and not (_whole(clock_mhz) and clock_mhz > 0):
        problems.append(
            f"{prefix}clock_mhz: {clock_mhz!r} is not allowed; use a positive clock in MHz or "
            "null (left as it is)"
        )
    return problems


def _whole(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: object) -> TypeGuard[float]:
    """Whether ``value`` is an int or a float (not a bool)."""
    return _whole(value) or isinstance(value, float)


def gradient_group(setting: DataParallelSetting, group: Any = None) -> Any:
    """The process group the gradients are all-reduced in under ``setting``.

    With ``ctas`` set, a copy of ``group`` whose NCCL communicator is limited to that many
    CTAs (on gloo, which has no CTAs, a plain copy), created collectively: call it on every
    rank at the same point. Without, ``group`` itself.

    Args:
        setting: the data-parallel setting.
        group: this rank's data-parallel group (None: the default process group).

    Returns:
        The gradient group (None: the default process group).
    """
    if setting.ctas is None:
        return group
    base = group if group is not None else dist.group.WORLD
    return cta_groups(base, (setting.ctas,))[setting.ctas]


def ddp_kwargs(setting: DataParallelSetting, group: Any = None) -> dict[str, Any]:
    """``DistributedDataParallel``'s arguments for ``setting``: ``bucket_cap_mb`` and
    ``process_group`` (see :func:`gradient_group`; collective when ``ctas`` is set).

    Args:
        setting: the data-parallel setting.
        group: this rank's data-parallel group (None: the default process group).

    Returns:
        The keyword arguments, to pass to DDP (or to a strategy that builds it).
    """
    return {
        "bucket_cap_mb": float(setting.bucket_cap_mb),
        "process_group": gradient_group(setting, group),
    }


def refuse_decided(kwargs: Mapping[str, Any], where: str) -> None:
    """Refuse DDP arguments that a data-parallel setting decides.

    Args:
        kwargs: DDP arguments given beside a setting.
        where: what they were given to, for the message.

    Raises:
        ConfigError: ``kwargs`` names ``bucket_cap_mb`` or ``process_group``.
    """
    clash = sorted({"bucket_cap_mb", "process_group"} & set(kwargs))
    if clash:
        raise ConfigError(
            f"{where}: {', '.join(clash)} come from the data-parallel setting; give the "
            "bucket size in the setting and the data-parallel group as `group`"
        )


def wrap_ddp(
    model: torch.nn.Module, setting: DataParallelSetting, group: Any = None, **kwargs: Any
) -> DistributedDataParallel:
    """``model`` in DDP under ``setting``; call it on every rank at the same point.

    Args:
        model: the module to wrap.
        setting: the data-parallel setting.
        group: this rank's data-parallel group (None: the default process group).
        **kwargs: DDP's other arguments (``device_ids``...).

    Returns:
        The wrapped model.

    Raises:
        ConfigError: ``kwargs`` names ``bucket_cap_mb`` or ``process_group``, which the
            setting decides.
    """
    refuse_decided(kwargs, "wrap_ddp")
    return DistributedDataParallel(model, **ddp_kwargs(setting, group), **kwargs)


class DataParallelClock:
    """The clock of a data-parallel setting as a knob of the job: it holds the clocks, so
    the job profiles neither power limits nor locked clocks (one owner of the clocks at a
    time), and it cannot be paced (the setting fixes the clock).

    Args:
        clock_mhz: the locked SM clock.
    """

    name = "kareus_data_parallel_clock"
    holds_clocks = True

    def __init__(self, clock_mhz: int) -> None:
        self.clock_mhz = clock_mhz

    def pace_frontier(self) -> list[tuple[float, float, str]]:
        """None to pace: the setting fixes the clock."""
        return []

    def apply_pace(self, scale: float) -> None:
        """Nothing: the setting fixes the clock."""
        return None


def hold_clock(controller: EnergyController, clock_mhz: int) -> DataParallelClock:
    """Lock every GPU of this rank at ``clock_mhz`` for the run of ``controller``.

    Call it on every rank alike, after the run is set up and before its first step. The
    clock knob is registered with the controller, then the clock is locked through the run's
    guard: recorded in the lease first, and released when the run ends, on every path
    (normal end, exception, signal, interpreter exit; ``lightning-energy recover`` after a
    crash). Whether every rank may lock it is agreed across ranks, so either all lock it
    or all raise.

    Args:
        controller: this rank's energy controller, its run set up.
        clock_mhz: the SM clock, one every GPU of the job supports.

    Returns:
        The knob registered.

    Raises:
        ConfigError: another knob of the job holds the clocks (Perseus' straggler
            equaliser, a plan's clocks); on every rank, when a rank's GPUs do not support
            ``clock_mhz`` (the message lists the clocks they do) or this job may not lock
            them (observe-only, no permission, no clock locking, an administrator's lock),
            naming why.
    """
    guard = controller.run_guard
    if guard is None:
        raise ConfigError(
            "kareus.data_parallel_clock_mhz: the energy run is not set up; lock the clock "
            "after it starts"
        )
    key = "kareus.data_parallel_clock_mhz"
    refuse_other_clock_owners(controller, key, DataParallelClock.name)
    knob = DataParallelClock(clock_mhz)
    agree(controller, unsupported_clock(controller, clock_mhz), key)
    controller.add_knob(knob)
    agree(controller, lock_refusal(guard, clock_mhz), key)
    return knob


def refuse_other_clock_owners(controller: EnergyController, key: str, name: str) -> None:
    """Refuse ``key``'s clock, held by the knob ``name``, beside another knob that holds
    the clocks (one owner of the clocks at a time; the built-in locked-clock knob yields
    them; a knob ``name`` of an earlier fit is replaced), before anything is locked.

    Raises:
        ConfigError: another knob holds the clocks, naming it.
    """
    owners = controller.clock_owners(except_name=name)
    if owners:
        raise ConfigError(
            f"{key}: {', '.join(owners)} already holds the clocks (one owner of the clocks "
            "at a time); use null here, or run without it"
        )


def lock_refusal(guard: GPUGuard, clock_mhz: int) -> str | None:
    """Lock this rank's GPUs at ``clock_mhz`` through the run's guard; why they were not
    locked (None: they were)."""
    if guard.observe_only:
        return f"this job only observes its GPUs ({guard.observe_only_reason})"
    if guard.lock_clocks_mhz(clock_mhz, clock_mhz, refusal_stops_clocks=True) is None:
        return f"the GPUs' clocks may not be locked ({guard.clocks_off_reason})"
    return None


def unsupported_clock(controller: EnergyController, clock_mhz: int) -> str | None:
    """Why this rank's GPUs cannot run at ``clock_mhz`` (None: every one supports it)."""
    try:
        supported = [gpu.supported_sm_clocks_mhz() for gpu in controller.devices.gpus]
    except DeviceError as exc:
        return f"the supported SM clocks cannot be read ({exc})"
    common = sorted(set.intersection(*(set(clocks) for clocks in supported)), reverse=True)
    if clock_mhz in common:
        return None
    if not common:
        return "the GPUs support no clock locking"
    shown = ", ".join(str(c) for c in common[:8]) + (", ..." if len(common) > 8 else "")
    return f"{clock_mhz} MHz is not a supported SM clock; use one of {shown}"


def agree(controller: EnergyController, refusal: str | None, key: str) -> None:
    """Raise on every rank when ``refusal`` is set on any; ``key`` names the setting.

    Raises:
        ConfigError: some rank refused, naming this rank's reason (or that another rank
            refused).
    """
    (refusals,), _ = controller.collective.sum_and_max([float(refusal is not None)], [])
    if refusals > 0:
        reason = refusal or "another rank of the job cannot lock its GPUs at this clock"
        raise ConfigError(
            f"{key}: {reason}; use a clock the GPUs support where "
            "the job may lock clocks, or null (the clock is left as it is)"
        )
