"""Energy optimisation for Lightning Fabric loops.

Fabric has no trainer, so the loop makes the calls a ``Trainer`` would make::

    from lightning.fabric import Fabric
    from lightning_energy.integrations.fabric import EnergyFabricCallback

    energy = EnergyFabricCallback(power_limit={"selector": "cost"})
    fabric = Fabric(accelerator="auto", devices=2, strategy="ddp", callbacks=[energy])
    fabric.launch()
    energy.setup(fabric)
    try:
        for batch in loader:
            fabric.call("on_train_batch_start")
            ...  # forward, fabric.backward(loss), optimizer.step()
            fabric.call("on_train_batch_end")
        fabric.call("on_validation_start")   # pauses profiling while validating
    finally:
        energy.teardown()                    # restores every GPU, returns the summary

``fabric.save(path, {"model": model, "energy": energy})`` saves the profile (the callback
implements ``state_dict``/``load_state_dict``) so ``fabric.load`` resumes without
profiling again.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from lightning_energy.collectives import GatherCollective
from lightning_energy.controller import EnergyController, RunSummary
from lightning_energy.integrations._common import EnergyAdapter

__all__ = ["EnergyFabricCallback"]

log = logging.getLogger(__name__)


class EnergyFabricCallback(EnergyAdapter):
    """Power-limit optimisation driven from a Fabric loop.

    Takes the arguments of :class:`~lightning_energy.integrations._common.EnergyAdapter`
    (``config``, ``device``, ``power_limit``, ``carbon``, ``strict``, ``report``); the
    report is written in :meth:`teardown`.

    Raises:
        ConfigError: invalid configuration (before any GPU is touched).
    """

    _is_global_zero = True

    def setup(self, fabric: Any) -> None:
        """Open this rank's GPU and take its lease (call after ``fabric.launch()``).

        Idempotent while a run is open; after :meth:`teardown` it starts another run (a
        second training loop), which reuses the profile of a workload already profiled.
        """
        if self.controller is not None and self.summary is None:
            return

        def all_gather(values: list[float]) -> list[list[float]]:
            gathered = fabric.all_gather(
                torch.tensor(values, dtype=torch.float64, device=fabric.device)
            )
            if gathered.dim() == 1:
                gathered = gathered.unsqueeze(0)
            return [row.tolist() for row in gathered.cpu()]

        self._is_global_zero = bool(fabric.is_global_zero)
        collective = GatherCollective(
            fabric.global_rank, fabric.world_size, all_gather, fabric.broadcast
        )
        self.summary = None
        if self.controller is None:
            self.controller = EnergyController(
                self.config,
                collective=collective,
                local_rank=fabric.local_rank,
                node_rank=fabric.node_rank,
                device=fabric.device,
            )
        self.controller.setup(collective=collective)

    def _require(self) -> EnergyController:
        if self.controller is None:
            from lightning_energy.errors import EnergyError

            raise EnergyError("call EnergyFabricCallback.setup(fabric) after fabric.launch()")
        return self.controller

    def on_train_batch_start(self, *args: Any, **kwargs: Any) -> None:
        """Open a training step (``fabric.call("on_train_batch_start")``)."""
        self._require().on_step_start()

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        """Close a training step (``fabric.call("on_train_batch_end")``)."""
        self._require().on_step_end()

    def on_validation_start(self, *args: Any, **kwargs: Any) -> None:
        """Pause profiling while validating (the window in progress is retried)."""
        self._require().interrupt("validation")

    def on_train_epoch_end(self, *args: Any, **kwargs: Any) -> None:
        """A profiling window must not span an epoch boundary."""
        self._require().interrupt("epoch end")

    def set_workload(self, key: str) -> None:
        """Declare a new workload (batch size or model change): it is profiled again."""
        self._require().set_workload(key)

    @property
    def metrics(self) -> dict[str, float]:
        """The latest ``energy/*`` metrics, for ``fabric.log_dict``."""
        return dict(self.controller.metrics) if self.controller is not None else {}

    def teardown(self) -> RunSummary | None:
        """Restore every GPU and return the run summary (idempotent until the next
        :meth:`setup`)."""
        if self.controller is None:
            return None
        if self.summary is None:
            self._finish(self.controller, main_process=self._is_global_zero)
        return self.summary

    def state_dict(self) -> dict[str, Any]:
        """The controller's state (``fabric.save`` calls this)."""
        return self._require().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the profile and choice (``fabric.load`` calls this)."""
        self._require().load_state_dict(dict(state_dict))
