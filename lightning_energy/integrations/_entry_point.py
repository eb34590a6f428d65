"""What a configuration file switches on by itself in a Lightning ``Trainer``.

The ``callbacks_factory`` entry points of both Lightning namespaces read the file named by
``LIGHTNING_ENERGY_CONFIG`` and add the energy callback, then what the file's sections
enable: ``perseus: {enabled: true}`` adds the Perseus callback (the straggler equaliser
for DDP; for a pipeline it checks that the strategy is ``perseus_pipeline``), and
``batch_size: {enabled: true}`` adds the batch-size callback. The training script is
unchanged.

Each ``Trainer`` gets its own callbacks, one of each kind: a callback of that kind the
user passed wins. They go into the ``Trainer``'s own list, never into the list the user
passed, so one configuration dictionary builds any number of Trainers.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Any

from lightning_energy.config import CONFIG_ENV_VAR, EnergyConfig, load_config

__all__ = ["configured_callbacks", "entry_point_callbacks"]

log = logging.getLogger(__name__)

_PERSEUS_MODULES = {
    "lightning.pytorch": "lightning_energy.integrations.perseus_lightning",
    "pytorch_lightning": "lightning_energy.integrations.perseus_pytorch_lightning",
}
# Frames between the entry point and the ``Trainer``'s callback connector: Lightning's
# ``_load_external_callbacks``, then ``on_trainer_init`` (a margin for wrappers).
_FRAMES_UP = 4


def configured_callbacks(config: EnergyConfig, namespace: str) -> list[Any]:
    """The callbacks ``config`` enables next to the energy callback.

    Args:
        config: the energy configuration.
        namespace: ``"lightning.pytorch"`` or ``"pytorch_lightning"``.

    Returns:
        The Perseus and batch-size callbacks of ``namespace`` the sections enable.
    """
    callbacks: list[Any] = []
    if config.perseus.enabled:
        module = importlib.import_module(_PERSEUS_MODULES[namespace])
        callbacks.append(module.PerseusCallback(config))
    if config.batch_size.enabled:
        from lightning_energy.integrations.batch_size import batch_size_callback_class

        callbacks.append(batch_size_callback_class(namespace)(config=config))
    return callbacks


def entry_point_callbacks(namespace: str, energy_class: type, trainer_class: type) -> list[Any]:
    """The ``callbacks_factory`` entry point of ``namespace``.

    Lightning calls it from ``Trainer.__init__`` and appends what it returns to
    ``trainer.callbacks``, which is then the very list the user passed. So the callbacks
    go into a new list of the ``Trainer`` being built (leaving out a kind the ``Trainer``
    has already) and none are returned; called from anywhere else, it returns them.

    Args:
        namespace: ``"lightning.pytorch"`` or ``"pytorch_lightning"``.
        energy_class: the namespace's ``EnergyCallback``.
        trainer_class: the namespace's ``Trainer``.

    Returns:
        Nothing while a ``Trainer`` is built; else, with ``LIGHTNING_ENERGY_CONFIG`` set,
        the energy callback and what the file enables (none when it is unset).

    Raises:
        ConfigError: the file is missing, unreadable or invalid.
    """
    config = load_config()
    if config is None:
        return []
    callbacks = [energy_class(config), *configured_callbacks(config, namespace)]
    trainer = _trainer_being_built(trainer_class)
    if trainer is None:
        return callbacks
    present = list(trainer.callbacks)
    added = [cb for cb in callbacks if not any(isinstance(p, type(cb)) for p in present)]
    trainer.callbacks = [*present, *added]
    if added:
        log.info("%s: added %s", CONFIG_ENV_VAR, ", ".join(type(cb).__name__ for cb in added))
    return []


def _trainer_being_built(trainer_class: type) -> Any | None:
    """The ``trainer_class`` whose callback connector called the entry point, or None.

    Lightning passes the entry point nothing; the connector that calls it, a few frames
    up, holds its ``Trainer`` as an attribute (read from the instance itself, so no
    property runs).
    """
    frame = inspect.currentframe()
    for _ in range(_FRAMES_UP + 2):  # this function and the entry point itself, first
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        trainer = vars(owner).get("trainer") if hasattr(owner, "__dict__") else None
        if isinstance(trainer, trainer_class):
            return trainer
        frame = frame.f_back
    return None
