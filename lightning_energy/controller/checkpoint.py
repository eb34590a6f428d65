"""The controller's state in a training checkpoint: what it holds and when it may resume.

:func:`energy_state` is what a checkpoint saves: the GPU models it was measured on, the
knobs' profiles and choices, and the job's steps and energy so far. :func:`check_resumable`
refuses a state measured on other GPU models (profiles do not transfer) or written by an
incompatible version.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning_energy.device.base import GPU
from lightning_energy.errors import CheckpointMismatchError

__all__ = ["STATE_VERSION", "check_resumable", "energy_state"]

#: The version of the state :func:`energy_state` writes (and the only one read back).
STATE_VERSION = 1


def _models(gpus: Sequence[GPU]) -> list[str]:
    return sorted({g.name for g in gpus})


def energy_state(
    gpus: Sequence[GPU], knobs: Mapping[str, Any], steps: int, energy_j: float
) -> dict[str, Any]:
    """The state to save (JSON-serialisable).

    Args:
        gpus: the job's GPUs.
        knobs: the knobs' own states, merged in.
        steps: the job's steps so far.
        energy_j: the energy they used.
    """
    return {
        "version": STATE_VERSION,
        "gpu_models": _models(gpus),
        **knobs,
        "steps": steps,
        "energy_j": energy_j,
    }


def check_resumable(state: Mapping[str, Any], gpus: Sequence[GPU]) -> None:
    """Raise unless ``state`` may be resumed on ``gpus``.

    Raises:
        CheckpointMismatchError: the state was saved on another GPU model or by an
            incompatible version.
    """
    if state.get("version") != STATE_VERSION:
        raise CheckpointMismatchError(
            f"energy state version {state.get('version')!r} cannot be resumed; "
            f"this version reads {STATE_VERSION}"
        )
    models = _models(gpus)
    if state.get("gpu_models") != models:
        raise CheckpointMismatchError(
            f"the checkpoint's energy profile was measured on {state.get('gpu_models')} "
            f"but this job runs on {models}; profiles do not transfer between GPU models "
            "(drop the energy state from the checkpoint to profile again)"
        )
