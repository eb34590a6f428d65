"""The Zeus energy-time cost, shared by the power-limit and batch-size optimizers.

Zeus (You et al., NSDI'23, eq. 2) scores a configuration by a weighted sum of the energy
it uses and the time it takes, the time converted to joules at the job's maximum power::

    cost = eta * energy_j + (1 - eta) * max_power_w * time_s

``eta = 1`` minimises energy alone, ``eta = 0`` time alone. ``max_power_w`` is the highest
power limit of one GPU times the number of GPUs of the whole job, so that a second of a
job costs at most as much as the energy the job could draw in that second. The same
function scores one training step, one epoch or a whole run to the target metric.
"""

from __future__ import annotations

import math

from lightning_energy.errors import ConfigError

__all__ = ["check_eta", "zeus_cost"]


def check_eta(eta: float, key: str = "eta") -> list[str]:
    """The problems with an ``eta`` value (empty when it is valid).

    Args:
        eta: the energy weight.
        key: the configuration key to name in the message.

    Returns:
        One message per problem, for :class:`~lightning_energy.errors.ConfigError`.
    """
    if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not 0.0 <= eta <= 1.0:
        return [f"{key}: {eta!r} is not allowed; use a number from 0 (time only) to 1 (energy)"]
    return []


def zeus_cost(energy_j: float, time_s: float, *, eta: float, max_power_w: float) -> float:
    """Energy-time cost of a step, an epoch or a run, in joules.

    Args:
        energy_j: energy used, summed over every GPU of the job.
        time_s: wall-clock time taken.
        eta: weight of energy from 0 (time only) to 1 (energy only).
        max_power_w: highest power limit of one GPU x number of GPUs of the job.

    Returns:
        ``eta * energy_j + (1 - eta) * max_power_w * time_s``.

    Raises:
        ConfigError: ``eta`` outside [0, 1] or ``max_power_w`` not positive.

    Example:
        >>> zeus_cost(1000.0, 10.0, eta=0.5, max_power_w=300.0)
        2000.0
    """
    problems = check_eta(eta)
    if not (math.isfinite(max_power_w) and max_power_w > 0):
        problems.append(f"max_power_w: {max_power_w!r} is not allowed; use a positive number")
    if problems:
        raise ConfigError(problems)
    return eta * energy_j + (1.0 - eta) * max_power_w * time_s
